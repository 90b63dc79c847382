"""Edges behind NAT: discovery through the origin and peer fetches over WebRTC.

:class:`EdgeRtc` is switched on by ``EdgeConfig.rtc_signal`` (the origin's address, which serves
``SignalService``). It

- announces this edge there every ``rtc_announce_s`` and turns the answer (every live edge) into
  overlay members (:meth:`EdgeRtc.members`, merged with the static ``peers``): edges behind NAT
  discover each other through the cluster. With ``cluster_key`` (needed when auth is on) every
  signalling call and every request to a peer carries a one-use edge token
  (:class:`kdn.wire.auth.EdgeKey`): only edges can announce, so every member learned here is an
  edge, and no peer ever receives this edge's ``upstream_token``;
- connects each member with an :class:`AutoPeerUpstream`: gRPC when the peer's health check
  answers within ``rtc_dial_probe_s`` (it is directly dialable), else a :class:`RtcPeerUpstream`
  over a WebRTC data channel (:mod:`kdn.wire.rtc`); ``rtc_mode: always`` skips the probe;
- connects to each newly announced peer in the background (``rtc_prewarm``), so the first
  request does not pay the setup;
- answers other edges' offers and serves their Lookup/Fetch on the channel with this node's own
  logic, under the same token check as the gRPC servicer (:class:`EdgeRtcHandler`).

Links through NATs are slow (a data channel is CPU-bound near 8 MB/s here; offices sit behind
tens of Mbit/s), so a raw artifact crosses them in the lossless ``rtc_link_codec`` (zstd:1 by
default, ~1.2–1.6x fewer bytes on KV): the asking edge sets the request's link-codec flag when its
request names no codec, the answering edge transcodes a raw container on a worker thread, and the
asking edge verifies what arrived and stores it raw again (the codec hosts read fastest, landing
in place). A container already in another codec travels as it is.

A peer that cannot be reached within ``rtc_connect_timeout_s`` raises ``Unavailable``: the node
marks it down and the miss goes to the next owner or the origin, as for a dead gRPC peer.
Metrics (the edge's Prometheus registry): ``kdn_edge_rtc_setup_seconds{path,role}``,
``kdn_edge_rtc_connections{path,role}``, ``kdn_edge_peer_bytes{direction,path}`` with path
``grpc``, ``direct`` or ``relayed``. TURN credentials are read from the config's secret only when
a peer connection is built; they are never logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from kdn.artifact import read_header, transcode
from kdn.edge.overlay import Member
from kdn.edge.tasks import cancel_and_wait
from kdn.edge.upstream import FetchSpec, PeerUpstream, Upstream, peer_upstream
from kdn.errors import KdnError
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.wire.auth import TokenAuth
from kdn.wire.convert import lookup_request, lookup_response, parse_fetch, parse_lookup
from kdn.wire.rtc import IceServer, RtcEndpoint
from kdn.wire.signal import SignalClient

if TYPE_CHECKING:
    from kdn.edge.config import EdgeConfig
    from kdn.edge.front import EdgeFront
    from kdn.edge.metrics import EdgeMetrics
    from kdn.edge.node import EdgeNode

__all__ = ["AutoPeerUpstream", "EdgeRtc", "EdgeRtcHandler", "RtcPeerUpstream", "ice_servers"]

log = logging.getLogger(__name__)


def ice_servers(config: "EdgeConfig") -> list[IceServer]:
    """The config's STUN/TURN servers as :class:`kdn.wire.rtc.IceServer` (credential unmasked here only)."""
    return [
        IceServer(tuple(s.urls), s.username, s.credential.get_secret_value() if s.credential is not None else None)
        for s in config.rtc_ice_servers
    ]


