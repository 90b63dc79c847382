"""The edge's gRPC server: ``EdgeService`` + the standard health service, over :class:`EdgeFront`.

In-process::

    server = EdgeServer(EdgeConfig(node_id="a", origin="127.0.0.1:50051", disk_dir="/tmp/a"))
    await server.start()          # binds (port 0 = free port), health SERVING when ready
    server.address                # "127.0.0.1:PORT"
    await server.stop()

As a process: ``python -m edge.cli --listen 127.0.0.1:0 ...`` (or ``kdn edge``) prints one JSON
line ``{"event": "ready", "address": ..., "port": ..., "node_id": ..., "metrics_port": ...}``.

The servicer only frames: each handler parses its request with :mod:`kdn.wire.convert` (malformed
keys/fingerprints -> INVALID_ARGUMENT, oversized declarations -> RESOURCE_EXHAUSTED, the caller's
token checked for the request's tenant first), asks the front (:class:`kdn.edge.front.EdgeFront`)
and converts the answer back with :mod:`kdn.wire.convert`. A failed call's status is the front's
refusal (:meth:`EdgeFront.refuse`), applied by the :func:`kdn.wire.service.rpc` envelope; an
unexpected exception becomes INTERNAL for that call and is logged; the server keeps serving.
The edge's parts are built by :func:`kdn.edge.compose.compose_edge`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

import grpc

from kdn.edge.budget import PutBudget
from kdn.edge.bulk import BulkListener
from kdn.edge.clock import Clock, MonotonicClock
from kdn.edge.compose import compose_edge
from kdn.edge.config import EdgeConfig
from kdn.edge.front import EdgeFront
from kdn.edge.node import EdgeNode
from kdn.edge.overlay import Member, MembershipProvider
from kdn.edge.shm import ShmPool
from kdn.edge.store import TieredStore, build_store
from kdn.edge.upstream import FORWARDED_HEADER, Upstream
from kdn.wire import convert as wc
from kdn.wire.auth import TokenAuth
from kdn.wire.channel import bearer_token, check_bindable, grpc_options
from kdn.wire.frames import encode_chunk, encode_frames
from kdn.wire.health import Health
from kdn.wire.service import Servicer, add_servicer, rpc

__all__ = ["EdgeServer", "EdgeServicer", "PutBudget", "SERVICE_NAME"]

log = logging.getLogger(__name__)

SERVICE_NAME = "kdn.v1.EdgeService"


class EdgeServicer(Servicer):
    """``EdgeService`` framed over the front: every handler runs in the :func:`kdn.wire.service.rpc`
    envelope, whose status is the front's refusal."""

    def __init__(self, front: EdgeFront) -> None:
        self.front = front

    @property
    def auth(self) -> TokenAuth:
        return self.front.auth

    @property
    def label(self) -> str:
        return self.front.node_id

    def refusal(self, rpc: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        refused = self.front.refuse(rpc, exc, via="grpc")
        if rpc == "Put":
            # gRPC frees what it buffered for the stream when the call is torn down, just after this
            self.front.put_budget.refused()
        return refused.code, refused.message

    @staticmethod
    def _token(context: grpc.aio.ServicerContext) -> str | None:
        return bearer_token(context.invocation_metadata())

    def _parse(self, parse: Callable[..., Any], request: Any, context: grpc.aio.ServicerContext) -> tuple[Any, str | None]:
        token = self._token(context)
        return parse(request, limit=self.front.config.max_chain_keys, authorize=self.front.authorizer(token)), token

    # -- RPCs ----------------------------------------------------------------------------------

    @rpc
    async def Fetch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        t0 = time.perf_counter()
        front = self.front
        ask, token = self._parse(wc.parse_fetch, request, context)
        forwarded = any(k == FORWARDED_HEADER for k, _ in context.invocation_metadata() or ())
        data, source = await front.fetch(ask, token, forwarded=forwarded)
        shm_name = await front.publish_async(ask.spec.namespace.tenant, ask.spec.key, data) if ask.shm else ""
        if shm_name:
            front.served("shm", len(data), source, t0)
            yield encode_chunk(b"", total_size=len(data), source=source, shm_name=shm_name)
            return
        # pre-encoded FetchChunk frames straight from the stored bytes: one copy per byte
        for frame in encode_frames(data, piece=front.config.stream_piece_bytes, source=source):
            yield frame
        front.served("grpc", len(data), source, t0)

    @rpc
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ask, token = self._parse(wc.parse_lookup, request, context)
        found = await self.front.lookup(ask, token)
        return wc.lookup_response(found, node_id=self.front.node_id)

    @rpc
    async def Put(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        front = self.front
        with front.put_lease() as reserve:
            header, data = await wc.receive_put(
                request_iterator, limit=front.config.max_artifact_bytes,
                authorize=front.authorizer(self._token(context)), reserve=reserve, check_container=True,
            )
            await front.put(header, data)
            del data
        return wc.put_response()

    @rpc
    async def Prefetch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ask, token = self._parse(wc.parse_prefetch, request, context)
        return wc.prefetch_response(await self.front.prefetch(ask, token))

    @rpc
    async def Hint(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ask, token = self._parse(wc.parse_hint, request, context)
        affected, name = await self.front.hint(ask, token)
        return wc.hint_response(ask, affected, name)

    @rpc
    async def OpenBulk(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """A ticket for the bulk byte path (:mod:`kdn.edge.bulk`); port 0 when it is not offered."""
        return wc.bulk_offer(self.front.open_bulk(self._token(context)))

    @rpc
    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        counters, details = await self.front.stats(self._token(context))
        return wc.stats_response(self.front.node_id, counters, details)


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
        # the composed parts (compose_edge), once started
        self.front: EdgeFront | None = None
        self.node: EdgeNode | None = None
        self.shm: ShmPool | None = None
        self.put_budget: PutBudget | None = None  # shared by gRPC and bulk Puts
        self.metrics_port: int | None = None
        self.bulk: BulkListener | None = None
        self.rtc: Any = None  # kdn.edge.rtc.EdgeRtc when rtc_signal is configured
        self._server: grpc.aio.Server | None = None
        self._health: Health | None = None
        self.port = 0

    @property
    def address(self) -> str:
        host = self.config.listen.rpartition(":")[0]
        if host in ("0.0.0.0", "[::]", "::"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

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
        edge = compose_edge(
            c, address=self.address, auth=self.auth, clock=self.clock, store=store, members=self._members,
            connect=self._connect_override,
            **({"origin": self._origin_override} if self._origin_override is not None else {}),
        )
        self.front, self.node, self.rtc = edge.front, edge.node, edge.rtc
        self.shm, self.put_budget = edge.front.shm, edge.front.put_budget
        add_servicer(self._server, EdgeServicer(edge.front), "EdgeService")
        self._health = Health(self._server)
        await edge.node.start()
        if self.rtc is not None:
            await self.rtc.start(edge.front, self.address)
        if c.bulk and tls is None:  # plain TCP: never where the operator asked for TLS
            self.bulk = BulkListener(edge.front, c.listen.rpartition(":")[0], c.bulk_port)
            try:
                await self.bulk.start()
            except OSError as exc:
                log.warning("%s: bulk byte path not offered (cannot bind port %s: %s)", c.node_id, c.bulk_port, exc)
                self.bulk = None
            edge.front.bulk = self.bulk
        await self._server.start()
        if c.metrics_port is not None:
            self.metrics_port = edge.front.metrics_port = edge.node.metrics.serve(c)
            if c.metrics_token is None and c.metrics_host not in ("127.0.0.1", "localhost", "::1"):
                log.warning("%s: /metrics on %s answers anyone who can reach it (set metrics_token)",
                            c.node_id, c.metrics_host)
        await self._health.serving(SERVICE_NAME)
        return self

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._health is not None:
            await self._health.shutdown()
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
