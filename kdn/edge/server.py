"""The edge's gRPC server: ``EdgeService`` + the standard health service, over :class:`EdgeNode`.

In-process::

    server = EdgeServer(EdgeConfig(node_id="a", origin="127.0.0.1:50051", disk_dir="/tmp/a"))
    await server.start()          # binds (port 0 = free port), health SERVING when ready
    server.address                # "127.0.0.1:PORT"
    await server.stop()

As a process: ``python -m edge.cli --listen 127.0.0.1:0 ...`` (or ``kdn edge``) prints one JSON
line ``{"event": "ready", "address": ..., "port": ..., "node_id": ..., "metrics_port": ...}``.

The servicer only translates: it parses and bounds every field (malformed keys/fingerprints ->
INVALID_ARGUMENT, oversized declarations -> RESOURCE_EXHAUSTED), checks the caller's token for the
request's tenant (:mod:`kdn.wire.auth`) and calls the node; conversions are
:mod:`kdn.wire.convert`'s, and the :func:`kdn.wire.service.rpc` envelope turns KdnErrors into
statuses (the one mapping). An unexpected exception becomes INTERNAL for that call and is logged;
the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager
from typing import Any, AsyncIterator, Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kdn.wire.auth import TokenAuth
from kdn.edge.bulk import BulkListener
from kdn.edge.clock import Clock, MonotonicClock
from kdn.edge.config import EdgeConfig
from kdn.edge.metrics import EdgeMetrics
from kdn.edge.node import EdgeNode
from kdn.edge.operator_hints import HintService
from kdn.edge.overlay import Member, MembershipProvider, Overlay, file_members, static_members
from kdn.edge.shm import ShmPool
from kdn.edge.store import TieredStore, build_store
from kdn.edge.upstream import FORWARDED_HEADER, FetchSpec, OriginUpstream, PeerUpstream, Upstream
from kdn.errors import StorageFull, Unavailable
from kdn.keys import ChunkKey, parse_fingerprint
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pbg
from kdn.wire.channel import bearer_token, check_bindable, grpc_options
from kdn.wire.convert import parse_keys, receive_put
from kdn.wire.frames import encode_chunk, encode_frames
from kdn.wire.service import Servicer, add_servicer, rpc

log = logging.getLogger(__name__)

SERVICE_NAME = "kdn.v1.EdgeService"


class PutBudget:
    """Bytes held by in-flight Puts, bounded across all of them (``EdgeConfig.put_buffer_bytes``).

    Each Put takes a lease; every piece it buffers is reserved first, and a reservation that would
    pass the bound refuses that Put with ``StorageFull`` (RESOURCE_EXHAUSTED) and frees what it
    held. Runs on the event loop only (no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._trim: asyncio.TimerHandle | None = None

    def refused(self) -> None:
        """A Put was refused: gRPC frees what it buffered for the stream when the call is torn
        down, just after this; give that heap back to the OS then (once per burst of refusals)."""
        if self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(0.25, self._trim_when_idle)

    def _trim_when_idle(self) -> None:
        self._trim = None
        if self.used == 0:
            _trim_heap()
        else:
            self.refused()  # Puts in flight hold the heap now: try again a little later

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes, or refuse with ``StorageFull``."""
        if self.used + n > self.limit:
            raise StorageFull(
                f"in-flight Puts hold {self.used} bytes; {n} more would pass the {self.limit}-byte budget"
            )
        self.used += n
        self.peak = max(self.peak, self.used)

    def give(self, n: int) -> None:
        """Give back ``n`` bytes a finished (or refused) Put held."""
        self.used -= n
        if n >= _TRIM_AFTER and self.used == 0:
            _trim_heap()

    @contextmanager
    def lease(self) -> Iterator[Callable[[int], None]]:
        held = 0

        def reserve(n: int) -> None:
            nonlocal held
            self.take(n)
            held += n

        try:
            yield reserve
        finally:
            self.give(held)


_TRIM_AFTER = 64 << 20  # a Put that held this much: give the freed heap back once no Put holds any


def _trim_heap() -> None:
    """Return freed heap to the OS (glibc ``malloc_trim``). A big Put's pieces (and gRPC's buffers
    for them) are freed when it ends, but glibc keeps freed arena memory mapped: without this, a
    flood of large refused Puts leaves the edge's RSS at its peak. A no-op where there is no glibc."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