class EdgeRtcHandler:
    """Serves another edge's Lookup/Fetch arriving on a data channel, framed over the front: the
    gRPC servicer's rules (token granted the request's tenant, bounded key chains), the front's
    refusals."""

    def __init__(self, front: "EdgeFront", *, link_codec: str = "") -> None:
        self.front = front
        self.link_codec = link_codec

    def _ask(self, parse: Callable[..., Any], request: Any, token: str | None) -> Any:
        front = self.front
        return parse(request, limit=front.config.max_chain_keys, authorize=front.authorizer(token))

    async def lookup(self, request: Any, token: str | None) -> Any:
        found = await self.front.lookup(self._ask(parse_lookup, request, token), token)
        return lookup_response(found, node_id=self.front.node_id)

    async def fetch(
        self, request: Any, token: str | None, *, forwarded: bool, link_codec: bool = False
    ) -> tuple[bytes, str]:
        """The container as this node serves it; when the asker takes the link codec and asked for
        no codec of its own, a raw container goes out in ``link_codec`` (lossless: the asker
        restores the same KV), transcoded on a worker thread so the event loop keeps serving."""
        ask = self._ask(parse_fetch, request, token)
        data, source = await self.front.fetch(ask, token, forwarded=forwarded)
        if link_codec and self.link_codec and not ask.spec.codec and read_header(data).codec == "raw":
            data = await asyncio.to_thread(transcode, data, self.link_codec)
        return data, source

    def refuse(self, rpc: str, exc: BaseException) -> tuple[int, str]:
        refused = self.front.refuse(rpc, exc, via="rtc")
        return refused.status, refused.message


class RtcPeerUpstream(Upstream):
    """A peer edge over a WebRTC data channel (dialled through the signalling service)."""

    kind = "peer"

    def __init__(
        self, name: str, address: str, endpoint: RtcEndpoint, metrics: "EdgeMetrics", *, token: str | None,
        call_deadline_s: float, fetch_deadline_s: float, max_artifact: int, link_codec: bool = False,
        credential: Callable[[str], str] | None = None,
    ) -> None:
        """``credential``: ``tenant -> token`` minted per request (edge tokens); it wins over ``token``."""
        self.name, self.address = name, address
        self._link_codec = link_codec
        self._endpoint = endpoint
        self._metrics = metrics
        self._token = token
        self._credential = credential
        self._call_deadline = call_deadline_s
        self._fetch_deadline = fetch_deadline_s
        self._max_artifact = max_artifact

    def _tok(self, token: str | None, tenant: str) -> str | None:
        if self._credential is not None:
            return self._credential(tenant)
        return self._token if self._token is not None else token

    async def fetch(self, spec: FetchSpec, *, token: str | None = None) -> bytes:
        """The container; with the link codec on and no codec asked for, what crossed the link
        compressed is verified and stored raw again (the codec hosts read fastest)."""
        client = await self._endpoint.connect(self.name)
        link = self._link_codec and not spec.codec
        data, _source = await client.fetch(
            spec.to_proto(), token=self._tok(token, spec.namespace.tenant), timeout_s=self._fetch_deadline,
            limit=self._max_artifact,
            forwarded=not spec.local_only, link_codec=link,
        )
        self._metrics.peer_bytes.labels("in", client.path).inc(len(data))
        if link:
            header = read_header(data)  # raises ArtifactCorrupt like the node's own check would
            if header.codec != "raw" and not header.lossy:
                # every checksum of what crossed the link is verified on the way
                data = await asyncio.to_thread(transcode, data, "raw", max_bytes=self._max_artifact)
        return data

    async def lookup(
        self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None = None
    ) -> int:
        client = await self._endpoint.connect(self.name)
        req = lookup_request(keys, fingerprint=fingerprint, namespace=namespace, local_only=True)
        resp = await client.lookup(req, token=self._tok(token, namespace.tenant), timeout_s=self._call_deadline)
        return min(int(resp.available), len(keys))

    async def healthy(self) -> bool:
        try:
            await self._endpoint.connect(self.name)
        except KdnError:
            return False
        return True


