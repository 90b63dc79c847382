"""The edge node's one typed config: validated on construction, loadable from YAML/JSON, overridable by flags.

Defaults live here and nowhere else. Example file::

    node_id: edge-a
    listen: 127.0.0.1:50061
    peers: {edge-b: 127.0.0.1:50062, edge-c: 127.0.0.1:50063}
    origin: 127.0.0.1:50051
    memory_bytes: 1073741824
    disk_dir: /var/cache/kdn/edge-a
    disk_bytes: 10737418240
    policy: prefix
    tokens: {s3cret-a: [tenant-a], s3cret-ops: ["*"]}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from kdn.config import RoleConfig, check_address, cluster_key_rule
from kdn.wire.channel import MAX_MESSAGE, STREAM_PIECE
from kdn.wire.shm import DEFAULT_SHM_DIR
from kdn.wire.tls import TlsFiles

if TYPE_CHECKING:
    from kdn.wire.auth import EdgeKey

_MAX_BYTES = 1 << 50  # 1 PiB: a byte budget above it is a typo (1e29), not a bound


def _check_address(value: str, what: str) -> str:
    return check_address(value, what, port_zero=True)


class IceServerConfig(BaseModel):
    """A STUN or TURN server for WebRTC. The credential is a secret: masked in reprs and logs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: list[str] = Field(min_length=1, description="stun:host:port, turn:host:port?transport=udp ...")
    username: str | None = None
    credential: SecretStr | None = None

    @field_validator("urls")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for u in v:
            if not u.startswith(("stun:", "turn:", "turns:")):
                raise ValueError(f"ICE server URL must start with stun:, turn: or turns:, got {u[:60]!r}")
        return v

    @model_validator(mode="after")
    def _turn_needs_credentials(self) -> "IceServerConfig":
        if any(u.startswith("turn") for u in self.urls) and (not self.username or self.credential is None):
            raise ValueError("a TURN server needs a username and a credential")
        return self