class EdgeServicer(Servicer, pbg.EdgeServiceServicer):
    """``EdgeService`` over the node: every handler runs in the :func:`kdn.wire.service.rpc` envelope."""

    def __init__(self, server: "EdgeServer") -> None:
        self._s = server

    @property
    def node(self) -> EdgeNode:
        assert self._s.node is not None
        return self._s.node

    @property
    def put_budget(self) -> PutBudget:
        return self._s.put_budget

    @property
    def auth(self) -> TokenAuth:
        return self._s.auth

    @property
    def label(self) -> str:
        return self._s.config.node_id

    def refused(self, rpc_name: str, code: grpc.StatusCode, exc: BaseException) -> None:
        self.node.metrics.refused.labels(rpc_name, code.name).inc()
        if rpc_name == "Put":
            self.put_budget.refused()

    def _keys(self, raw: Any) -> list[ChunkKey]:
        return parse_keys(raw, limit=self._s.config.max_chain_keys)

    # -- RPCs ----------------------------------------------------------------------------------

    @rpc
    async def Fetch(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        t0 = time.perf_counter()
        ns, token = self.authorize(context, request.namespace)
        spec = FetchSpec.from_proto(request, ns)
        next_keys = self._keys(request.next_keys)
        forwarded = any(k == FORWARDED_HEADER for k, _ in context.invocation_metadata() or ())
        data, source = await self.node.fetch_bytes(spec, token=token, next_keys=next_keys, forwarded=forwarded)
        shm_name = ""
        if request.shm and self._s.shm is not None:
            try:
                shm_name = await asyncio.to_thread(self._s.shm.publish, ns.tenant, spec.key, data) \
                    if len(data) > (4 << 20) else self._s.shm.publish(ns.tenant, spec.key, data)
            except Unavailable as exc:  # no room in shared memory: stream the bytes instead
                log.info("%s: shm refused (%s); streaming", self._s.config.node_id, exc)
        metrics = self.node.metrics
        if shm_name:
            metrics.bytes_out.labels("shm").inc(len(data))
            yield encode_chunk(b"", total_size=len(data), source=source, shm_name=shm_name)
        else:
            # pre-encoded FetchChunk frames straight from the stored bytes: one copy per byte
            for frame in encode_frames(data, piece=self._s.config.stream_piece_bytes, source=source):
                yield frame
            metrics.bytes_out.labels("grpc").inc(len(data))
        metrics.latency.labels("Fetch", source).observe(time.perf_counter() - t0)

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        t0 = time.perf_counter()
        ns, token = self.authorize(context, request.namespace)
        fp = parse_fingerprint(request.fingerprint)
        keys = self._keys(request.keys)
        found = await self.node.lookup(keys, fingerprint=fp, namespace=ns, local_only=request.local_only, token=token)
        if request.probe and found:
            self.node.metrics.tokenization_mismatch.inc()
        self.node.metrics.latency.labels("Lookup", "").observe(time.perf_counter() - t0)
        return pb.LookupResponse(
            available=len(found),
            locations=[pb.Location(tier=f.tier, node_id=f.node_id, address=f.address) for f in found],
            node_id=self._s.config.node_id,
        )

    @rpc
    async def Put(self, request_iterator: AsyncIterator[pb.PutChunk], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        with self._s.put_budget.lease() as reserve:
            header, data = await receive_put(
                request_iterator, limit=self._s.config.max_artifact_bytes,
                authorize=lambda ns: self.auth.check(bearer_token(context.invocation_metadata()), ns.tenant),
                reserve=reserve, check_container=True,
            )
            await self.node.put(data, namespace=header.namespace, fingerprint=header.fingerprint, key=header.key)
            del data
        return pb.PutResponse(stored=True)

    @rpc
    async def Prefetch(self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext) -> pb.PrefetchResponse:
        ns, token = self.authorize(context, request.namespace)
        fp = parse_fingerprint(request.fingerprint)
        keys = await self.node.resolve_keys(
            self._keys(request.keys), request.document, fingerprint=fp, namespace=ns, token=token
        )
        queued = self.node.prefetch(keys, fingerprint=fp, namespace=ns, codec=request.codec, token=token)
        return pb.PrefetchResponse(queued=queued)

    @rpc
    async def Hint(self, request: pb.HintRequest, context: grpc.aio.ServicerContext) -> pb.HintResponse:
        ns, token = self.authorize(context, request.namespace)
        affected, name = await self._s.hints.apply(request, ns, token, self._keys(request.keys))
        if request.action == pb.HintRequest.EMPHASIZE:
            return pb.HintResponse(affected=affected, steer_variant=name)
        return pb.HintResponse(affected=affected, schedule_id=name)

    @rpc
    async def OpenBulk(self, request: pb.BulkRequest, context: grpc.aio.ServicerContext) -> pb.BulkOffer:
        """A ticket for the bulk byte path (:mod:`kdn.edge.bulk`), standing for the caller's token;
        port 0 when the path is not offered. Any valid token: tenants are checked per request."""
        token = bearer_token(context.invocation_metadata())
        self.auth.check_admin(token)
        bulk = self._s.bulk
        if bulk is None:
            return pb.BulkOffer()
        return pb.BulkOffer(port=bulk.port, ticket=bulk.grant(token), ttl_s=bulk.ttl_s)

    @rpc
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        self.authorize_admin(context)
        scope = self.auth.scope(bearer_token(context.invocation_metadata()))
        counters, details = await self.node.stats(tenants=scope)
        if scope is not None:  # a tenant's token: its own figures only (EdgeNode.stats)
            return pb.StatsResponse(
                node_id=self._s.config.node_id, role="edge", counters=counters, json=EdgeNode.details_json(details)
            )
        if self._s.shm is not None:
            counters["shm_segments"] = float(len(self._s.shm))
            counters["shm_bytes"] = float(self._s.shm.bytes_used)
        if self._s.metrics_port is not None:
            details["metrics_port"] = self._s.metrics_port
        return pb.StatsResponse(
            node_id=self._s.config.node_id, role="edge", counters=counters, json=EdgeNode.details_json(details)
        )


class EdgeServer:
    """One edge node served over gRPC. ``start()`` / ``address`` / ``stop()``."""

    def __init__(
        self,
        config: EdgeConfig,
        *,
        origin: Upstream | None = None,
        connect: Callable[[Member], Upstream] | None = None,
        members: MembershipProvider | None = None,
        store: TieredStore | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.edge_key = config.edge_key()  # the cluster key: peers' tokens checked, ours minted
        self.auth = TokenAuth.from_config(config.tokens, self.edge_key)
        self.clock = clock or MonotonicClock()
        self._origin_override = origin
        self._connect_override = connect
        self._members = members
        self._store = store
        self.node: EdgeNode | None = None
        self.shm: ShmPool | None = None
        self.hints: HintService | None = None
        self.metrics_port: int | None = None
        self.put_budget = PutBudget(config.put_buffer_bytes)  # shared by gRPC and bulk Puts
        self.bulk: BulkListener | None = None
        self.rtc: Any = None  # kdn.edge.rtc.EdgeRtc when rtc_signal is configured
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        host = self.config.listen.rpartition(":")[0]
        if host in ("0.0.0.0", "[::]", "::"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    def _connect(self, member: Member) -> Upstream:
        c = self.config
        key = self.edge_key  # with a cluster key, peers get one-use edge tokens, never upstream_token
        return PeerUpstream(
            member.node_id, member.address, tls=c.upstream_tls, token=None if key else c.upstream_token,
            fetch_deadline_s=c.peer_deadline_s * 4, call_deadline_s=c.peer_deadline_s,
            max_message=c.max_message_bytes, max_artifact=c.max_artifact_bytes,
            credential=key.credential(member.node_id) if key else None,
        )

    async def start(self) -> "EdgeServer":
        c = self.config
        tls = c.server_tls
        if tls is not None:
            tls.check_server_files()  # gRPC would only say "Failed to bind"
        check_bindable(c.listen)  # before gRPC, which logs its own multi-line complaint
        store = self._store if self._store is not None else await asyncio.to_thread(build_store, c, clock=self.clock)
        self._server = grpc.aio.server(options=grpc_options(c.max_message_bytes))
        try:
            if tls is not None:
                self.port = self._server.add_secure_port(c.listen, tls.server_credentials())
            else:
                self.port = self._server.add_insecure_port(c.listen)
        except (RuntimeError, OSError) as exc:  # grpcio raises RuntimeError("Failed to bind ...")
            self.port = 0
            log.debug("bind %s failed: %s", c.listen, exc)
        if not self.port:
            self._server = None
            if self._store is None:
                await asyncio.to_thread(store.close)
            raise OSError(f"cannot bind {c.listen}: the port is in use or the host is not an address of this machine")
        self_member = Member(c.node_id, self.address, c.weight)
        metrics = EdgeMetrics(c.node_id)
        members: Any = (
            self._members if self._members is not None
            else file_members(c.peers_file, c.peer_weights) if c.peers_file
            else static_members(c.peers, c.peer_weights)
        )
        connect = self._connect_override or self._connect
        if c.rtc_signal:  # edges behind NAT: discovery at the origin, WebRTC where gRPC cannot dial
            from kdn.edge.rtc import EdgeRtc

            self.rtc = EdgeRtc(c, self.auth, metrics, members if callable(members) else list(members))
            members = self.rtc.members
            connect = self._connect_override or self.rtc.connect
        overlay = Overlay(
            self_member, members, replicas=c.replicas, backoff_s=c.peer_backoff_s, clock=self.clock,
        )
        origin = self._origin_override
        if origin is None and c.origin:
            origin = OriginUpstream(
                c.origin, tls=c.upstream_tls, token=c.upstream_token,
                fetch_deadline_s=c.fetch_deadline_s, call_deadline_s=c.admin_deadline_s,
                max_message=c.max_message_bytes, max_artifact=c.max_artifact_bytes,
            )
        self.node = EdgeNode(
            c, store=store, overlay=overlay, connect=connect, origin=origin,
            metrics=metrics, clock=self.clock,
        )
        self.node.address = self.address
        self.hints = HintService(self.node, disk_dir=c.disk_dir, clock=self.clock)
        self.node.scheduler = self.hints
        if c.shm:
            self.shm = ShmPool(c.node_id, directory=c.shm_dir, max_segments=c.shm_max_segments, max_bytes=c.shm_max_bytes)
        add_servicer(self._server, EdgeServicer(self), "EdgeService")
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        await self.node.start()
        if self.rtc is not None:
            await self.rtc.start(self.node, self.address)
        if c.bulk and tls is None:  # plain TCP: never where the operator asked for TLS
            self.bulk = BulkListener(self, c.listen.rpartition(":")[0], c.bulk_port)
            try:
                await self.bulk.start()
            except OSError as exc:
                log.warning("%s: bulk byte path not offered (cannot bind port %s: %s)", c.node_id, c.bulk_port, exc)
                self.bulk = None
        await self._server.start()
        if c.metrics_port is not None:
            self.metrics_port = metrics.serve(c.metrics_host, c.metrics_port, token=c.metrics_token,
                                              max_connections=c.metrics_max_connections, timeout_s=c.metrics_timeout_s)
            if c.metrics_token is None and c.metrics_host not in ("127.0.0.1", "localhost", "::1"):
                log.warning("%s: /metrics on %s answers anyone who can reach it (set metrics_token)",
                            c.node_id, c.metrics_host)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        return self

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self.bulk is not None:
            await self.bulk.stop()
            self.bulk = None
        if self.rtc is not None:
            await self.rtc.stop()
            self.rtc = None
        if self.node is not None:
            await self.node.stop()
            self.node.metrics.close()
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> "EdgeServer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
