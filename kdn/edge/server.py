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
request's tenant (:mod:`kdn.wire.auth`), calls the node, and converts KdnErrors to statuses with
:func:`kdn.wire.errors.abort_for` — the one mapping. An unexpected exception becomes
INTERNAL for that call and is logged; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kdn.wire.auth import TokenAuth
from kdn.edge.clock import Clock, MonotonicClock
from kdn.edge.config import EdgeConfig
from kdn.edge.metrics import EdgeMetrics
from kdn.edge.node import EdgeNode
from kdn.edge.overlay import Member, MembershipProvider, Overlay, file_members, static_members
from kdn.edge.shm import ShmPool
from kdn.edge.upstream import FORWARDED_HEADER, FetchSpec, OriginUpstream, PeerUpstream, Upstream
from kdn.wire.frames import encode_chunk, serialize_chunk
from kdn.errors import InvalidInput, KdnError, MessageTooLarge, Unavailable
from kdn.keys import ChunkKey, Namespace, parse_fingerprint, parse_key
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pbg
from kdn.wire.channel import bearer_token, grpc_options
from kdn.wire.errors import status_for

log = logging.getLogger(__name__)

SERVICE_NAME = "kdn.v1.EdgeService"


def make_store(config: EdgeConfig, clock: Clock) -> Any:
    """The tiered store the config describes: memory, then disk if ``disk_dir`` is set."""
    from kdn.edge.store import DiskTier, MemoryTier, TieredStore

    tiers: list[Any] = [MemoryTier(config.memory_bytes)]
    if config.disk_dir:
        tiers.append(DiskTier(Path(config.disk_dir), config.disk_bytes))
    return TieredStore(tiers, policy=config.policy, clock=clock)


def _namespace(msg: pb.Namespace) -> Namespace:
    return Namespace(msg.tenant, msg.salt)