class AutoPeerUpstream(Upstream):
    """gRPC to a peer that answers its health check within ``probe_s``, else WebRTC.

    The first request waits for the probe; after ``recheck_s`` the probe runs again in the
    background (requests keep the current path meanwhile), and after a failure at once: a peer
    that moved behind NAT, or out from behind it, is noticed. ``always_rtc`` skips the probe."""

    kind = "peer"

    def __init__(
        self, grpc_up: PeerUpstream, rtc_up: RtcPeerUpstream, metrics: "EdgeMetrics", *, probe_s: float,
        always_rtc: bool = False, recheck_s: float = 30.0,
    ) -> None:
        self.name, self.address = grpc_up.name, grpc_up.address
        self.grpc, self.rtc = grpc_up, rtc_up
        self._metrics = metrics
        self._probe_s = probe_s
        self._always_rtc = always_rtc
        self._recheck_s = recheck_s
        self._choice: Upstream | None = None
        self._until = 0.0
        self._reprobe: asyncio.Future[Upstream] | None = None

    @property
    def path(self) -> str:
        return "unknown" if self._choice is None else ("grpc" if self._choice is self.grpc else "rtc")

    async def _probe(self) -> Upstream:
        try:
            ok = await asyncio.wait_for(self.grpc.healthy(), self._probe_s)
        except asyncio.TimeoutError:
            ok = False
        choice = self.grpc if ok else self.rtc
        if choice is not self._choice:
            log.info("peer %s: %s", self.name, "dialled over gRPC" if ok else "not dialable: WebRTC")
        self._choice = choice
        self._until = time.monotonic() + self._recheck_s
        return choice

    async def _pick(self) -> Upstream:
        if self._always_rtc:
            return self.rtc
        if self._choice is None:
            return await self._probe()  # the first request waits for the probe (at most probe_s)
        if time.monotonic() >= self._until and (self._reprobe is None or self._reprobe.done()):
            self._reprobe = asyncio.ensure_future(self._probe())  # later ones never do
        return self._choice

    async def fetch(self, spec: FetchSpec, *, token: str | None = None) -> bytes:
        up = await self._pick()
        data = await up.fetch(spec, token=token)
        if up is self.grpc:
            self._metrics.peer_bytes.labels("in", "grpc").inc(len(data))
        return data

    async def lookup(
        self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None = None
    ) -> int:
        return await (await self._pick()).lookup(keys, fingerprint=fingerprint, namespace=namespace, token=token)

    async def warm(self) -> None:
        """Pick the path and, for WebRTC, connect now (background pre-warming; errors are kept
        for the first request to see)."""
        up = await self._pick()
        if up is self.rtc:
            await self.rtc.healthy()

    async def healthy(self) -> bool:
        """After a failure: probe which path works now, then ask that one."""
        if self._always_rtc:
            return await self.rtc.healthy()
        return await (await self._probe()).healthy()

    async def close(self) -> None:
        if self._reprobe is not None:
            self._reprobe.cancel()
        await self.grpc.close()


