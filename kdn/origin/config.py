"""The origin's one typed config: store, models, codecs, serving, Ray workers, auth.

Defaults live here and nowhere else. Load with ``OriginConfig.from_file(path, **flag_overrides)``
or build with ``OriginConfig.build({...})``; unknown keys are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from kdn.codecs import get_codec
from kdn.config import RoleConfig, cluster_key_rule, refuse_when
from kdn.keys import DEFAULT_CHUNK_SIZE, Namespace
from kdn.models import DEFAULT_MODEL, DTYPES
from kdn.wire.tls import TlsFiles

__all__ = ["OriginConfig"]


class OriginConfig(RoleConfig):
    node_id: str = Field("origin", description="name this origin reports in Stats and Lookup locations")
    store_dir: str = Field("~/.kdn/origin", description="root of the durable origin store (blobs + manifest)")
    models: list[str] = Field(
        default_factory=lambda: [DEFAULT_MODEL],
        description="model specs served: built-in names or local HF model directories; the first is the default",
    )
    dtype: str = Field("float32", description="KV dtype (part of the fingerprint)")
    chunk_size: int = Field(DEFAULT_CHUNK_SIZE, gt=0, description="tokens per chunk (part of the fingerprint)")
    codecs: list[str] = Field(
        default_factory=lambda: ["zstd:3"],
        description="codecs every ingested/computed chunk is stored in (first = preferred when serving)",
    )
    namespace: str = Field("default", description="default namespace for ingest: TENANT or TENANT:SALT")
    listen: str = Field("127.0.0.1:50061", description="gRPC listen address; port 0 picks a free port")
    tokens: dict[str, list[str]] = Field(
        default_factory=dict,
        description='bearer token -> tenants it may use ("*" = all), as on the edge; empty = no auth',
    )
    cluster_key: SecretStr | None = Field(
        None, description="the secret every edge of the cluster also holds (kdn.wire.auth.EdgeKey): "
        "signalling (WebRTC discovery and mailboxes) answers only calls signed with it, never a tenant token; "
        "None with tokens set = signalling refused",
    )
    tls_cert: str | None = Field(None, description="PEM certificate: serve TLS")
    tls_key: str | None = Field(None, description="PEM private key for tls_cert")
    tls_ca: str | None = Field(None, description="PEM CA: require client certificates (mTLS)")
    workers: int = Field(
        0, ge=0, description="Ray origin workers (actors on nodes with kdn_origin); 0 = prefill in-process, no Ray"
    )
    worker_threads: int = Field(1, ge=1, description="torch threads per prefill worker")
    ray_address: str | None = Field(None, description="existing Ray cluster to join; None = start a local one")
    max_restarts: int = Field(3, ge=0, description="restarts of a dead Ray worker before it is given up")
    max_attempts: int = Field(3, ge=1, description="tries per document before it is reported failed")
    verify_on_start: Literal["full", "size", "none"] = Field(
        "full", description="store self-check on open: verify checksums, only sizes, or nothing"
    )
    fsync: bool = Field(True, description="fsync blobs before they become visible")
    max_compute_tokens: int = Field(1 << 17, gt=0, description="largest chain a Compute request may ask for")
    compute_timeout_s: float = Field(300.0, gt=0, description="bound on one Compute call")
    blend_cache_bytes: int = Field(1 << 30, ge=0, description="blend variants kept in memory to be fetched "
                                   "(kdn.origin.blend); least recently used out first")

    @field_validator("codecs")
    @classmethod
    def _codecs_known(cls, v: list[str]) -> list[str]:
        """Every codec known; one given twice (``raw``, ``raw``) is kept once, where it first appears."""
        if not v:
            raise ValueError("at least one codec is needed")
        seen: set[str] = set()
        out = []
        for spec in v:
            canonical = get_codec(spec).spec  # UnknownCodec is a ValueError: pydantic reports it against the field
            if canonical not in seen:
                seen.add(canonical)
                out.append(spec)
        return out

    _cluster_key_long = cluster_key_rule()

    @field_validator("models")
    @classmethod
    def _models_given(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one model is needed")
        if any(not spec.strip() for spec in v):  # an unset variable must not mean "the default model"
            raise ValueError("a model spec is empty")
        return v

    _store_dir_given = refuse_when("store_dir", bad=lambda v: not v.strip(),
                                   why="is empty (an unset variable?): name the store directory")

    _dtype_known = refuse_when("dtype", bad=lambda v: v not in DTYPES,
                               why=lambda v: f"unknown dtype {v!r}; choose one of {sorted(DTYPES)}")

    @field_validator("namespace")
    @classmethod
    def _namespace_valid(cls, v: str) -> str:
        Namespace.parse(v)  # raises InvalidInput (a ValueError) naming the rule
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> "OriginConfig":
        TlsFiles.for_server(self.tls_cert, self.tls_key, self.tls_ca)  # the TLS rules: kdn.wire.tls
        return self

    @property
    def server_tls(self) -> TlsFiles | None:
        return TlsFiles.for_server(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def store_path(self) -> Path:
        return Path(self.store_dir).expanduser()

    @property
    def default_namespace(self) -> Namespace:
        return Namespace.parse(self.namespace)
