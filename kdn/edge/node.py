"""The edge node's logic, independent of gRPC: local tiers, then owners, then the origin.

:class:`EdgeNode` is what ``kdn.edge.server.EdgeServer`` wraps in a gRPC servicer, and what unit
tests wire together with in-memory upstreams (no sockets). The read path of ``fetch_bytes``:

1. the local tiers (memory hits are served inline; disk reads, which verify every checksum, run
   in a worker thread);
2. on a miss, one upstream fetch per key however many requests wait for it (:class:`SingleFlight`):
   - the other live owners are asked in bounded-load order (:meth:`Overlay.balanced_peers`): the
     preferred owner first unless this node already sent it more than ``bounded_load_c`` times
     its share of requests, so a hot key's reads spread over its replicas;
   - if this node is one of the key's owners: ask the other live owners for their local copy,
     then the origin;
   - otherwise: ask the first live owner to fetch it (it goes to the origin and keeps a copy, so
     the whole overlay fetches a key from the origin once), then the next owners' local copies,
     then the origin directly;
   a peer that fails and then fails a health check is marked down (the overlay skips it until a
   backoff passes); bytes from any source that this edge cannot use for any reason (checksum,
   size, a codec it does not know, hostile codec metadata, a newer version, another key) are
   dropped and the next source is tried;
3. what came from upstream is verified (header key/fingerprint, a decode of every section when
   ``decode_check`` is on, then every checksum by ``TieredStore.put``) before it is stored or
   served; a Put is decode-checked the same way, so a checksum-valid but undecodable artifact
   (checksums are unkeyed: anyone can make one) is refused instead of shadowing the honest Put
   of the same key that comes after it (the first writer of a key wins). Bytes are never served unverified: memory
   holds only what was verified on put, disk is verified on every read.

After chunk i, the request's ``next_keys[:prefetch_depth]`` are offered to the prefetcher.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, Sequence

from kdn.edge.clock import Clock, MonotonicClock
from kdn.edge.config import EdgeConfig
from kdn.edge.metrics import EdgeMetrics
from kdn.edge.overlay import Member, Overlay
from kdn.edge.prefetch import Prefetcher, PrefetchJob
from kdn.edge.store import EntryMeta, TieredStore
from kdn.edge.tasks import cancel_and_wait
from kdn.edge.upstream import FetchSpec, SingleFlight, Upstream
from kdn.artifact import PB_TO_DTYPE, ArtifactReader, read_header
from kdn.errors import (
    ArtifactCorrupt,
    ArtifactError,
    FingerprintMismatch,
    InvalidInput,
    KdnError,
    LossyRefused,
    MessageTooLarge,
    NotFound,
    StorageFull,
    Unavailable,
)
from kdn.keys import ChunkKey, ModelFingerprint, Namespace

log = logging.getLogger(__name__)
DOCUMENT_TOKENS = 8192  # a long document: a full window of the built-in trained model
FEW_DOCUMENTS = 4  # the memory tier should hold at least this many of them

_DECODE_PIECE = 1 << 20  # bytes fed to the decode check at a time
_MAX_LOOKUP_HOPS = 8  # peer Lookups per chain before the rest is asked of the origin


class ScheduledHints(Protocol):
    """What the node's schedule loop and Stats need of the operator's schedules
    (:class:`kdn.edge.operator_hints.HintService`)."""

    async def run_due(self) -> int: ...

    def describe(self, tenants: frozenset[str] | None = None) -> list[dict[str, Any]]: ...


def _drop(section: object) -> None:
    return None


def check_decodes(data: bytes, fingerprint: bytes | None = None) -> None:
    """Decode every section of ``data`` (one at a time, then dropped): checksums are unkeyed, so a
    checksum-valid container may still not decode, and the edge must not keep what no reader can
    use (the first writer of a key wins, so a poisoned entry would shadow every honest Put after
    it). Raises a KdnError; a codec's own exception on hostile bytes becomes ``ArtifactCorrupt``."""
    # sections borrowed, not kept: the raw codec's check is its length (no copy), the others decode
    reader = ArtifactReader(expect_fingerprint=fingerprint, sink=_drop)  # type: ignore[arg-type]
    view = memoryview(data)
    try:
        for at in range(0, len(view), _DECODE_PIECE):  # piecewise: a few sections' KV alive at once
            reader.feed(view[at : at + _DECODE_PIECE])
        reader.finish()
    except KdnError:
        raise
    except Exception as exc:  # noqa: BLE001 - a codec tripping over crafted bytes
        raise ArtifactCorrupt(f"artifact does not decode: {type(exc).__name__}: {str(exc)[:200]}") from exc


