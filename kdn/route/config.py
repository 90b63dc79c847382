"""``kdn route``'s settings: one frozen config, defaults here and nowhere else."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kdn.config import RoleConfig, check_address, refuse_when
from kdn.keys import DEFAULT_CHUNK_SIZE, Namespace
from kdn.pretrained import DEFAULT_MODEL
from kdn.route.policy import POLICIES
from kdn.wire.tls import TlsFiles

__all__ = ["HostSpec", "RouteConfig", "parse_host"]


class HostSpec(BaseModel):
    """One inference host: its OpenAI-compatible base URL (``vllm serve``) and its edge."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="base URL of the host's OpenAI server, e.g. http://10.0.0.5:8000")
    edge: str | None = Field(None, description="host:port of the edge beside it (None: it reuses nothing)")
    name: str = Field("", description="a name in logs and stats (default: the URL's host:port)")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        try:
            parts = urlsplit(v)
            parts.port  # ValueError: a malformed IPv6 host, or a port that is not a number in 0..65535
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"host URL must be http(s)://HOST[:PORT], got {v!r}")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _name(self) -> "HostSpec":
        if not self.name:
            self.__dict__["name"] = urlsplit(self.url).netloc
        return self


def parse_host(text: str) -> HostSpec:
    """``URL`` or ``URL=EDGE`` (``http://127.0.0.1:8001=127.0.0.1:7071``)."""
    url, sep, edge = text.rpartition("=") if "=" in text else (text, "", "")
    return HostSpec(url=url if sep else text, edge=edge or None)


class RouteConfig(RoleConfig):
    """Settings of one router."""

    listen: str = Field("127.0.0.1:8100", description="host:port of the router's OpenAI-compatible front (port 0: any)")
    hosts: list[HostSpec] = Field(min_length=1, description="the inference hosts behind the router")
    model: str = Field(DEFAULT_MODEL, description="the hosts' model: a built-in name or a model directory "
                       "(its tokenizer and fingerprint must be the engines')")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the engines' dtype (--dtype of vllm serve)")
    chunk_size: int = Field(DEFAULT_CHUNK_SIZE, gt=0, description="the connectors' chunk size")
    tenant: str = Field("default", description="namespace of requests that name none (the connectors' default tenant)")
    salt: str = Field("", description="salt of that default namespace")
    policy: str = Field("cost", description=f"routing policy: {', '.join(POLICIES)}")
    tokens: dict[str, list[str]] = Field(default_factory=dict, description="client bearer token -> tenants it may use "
                                         "('*': any); empty: no authentication")
    edge_token: str | None = Field(None, description="the router's token for the edges (a '*' token: Stats answers "
                                   "node-wide, needed for link rates); else a request's own token is used for its Lookups")
    host_api_key: str | None = Field(None, description="sent to the hosts as 'Authorization: Bearer' (vllm serve --api-key)")
    max_body_bytes: int = Field(4 << 20, gt=0, description="largest request body accepted (413 above)")
    body_timeout_s: float = Field(30.0, gt=0, description="deadline of receiving a request's whole body (408 "
                                  "after it): a client that stops sending does not hold its connection")
    lookup_timeout_s: float = Field(0.5, gt=0, description="deadline of one edge Lookup; a late edge counts as holding nothing")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline of one forwarded request")
    connect_timeout_s: float = Field(2.0, gt=0, description="deadline of connecting to a host")
    health_interval_s: float = Field(1.0, gt=0, description="each host's /health is asked this often")
    health_timeout_s: float = Field(2.0, gt=0, description="deadline of one health check")
    fail_after: int = Field(2, ge=1, description="consecutive failed checks (or failed forwards) that take a host out")
    rates_interval_s: float = Field(2.0, gt=0, description="each edge's counters are read this often (link rates)")
    calibrate_tokens: list[int] = Field(default_factory=lambda: [16, 128], description="prompt lengths of the probes "
                                        "sent to a host when it joins, to measure its prefill rate ([]: none)")
    prior_s_per_token: float = Field(2e-3, gt=0, description="prefill seconds per token assumed until measured")
    prior_link_bytes_per_s: dict[str, float] = Field(
        default_factory=lambda: {"memory": 2e9, "disk": 5e8, "peer": 5e8, "origin": 1e8},
        description="bytes/s per tier assumed until an edge's counters measure it")
    engine_record_tokens: int = Field(32768, ge=0, description="tokens of recently routed prompts remembered per host as "
                                      "held in its engine's own KV cache (0: none)")
    engine_record_s: float = Field(120.0, gt=0, description="how long such a record is believed")
    tie_s: float = Field(0.005, ge=0, description="scores within this many seconds of the best are equal")
    tie_fraction: float = Field(0.02, ge=0, description="... or within this fraction of the best")
    edge_tls_ca: Path | None = None
    edge_tls_cert: Path | None = None
    edge_tls_key: Path | None = None

    _policy = refuse_when("policy", bad=lambda v: v not in POLICIES,
                          why=lambda v: f"unknown routing policy {v!r}; choose one of {', '.join(POLICIES)}")
    _calibrate = refuse_when("calibrate_tokens", bad=lambda v: any(n < 2 for n in v),
                             why="calibration prompts need at least 2 tokens")

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return check_address(v, "listen", port_zero=True)

    @model_validator(mode="after")
    def _check(self) -> "RouteConfig":
        Namespace(self.tenant, self.salt)
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"host names must differ: {names}")
        TlsFiles.for_client(self.edge_tls_cert, self.edge_tls_key, self.edge_tls_ca)
        return self

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.tenant, self.salt)

    def edge_tls(self) -> TlsFiles | None:
        return TlsFiles.for_client(self.edge_tls_cert, self.edge_tls_key, self.edge_tls_ca)
