"""The edge's one front door: what every transport asks of the node, and the one refusal rule.

gRPC (:mod:`kdn.edge.server`), the bulk socket (:mod:`kdn.edge.bulk`) and WebRTC data channels
(:mod:`kdn.edge.rtc`) are framing adapters over :class:`EdgeFront`. Each one turns its bytes into
a request with :mod:`kdn.wire.convert` (the tenant is named and the caller's token checked for it
first, :meth:`EdgeFront.authorizer`), asks the front, and frames what comes back. When a request
fails, the transport hands the exception to :meth:`EdgeFront.refuse`, which decides what the
caller is told (the status and message of :func:`kdn.wire.errors.status_for`, the one mapping),
logs an exception that is not a KdnError (a bug) and counts the refusal
(``kdn_edge_refused{rpc,reason}``, the reason being the status name); the transport only frames
that answer: a gRPC status, the bulk socket's error answer, the data channel's ERROR message.

Counting of served requests is the front's too: bytes out per path and Fetch latency per source
(:meth:`EdgeFront.served`), Lookup latency and probes that found KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from kdn.edge.budget import PutBudget
from kdn.edge.node import EdgeNode, Located
from kdn.edge.store import EntryMeta
from kdn.errors import KdnError, Unavailable
from kdn.keys import ChunkKey, Namespace
from kdn.wire.auth import TokenAuth
from kdn.wire.convert import BulkOffer, FetchAsk, HintAsk, LookupAsk, PrefetchAsk, PutHeader
from kdn.wire.errors import status_for, status_value

if TYPE_CHECKING:
    from kdn.edge.operator_hints import HintService
    from kdn.edge.shm import ShmPool

__all__ = ["EdgeFront", "Refusal", "SHM_INLINE_BYTES"]

log = logging.getLogger(__name__)

SHM_INLINE_BYTES = 4 << 20
"""A container up to this size is written to shared memory on the event loop; a larger one on a
worker thread."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """What a refused request is answered with, whichever transport carries it."""

    code: Any  # grpc.StatusCode
    message: str

    @property
    def status(self) -> int:
        """The status as a number (the bulk socket and the data channel carry it so)."""
        return status_value(self.code)


class EdgeFront:
    """The node as every transport sees it. ``bulk`` and ``metrics_port`` are set by the server
    once they are up (OpenBulk offers the one, Stats names the other)."""

    def __init__(
        self, node: EdgeNode, *, auth: TokenAuth, put_budget: PutBudget, hints: "HintService",
        shm: "ShmPool | None" = None,
    ) -> None:
        self.node = node
        self.config = node.config
        self.auth = auth
        self.put_budget = put_budget
        self.hints = hints
        self.shm = shm
        self.bulk: Any = None  # kdn.edge.bulk.BulkListener, when the bulk byte path is offered
        self.metrics_port: int | None = None

    @property
    def node_id(self) -> str:
        return self.config.node_id

    # -- the one refusal rule ------------------------------------------------------------------

    def refuse(self, rpc: str, exc: BaseException, *, via: str) -> Refusal:
        """The answer to a request of ``rpc`` (a method name, or the transport's name for a request
        it could not even read) that raised ``exc``, over the transport ``via``; counted once."""
        code, message = status_for(exc)
        if not isinstance(exc, KdnError):
            log.error("%s: %s %s crashed", self.node_id, via, rpc, exc_info=exc)
        self.node.metrics.refused.labels(rpc, code.name).inc()
        return Refusal(code, message)

    def authorizer(self, token: str | None) -> Callable[[Namespace], None]:
        """The check a request's parser runs once it named its tenant: ``token`` is granted it."""
        return lambda ns: self.auth.check(token, ns.tenant)

    # -- Fetch ---------------------------------------------------------------------------------

    async def fetch(self, ask: FetchAsk, token: str | None, *, forwarded: bool = False) -> tuple[bytes, str]:
        """Verified container bytes and the source that served them (:meth:`EdgeNode.fetch_bytes`)."""
        return await self.node.fetch_bytes(ask.spec, token=token, next_keys=ask.next_keys, forwarded=forwarded)

    def fetch_blocking(self, ask: FetchAsk, token: str | None, loop: asyncio.AbstractEventLoop) -> tuple[bytes, str]:
        """:meth:`fetch` from a thread that is not ``loop``'s: a hit is answered on this thread
        (:meth:`EdgeNode.hit`), without a round trip through the event loop; a miss runs on
        ``loop`` (coalescing, peers and the origin live there)."""
        held = self.node.hit(ask.spec)
        if held is None:
            return asyncio.run_coroutine_threadsafe(self.fetch(ask, token), loop).result()
        if ask.next_keys:
            loop.call_soon_threadsafe(self.node.read_ahead, ask.spec, ask.next_keys, token)
        return held

    def publish(self, tenant: str, key: ChunkKey, data: bytes) -> str:
        """The shared-memory segment that holds ``data`` (written once per key, then reused); ""
        when this edge has no pool or no room in it (the caller then sends the bytes)."""
        if self.shm is None:
            return ""
        try:
            return self.shm.publish(tenant, key, data)
        except Unavailable as exc:
            log.info("%s: shm refused (%s); sending the bytes", self.node_id, exc)
            return ""

    async def publish_async(self, tenant: str, key: ChunkKey, data: bytes) -> str:
        """:meth:`publish` from the event loop (a large container is written on a worker thread)."""
        if self.shm is None:
            return ""
        if len(data) > SHM_INLINE_BYTES:
            return await asyncio.to_thread(self.publish, tenant, key, data)
        return self.publish(tenant, key, data)

    def served(self, path: str, nbytes: int, source: str, t0: float) -> None:
        """Count a Fetch answered over ``path`` (``grpc``, ``bulk``, ``shm``, ``rtc``) since ``t0``
        (``time.perf_counter()``)."""
        metrics = self.node.metrics
        metrics.bytes_out.labels(path).inc(nbytes)
        metrics.latency.labels("Fetch", source).observe(time.perf_counter() - t0)

    # -- the other requests --------------------------------------------------------------------

    async def lookup(self, ask: LookupAsk, token: str | None) -> list[Located]:
        t0 = time.perf_counter()
        found = await self.node.lookup(ask.keys, fingerprint=ask.fingerprint, namespace=ask.namespace,
                                       local_only=ask.local_only, token=token)
        if ask.probe and found:
            self.node.metrics.tokenization_mismatch.inc()
        self.node.metrics.latency.labels("Lookup", "").observe(time.perf_counter() - t0)
        return found

    def put_lease(self) -> AbstractContextManager[Callable[[int], None]]:
        """A Put's share of the bytes in-flight Puts may hold (:class:`kdn.edge.budget.PutBudget`)."""
        return self.put_budget.lease()

    async def put(self, header: PutHeader, data: bytes | bytearray | memoryview, *, take: bool = False) -> EntryMeta:
        return await self.node.put(data, namespace=header.namespace, fingerprint=header.fingerprint, key=header.key,
                                   take=take)

    def held(self, header: PutHeader) -> bool:
        """Whether the Put's key is held already (its bytes will store nothing new)."""
        return self.node.store.contains(header.key, tenant=header.namespace.tenant)

    async def prefetch(self, ask: PrefetchAsk, token: str | None) -> int:
        keys = await self.node.resolve_keys(ask.keys, ask.document, fingerprint=ask.fingerprint,
                                            namespace=ask.namespace, token=token)
        return self.node.prefetch(keys, fingerprint=ask.fingerprint, namespace=ask.namespace, codec=ask.codec,
                                  token=token)

    async def hint(self, ask: HintAsk, token: str | None) -> tuple[int, str]:
        return await self.hints.apply(ask, ask.namespace, token, ask.keys)

    def open_bulk(self, token: str | None) -> BulkOffer | None:
        """A ticket for the bulk byte path standing for ``token`` (any valid token: tenants are
        checked per request), with the shared-memory bounds; None when the path is not offered."""
        self.auth.check_admin(token)
        if self.bulk is None:
            return None
        segments, size = self.shm.bounds if self.shm is not None else (0, 0)
        return BulkOffer(self.bulk.port, self.bulk.grant(token), self.bulk.ttl_s, segments, size, self.bulk.local_name)

    async def stats(self, token: str | None) -> tuple[dict[str, float], dict[str, Any]]:
        """(counters, details): the node's for an operator, a tenant's own for its token
        (:meth:`EdgeNode.stats`)."""
        self.auth.check_admin(token)
        scope = self.auth.scope(token)
        counters, details = await self.node.stats(tenants=scope)
        if scope is not None:
            return counters, details
        if self.shm is not None:
            counters["shm_segments"] = float(len(self.shm))
            counters["shm_bytes"] = float(self.shm.bytes_used)
        if self.metrics_port is not None:
            details["metrics_port"] = self.metrics_port
        return counters, details
