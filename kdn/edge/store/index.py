"""The store's index: which entry is resident in which tier, and the accounting eviction needs.

One :class:`Entry` record per resident entry, and per tier: bytes used, pinned bytes, the count of
entries in each priority class, hit/miss counters and the tier's eviction policy (which sees every
attach and detach). ``hinted`` is the set of entries with a non-default pin, priority or TTL
(what the retention file saves). Nothing here moves bytes or takes a lock: every method runs under
the store's lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kdn.edge.eviction import EvictionPolicy
from kdn.edge.store.expiry import Deadlines
from kdn.edge.store.tiers import EntryId, EntryMeta, StorageTier
from kdn.errors import InvalidInput

__all__ = ["Entry", "EntryState", "StoreIndex", "check_priority"]

_PRIORITY_LIMIT = 1 << 31


@dataclass(slots=True, eq=False)
class Entry:
    """Index record of one resident entry (mutable; guarded by the store's lock)."""

    meta: EntryMeta
    tier: int = -1
    pinned: bool = False
    priority: int = 0
    expires_at: float | None = None  # on the clock's monotonic scale


@dataclass(frozen=True, slots=True)
class EntryState:
    """A snapshot of one entry for listings (``kdn stats``, the Hint API's replies)."""

    meta: EntryMeta
    tier: str
    pinned: bool
    priority: int
    ttl_left_s: float | None


class StoreIndex:
    """Resident entries and per-tier accounting (see the module docstring)."""

    def __init__(self, tiers: Sequence[StorageTier], policies: Sequence[EvictionPolicy]) -> None:
        n = len(tiers)
        self.tiers = list(tiers)
        self.policies = list(policies)
        self.entries: dict[EntryId, Entry] = {}
        self.used = [0] * n
        self.pinned_bytes = [0] * n
        self.prio: list[Counter[int]] = [Counter() for _ in range(n)]
        self.hits = [0] * n
        self.misses = [0] * n
        self.count: Counter[str] = Counter()
        self.pinned_count = 0
        self.hinted: set[EntryId] = set()  # entries with a pin, a priority or a TTL
        self.deadlines: Deadlines[Entry] = Deadlines()

    # -- membership ----------------------------------------------------------------------------

    def remember(self, eid: EntryId, entry: Entry) -> None:
        """Put a new entry into the index (its tier is attached separately)."""
        self.entries[eid] = entry
        if entry.pinned:
            self.pinned_count += 1
        self.note_hinted(eid, entry)

    def forget(self, eid: EntryId, entry: Entry) -> None:
        """Take an entry out of the index (it is already detached from its tier)."""
        del self.entries[eid]
        self.hinted.discard(eid)
        if entry.pinned:
            self.pinned_count -= 1

    def attach(self, i: int, eid: EntryId, entry: Entry) -> None:
        """Account ``entry`` as resident in tier ``i`` (index side only; no bytes move)."""
        entry.tier = i
        size = entry.meta.size
        self.used[i] += size
        self.policies[i].insert(eid, size, entry.meta.parent_eid)
        self.prio[i][entry.priority] += 1
        if entry.pinned:
            self.pinned_bytes[i] += size

    def detach(self, i: int, eid: EntryId, entry: Entry) -> None:
        size = entry.meta.size
        self.used[i] -= size
        self.policies[i].remove(eid)
        _decrement(self.prio[i], entry.priority)
        if entry.pinned:
            self.pinned_bytes[i] -= size

    def fits(self, i: int, size: int) -> bool:
        """Could tier ``i`` hold ``size`` more bytes if every unpinned entry left?"""
        return size <= self.tiers[i].capacity_bytes - self.pinned_bytes[i]

    # -- hints ---------------------------------------------------------------------------------

    def note_hinted(self, eid: EntryId, entry: Entry) -> None:
        """Keep ``hinted`` = the entries with a non-default pin, priority or TTL."""
        if entry.pinned or entry.priority or entry.expires_at is not None:
            self.hinted.add(eid)
        else:
            self.hinted.discard(eid)

    def set_pinned(self, eid: EntryId, entry: Entry, pinned: bool) -> None:
        if entry.pinned != pinned:
            entry.pinned = pinned
            self.pinned_count += 1 if pinned else -1
            self.pinned_bytes[entry.tier] += entry.meta.size if pinned else -entry.meta.size
            self.note_hinted(eid, entry)

    def set_ttl(self, eid: EntryId, entry: Entry, ttl_s: float | None, now: float) -> None:
        if ttl_s is None:
            entry.expires_at = None
            self.note_hinted(eid, entry)
            return
        entry.expires_at = now + ttl_s
        self.hinted.add(eid)
        self.deadlines.push(eid, entry, self.entries)

    def set_priority(self, eid: EntryId, entry: Entry, priority: int) -> None:
        if entry.priority == priority:
            return
        counter = self.prio[entry.tier]
        _decrement(counter, entry.priority)
        counter[priority] += 1
        entry.priority = priority
        self.note_hinted(eid, entry)

    # -- counters ------------------------------------------------------------------------------

    def record_hit(self, i: int) -> None:
        self.hits[i] += 1
        self.count["hits"] += 1
        for j in range(i):
            self.misses[j] += 1

    def record_miss(self) -> None:
        self.count["misses"] += 1
        for j in range(len(self.misses)):
            self.misses[j] += 1

    def state(self, entry: Entry, now: float) -> EntryState:
        return EntryState(
            meta=entry.meta,
            tier=self.tiers[entry.tier].name,
            pinned=entry.pinned,
            priority=entry.priority,
            ttl_left_s=None if entry.expires_at is None else max(0.0, entry.expires_at - now),
        )


def _decrement(counter: Counter[int], level: int) -> None:
    counter[level] -= 1
    if counter[level] <= 0:
        del counter[level]


def check_priority(priority: int) -> None:
    if not isinstance(priority, int) or isinstance(priority, bool) or not -_PRIORITY_LIMIT <= priority < _PRIORITY_LIMIT:
        raise InvalidInput(f"priority must be an integer in [-2**31, 2**31), got {priority!r}")
