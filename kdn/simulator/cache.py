"""A byte-budget cache that holds no values, only sizes, driven by an edge eviction policy.

The simulator's edges, the eviction benchmark and the policy tests use it to run
:mod:`kdn.edge.eviction`'s policies without the edge's tiered store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kdn.edge.eviction import EvictionPolicy, Key
from kdn.errors import InvalidInput

__all__ = ["BoundedCache", "CacheStats"]


@dataclass(slots=True)
class CacheStats:
    """Counters of a :class:`BoundedCache` (mutable: they count)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_used: int = 0
    rejected: int = 0  # misses that admission control (or a too-large size) kept out


class BoundedCache:
    """Keys with sizes under a byte budget; ``policy`` decides what is admitted and evicted.

    Used by the eviction benchmark, the simulator and the tests. Holds no values, only sizes.
    ``bytes_used <= capacity_bytes`` after every call unless pinned keys alone exceed the budget.
    """

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy) -> None:
        if capacity_bytes < 0:
            raise InvalidInput(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.stats = CacheStats()
        self._sizes: dict[Key, int] = {}
        self._pinned: set[Key] = set()

    # counters, also reachable as attributes of the cache
    @property
    def hits(self) -> int:
        return self.stats.hits

    @property
    def misses(self) -> int:
        return self.stats.misses

    @property
    def evictions(self) -> int:
        return self.stats.evictions

    @property
    def bytes_used(self) -> int:
        return self.stats.bytes_used

    def access(self, key: Key, size: int, parent: Key | None = None) -> bool:
        """Read ``key``: True on a hit; on a miss, admit and insert it, evicting as needed."""
        if key in self._sizes:
            self.stats.hits += 1
            self.policy.touch(key)
            return True
        self.stats.misses += 1
        if size > self.capacity_bytes or not self.policy.admit(key, size, parent):
            self.stats.rejected += 1
            return False
        self._sizes[key] = size
        self.stats.bytes_used += size
        self.policy.insert(key, size, parent)
        self._shrink()
        return False

    def _shrink(self) -> None:
        skip = self._pinned.__contains__ if self._pinned else None
        while self.stats.bytes_used > self.capacity_bytes:
            key = self.policy.victim(skip)
            if key is None:
                return
            self.remove(key)
            self.stats.evictions += 1

    def remove(self, key: Key) -> bool:
        """Drop ``key`` (not counted as an eviction). False if it was not resident."""
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.stats.bytes_used -= size
        self._pinned.discard(key)
        self.policy.remove(key)
        return True

    def pin(self, key: Key) -> None:
        """Never evict resident ``key`` until :meth:`unpin`."""
        if key in self._sizes:
            self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        self._pinned.discard(key)
        self._shrink()

    def keys(self) -> Iterable[Key]:
        return self._sizes.keys()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes
