"""The :class:`TieredStore`: the public face of the edge's store (see :mod:`kdn.edge.store`).

It owns the lock and composes the parts, each in its own file: the index and its accounting
(:mod:`.index`), TTL deadlines (:mod:`.expiry`), where bytes go, staged writes and the verified
reads of slow tiers (:mod:`.placement`), and the retention hints (:mod:`.hints`, saved by
:mod:`.retention`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from kdn.artifact import verify_artifact
from kdn.edge.clock import Clock, MonotonicClock
from kdn.edge.eviction import EvictionPolicy, make_policy
from kdn.edge.store.expiry import check_ttl
from kdn.edge.store.hints import Hints
from kdn.edge.store.index import Entry, EntryState, StoreIndex, check_priority
from kdn.edge.store.placement import MOVED, Placement, StagedWrite
from kdn.edge.store.stats import index_stats
from kdn.edge.store.tiers import EntryId, EntryMeta, StorageTier, check_tenant
from kdn.errors import InvalidInput, StorageFull, Unavailable
from kdn.keys import ChunkKey

__all__ = ["PolicyFactory", "TieredStore"]

PolicyFactory = Callable[[int, int], EvictionPolicy]
"""``factory(tier_index, tier_count)`` -> a fresh policy for that tier."""


class TieredStore:
    """Verified artifacts in a chain of tiers, fastest first (see :mod:`kdn.edge.store`)."""

    def __init__(
        self,
        tiers: Sequence[StorageTier],
        *,
        policy: str | PolicyFactory,
        clock: Clock | None = None,
    ) -> None:
        """``policy``: an eviction policy's name (``EdgeConfig.policy``) or a factory of one per tier."""
        if not tiers:
            raise InvalidInput("a tiered store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidInput(f"tier names must be distinct, got {names}")
        n = len(tiers)
        factory = policy if callable(policy) else _named_policy(policy)
        self._ix = StoreIndex(tiers, [factory(i, n) for i in range(n)])
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._lock = threading.Lock()
        self._place = Placement(self._ix, self._lock)
        self._closed = False
        state_dirs = [d for d in (t.state_dir() for t in tiers) if d is not None]
        self._hints = Hints(self._ix, self._lock, self._clock, state_dirs[0] if state_dirs else None)
        self._rebuild()

    @property
    def tiers(self) -> tuple[StorageTier, ...]:
        return tuple(self._ix.tiers)

    @property
    def clock(self) -> Clock:
        return self._clock

    # ------------------------------------------------------------------------------------------
    # public API

    def put(
        self, data: bytes | bytearray | memoryview, *, tenant: str, expect_fingerprint: bytes | None = None,
        pin: bool = False, ttl_s: float | None = None, priority: int | None = None, take: bool = False,
    ) -> EntryMeta:
        """Verify and store one artifact for ``tenant``; returns its metadata.

        ``take``: ``data`` is a buffer its caller hands over and never touches again (the bulk
        path's receive buffer): it is kept as it is, without the copy a mutable buffer otherwise gets.

        Raises :class:`~kdn.errors.ArtifactCorrupt` (and the other
        :class:`~kdn.errors.ArtifactError` kinds) or :class:`~kdn.errors.FingerprintMismatch`
        before anything is stored, and :class:`~kdn.errors.StorageFull` when no tier can take it
        (including a full disk). A key the tenant already holds is not rewritten: the existing
        entry is touched (and given ``pin``/``ttl_s``/``priority`` if passed) and its metadata
        returned. When every tier's admission policy refuses the artifact it is not stored
        (``admission_rejected`` counts it) and its metadata is still returned.
        """
        check_tenant(tenant)
        if ttl_s is not None:
            check_ttl(ttl_s)
        if priority is not None:
            check_priority(priority)
        fp = None if expect_fingerprint is None else bytes(expect_fingerprint)
        header = verify_artifact(data, expect_fingerprint=fp)  # every checksum, on the bytes as given
        meta = EntryMeta.from_header(header, tenant=tenant, size=len(data))
        eid = meta.eid
        ix, place = self._ix, self._place
        with self._lock:
            held = self._live(eid, self._clock.monotonic()) is not None
        # The store keeps immutable bytes: a mutable buffer is copied, outside the lock, unless its
        # caller hands it over (``take``) or the key is already held (a duplicate stores nothing).
        blob: bytes | bytearray | memoryview = data if isinstance(data, bytes) or take or held else bytes(data)
        while True:
            writes: list[StagedWrite] = []
            wait_for: StagedWrite | None = None
            hinted = False
            try:
                with self._lock:
                    self._check_open()
                    now = self._clock.monotonic()
                    existing = self._live(eid, now)
                    if existing is not None:
                        ix.count["duplicate_puts"] += 1
                        ix.policies[existing.tier].touch(eid)
                        hinted = self._hints.apply(eid, existing, pin, ttl_s, priority, now)
                        return existing.meta
                    wait_for = place.staging.get(eid)
                    if wait_for is None:
                        if not (isinstance(blob, bytes) or take):
                            blob = bytes(blob)  # it was held a moment ago, and is not any more
                        # Pin and priority count from the start: a pinned newcomer is never the
                        # victim of its own placement.
                        entry = Entry(meta, pinned=pin, priority=priority or 0)
                        if place.place_new(eid, entry, blob, writes) and ix.entries.get(eid) is entry:
                            if ttl_s is not None:
                                ix.set_ttl(eid, entry, ttl_s, now)
                            hinted = eid in ix.hinted
                            if hinted:
                                self._hints.changed()
                        return meta
            finally:
                error = place.run_writes(writes)
                if error is not None:
                    raise StorageFull(f"could not store artifact {meta.key.hex()[:16]}…: {error}") from error
                if hinted:
                    self._hints.save()
            # A deleted copy of this entry is still being written out: let that finish first.
            wait_for.done.wait()

    def get(
        self, key: ChunkKey, *, tenant: str, promote: bool = True
    ) -> tuple[bytes, str] | None:
        """The artifact's bytes and the name of the tier that served them, or None.

        None means absent, expired, owned by another tenant, or found corrupt on disk (dropped;
        fetch it again). Disk reads are verified; a disk hit moves to the top tier unless
        ``promote`` is false.
        """
        eid = EntryId(tenant, key)
        ix = self._ix
        for _ in range(3):  # retried only when the entry moved between tiers during a disk read
            with self._lock:
                self._check_open()
                entry = self._live(eid, self._clock.monotonic())
                if entry is None:
                    ix.record_miss()
                    return None
                i = entry.tier
                tier = ix.tiers[i]
                staged = self._place.staging.get(eid)
                if staged is not None or not tier.slow:
                    data = staged.data if staged is not None else tier.get(eid)
                    if data is not None:
                        ix.record_hit(i)
                        ix.policies[i].touch(eid)
                        return data, tier.name
            result = self._place.read_slow(eid, entry, i, promote)
            if result is not MOVED:
                return result  # type: ignore[return-value]
        with self._lock:
            ix.record_miss()
        return None

    def lookup(self, keys: Sequence[ChunkKey], *, tenant: str) -> list[str]:
        """Tier names of the leading run of ``keys`` that are resident (stops at the first miss)."""
        out: list[str] = []
        with self._lock:
            self._check_open()
            now = self._clock.monotonic()
            for key in keys:
                entry = self._live(EntryId(tenant, key), now)
                if entry is None:
                    break
                out.append(self._ix.tiers[entry.tier].name)
        return out

    def meta(self, key: ChunkKey, *, tenant: str) -> EntryMeta | None:
        """What the store knows of the tenant's live entry for ``key`` (from its verified header), or None."""
        with self._lock:
            self._check_open()
            entry = self._live(EntryId(tenant, key), self._clock.monotonic())
            return None if entry is None else entry.meta

    def contains(self, key: ChunkKey, *, tenant: str) -> bool:
        with self._lock:
            return self._live(EntryId(tenant, key), self._clock.monotonic()) is not None

    def delete(self, key: ChunkKey, *, tenant: str) -> bool:
        """Drop the tenant's entry for ``key``; False if it held none."""
        eid = EntryId(tenant, key)
        with self._lock:
            self._check_open()
            entry = self._live(eid, self._clock.monotonic())
            if entry is None:
                return False
            self._place.drop(eid, entry)
            self._ix.count["deleted"] += 1
            return True

    def pin(self, keys: Iterable[ChunkKey], *, tenant: str) -> int:
        """Protect resident entries from eviction and demotion. Returns how many are resident."""
        return self._hint(keys, tenant, lambda eid, e, now: self._ix.set_pinned(eid, e, True))

    def unpin(self, keys: Iterable[ChunkKey], *, tenant: str) -> int:
        return self._hint(keys, tenant, lambda eid, e, now: self._ix.set_pinned(eid, e, False))

    def set_ttl(self, keys: Iterable[ChunkKey], ttl_s: float | None, *, tenant: str) -> int:
        """Expire resident entries ``ttl_s`` seconds from now (None clears the TTL)."""
        if ttl_s is not None:
            check_ttl(ttl_s)
        return self._hint(keys, tenant, lambda eid, e, now: self._ix.set_ttl(eid, e, ttl_s, now))

    def set_priority(self, keys: Iterable[ChunkKey], priority: int, *, tenant: str) -> int:
        """Set the eviction class of resident entries (higher is evicted later; default 0)."""
        check_priority(priority)
        return self._hint(keys, tenant, lambda eid, e, now: self._ix.set_priority(eid, e, priority))

    def expire(self) -> int:
        """Drop every entry whose TTL has passed; returns how many were dropped."""
        dropped = 0
        ix = self._ix
        with self._lock:
            self._check_open()
            for deadline, eid, entry in ix.deadlines.due(self._clock.monotonic()):
                if ix.entries.get(eid) is entry and entry.expires_at == deadline:
                    self._place.drop(eid, entry)
                    ix.count["expired"] += 1
                    dropped += 1
        return dropped

    def entries(self, *, tenant: str | None = None) -> list[EntryState]:
        """Snapshot of resident entries (of one tenant, or all)."""
        with self._lock:
            now = self._clock.monotonic()
            return [self._ix.state(e, now) for eid, e in self._ix.entries.items() if tenant is None or eid.tenant == tenant]

    def stats(self) -> dict[str, float]:
        """The counters of each tier and of the store (see :func:`.stats.index_stats`)."""
        with self._lock:
            return index_stats(self._ix)

    def close(self) -> None:
        """Close every tier. Writes already started finish; later calls raise Unavailable.

        Entries of a tier that does not survive a restart (memory) are first moved down to a
        durable tier below it (disk) when there is one and it has room, so a graceful stop
        keeps acknowledged entries (see the package docstring: a SIGKILL does not)."""
        writes: list[StagedWrite] = []
        with self._lock:
            if self._closed:
                return
            self._closed = True
            flushed = self._place.flush_down(writes)
            if flushed and self._ix.hinted:
                self._hints.changed()
            pending = [w for w in self._place.staging.values() if w not in writes]
        self._place.run_writes(writes)
        if flushed:
            self._hints.save()  # pins/TTLs/priorities of the entries that moved to disk
        for w in pending:
            w.done.wait(timeout=30)
        for tier in self._ix.tiers:
            tier.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # internals (callers hold self._lock unless stated)

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the edge store is closed")

    def _rebuild(self) -> None:
        """Index what durable tiers already hold, then bring every tier under its budget."""
        ix, place = self._ix, self._place
        writes: list[StagedWrite] = []
        try:
            with self._lock:
                for i, tier in enumerate(ix.tiers):
                    for meta in tier.metas():
                        eid = meta.eid
                        if eid in ix.entries:  # also in a faster tier: keep that one
                            tier.delete(eid)
                            continue
                        entry = Entry(meta)
                        ix.remember(eid, entry)
                        ix.attach(i, eid, entry)
                # pins first, so the budget trim below respects them
                self._hints.restore(place.drop)
                for i in range(len(ix.tiers)):
                    place.shrink(i, writes)
        finally:
            place.run_writes(writes)

    def _live(self, eid: EntryId, now: float) -> Entry | None:
        """The resident entry, dropping it first if its TTL has passed."""
        entry = self._ix.entries.get(eid)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
            self._place.drop(eid, entry)
            self._ix.count["expired"] += 1
            return None
        return entry

    def _hint(self, keys: Iterable[ChunkKey], tenant: str, fn: Callable[[EntryId, Entry, float], None]) -> int:
        """Apply ``fn`` to each resident entry of ``keys``; persist the hints if any applied."""
        with self._lock:
            self._check_open()
            n = self._hints.apply_each((EntryId(tenant, key) for key in keys), self._live, fn)
        if n:
            self._hints.save()
        return n


def _named_policy(name: str) -> PolicyFactory:
    """A factory for the registered policy ``name``.

    In a store of several tiers each tier holds only part of every chain (hot roots in memory,
    tails demoted to disk): each tier's policy is told so (``whole_chains=False``).
    """
    make_policy(name)  # validate the name now: InvalidInput lists the known ones

    def factory(index: int, count: int) -> EvictionPolicy:
        return make_policy(name, whole_chains=count == 1)

    return factory