class EdgeServicer(pbg.EdgeServiceServicer):
    def __init__(self, server: "EdgeServer") -> None:
        self._s = server

    @property
    def node(self) -> EdgeNode:
        assert self._s.node is not None
        return self._s.node

    # -- helpers -------------------------------------------------------------------------------

    def _auth(self, context: grpc.aio.ServicerContext, tenant: str) -> str | None:
        token = bearer_token(context.invocation_metadata())
        self._s.auth.check(token, tenant)
        return token

    def _keys(self, raw: Any) -> list[ChunkKey]:
        if len(raw) > self._s.config.max_chain_keys:
            raise MessageTooLarge(f"{len(raw)} keys in one request (limit {self._s.config.max_chain_keys})")
        return [parse_key(k) for k in raw]

    async def _fail(self, context: grpc.aio.ServicerContext, rpc: str, exc: BaseException) -> None:
        code, message = status_for(exc)
        if not isinstance(exc, KdnError):
            log.exception("%s: %s crashed", self._s.config.node_id, rpc, exc_info=exc)
        self.node.metrics.refused.labels(rpc, code.name).inc()
        await context.abort(code, message)

    # -- RPCs ----------------------------------------------------------------------------------

    async def Fetch(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        t0 = time.perf_counter()
        try:
            ns = _namespace(request.namespace)
            token = self._auth(context, ns.tenant)
            spec = FetchSpec(
                parse_key(request.key),
                parse_fingerprint(request.fingerprint),
                ns,
                codec=request.codec,
                require_lossless=request.require_lossless,
                local_only=request.local_only,
            )
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
        except Exception as exc:
            await self._fail(context, "Fetch", exc)
            return
        metrics = self.node.metrics
        if shm_name:
            metrics.bytes_out.labels("shm").inc(len(data))
            yield encode_chunk(b"", total_size=len(data), source=source, shm_name=shm_name)
        else:
            # pre-encoded FetchChunk frames straight from the stored bytes: one copy per byte
            piece = self._s.config.stream_piece_bytes
            total = len(data)
            view = memoryview(data)
            yield encode_chunk(view[:piece], total_size=total, source=source)
            for start in range(piece, total, piece):
                yield encode_chunk(view[start : start + piece])
            metrics.bytes_out.labels("grpc").inc(total)
        metrics.latency.labels("Fetch", source).observe(time.perf_counter() - t0)

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        t0 = time.perf_counter()
        try:
            ns = _namespace(request.namespace)
            token = self._auth(context, ns.tenant)
            fp = parse_fingerprint(request.fingerprint)
            keys = self._keys(request.keys)
            found = await self.node.lookup(keys, fingerprint=fp, namespace=ns, local_only=request.local_only, token=token)
        except Exception as exc:
            await self._fail(context, "Lookup", exc)
            return pb.LookupResponse()
        self.node.metrics.latency.labels("Lookup", "").observe(time.perf_counter() - t0)
        return pb.LookupResponse(
            available=len(found),
            locations=[pb.Location(tier=f.tier, node_id=f.node_id, address=f.address) for f in found],
            node_id=self._s.config.node_id,
        )

    async def Put(self, request_iterator: AsyncIterator[pb.PutChunk], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        try:
            header: pb.PutHeader | None = None
            buf = bytearray()
            limit = self._s.config.max_artifact_bytes
            async for chunk in request_iterator:
                if header is None:
                    if not chunk.HasField("header"):
                        raise InvalidInput("the first Put message must carry the header")
                    header = chunk.header
                    ns = _namespace(header.namespace)
                    self._auth(context, ns.tenant)
                    key = parse_key(header.key)
                    fp = parse_fingerprint(header.fingerprint)
                    if header.total_size > limit:
                        raise MessageTooLarge(f"Put declares {header.total_size} bytes (limit {limit})")
                elif chunk.HasField("header"):
                    raise InvalidInput("only the first Put message may carry a header")
                buf += chunk.data
                if len(buf) > limit or (header.total_size and len(buf) > header.total_size):
                    raise MessageTooLarge(f"Put sent more bytes than declared/allowed ({len(buf)})")
            if header is None:
                raise InvalidInput("empty Put stream")
            if header.total_size and len(buf) != header.total_size:
                raise InvalidInput(f"Put declared {header.total_size} bytes but sent {len(buf)}")
            await self.node.put(bytes(buf), namespace=ns, fingerprint=fp, key=key)
        except Exception as exc:
            await self._fail(context, "Put", exc)
            return pb.PutResponse()
        return pb.PutResponse(stored=True)

    async def Prefetch(self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext) -> pb.PrefetchResponse:
        try:
            ns = _namespace(request.namespace)
            token = self._auth(context, ns.tenant)
            fp = parse_fingerprint(request.fingerprint)
            keys = await self.node.resolve_keys(
                self._keys(request.keys), request.document, fingerprint=fp, namespace=ns, token=token
            )
            queued = self.node.prefetch(keys, fingerprint=fp, namespace=ns, codec=request.codec, token=token)
        except Exception as exc:
            await self._fail(context, "Prefetch", exc)
            return pb.PrefetchResponse()
        return pb.PrefetchResponse(queued=queued)

    async def Hint(self, request: pb.HintRequest, context: grpc.aio.ServicerContext) -> pb.HintResponse:
        try:
            ns = _namespace(request.namespace)
            token = self._auth(context, ns.tenant)
            affected, schedule_id = await self._s.hints.apply(request, ns, token, self._keys(request.keys))
        except Exception as exc:
            await self._fail(context, "Hint", exc)
            return pb.HintResponse()
        return pb.HintResponse(affected=affected, schedule_id=schedule_id)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        try:
            self._s.auth.check_admin(bearer_token(context.invocation_metadata()))
            counters, details = await self.node.stats()
            if self._s.shm is not None:
                counters["shm_segments"] = float(len(self._s.shm))
                counters["shm_bytes"] = float(self._s.shm.bytes_used)
            if self._s.metrics_port is not None:
                details["metrics_port"] = self._s.metrics_port
        except Exception as exc:
            await self._fail(context, "Stats", exc)
            return pb.StatsResponse()
        return pb.StatsResponse(
            node_id=self._s.config.node_id, role="edge", counters=counters, json=EdgeNode.details_json(details)
        )


def _add_servicer(servicer: EdgeServicer, server: grpc.aio.Server) -> None:
    """As the generated ``add_EdgeServiceServicer_to_server``, except that Fetch yields pre-encoded
    ``FetchChunk`` bytes (:mod:`kdn.wire.frames`); the bytes on the wire are the same."""
    u, s_, su = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler, grpc.stream_unary_rpc_method_handler
    handlers = {
        "Lookup": u(servicer.Lookup, request_deserializer=pb.LookupRequest.FromString,
                    response_serializer=pb.LookupResponse.SerializeToString),
        "Fetch": s_(servicer.Fetch, request_deserializer=pb.FetchRequest.FromString, response_serializer=serialize_chunk),
        "Put": su(servicer.Put, request_deserializer=pb.PutChunk.FromString,
                  response_serializer=pb.PutResponse.SerializeToString),
        "Prefetch": u(servicer.Prefetch, request_deserializer=pb.PrefetchRequest.FromString,
                      response_serializer=pb.PrefetchResponse.SerializeToString),
        "Hint": u(servicer.Hint, request_deserializer=pb.HintRequest.FromString,
                  response_serializer=pb.HintResponse.SerializeToString),
        "Stats": u(servicer.Stats, request_deserializer=pb.StatsRequest.FromString,
                   response_serializer=pb.StatsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class EdgeServer:
    """One edge node served over gRPC. ``start()`` / ``address`` / ``stop()``."""

    def __init__(
        self,
        config: EdgeConfig,
        *,
        origin: Upstream | None = None,
        connect: Callable[[Member], Upstream] | None = None,
        members: MembershipProvider | None = None,
        store: Any | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.auth = TokenAuth.from_config(config.tokens)
        self.clock = clock or MonotonicClock()
        self._origin_override = origin
        self._connect_override = connect
        self._members = members
        self._store = store
        self.node: EdgeNode | None = None
        self.shm: ShmPool | None = None
        self.hints: Any = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health: Any = None
        self.port = 0

    @property
    def address(self) -> str:
        host = self.config.listen.rpartition(":")[0]
        if host in ("0.0.0.0", "[::]", "::"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    def _connect(self, member: Member) -> Upstream:
        c = self.config
        return PeerUpstream(
            member.node_id, member.address, tls=c.upstream_tls, token=c.upstream_token,
            fetch_deadline_s=c.peer_deadline_s * 4, call_deadline_s=c.peer_deadline_s,
            max_message=c.max_message_bytes, max_artifact=c.max_artifact_bytes,
        )

    async def start(self) -> "EdgeServer":
        from kdn.edge.hint_api import HintService

        c = self.config
        store = self._store if self._store is not None else await asyncio.to_thread(make_store, c, self.clock)
        self._server = grpc.aio.server(options=grpc_options(c.max_message_bytes))
        tls = c.server_tls
        if tls is not None:
            self.port = self._server.add_secure_port(c.listen, tls.server_credentials())
        else:
            self.port = self._server.add_insecure_port(c.listen)
        if not self.port:
            raise OSError(f"cannot bind {c.listen}")
        self_member = Member(c.node_id, self.address, c.weight)
        overlay = Overlay(
            self_member,
            self._members if self._members is not None
            else file_members(c.peers_file, c.peer_weights) if c.peers_file
            else static_members(c.peers, c.peer_weights),
            replicas=c.replicas, backoff_s=c.peer_backoff_s, clock=self.clock,
        )
        origin = self._origin_override
        if origin is None and c.origin:
            origin = OriginUpstream(
                c.origin, tls=c.upstream_tls, token=c.upstream_token,
                fetch_deadline_s=c.fetch_deadline_s, call_deadline_s=c.admin_deadline_s,
                max_message=c.max_message_bytes, max_artifact=c.max_artifact_bytes,
            )
        metrics = EdgeMetrics(c.node_id)
        self.node = EdgeNode(
            c, store=store, overlay=overlay, connect=self._connect_override or self._connect, origin=origin,
            metrics=metrics, clock=self.clock,
        )
        self.node.address = self.address
        self.hints = HintService(self.node, disk_dir=c.disk_dir, clock=self.clock)
        self.node.scheduler = self.hints
        if c.shm:
            self.shm = ShmPool(c.node_id, directory=c.shm_dir, max_segments=c.shm_max_segments, max_bytes=c.shm_max_bytes)
        _add_servicer(EdgeServicer(self), self._server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        await self.node.start()
        await self._server.start()
        if c.metrics_port is not None:
            self.metrics_port = metrics.serve(c.metrics_host, c.metrics_port)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        return self

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
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