@dataclass(frozen=True, slots=True)
class Located:
    """Where one available key of a Lookup lives."""

    tier: str  # "memory" | "disk" | "peer" | "origin"
    node_id: str
    address: str


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
        self.origin = origin
        self.metrics = metrics or EdgeMetrics(config.node_id)
        self.metrics.attach_store(self._store_stats)
        self.scheduler = scheduler
        self.clock = clock or MonotonicClock()
        self._connect = connect
        self._peers: dict[str, Upstream] = {}
        self._flight: SingleFlight[tuple[str, bytes, bool], tuple[bytes, str]] = SingleFlight()
        self.prefetcher = Prefetcher(self._run_prefetch, queue_size=config.prefetch_queue, workers=config.prefetch_workers)
        self.origin_available: bool | None = None
        self.address = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._started = time.time()
        self._models_seen: set[bytes] = set()

    @property
    def node_id(self) -> str:
        return self.config.node_id

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
        for up in list(self._peers.values()) + ([self.origin] if self.origin else []):
            try:
                await up.close()
            except Exception:  # closing is best effort
                pass
        self._peers.clear()
        await asyncio.to_thread(self.store.close)

    # -- upstream plumbing ---------------------------------------------------------------------

    def _peer(self, member: Member) -> Upstream:
        up = self._peers.get(member.node_id)
        if up is None or getattr(up, "address", member.address) != member.address:
            if up is not None:  # the member moved (restarted elsewhere): drop the old channel
                self._tasks.append(asyncio.ensure_future(up.close()))
            up = self._connect(member)
            self._peers[member.node_id] = up
        return up

    def peer(self, member: Member) -> Upstream:
        """The upstream for ``member`` (made on first use, kept while its address holds)."""
        return self._peer(member)

    async def _peer_failed(self, member: Member, up: Upstream, exc: KdnError) -> None:
        if isinstance(exc, Unavailable) and not await up.healthy():
            log.info("%s: peer %s marked down: %s", self.node_id, member.node_id, exc)
            self.overlay.mark_down(member.node_id)

    # -- reads ---------------------------------------------------------------------------------

    async def _local_get(self, key: ChunkKey, tenant: str) -> tuple[bytes, str] | None:
        tiers = self.store.lookup([key], tenant=tenant)
        if not tiers:
            return None
        if tiers[0] == "memory":
            got = self.store.get(key, tenant=tenant)
            if got is not None:
                return got
        return await asyncio.to_thread(self.store.get, key, tenant=tenant)

    async def lookup_local(self, keys: Sequence[ChunkKey], *, tenant: str) -> list[str]:
        return list(self.store.lookup(keys, tenant=tenant))

    def _check_served(self, data: bytes, spec: FetchSpec) -> None:
        header = read_header(memoryview(data))
        self._check_meta(header.fingerprint, header.lossy, header.codec, spec)

    @staticmethod
    def _check_meta(fingerprint: bytes, lossy: bool, codec: str, spec: FetchSpec) -> None:
        if fingerprint != bytes(spec.fingerprint):
            raise FingerprintMismatch(
                f"artifact {bytes(spec.key).hex()[:16]} belongs to model {fingerprint.hex()[:16]}, "
                f"not {bytes(spec.fingerprint).hex()[:16]}"
            )
        if spec.require_lossless and lossy:
            raise LossyRefused(f"artifact {bytes(spec.key).hex()[:16]} is lossy ({codec})")

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
        got = await self._local_get(spec.key, tenant)
        if got is not None:
            data, tier = got
            self.metrics.hits.labels(tier).inc()
        elif spec.local_only:
            self.metrics.misses.inc()
            raise NotFound(f"{self.node_id} does not hold {bytes(spec.key).hex()[:16]}")
        else:
            self.metrics.misses.inc()
            (data, tier), shared = await self._flight.do(
                (tenant, bytes(spec.key), forwarded), lambda: self._fetch_upstream(spec, token, forwarded)
            )
            if shared:
                self.metrics.coalesced.inc()
        self._check_served(data, spec)
        if next_keys and self.config.prefetch_depth and not spec.local_only:
            self._read_ahead(spec, next_keys, token)
        return data, tier

    def fetch_held(
        self, spec: FetchSpec, loop: asyncio.AbstractEventLoop, *, token: str | None = None,
        next_keys: Sequence[ChunkKey] = (),
    ) -> tuple[bytes, str] | None:
        """:meth:`fetch_bytes` for an artifact this node holds, from any thread (the store locks;
        a disk read blocks the caller, not ``loop``); None when it is not held here (then ask
        :meth:`fetch_bytes` on ``loop``: coalescing, peers and the origin live there). The bulk
        byte path's threads answer hits this way without a round trip through the event loop."""
        tenant = spec.namespace.tenant
        meta = self.store.meta(spec.key, tenant=tenant)
        if meta is None:
            return None
        got = self.store.get(spec.key, tenant=tenant)
        if got is None:
            return None
        data, tier = got
        self.metrics.hits.labels(tier).inc()
        # the stored header's fingerprint and lossiness, as verified at Put: not parsed again per fetch
        self._check_meta(meta.fingerprint, meta.lossy, meta.codec, spec)
        if next_keys and self.config.prefetch_depth and not spec.local_only:
            loop.call_soon_threadsafe(self._read_ahead, spec, next_keys, token)
        return data, tier

    def _read_ahead(self, spec: FetchSpec, next_keys: Sequence[ChunkKey], token: str | None) -> None:
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

    async def _fetch_upstream(self, spec: FetchSpec, token: str | None, forwarded: bool = False) -> tuple[bytes, str]:
        """Owners, then the origin. Runs once per key per burst (under SingleFlight)."""
        owners = self.overlay.owners(spec.key)
        peers = self.overlay.balanced_peers(spec.key, self.config.bounded_load_c)  # a hot key spreads
        # A non-owner asks the first owner that answers to fetch on its behalf (so the owner keeps
        # a copy and the overlay goes to the origin once); owners only ask each other's copies.
        forward = not forwarded and bool(peers) and len(peers) == len(owners)
        plan: list[Member | None] = [*peers, None]
        errors: list[str] = []
        unavailable = False
        for member in plan:
            sub = spec.local() if member is not None and not forward else replace(spec, local_only=False)
            if member is None:
                if self.origin is None:
                    errors.append("no origin configured")
                    break
                up: Upstream = self.origin
                target = "origin"
            else:
                up = self._peer(member)
                target = "peer"
                self.overlay.sent(member.node_id)
            try:
                data = await up.fetch(sub, token=self.config.upstream_token or token)
            except NotFound as exc:
                self.metrics.upstream.labels(target, "not_found").inc()
                errors.append(f"{up.name}: not found")
                if member is None:  # the origin is authoritative
                    self.origin_available = True
                    raise NotFound(f"{bytes(spec.key).hex()[:16]} not found (asked {len(errors)} sources)") from exc
                forward = False  # an owner answered: the others are asked for their own copies only
                continue
            except (Unavailable, MessageTooLarge, ArtifactError, InvalidInput) as exc:
                self.metrics.upstream.labels(target, type(exc).__name__).inc()
                errors.append(f"{up.name}: {exc}")
                unavailable = True
                if member is None:
                    self.origin_available = not isinstance(exc, Unavailable)
                else:
                    await self._peer_failed(member, up, exc)
                continue
            except KdnError as exc:
                self.metrics.upstream.labels(target, type(exc).__name__).inc()
                if member is not None:
                    # whatever a peer's answer was wrong with, the next source may do better (a peer
                    # of another version, a lossy copy where lossless is asked): try it
                    errors.append(f"{up.name}: {type(exc).__name__}: {exc}")
                    unavailable = True
                    continue
                # the origin's FingerprintMismatch, LossyRefused, Unauthorized: the answer itself
                self.origin_available = True
                raise
            if member is None:
                self.origin_available = True
            else:
                self.overlay.mark_up(member.node_id)
                forward = False
            try:
                await self._admit(data, spec)
            except KdnError as exc:
                # any project error about the bytes (checksum, size, unknown codec, hostile codec
                # metadata, newer version, wrong key or model): drop them and try the next source
                self.metrics.corrupt.inc()
                self.metrics.upstream.labels(target, "corrupt").inc()
                errors.append(f"{up.name}: {exc}")
                log.warning("%s: dropped bad artifact from %s: %s: %s", self.node_id, up.name, type(exc).__name__, exc)
                unavailable = True
                continue
            self.metrics.upstream.labels(target, "ok").inc()
            self.metrics.bytes_in.labels(target).inc(len(data))
            return data, target
        if unavailable:
            raise Unavailable(f"{bytes(spec.key).hex()[:16]}: no source could serve it ({'; '.join(errors)})")
        raise NotFound(f"{bytes(spec.key).hex()[:16]} not found ({'; '.join(errors)})")

    def _note_model(self, header: Any) -> None:
        """Once per model fingerprint: warn when the memory tier holds fewer than
        :data:`FEW_DOCUMENTS` documents of :data:`DOCUMENT_TOKENS` tokens of that model's KV
        (most hits would then come from disk or upstream)."""
        fp = bytes(header.fingerprint)
        if fp in self._models_seen:
            return
        self._models_seen.add(fp)
        per_token = 2 * header.num_layers * header.num_kv_heads * header.head_dim * PB_TO_DTYPE[header.dtype].itemsize
        tokens = self.config.memory_bytes // max(1, per_token)
        if tokens < FEW_DOCUMENTS * DOCUMENT_TOKENS:
            log.warning("%s: the memory tier (%.2f GiB) holds about %d tokens of KV of model %s… (%d KB per token): "
                        "fewer than %d documents of %d tokens; raise --memory-bytes (memory_bytes) to keep more of "
                        "them in memory", self.node_id, self.config.memory_bytes / 2**30, tokens, fp.hex()[:16],
                        per_token // 1000, FEW_DOCUMENTS, DOCUMENT_TOKENS)

    async def _admit(self, data: bytes, spec: FetchSpec) -> None:
        """Verify bytes from upstream and keep them. Raises on bad bytes; a full store only logs."""
        if len(data) > self.config.max_artifact_bytes:
            raise MessageTooLarge(f"artifact of {len(data)} bytes exceeds {self.config.max_artifact_bytes}")
        header = read_header(memoryview(data))
        if header.key != bytes(spec.key):
            raise FingerprintMismatch(f"upstream answered {header.key.hex()[:16]} for {bytes(spec.key).hex()[:16]}")
        self._note_model(header)
        if self.config.decode_check:
            await asyncio.to_thread(check_decodes, data, bytes(spec.fingerprint))
        try:
            await asyncio.to_thread(
                self.store.put, data, tenant=spec.namespace.tenant, expect_fingerprint=bytes(spec.fingerprint)
            )
        except StorageFull as exc:
            # verification happened before the budget check; serve it without keeping it
            log.info("%s: not caching %s: %s", self.node_id, bytes(spec.key).hex()[:16], exc)

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
        if local_only:
            return found
        tok = self.config.upstream_token or token
        i = len(found)
        hops = 0
        while i < len(keys) and hops < _MAX_LOOKUP_HOPS:
            hops += 1
            peers = self.overlay.balanced_peers(keys[i], self.config.bounded_load_c)
            n = 0
            for member in peers:
                up = self._peer(member)
                self.overlay.sent(member.node_id)
                try:
                    n = await up.lookup(keys[i:], fingerprint=fingerprint, namespace=namespace, token=tok)
                except KdnError as exc:
                    await self._peer_failed(member, up, exc)
                    continue
                if n:
                    found += [Located("peer", member.node_id, member.address)] * n
                    break
            if not n:
                break
            i += n
        if i < len(keys) and self.origin is not None:
            try:
                n = await self.origin.lookup(keys[i:], fingerprint=fingerprint, namespace=namespace, token=tok)
                self.origin_available = True
            except Unavailable:
                self.origin_available = False
                n = 0
            except KdnError:
                n = 0
            found += [Located("origin", "origin", "")] * n
        return found

    # -- writes and operator hints -------------------------------------------------------------

    async def put(self, data: bytes | bytearray, *, namespace: Namespace, fingerprint: ModelFingerprint, key: ChunkKey,
                  take: bool = False) -> EntryMeta:
        """Verify and store one container (``take``: the caller hands ``data`` over, see
        :meth:`kdn.edge.store.tiered.TieredStore.put`)."""
        header = read_header(memoryview(data))
        if header.key != bytes(key):
            raise InvalidInput(f"Put declared key {bytes(key).hex()[:16]} but the artifact holds {header.key.hex()[:16]}")
        self._note_model(header)
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
        if self.origin is None:
            raise Unavailable("documents are resolved by the origin, and none is configured")
        try:
            out = await self.origin.document(
                document, fingerprint=fingerprint, namespace=namespace, token=self.config.upstream_token or token
            )
        except Unavailable:
            self.origin_available = False
            raise
        self.origin_available = True
        if len(out) > self.config.max_chain_keys:
            raise MessageTooLarge(f"document {document!r} has {len(out)} chunks (limit {self.config.max_chain_keys})")
        return out

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
        if self.origin is None:
            return None
        self.origin_available = await self.origin.healthy()
        return self.origin_available

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

    @staticmethod
    def details_json(details: dict[str, Any]) -> str:
        return json.dumps(details, sort_keys=True, default=str)
