"""The edge's tiered store: memory over disk, byte budgets, eviction, pins, TTLs and priorities.

An entry is one verified artifact owned by one tenant (:class:`~kdn.edge.tiers.EntryId`) and lives in
exactly one tier at a time (exclusive tiering):

* **put** verifies every checksum first (:func:`kdn.artifact.verify_artifact`; a corrupt artifact
  or one for another model raises and nothing is stored), then places the entry in the highest
  tier that admits it (the tier's policy :meth:`~kdn.edge.eviction.EvictionPolicy.admit`) and can make
  room for it. A tier that is over budget *demotes* its policy's victim to the next tier
  (memory -> disk), and the last tier drops it. An artifact bigger than a tier's budget skips that
  tier; when no tier can make room (everything pinned, or bigger than every budget) the put raises
  :class:`~kdn.errors.StorageFull` and nothing already stored changes.
* **get** serves from whichever tier holds the entry. Bytes from a ``durable`` tier (disk) are
  verified again on every read; a corrupt or vanished blob is dropped, counted
  (``corrupt_dropped``/``lost``) and reported as a miss, so the caller fetches it again. A disk hit
  is promoted to the top tier.
* **Tenants.** Entries are keyed by *(tenant, key)*: a tenant asking for another tenant's key gets
  exactly what it gets for an absent key (None, a miss), and cannot overwrite it.

Operator hints (all idempotent, all return how many *resident* entries they applied to):

* **pin** — a pinned entry is never evicted or demoted (it stays in its tier until unpinned,
  deleted or its TTL runs out). Pinned bytes count against the budget; a put that finds the top
  tier full of pins goes to the next tier.
* **TTL** — ``set_ttl(keys, seconds)`` drops the entries that long from now, on the monotonic
  clock; expiry is checked lazily on every read and in bulk by :meth:`TieredStore.expire`. A TTL
  wins over a pin (both are explicit operator intent; "pin until tonight" is pin + TTL).
* **priority** — an integer, default 0. Eviction in a tier takes its policy's victim among the
  lowest-priority class present; a higher class is touched only when every lower-class entry of
  the tier is pinned (or being written). Within a class the policy's order rules. A newcomer is
  judged with the residents, so a priority-0 put into a memory tier full of higher-priority
  entries goes straight down to disk. Keep the number of classes small (each costs a victim scan).

Hints are saved (atomically, as JSON: :data:`HINTS_FILE`) in the state directory of the first tier
that has one — the disk tier's root — whenever they change, and re-applied on restart to the
entries the disk brought back; a TTL is saved as a wall-clock deadline, so an entry whose TTL ran
out while the edge was down is dropped on start. Hints of memory-only entries die with them.

Concurrency: every method is thread-safe behind one lock, and no big disk I/O happens under it —
reads of disk blobs and their verification run outside; writes to a disk tier (a put that lands
on disk, or a demotion) are *staged*: the entry is indexed and readable from the staged bytes at
once, and the calling thread writes the blob after releasing the lock. At most one write per
entry is in flight; a staged entry is neither evicted nor promoted until its write is done.
Unlinks (small) do happen under the lock.

Counters in :meth:`TieredStore.stats`: ``hits_<tier>``/``misses_<tier>`` (a disk hit is a memory
miss), ``bytes_<tier>``, ``capacity_<tier>``, ``entries_<tier>``, ``pinned_bytes_<tier>``, and
``hits``, ``misses``, ``puts``, ``duplicate_puts``, ``evictions`` (dropped to make room),
``demotions``, ``promotions``, ``corrupt_dropped``, ``lost`` (blob vanished under us),
``expired``, ``deleted``, ``admission_rejected``, ``write_failures``, ``pinned`` (entries),
``entries``.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import math
import os
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kdn.edge.clock import Clock, MonotonicClock
from kdn.edge.eviction import EvictionPolicy, make_policy
from kdn.edge.tiers import (
    DiskTier,
    EntryId,
    EntryMeta,
    MemoryTier,
    StorageTier,
    check_tenant,
)
from kdn.artifact import verify_artifact
from kdn.errors import InvalidInput, KdnError, StorageFull, Unavailable
from kdn.keys import ChunkKey

__all__ = [
    "DiskTier",
    "EntryId",
    "EntryMeta",
    "EntryState",
    "MemoryTier",
    "StorageTier",
    "TieredStore",
    "make_store",
]

log = logging.getLogger(__name__)

HINTS_FILE = ".entry-hints.json"
"""Where pins, priorities and TTLs are saved: in the first tier with a state directory (the disk)."""

PolicyFactory = Callable[[int, int], EvictionPolicy]
"""``factory(tier_index, tier_count)`` -> a fresh policy for that tier."""

_PRIORITY_LIMIT = 1 << 31


@dataclass(slots=True, eq=False)
class _Entry:
    """Index record of one resident entry (mutable; guarded by the store's lock)."""

    meta: EntryMeta
    tier: int = -1
    pinned: bool = False
    priority: int = 0
    expires_at: float | None = None  # on the clock's monotonic scale


@dataclass(slots=True, eq=False)
class _Write:
    """A staged write of ``data`` into slow tier ``tier`` for ``entry``."""

    eid: EntryId
    entry: _Entry
    data: bytes
    tier: int
    own: bool  # the artifact of the put that staged it: its failure is that caller's error
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True, slots=True)
class EntryState:
    """A snapshot of one entry for listings (``kdn stats``, the Hint API's replies)."""

    meta: EntryMeta
    tier: str
    pinned: bool
    priority: int
    ttl_left_s: float | None