class EdgeConfig(RoleConfig):
    """Everything one edge node needs; see the module docstring for a file example."""

    node_id: str = Field("edge-0", min_length=1, max_length=128, description="this node's id in the overlay")
    listen: str = Field("127.0.0.1:0", description="gRPC listen address; port 0 picks a free port")
    peers: dict[str, str] = Field(default_factory=dict, description="static overlay members: node_id -> host:port")
    peers_file: str | None = Field(
        None, description="re-read on every membership refresh: JSON {id: host:port} or id=host:port lines"
    )
    membership_refresh_s: float = Field(2.0, gt=0, description="how often peers_file / the provider is re-read")
    peer_weights: dict[str, float] = Field(default_factory=dict, description="node_id -> placement weight (default 1)")
    weight: float = Field(1.0, gt=0, description="this node's placement weight")
    origin: str | None = Field(None, description="origin address host:port; None = no origin")
    memory_bytes: int = Field(1 << 30, ge=0, le=_MAX_BYTES, description="memory tier budget")
    disk_dir: str | None = Field(None, description="disk tier directory; None = no disk tier")
    disk_bytes: int = Field(10 << 30, ge=0, le=_MAX_BYTES, description="disk tier budget")
    disk_fsync: bool = Field(
        True, description="fsync disk-tier blobs before they become visible; False is faster but a power cut may lose recent writes"
    )
    disk_verify_on_open: bool = Field(
        False, description="on start, check every checksum of every disk blob (not only header and trailer)"
    )
    policy: str = Field(
        "adaptive",
        description="eviction policy name (kdn.edge.eviction registry); adaptive: prefix-aware, leaves ordered by recency or by decayed frequency, whichever sampled miniature caches say wins",
    )
    replicas: int = Field(2, ge=1, le=16, description="owners per key in the overlay")
    bounded_load_c: float = Field(
        1.25, ge=1.0, le=16.0, description="bounded-load factor: a peer is asked first only while it got under "
        "c x its share of this node's requests to peers (a hot key's reads spread over its replicas)",
    )
    prefetch_depth: int = Field(2, ge=0, le=64, description="chunks fetched ahead after chunk i")
    prefetch_queue: int = Field(256, ge=1, description="bound on queued background prefetches; more are dropped")
    prefetch_workers: int = Field(2, ge=1, le=64)
    tokens: dict[str, list[str]] = Field(
        default_factory=dict,
        description="bearer token -> tenants it may use ('*' = all). Empty = authentication off.",
    )
    upstream_token: str | None = Field(
        None, description="token this edge presents to the origin, and to static peers when there is no "
        "cluster_key; None = forward the caller's token",
    )
    cluster_key: SecretStr | None = Field(
        None, description="the secret every edge and the origin of the cluster hold (kdn.wire.auth.EdgeKey): "
        "requests to peers and to signalling carry one-use tokens signed with it instead of upstream_token, "
        "and peers' tokens are checked with it. Needed for rtc_signal when auth is on",
    )
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = Field(None, description="on the server: require client certs signed by this CA (mTLS)")
    upstream_tls_ca: str | None = Field(None, description="CA to verify peers/origin with; None = plaintext upstream")
    upstream_tls_cert: str | None = None
    upstream_tls_key: str | None = None
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus /metrics port; 0 = ephemeral, None = off")
    metrics_host: str = Field(
        "127.0.0.1", description="where /metrics listens; its figures are node-wide (all tenants), so loopback by default"
    )
    metrics_token: str | None = Field(
        None, description="when set, /metrics answers only scrapes that send 'Authorization: Bearer <token>'"
    )
    metrics_max_connections: int = Field(
        64, ge=1, le=4096, description="open /metrics connections at most; a new one past it closes the oldest"
    )
    metrics_timeout_s: float = Field(5.0, gt=0, le=300, description="a /metrics request must arrive whole within this")
    fetch_deadline_s: float = Field(30.0, gt=0, description="deadline of upstream fetches (peer or origin)")
    peer_deadline_s: float = Field(5.0, gt=0, description="deadline of peer lookups and fetches")
    admin_deadline_s: float = Field(10.0, gt=0)
    peer_backoff_s: float = Field(2.0, gt=0, description="a peer marked down is retried after this long")
    max_message_bytes: int = Field(MAX_MESSAGE, ge=64 << 10, description="bound on any single gRPC message")
    stream_piece_bytes: int = Field(STREAM_PIECE, ge=4 << 10, description="size of each streamed Fetch message")
    max_artifact_bytes: int = Field(512 << 20, ge=1 << 10, description="largest artifact accepted by Put or upstream")
    put_buffer_bytes: int = Field(
        1 << 30, ge=1 << 10, le=_MAX_BYTES,
        description="bound on the bytes buffered by all in-flight Puts together; a Put that would pass it is "
        "refused (RESOURCE_EXHAUSTED). A Put holds its bytes about twice while they are joined",
    )
    decode_check: bool = Field(
        True, description="decode every section of what a Put or an upstream fetch brings before keeping it "
        "(checksums are unkeyed: a checksum-valid artifact may still not decode); False skips the CPU cost",
    )
    max_chain_keys: int = Field(4096, ge=1, description="longest key chain accepted in Lookup/Prefetch/Hint")
    bulk: bool = Field(True, description="offer the bulk byte path (plain TCP beside gRPC; never with TLS)")
    bulk_port: int = Field(0, ge=0, le=65535, description="port of the bulk byte path on the listen host; 0 = a free one")
    bulk_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="bulk connection: a hello, a request, a payload or an answer that makes no "
        "progress for this long closes it (a payload must also arrive at 1 MiB/s or more)",
    )
    bulk_idle_s: float = Field(120.0, gt=0, le=86400, description="bulk connection with no request for this long is closed")
    bulk_max_connections: int = Field(256, ge=1, le=65536, description="bulk connections served at once (a thread each)")
    bulk_max_connections_per_token: int = Field(
        64, ge=1, le=65536, description="bulk connections one bearer token may hold at once; past it: refused, the "
        "client uses gRPC",
    )
    bulk_max_pending: int = Field(
        256, ge=1, le=65536, description="bulk connections waiting for their hello at most; a new one past it closes "
        "the oldest (a client sends its hello at once)",
    )
    bulk_tickets_per_token: int = Field(
        64, ge=1, le=65536, description="bulk tickets outstanding per bearer token; the token's oldest goes first"
    )
    shm: bool = Field(True, description="offer the same-host shared-memory path")
    shm_dir: str = Field(DEFAULT_SHM_DIR, description="where shared-memory segments live")
    shm_max_segments: int = Field(
        256, ge=1, le=65536,
        description="bound on live shm segments (one descriptor each; same-host clients map as many); oldest unlinked first",
    )
    shm_max_bytes: int = Field(1 << 30, ge=1 << 20, description="bound on the bytes of live shm segments")
    schedule_tick_s: float = Field(1.0, gt=0, description="how often scheduled prefetches are checked")
    rtc_signal: str | None = Field(
        None, description="host:port of the WebRTC signalling service (the origin serves it); None = WebRTC off. "
        "With it, this edge announces itself there, learns the other edges, and reaches those it cannot dial "
        "(behind NAT) over WebRTC data channels (needs the webrtc extra: aiortc)",
    )
    rtc_advertise: str | None = Field(None, description="address announced to other edges; None = the listen address")
    rtc_ice_servers: list[IceServerConfig] = Field(
        default_factory=list, description="STUN/TURN servers for WebRTC; none = host candidates only"
    )
    rtc_mode: str = Field(
        "auto", description="auto: dial a peer over gRPC when its health check answers within rtc_dial_probe_s, "
        "else WebRTC; always: WebRTC to every announced peer",
    )
    rtc_dial_probe_s: float = Field(1.0, gt=0, le=30, description="how long a peer's gRPC health check may take in auto mode")
    rtc_connect_timeout_s: float = Field(
        10.0, gt=0, le=120, description="WebRTC setup (offer, ICE, data channel) must finish within this; else the "
        "peer counts as down and the miss goes to the next owner or the origin",
    )
    rtc_relay_only: bool = Field(False, description="use TURN relay candidates only (ICE transport policy relay)")
    rtc_relay_after_s: float = Field(
        1.5, gt=0, le=60, description="with a TURN server configured, a relay-only attempt starts beside the first "
        "when no path is up after this long; the first channel to open wins",
    )
    rtc_announce_s: float = Field(5.0, gt=0, le=300, description="how often this edge re-announces itself")
    rtc_max_answers: int = Field(
        64, ge=1, le=4096, description="WebRTC connections this edge answers at most (all peers); an offer past it is dropped",
    )
    rtc_max_answers_per_peer: int = Field(
        4, ge=1, le=256, description="WebRTC connections answered per peer; a new offer past it closes that peer's oldest",
    )
    rtc_prewarm: bool = Field(
        True, description="connect to each newly announced peer in the background (probe, then WebRTC if needed), "
        "so the first request does not pay the setup",
    )
    rtc_link_codec: str = Field(
        "zstd:1", description="lossless codec a raw artifact travels in over a WebRTC link (the asking edge stores "
        "it raw again); '' = as stored. Asking edges ask for it, answering edges use their own setting",
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _check_address(v, "listen")

    @field_validator("origin")
    @classmethod
    def _origin(cls, v: str | None) -> str | None:
        return None if v in (None, "") else _check_address(v, "origin")

    @field_validator("rtc_signal")
    @classmethod
    def _rtc_signal(cls, v: str | None) -> str | None:
        return None if v in (None, "") else _check_address(v, "rtc_signal")

    _cluster_key_long = cluster_key_rule()

    @field_validator("rtc_link_codec")
    @classmethod
    def _rtc_link_codec(cls, v: str) -> str:
        if v in ("", "raw"):
            return ""
        from kdn.codecs import get_codec
        from kdn.errors import UnknownCodec

        try:
            codec = get_codec(v)
        except UnknownCodec as exc:
            raise ValueError(f"rtc_link_codec: {exc}") from exc
        if codec.lossy:
            raise ValueError(f"rtc_link_codec must be lossless, got {v!r}")
        return codec.spec

    @field_validator("rtc_mode")
    @classmethod
    def _rtc_mode(cls, v: str) -> str:
        if v not in ("auto", "always"):
            raise ValueError(f"rtc_mode must be auto or always, got {v!r}")
        return v

    @field_validator("peers")
    @classmethod
    def _peers(cls, v: dict[str, str]) -> dict[str, str]:
        for node, addr in v.items():
            _check_address(addr, f"peer {node}")
        return v

    @model_validator(mode="after")
    def _cross(self) -> "EdgeConfig":
        TlsFiles.for_server(self.tls_cert, self.tls_key, self.tls_ca)  # the TLS rules: kdn.wire.tls
        if self.stream_piece_bytes > self.max_message_bytes - 1024:
            raise ValueError("stream_piece_bytes must leave room under max_message_bytes")
        for w in self.peer_weights.values():
            if w <= 0:
                raise ValueError("peer weights must be positive")
        from kdn.edge.eviction import POLICIES  # late: keeps config import light

        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(sorted(POLICIES))}")
        if self.rtc_signal and self.cluster_key is None and (self.tokens or self.upstream_token):
            raise ValueError("rtc_signal with tokens needs cluster_key: signalling and the peers it announces "
                             "take only edge tokens signed with it (the same key on the origin and every edge)")
        return self

    def edge_key(self) -> "EdgeKey | None":
        """This node's :class:`~kdn.wire.auth.EdgeKey` from ``cluster_key`` (None without one)."""
        from kdn.wire.auth import EdgeKey

        return None if self.cluster_key is None else EdgeKey(self.cluster_key.get_secret_value(), self.node_id)

    @property
    def server_tls(self) -> TlsFiles | None:
        return TlsFiles.for_server(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def upstream_tls(self) -> TlsFiles | None:
        if not self.upstream_tls_ca:  # upstream TLS is on when a CA to verify peers/origin is named
            return None
        return TlsFiles.for_client(self.upstream_tls_cert, self.upstream_tls_key, self.upstream_tls_ca)