class EdgeRtc:
    """The edge's WebRTC side: announce, discover, dial, answer. See the module docstring."""

    def __init__(
        self, config: "EdgeConfig", auth: TokenAuth, metrics: "EdgeMetrics",
        static: Sequence[Member] | Callable[[], Iterable[Member]],
    ) -> None:
        assert config.rtc_signal
        self.config = config
        self.auth = auth
        self.metrics = metrics
        self._static = static  # the config's peers, or another provider (peers file, registry)
        self._announced: list[Member] = []
        self.edge_key = auth.edges  # signalling calls and peer requests carry one-use edge tokens
        self.signal = SignalClient(config.rtc_signal, token=config.upstream_token, tls=config.upstream_tls,
                                   deadline_s=config.peer_deadline_s, edge=self.edge_key)
        self.endpoint = RtcEndpoint(
            config.node_id, self.signal, ice_servers=ice_servers(config),
            connect_timeout_s=config.rtc_connect_timeout_s, relay_only=config.rtc_relay_only,
            relay_after_s=config.rtc_relay_after_s, on_connect=self._connected, on_served=self._served,
            max_answers=config.rtc_max_answers, max_answers_per_peer=config.rtc_max_answers_per_peer,
            on_offer=lambda outcome: metrics.rtc_offers.labels(outcome).inc(),
        )
        self.address = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._node: "EdgeNode | None" = None
        self._warmed: set[str] = set()
        self._warming: set[asyncio.Task[None]] = set()

    def _connected(self, peer: str, path: str, setup_s: float, role: str) -> None:
        self.metrics.rtc_connections.labels(path, role).inc()
        self.metrics.rtc_setup.labels(path, role).observe(setup_s)
        log.info("%s: WebRTC %s %s up (%s, %.3f s)", self.config.node_id, role, peer, path, setup_s)

    def _served(self, path: str, nbytes: int) -> None:
        self.metrics.peer_bytes.labels("out", path).inc(nbytes)
        self.metrics.bytes_out.labels("rtc").inc(nbytes)

    def members(self) -> list[Member]:
        """Configured peers (static or from their provider) plus every other edge announced at the
        origin (the overlay's provider)."""
        static = list(self._static() if callable(self._static) else self._static)
        seen = {m.node_id for m in static}
        return static + [m for m in self._announced if m.node_id not in seen]

    async def announce(self) -> None:
        anns = await self.signal.announce(
            self.config.node_id, self.address, weight=self.config.weight, ttl_s=self.config.rtc_announce_s * 3
        )
        self._announced = [Member(a.node_id, a.address, a.weight or 1.0) for a in anns if a.node_id != self.config.node_id]

    async def _announce_loop(self) -> None:
        while True:
            try:
                await self.announce()
            except KdnError as exc:
                log.info("%s: announce to %s failed: %s", self.config.node_id, self.config.rtc_signal, exc)
            self._prewarm()
            await asyncio.sleep(self.config.rtc_announce_s)

    def _prewarm(self) -> None:
        """Connect to newly announced peers in the background, once each."""
        if not self.config.rtc_prewarm or self._node is None:
            return
        for m in self._announced:
            if m.node_id in self._warmed:
                continue
            self._warmed.add(m.node_id)
            up = self._node.peer(m)
            if isinstance(up, AutoPeerUpstream):
                t = asyncio.ensure_future(self._warm(up))
                self._warming.add(t)
                t.add_done_callback(self._warming.discard)

    async def _warm(self, up: "AutoPeerUpstream") -> None:
        try:
            await up.warm()
        except KdnError as exc:
            log.info("%s: pre-warming %s: %s", self.config.node_id, up.name, exc)

    async def start(self, front: "EdgeFront", address: str) -> None:
        self._node = front.node
        self.endpoint.handler = EdgeRtcHandler(front, link_codec=self.config.rtc_link_codec)
        self.address = self.config.rtc_advertise or address
        try:
            await self.announce()  # members known before the first request, when the origin answers
        except KdnError as exc:
            log.warning("%s: signalling at %s not reachable yet: %s", self.config.node_id, self.config.rtc_signal, exc)
        self.endpoint.start()
        self._tasks.append(asyncio.ensure_future(self._announce_loop()))

    def connect(self, member: Member) -> Upstream:
        c = self.config
        key = self.edge_key  # with a cluster key, a peer gets one-use edge tokens, never upstream_token
        token = None if key is not None else c.upstream_token
        credential = key.credential(member.node_id) if key is not None else None
        grpc_up = peer_upstream(c, key, member)
        rtc_up = RtcPeerUpstream(
            member.node_id, member.address, self.endpoint, self.metrics, token=token, credential=credential,
            call_deadline_s=c.peer_deadline_s, fetch_deadline_s=c.peer_deadline_s * 4, max_artifact=c.max_artifact_bytes,
            link_codec=bool(c.rtc_link_codec),
        )
        return AutoPeerUpstream(grpc_up, rtc_up, self.metrics, probe_s=c.rtc_dial_probe_s, always_rtc=c.rtc_mode == "always")

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks + list(self._warming))
        self._tasks = []
        await self.endpoint.close()
        await self.signal.close()