class TieredStore:
    """Verified artifacts in a chain of tiers, fastest first (see the module docstring)."""

    def __init__(
        self,
        tiers: Sequence[StorageTier],
        *,
        policy: str | PolicyFactory = "prefix",
        clock: Clock | None = None,
    ) -> None:
        if not tiers:
            raise InvalidInput("a tiered store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidInput(f"tier names must be distinct, got {names}")
        self._tiers: list[StorageTier] = list(tiers)
        n = len(self._tiers)
        factory = policy if callable(policy) else _named_policy(policy)
        self._policies: list[EvictionPolicy] = [factory(i, n) for i in range(n)]
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._lock = threading.Lock()
        self._entries: dict[EntryId, _Entry] = {}
        self._staging: dict[EntryId, _Write] = {}
        self._used = [0] * n
        self._pinned_bytes = [0] * n
        self._prio: list[Counter[int]] = [Counter() for _ in range(n)]
        self._ttl_heap: list[tuple[float, int, EntryId, _Entry]] = []
        self._ttl_seq = itertools.count()
        self._hits = [0] * n
        self._misses = [0] * n
        self._count: Counter[str] = Counter()
        self._pinned_count = 0
        self._hinted: set[EntryId] = set()  # entries with a pin, a priority or a TTL
        self._closed = False
        state_dirs = [d for d in (t.state_dir() for t in self._tiers) if d is not None]
        self._hints_path: Path | None = state_dirs[0] / HINTS_FILE if state_dirs else None
        self._hints_seq = 0  # bumped (under the lock) whenever a hint changes
        self._hints_written = 0
        self._hints_write_lock = threading.Lock()
        self._rebuild()

    @property
    def tiers(self) -> tuple[StorageTier, ...]:
        return tuple(self._tiers)

    @property
    def clock(self) -> Clock:
        return self._clock

    # ------------------------------------------------------------------------------------------
    # public API

    def put(
        self,
        data: bytes | bytearray | memoryview,
        *,
        tenant: str,
        expect_fingerprint: bytes | None = None,
        pin: bool = False,
        ttl_s: float | None = None,
        priority: int | None = None,
    ) -> EntryMeta:
        """Verify and store one artifact for ``tenant``; returns its metadata.

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
            _check_ttl(ttl_s)
        if priority is not None:
            _check_priority(priority)
        blob = data if isinstance(data, bytes) else bytes(data)
        fp = None if expect_fingerprint is None else bytes(expect_fingerprint)
        header = verify_artifact(blob, expect_fingerprint=fp)
        meta = EntryMeta.from_header(header, tenant=tenant, size=len(blob))
        eid = meta.eid
        while True:
            writes: list[_Write] = []
            wait_for: _Write | None = None
            hinted = False
            try:
                with self._lock:
                    self._check_open()
                    now = self._clock.monotonic()
                    existing = self._live(eid, now)
                    if existing is not None:
                        self._count["duplicate_puts"] += 1
                        self._policies[existing.tier].touch(eid)
                        hinted = self._apply_hints(eid, existing, pin, ttl_s, priority, now)
                        return existing.meta
                    wait_for = self._staging.get(eid)
                    if wait_for is None:
                        # Pin and priority count from the start: a pinned newcomer is never the
                        # victim of its own placement.
                        entry = _Entry(meta, pinned=pin, priority=priority or 0)
                        if self._place_new(eid, entry, blob, writes) and self._entries.get(eid) is entry:
                            if ttl_s is not None:
                                self._set_ttl(eid, entry, ttl_s, now)
                            hinted = eid in self._hinted
                            if hinted:
                                self._hints_seq += 1
                        return meta
            finally:
                error = self._run_writes(writes)
                if error is not None:
                    raise StorageFull(f"could not store artifact {meta.key.hex()[:16]}…: {error}") from error
                if hinted:
                    self._save_hints()
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
        for _ in range(3):  # retried only when the entry moved between tiers during a disk read
            with self._lock:
                self._check_open()
                entry = self._live(eid, self._clock.monotonic())
                if entry is None:
                    self._record_miss()
                    return None
                i = entry.tier
                tier = self._tiers[i]
                staged = self._staging.get(eid)
                if staged is not None or not tier.slow:
                    data = staged.data if staged is not None else tier.get(eid)
                    if data is not None:
                        self._record_hit(i)
                        self._policies[i].touch(eid)
                        return data, tier.name
            result = self._read_slow(eid, entry, i, promote)
            if result is not _MOVED:
                return result  # type: ignore[return-value]
        with self._lock:
            self._record_miss()
        return None

    def meta(self, key: ChunkKey, *, tenant: str) -> EntryMeta | None:
        """Metadata of a resident entry (no hit counted, nothing read from disk)."""
        with self._lock:
            entry = self._live(EntryId(tenant, key), self._clock.monotonic())
            return None if entry is None else entry.meta

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
                out.append(self._tiers[entry.tier].name)
        return out

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
            self._drop(eid, entry)
            self._count["deleted"] += 1
            return True

    def pin(self, keys: Iterable[ChunkKey], *, tenant: str) -> int:
        """Protect resident entries from eviction and demotion. Returns how many are resident."""
        return self._hint(keys, tenant, lambda eid, e, now: self._set_pinned(eid, e, True))

    def unpin(self, keys: Iterable[ChunkKey], *, tenant: str) -> int:
        return self._hint(keys, tenant, lambda eid, e, now: self._set_pinned(eid, e, False))

    def set_ttl(self, keys: Iterable[ChunkKey], ttl_s: float | None, *, tenant: str) -> int:
        """Expire resident entries ``ttl_s`` seconds from now (None clears the TTL)."""
        if ttl_s is not None:
            _check_ttl(ttl_s)
        return self._hint(keys, tenant, lambda eid, e, now: self._set_ttl(eid, e, ttl_s, now))

    def set_priority(self, keys: Iterable[ChunkKey], priority: int, *, tenant: str) -> int:
        """Set the eviction class of resident entries (higher is evicted later; default 0)."""
        _check_priority(priority)
        return self._hint(keys, tenant, lambda eid, e, now: self._set_priority(eid, e, priority))

    def expire(self) -> int:
        """Drop every entry whose TTL has passed; returns how many were dropped."""
        dropped = 0
        with self._lock:
            self._check_open()
            now = self._clock.monotonic()
            heap = self._ttl_heap
            while heap and heap[0][0] <= now:
                deadline, _, eid, entry = heapq.heappop(heap)
                if self._entries.get(eid) is entry and entry.expires_at == deadline:
                    self._drop(eid, entry)
                    self._count["expired"] += 1
                    dropped += 1
        return dropped

    def entries(self, *, tenant: str | None = None) -> list[EntryState]:
        """Snapshot of resident entries (of one tenant, or all)."""
        with self._lock:
            now = self._clock.monotonic()
            return [
                EntryState(
                    meta=e.meta,
                    tier=self._tiers[e.tier].name,
                    pinned=e.pinned,
                    priority=e.priority,
                    ttl_left_s=None if e.expires_at is None else max(0.0, e.expires_at - now),
                )
                for eid, e in self._entries.items()
                if tenant is None or eid.tenant == tenant
            ]

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {}
            for i, tier in enumerate(self._tiers):
                out[f"hits_{tier.name}"] = self._hits[i]
                out[f"misses_{tier.name}"] = self._misses[i]
                out[f"bytes_{tier.name}"] = self._used[i]
                out[f"capacity_{tier.name}"] = tier.capacity_bytes
                out[f"entries_{tier.name}"] = len(self._policies[i])
                out[f"pinned_bytes_{tier.name}"] = self._pinned_bytes[i]
            for name in (
                "hits", "misses", "puts", "duplicate_puts", "evictions", "demotions", "promotions",
                "corrupt_dropped", "lost", "expired", "deleted", "admission_rejected",
                "write_failures",
            ):
                out[name] = self._count[name]
            out["pinned"] = self._pinned_count
            out["entries"] = len(self._entries)
            return out

    def close(self) -> None:
        """Close every tier. Writes already started finish; later calls raise Unavailable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._staging.values())
        for w in pending:
            w.done.wait(timeout=30)
        for tier in self._tiers:
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
        writes: list[_Write] = []
        try:
            with self._lock:
                for i, tier in enumerate(self._tiers):
                    for meta in tier.metas():
                        eid = meta.eid
                        if eid in self._entries:  # also in a faster tier: keep that one
                            tier.delete(eid)
                            continue
                        entry = _Entry(meta)
                        self._remember(eid, entry)
                        self._attach(i, eid, entry)
                self._load_hints()  # pins first, so the budget trim below respects them
                for i in range(len(self._tiers)):
                    self._shrink(i, writes)
        finally:
            self._run_writes(writes)

    def _live(self, eid: EntryId, now: float) -> _Entry | None:
        """The resident entry, dropping it first if its TTL has passed."""
        entry = self._entries.get(eid)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
            self._drop(eid, entry)
            self._count["expired"] += 1
            return None
        return entry

    def _record_hit(self, i: int) -> None:
        self._hits[i] += 1
        self._count["hits"] += 1
        for j in range(i):
            self._misses[j] += 1

    def _record_miss(self) -> None:
        self._count["misses"] += 1
        for j in range(len(self._misses)):
            self._misses[j] += 1

    def _attach(self, i: int, eid: EntryId, entry: _Entry) -> None:
        """Account ``entry`` as resident in tier ``i`` (index side only; no bytes move)."""
        entry.tier = i
        size = entry.meta.size
        self._used[i] += size
        self._policies[i].insert(eid, size, entry.meta.parent_eid)
        self._prio[i][entry.priority] += 1
        if entry.pinned:
            self._pinned_bytes[i] += size

    def _detach(self, i: int, eid: EntryId, entry: _Entry) -> None:
        size = entry.meta.size
        self._used[i] -= size
        self._policies[i].remove(eid)
        counter = self._prio[i]
        counter[entry.priority] -= 1
        if counter[entry.priority] <= 0:
            del counter[entry.priority]
        if entry.pinned:
            self._pinned_bytes[i] -= size

    def _fits(self, i: int, size: int) -> bool:
        """Could tier ``i`` hold ``size`` more bytes if every unpinned entry left?"""
        return size <= self._tiers[i].capacity_bytes - self._pinned_bytes[i]

    def _place(self, i: int, eid: EntryId, entry: _Entry, data: bytes, writes: list[_Write], own: bool = False) -> None:
        """Put ``entry`` into tier ``i`` (room already made): memory now, slow tiers staged."""
        self._attach(i, eid, entry)
        tier = self._tiers[i]
        if tier.slow:
            w = _Write(eid, entry, data, i, own)
            self._staging[eid] = w
            writes.append(w)
        else:
            tier.put(entry.meta, data)

    def _place_new(self, eid: EntryId, entry: _Entry, data: bytes, writes: list[_Write]) -> bool:
        """Place a new entry in the first tier that admits it and has room (see :meth:`put`).

        A fast tier takes it first and then evicts down to budget, so the policy judges the new
        entry beside the old ones (the new one may be demoted at once, as :class:`BoundedCache`
        would drop it); a slow tier makes room first, since the new bytes are only staged.
        """
        size, parent = entry.meta.size, entry.meta.parent_eid
        no_room: list[str] = []
        for i, tier in enumerate(self._tiers):
            if not self._fits(i, size):
                no_room.append(f"{tier.name}: {size} B > {tier.capacity_bytes - self._pinned_bytes[i]} B unpinned budget")
                continue
            if not self._policies[i].admit(eid, size, parent):
                continue
            if tier.slow:
                if not self._make_room(i, size, writes):
                    no_room.append(f"{tier.name}: could not make room")
                    continue
                self._remember(eid, entry)
                self._place(i, eid, entry, data, writes, own=True)
            else:
                self._remember(eid, entry)
                self._place(i, eid, entry, data, writes)
                if not self._shrink(i, writes) and self._entries.get(eid) is entry and entry.tier == i:
                    # Nothing else evictable (cannot happen with a policy that keeps its contract,
                    # since _fits counted the pins): take it back out and try the next tier.
                    self._detach(i, eid, entry)
                    self._tiers[i].delete(eid)
                    self._forget(eid, entry)
                    no_room.append(f"{tier.name}: could not make room")
                    continue
            self._count["puts"] += 1
            return True
        if no_room:
            raise StorageFull(f"no tier can take {size} bytes ({'; '.join(no_room)})")
        self._count["admission_rejected"] += 1
        return False

    def _make_room(self, i: int, size: int, writes: list[_Write]) -> bool:
        """Evict from tier ``i`` until ``size`` more bytes fit; False if it cannot."""
        if not self._fits(i, size):
            return False
        cap = self._tiers[i].capacity_bytes
        while self._used[i] + size > cap:
            victim = self._victim(i)
            if victim is None:
                return False
            self._evict(i, victim, writes)
        return True

    def _shrink(self, i: int, writes: list[_Write]) -> bool:
        """Evict from tier ``i`` until it is within budget; False if it cannot."""
        return self._make_room(i, 0, writes)

    def _victim(self, i: int) -> EntryId | None:
        policy = self._policies[i]
        classes = sorted(self._prio[i])
        entries, staging = self._entries, self._staging
        if len(classes) <= 1 and not staging and not self._pinned_bytes[i]:
            return policy.victim()
        for level in classes:

            def skip(eid: EntryId, level: int = level) -> bool:
                e = entries[eid]
                return e.pinned or e.priority > level or eid in staging

            victim = policy.victim(skip)
            if victim is not None:
                return victim
        return None

    def _evict(self, i: int, eid: EntryId, writes: list[_Write]) -> None:
        """Move ``eid`` out of tier ``i``: demote it to tier ``i + 1`` if that can make room, else drop."""
        entry = self._entries[eid]
        size = entry.meta.size
        nxt = i + 1
        data = None
        if nxt < len(self._tiers) and self._fits(nxt, size):
            data = self._tiers[i].get(eid)
        self._detach(i, eid, entry)
        self._tiers[i].delete(eid)
        if data is not None and self._make_room(nxt, size, writes):
            self._place(nxt, eid, entry, data, writes)
            self._count["demotions"] += 1
        else:
            self._forget(eid, entry)
            self._count["evictions"] += 1

    def _drop(self, eid: EntryId, entry: _Entry) -> None:
        """Remove a resident entry for good (delete, expiry, corruption)."""
        self._forget(eid, entry)
        self._detach(entry.tier, eid, entry)
        if eid not in self._staging:  # else the writer sees it gone and removes the blob
            try:
                self._tiers[entry.tier].delete(eid)
            except OSError:
                pass

    def _promote(self, eid: EntryId, entry: _Entry, data: bytes, writes: list[_Write]) -> None:
        size, src = entry.meta.size, entry.tier
        if not self._fits(0, size) or not self._policies[0].admit(eid, size, entry.meta.parent_eid):
            return
        self._detach(src, eid, entry)
        if self._make_room(0, size, writes):
            self._tiers[src].delete(eid)
            self._place(0, eid, entry, data, writes)
            self._count["promotions"] += 1
        else:
            self._attach(src, eid, entry)
            self._shrink(src, writes)  # demotions may have filled it meanwhile

    def _read_slow(self, eid: EntryId, entry: _Entry, i: int, promote: bool) -> Any:
        """Read and verify a blob outside the lock; then account for it (and promote) under it."""
        tier = self._tiers[i]
        try:
            data = tier.get(eid)
        except OSError:
            data = None
        ok = False
        if data is not None:
            try:
                if tier.durable:
                    verify_artifact(data, expect_key=eid.key)
                ok = True
            except KdnError:
                ok = False
        writes: list[_Write] = []
        try:
            with self._lock:
                current = self._entries.get(eid)
                same = current is entry and entry.tier == i and eid not in self._staging
                if not ok:
                    if same:
                        self._drop(eid, entry)
                        self._count["corrupt_dropped" if data is not None else "lost"] += 1
                    elif current is not None:
                        return _MOVED
                    self._record_miss()
                    return None
                self._record_hit(i)
                if same:
                    self._policies[i].touch(eid)
                    if promote and i > 0:
                        self._promote(eid, entry, data, writes)
                return data, tier.name
        finally:
            self._run_writes(writes)

    def _run_writes(self, writes: list[_Write]) -> BaseException | None:
        """Perform staged writes (caller does NOT hold the lock). Returns the own write's error."""
        own_error: BaseException | None = None
        for w in writes:
            tier = self._tiers[w.tier]
            error: BaseException | None = None
            try:
                tier.put(w.entry.meta, w.data)
            except (OSError, KdnError) as exc:
                error = exc
            with self._lock:
                if self._staging.get(w.eid) is w:
                    del self._staging[w.eid]
                current = self._entries.get(w.eid)
                if error is None:
                    if current is not w.entry:  # deleted or expired while being written
                        try:
                            tier.delete(w.eid)
                        except OSError:
                            pass
                else:
                    self._count["write_failures"] += 1
                    if current is w.entry:
                        self._forget(w.eid, w.entry)
                        self._detach(w.tier, w.eid, w.entry)
                        if not w.own:
                            self._count["evictions"] += 1
            w.done.set()
            if error is not None and w.own:
                own_error = error
        return own_error

    def _hint(self, keys: Iterable[ChunkKey], tenant: str, fn: Callable[[EntryId, _Entry, float], None]) -> int:
        """Apply ``fn`` to each resident entry of ``keys``; persist the hints if any applied."""
        n = 0
        with self._lock:
            self._check_open()
            now = self._clock.monotonic()
            for key in keys:
                eid = EntryId(tenant, key)
                entry = self._live(eid, now)
                if entry is not None:
                    fn(eid, entry, now)
                    n += 1
            if n:
                self._hints_seq += 1
        if n:
            self._save_hints()
        return n

    # -- hint persistence ----------------------------------------------------------------------

    def _save_hints(self) -> None:
        """Write the pins, priorities and TTLs of resident entries beside the disk tier.

        Called without the lock: the snapshot is taken under it, the file written outside it,
        and a snapshot older than one already written is skipped. The write is atomic (temp
        file, fsync, rename); a failure is logged and counted, never raised: hints are advice.
        """
        if self._hints_path is None:
            return
        with self._lock:
            seq = self._hints_seq
            now_mono, now_wall = self._clock.monotonic(), self._clock.now().timestamp()
            records = [
                {
                    "tenant": eid.tenant,
                    "key": bytes(eid.key).hex(),
                    "pinned": e.pinned,
                    "priority": e.priority,
                    "expires_unix": None if e.expires_at is None else now_wall + (e.expires_at - now_mono),
                }
                for eid in self._hinted
                for e in (self._entries[eid],)
            ]
        with self._hints_write_lock:
            if seq <= self._hints_written:
                return
            path = self._hints_path
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            try:
                with open(tmp, "w", encoding="utf-8") as fh:
                    json.dump({"version": 1, "entries": records}, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
                self._hints_written = seq
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                self._count["hint_save_failures"] += 1
                log.warning("could not save entry hints to %s: %s", path, exc)

    def _load_hints(self) -> None:
        """Re-apply saved hints to entries the durable tiers brought back (caller holds the lock).

        An entry whose saved TTL ran out while the edge was down is dropped now.
        """
        path = self._hints_path
        if path is None:
            return
        for stale in path.parent.glob(f"{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            records = doc["entries"]
            if not isinstance(records, list):
                raise ValueError("'entries' is not a list")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable entry hints %s: %s", path, exc)
            return
        now_mono, now_wall = self._clock.monotonic(), self._clock.now().timestamp()
        for rec in records:
            try:
                eid = EntryId(str(rec["tenant"]), ChunkKey(bytes.fromhex(rec["key"])))
                entry = self._entries.get(eid)
                if entry is None:
                    continue
                expires = rec.get("expires_unix")
                if expires is not None and float(expires) <= now_wall:
                    self._drop(eid, entry)
                    self._count["expired"] += 1
                    continue
                priority = int(rec.get("priority", 0))
                _check_priority(priority)
                self._set_priority(eid, entry, priority)
                self._set_pinned(eid, entry, bool(rec.get("pinned", False)))
                if expires is not None:
                    self._set_ttl(eid, entry, float(expires) - now_wall, now_mono)
            except (KdnError, ValueError, KeyError, TypeError):
                continue

    def _apply_hints(
        self, eid: EntryId, entry: _Entry, pin: bool, ttl_s: float | None, priority: int | None, now: float
    ) -> bool:
        """Apply a put's hints; True (and the persisted hints marked stale) if there were any."""
        if pin:
            self._set_pinned(eid, entry, True)
        if ttl_s is not None:
            self._set_ttl(eid, entry, ttl_s, now)
        if priority is not None:
            self._set_priority(eid, entry, priority)
        hinted = pin or ttl_s is not None or priority is not None
        if hinted:
            self._note_hinted(eid, entry)
            self._hints_seq += 1
        return hinted

    def _remember(self, eid: EntryId, entry: _Entry) -> None:
        """Put a new entry into the index (its tier is attached separately)."""
        self._entries[eid] = entry
        if entry.pinned:
            self._pinned_count += 1
        self._note_hinted(eid, entry)

    def _forget(self, eid: EntryId, entry: _Entry) -> None:
        """Take an entry out of the index (it is already detached from its tier)."""
        del self._entries[eid]
        self._hinted.discard(eid)
        if entry.pinned:
            self._pinned_count -= 1

    def _note_hinted(self, eid: EntryId, entry: _Entry) -> None:
        """Keep ``_hinted`` = the entries with a non-default pin, priority or TTL."""
        if entry.pinned or entry.priority or entry.expires_at is not None:
            self._hinted.add(eid)
        else:
            self._hinted.discard(eid)

    def _set_pinned(self, eid: EntryId, entry: _Entry, pinned: bool) -> None:
        if entry.pinned != pinned:
            entry.pinned = pinned
            self._pinned_count += 1 if pinned else -1
            self._pinned_bytes[entry.tier] += entry.meta.size if pinned else -entry.meta.size
            self._note_hinted(eid, entry)

    def _set_ttl(self, eid: EntryId, entry: _Entry, ttl_s: float | None, now: float) -> None:
        if ttl_s is None:
            entry.expires_at = None
            self._note_hinted(eid, entry)
            return
        entry.expires_at = now + ttl_s
        self._hinted.add(eid)
        heapq.heappush(self._ttl_heap, (entry.expires_at, next(self._ttl_seq), eid, entry))
        if len(self._ttl_heap) > 4 * len(self._entries) + 64:
            self._ttl_heap = [
                (e.expires_at, next(self._ttl_seq), k, e)
                for k, e in self._entries.items()
                if e.expires_at is not None
            ]
            heapq.heapify(self._ttl_heap)

    def _set_priority(self, eid: EntryId, entry: _Entry, priority: int) -> None:
        if entry.priority == priority:
            return
        counter = self._prio[entry.tier]
        counter[entry.priority] -= 1
        if counter[entry.priority] <= 0:
            del counter[entry.priority]
        counter[priority] += 1
        entry.priority = priority
        self._note_hinted(eid, entry)


_MOVED = object()


def _check_ttl(ttl_s: float) -> None:
    if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise InvalidInput(f"ttl must be a positive number of seconds, got {ttl_s!r}")


def _check_priority(priority: int) -> None:
    if not isinstance(priority, int) or isinstance(priority, bool) or not -_PRIORITY_LIMIT <= priority < _PRIORITY_LIMIT:
        raise InvalidInput(f"priority must be an integer in [-2**31, 2**31), got {priority!r}")


def _named_policy(name: str) -> PolicyFactory:
    """A factory for the registered policy ``name``.

    In a store of several tiers each tier holds only part of every chain (hot roots in memory,
    tails demoted to disk): each tier's policy is told so (``whole_chains=False``).
    """
    make_policy(name)  # validate the name now: InvalidInput lists the known ones

    def factory(index: int, count: int) -> EvictionPolicy:
        return make_policy(name, whole_chains=count == 1)

    return factory


def make_store(
    *,
    memory_bytes: int,
    disk_dir: str | Path | None = None,
    disk_bytes: int = 0,
    policy: str | PolicyFactory = "prefix",
    clock: Clock | None = None,
    fsync: bool = True,
    verify_on_open: bool = False,
) -> TieredStore:
    """The edge's usual store: a memory tier, then a disk tier under ``disk_dir`` if given."""
    tiers: list[StorageTier] = [MemoryTier(memory_bytes)]
    if disk_dir is not None:
        tiers.append(DiskTier(disk_dir, disk_bytes, fsync=fsync, verify_on_open=verify_on_open))
    return TieredStore(tiers, policy=policy, clock=clock)

