"""The edge node's logic, independent of any transport: local tiers, then owners, then the origin.

:class:`EdgeNode` is what the edge's front (:class:`kdn.edge.front.EdgeFront`) serves over gRPC,
the bulk socket and WebRTC, and what unit tests wire together with in-memory upstreams (no
sockets). The read path of :meth:`EdgeNode.fetch_bytes`:

1. the local tiers, through the one hit path :meth:`EdgeNode.hit` (memory hits are served
   inline; disk reads, which verify every checksum, run in a worker thread);
2. on a miss, one upstream fetch per key however many requests wait for it (:class:`SingleFlight`),
   in the order :class:`kdn.edge.sources.Sources` states (owners, then the origin);
3. what came from upstream is verified before it is stored or served; a Put is decode-checked the
   same way, so a checksum-valid but undecodable artifact (checksums are unkeyed: anyone can make
   one) is refused instead of shadowing the honest Put of the same key that comes after it (the
   first writer of a key wins). Bytes are never served unverified: memory holds only what was
   verified on put, disk is verified on every read.

After chunk i, the request's ``next_keys[:prefetch_depth]`` are offered to the prefetcher.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Protocol, Sequence

from kdn.edge.clock import Clock, MonotonicClock
from kdn.edge.config import EdgeConfig
from kdn.edge.metrics import EdgeMetrics
from kdn.edge.overlay import Member, Overlay
from kdn.edge.prefetch import Prefetcher, PrefetchJob
from kdn.edge.sources import DOCUMENT_TOKENS, FEW_DOCUMENTS, Located, Sources, check_decodes
from kdn.edge.store import EntryMeta, TieredStore
from kdn.edge.tasks import cancel_and_wait
from kdn.edge.upstream import FetchSpec, SingleFlight, Upstream
from kdn.artifact import read_header
from kdn.errors import FingerprintMismatch, InvalidInput, KdnError, LossyRefused, NotFound
from kdn.keys import ChunkKey, ModelFingerprint, Namespace

__all__ = ["DOCUMENT_TOKENS", "FEW_DOCUMENTS", "EdgeNode", "Located", "ScheduledHints", "check_decodes"]

log = logging.getLogger(__name__)


class ScheduledHints(Protocol):
    """What the node's schedule loop and Stats need of the operator's schedules
    (:class:`kdn.edge.operator_hints.HintService`)."""

    async def run_due(self) -> int: ...

    def describe(self, tenants: frozenset[str] | None = None) -> list[dict[str, Any]]: ...


class EdgeNode:
    """One edge: store + overlay + upstreams + prefetcher + hint scheduler."""

    def __init__(
        self,
        config: EdgeConfig,
        *,
        store: TieredStore,
        overlay: Overlay,
        connect: Callable[[Member], Upstream],
        origin: Upstream | None = None,
        metrics: EdgeMetrics | None = None,
        scheduler: ScheduledHints | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.overlay = overlay
        self.metrics = metrics or EdgeMetrics(config.node_id)
        self.metrics.attach_store(self._store_stats)
        self.sources = Sources(config, store=store, overlay=overlay, connect=connect, origin=origin,
                               metrics=self.metrics)
        self.scheduler = scheduler
        self.clock = clock or MonotonicClock()
        self._flight: SingleFlight[tuple[str, bytes, bool], tuple[bytes, str]] = SingleFlight()
        self.prefetcher = Prefetcher(self._run_prefetch, queue_size=config.prefetch_queue, workers=config.prefetch_workers)
        self.address = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._started = time.time()

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def origin(self) -> Upstream | None:
        return self.sources.origin

    @property
    def origin_available(self) -> bool | None:
        """What the origin's last answer said of it (None: not asked yet, or none configured)."""
        return self.sources.origin_available

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.prefetcher.start()
        self._tasks.append(asyncio.ensure_future(self._membership_loop()))
        if self.scheduler is not None:
            self._tasks.append(asyncio.ensure_future(self._schedule_loop()))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        await self.prefetcher.stop()
        await self.sources.close()
        await asyncio.to_thread(self.store.close)

    def peer(self, member: Member) -> Upstream:
        """The upstream for ``member`` (made on first use, kept while its address holds)."""
        return self.sources.peer(member)

    # -- reads ---------------------------------------------------------------------------------

    async def lookup_local(self, keys: Sequence[ChunkKey], *, tenant: str) -> list[str]:
        return list(self.store.lookup(keys, tenant=tenant))

    @staticmethod
    def _check_meta(fingerprint: bytes, lossy: bool, codec: str, spec: FetchSpec) -> None:
        if fingerprint != bytes(spec.fingerprint):
            raise FingerprintMismatch(
                f"artifact {bytes(spec.key).hex()[:16]} belongs to model {fingerprint.hex()[:16]}, "
                f"not {bytes(spec.fingerprint).hex()[:16]}"
            )
        if spec.require_lossless and lossy:
            raise LossyRefused(f"artifact {bytes(spec.key).hex()[:16]} is lossy ({codec})")

    def hit(self, spec: FetchSpec) -> tuple[bytes, str] | None:
        """The one hit path: the bytes of ``spec.key`` held here and their tier, or None when they
        are not held. Callable from any thread (the store locks; a disk read, which verifies every
        checksum, blocks the caller). Checked against the stored header's fingerprint and
        lossiness, as verified at Put: the bytes are not parsed again per hit."""
        tenant = spec.namespace.tenant
        meta = self.store.meta(spec.key, tenant=tenant)
        if meta is None:
            return None
        got = self.store.get(spec.key, tenant=tenant)
        if got is None:
            return None
        self.metrics.hits.labels(got[1]).inc()
        self._check_meta(meta.fingerprint, meta.lossy, meta.codec, spec)
        return got

    async def fetch_bytes(
        self,
        spec: FetchSpec,
        *,
        token: str | None = None,
        next_keys: Sequence[ChunkKey] = (),
        forwarded: bool = False,
    ) -> tuple[bytes, str]:
        """Verified container bytes of ``spec.key`` and the source that served them.

        ``forwarded``: another edge sent this miss here to be fetched on its behalf. A forwarded
        miss is never forwarded again and does not join a flight that forwards, so two edges
        with momentarily different membership views cannot send a key back and forth.
        """
        tenant = spec.namespace.tenant
        tiers = self.store.lookup([spec.key], tenant=tenant)
        got = self.hit(spec) if tiers and tiers[0] == "memory" else None  # memory: inline
        if got is None and tiers:
            got = await asyncio.to_thread(self.hit, spec)
        if got is not None:
            data, tier = got
        elif spec.local_only:
            self.metrics.misses.inc()
            raise NotFound(f"{self.node_id} does not hold {bytes(spec.key).hex()[:16]}")
        else:
            self.metrics.misses.inc()
            (data, tier), shared = await self._flight.do(
                (tenant, bytes(spec.key), forwarded), lambda: self.sources.fetch(spec, token, forwarded)
            )
            if shared:
                self.metrics.coalesced.inc()
            header = read_header(memoryview(data))
            self._check_meta(header.fingerprint, header.lossy, header.codec, spec)
        self.read_ahead(spec, next_keys, token)
        return data, tier

    def read_ahead(self, spec: FetchSpec, next_keys: Sequence[ChunkKey], token: str | None) -> None:
        """Offer the chain's next ``prefetch_depth`` keys not held here to the prefetcher (on the
        event loop)."""
        if not next_keys or not self.config.prefetch_depth or spec.local_only:
            return
        ahead = list(next_keys[: self.config.prefetch_depth])
        held = len(self.store.lookup(ahead, tenant=spec.namespace.tenant))
        for key in ahead[held:]:
            if self._flight.in_flight((spec.namespace.tenant, bytes(key), False)):
                continue
            self.prefetcher.offer(PrefetchJob(replace(spec, key=key, local_only=False), token))

    async def _run_prefetch(self, job: PrefetchJob) -> None:
        tenant = job.spec.namespace.tenant
        if self.store.lookup([job.spec.key], tenant=tenant):
            self.metrics.prefetch.labels("already_held").inc()
            return
        try:
            await self.fetch_bytes(job.spec, token=job.token)
        except KdnError:
            self.metrics.prefetch.labels("failed").inc()
            raise
        self.metrics.prefetch.labels("fetched").inc()

    # -- lookup --------------------------------------------------------------------------------

    async def lookup(
        self,
        keys: Sequence[ChunkKey],
        *,
        fingerprint: ModelFingerprint,
        namespace: Namespace,
        local_only: bool = False,
        token: str | None = None,
    ) -> list[Located]:
        """Where each of the leading available ``keys`` is: here, on an owner, or at the origin."""
        tiers = await self.lookup_local(keys, tenant=namespace.tenant)
        found = [Located(t, self.node_id, self.address) for t in tiers]
        if local_only or len(found) == len(keys):
            return found
        return found + await self.sources.lookup(
            keys[len(found):], fingerprint=fingerprint, namespace=namespace, token=token
        )

    # -- writes and operator hints -------------------------------------------------------------

    async def put(self, data: bytes | bytearray, *, namespace: Namespace, fingerprint: ModelFingerprint, key: ChunkKey,
                  take: bool = False) -> EntryMeta:
        """Verify and store one container (``take``: the caller hands ``data`` over, see
        :meth:`kdn.edge.store.tiered.TieredStore.put`)."""
        header = read_header(memoryview(data))
        if header.key != bytes(key):
            raise InvalidInput(f"Put declared key {bytes(key).hex()[:16]} but the artifact holds {header.key.hex()[:16]}")
        self.sources.note_model(header)
        if self.config.decode_check:
            await asyncio.to_thread(check_decodes, data, bytes(fingerprint))
        meta = await asyncio.to_thread(self.store.put, data, tenant=namespace.tenant, expect_fingerprint=bytes(fingerprint),
                                       take=take)
        self.metrics.bytes_in.labels("put").inc(len(data))
        return meta

    async def resolve_keys(
        self,
        keys: Sequence[ChunkKey],
        document: str,
        *,
        fingerprint: ModelFingerprint,
        namespace: Namespace,
        token: str | None,
    ) -> list[ChunkKey]:
        if keys or not document:
            return list(keys)
        return await self.sources.document(document, fingerprint=fingerprint, namespace=namespace, token=token)

    def prefetch(self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace,
                 codec: str = "", token: str | None = None) -> int:
        """Queue background fetches of ``keys`` not held here; returns how many were queued."""
        held = set()
        for k in keys:
            if self.store.contains(k, tenant=namespace.tenant):
                held.add(bytes(k))
        queued = 0
        for k in keys:
            if bytes(k) in held:
                continue
            spec = FetchSpec(k, fingerprint, namespace, codec=codec)
            queued += self.prefetcher.offer(PrefetchJob(spec, token))
        return queued

    async def _membership_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.membership_refresh_s)
            try:
                if self.overlay.refresh():
                    log.info("%s: membership changed: %s", self.node_id, self.overlay.snapshot())
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken provider must not stop the node
                log.exception("%s: membership refresh failed", self.node_id)

    async def _schedule_loop(self) -> None:
        assert self.scheduler is not None
        while True:
            await asyncio.sleep(self.config.schedule_tick_s)
            try:
                await self.scheduler.run_due()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad schedule must not stop the others
                log.exception("%s: scheduled prefetch failed", self.node_id)

    # -- stats ---------------------------------------------------------------------------------

    def _store_stats(self) -> dict[str, float]:
        return dict(self.store.stats())

    async def probe_origin(self) -> bool | None:
        return await self.sources.probe_origin()

    async def stats(self, tenants: frozenset[str] | None = None) -> tuple[dict[str, float], dict[str, Any]]:
        """(flat counters, details) for the Stats RPC and ``kdn stats``.

        ``tenants`` None (an operator: auth off or a ``*`` token): the node's figures. Every
        counter then is **global** (all tenants' traffic together: hits, misses, bytes, upstream
        and prefetch counts, store occupancy, coalescing, peers, uptime) and the details list every
        tenant's schedules. For a tenant's token (``tenants`` = what it is granted) the answer
        holds only that tenant's figures: ``tenant_entries``, ``tenant_bytes``, ``tenant_pinned``
        (its resident entries) and its own schedules; nothing that moves with another tenant's
        requests, no other tenant's names or ids.
        """
        if tenants is not None:
            entries = [s for t in sorted(tenants) for s in self.store.entries(tenant=t)]
            counters = {
                "tenant_entries": float(len(entries)),
                "tenant_bytes": float(sum(s.meta.size for s in entries)),
                "tenant_pinned": float(sum(1 for s in entries if s.pinned)),
            }
            details: dict[str, Any] = {"node_id": self.node_id, "scope": "tenant", "tenants": sorted(tenants)}
            if self.scheduler is not None:
                details["schedules"] = self.scheduler.describe(tenants)
            return counters, details
        await self.probe_origin()
        counters: dict[str, float] = {}
        for name, value in self._store_stats().items():
            counters[f"store_{name}"] = float(value)
        counters.update(self.metrics.counters())
        counters.update({k: float(v) for k, v in self.prefetcher.stats().items()})
        counters["coalesce_started"] = float(self._flight.started)
        counters["coalesced"] = float(self._flight.coalesced)
        counters["inflight"] = float(len(self._flight))
        counters["origin_configured"] = float(self.origin is not None)
        counters["origin_available"] = float(bool(self.origin_available)) if self.origin is not None else 0.0
        counters["peers"] = float(len(self.overlay.members) - 1)
        counters["peers_down"] = float(len(self.overlay.down()))
        counters["uptime_s"] = time.time() - self._started
        details = {
            "node_id": self.node_id,
            "scope": "node",
            "address": self.address,
            "origin": {"address": self.config.origin, "available": self.origin_available},
            "overlay": self.overlay.snapshot(),
            "policy": self.config.policy,
        }
        if self.scheduler is not None:
            details["schedules"] = self.scheduler.describe()
        return counters, details
