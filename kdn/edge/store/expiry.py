"""TTLs: the deadline heap behind ``TieredStore.expire`` and the TTL rule.

Deadlines are on the store clock's monotonic scale. The heap is lazy: an entry whose TTL changed
or that left the store keeps its old heap record until that record comes due or the heap is
rebuilt (when it holds more than four records per resident entry); the caller checks a due record
against the index before acting on it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Mapping
from typing import Generic, Protocol, TypeVar

from kdn.edge.store.tiers import EntryId
from kdn.errors import InvalidInput

__all__ = ["Deadlines", "check_ttl"]

class _Expiring(Protocol):
    expires_at: float | None


E = TypeVar("E", bound=_Expiring)


class Deadlines(Generic[E]):
    """A min-heap of ``(deadline, eid, entry)`` records (guarded by the store's lock)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, EntryId, E]] = []
        self._seq = itertools.count()

    def push(self, eid: EntryId, entry: E, resident: Mapping[EntryId, E]) -> None:
        """Record ``entry.expires_at`` (set); rebuild from ``resident`` when stale records pile up."""
        assert entry.expires_at is not None
        heapq.heappush(self._heap, (entry.expires_at, next(self._seq), eid, entry))
        if len(self._heap) > 4 * len(resident) + 64:
            self._heap = [
                (e.expires_at, next(self._seq), k, e)
                for k, e in resident.items()
                if e.expires_at is not None
            ]
            heapq.heapify(self._heap)

    def due(self, now: float) -> Iterator[tuple[float, EntryId, E]]:
        """Pop every record whose deadline is ``<= now`` (stale ones included)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, eid, entry = heapq.heappop(heap)
            yield deadline, eid, entry


def check_ttl(ttl_s: float) -> None:
    if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise InvalidInput(f"ttl must be a positive number of seconds, got {ttl_s!r}")
