"""The interface every eviction policy implements, and the lazy heap two of them share.

A policy only *orders* keys; it never holds bytes. The tier that owns the bytes (the edge's tiered
store, the simulator's :class:`~kdn.simulator.cache.BoundedCache`) tells the policy what became
resident (:meth:`EvictionPolicy.insert`), what was hit (:meth:`~EvictionPolicy.touch`) and what
left (:meth:`~EvictionPolicy.remove`), and asks it for the next key to evict
(:meth:`~EvictionPolicy.victim`), which it then removes itself. Keys are any hashable value:
``EntryId`` pairs in the edge, ints in the simulator and the trace replay.

Invariants every policy keeps:

* ``victim()`` never returns a key for which ``skip(key)`` is true (pinned keys), and never a key
  that is not resident; it returns ``None`` only when no resident key is evictable.
* ``victim()`` does not remove the key: the caller calls ``remove(key)`` once it has dropped it.
  Calling ``victim()`` twice without a ``remove`` returns the same key (queue-based policies may
  reorder their queues in between, which is not observable through the interface).
* Every operation is O(1) or O(log n) amortised, with n the number of resident keys, as long as
  few keys are pinned (a pinned key costs at most a constant per ``victim`` call that passes it).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable
from typing import Any, ClassVar

__all__ = ["EvictionPolicy", "Key", "SkipFn", "lazy_heap_victim"]

Key = Hashable
SkipFn = Callable[[Any], bool]


class EvictionPolicy(ABC):
    """Orders resident keys for eviction. One instance per cache tier; not thread-safe.

    A subclass keeps its resident keys in ``self._resident`` (any collection keyed by the key),
    which gives ``len()`` and ``in``.
    """

    name: ClassVar[str]
    _resident: Collection[Key]

    @classmethod
    def for_tier(cls, *, whole_chains: bool = True, **kw: Any) -> "EvictionPolicy":
        """A policy for a cache that holds every chunk's whole prefix chain (``whole_chains``) or
        only part of each chain (a tier of several: hot roots in memory, tails on disk; an edge
        whose chunks' parents may live at another edge). Policies that do not reason about chains
        ignore the flag; ``kw`` are the policy's own options."""
        return cls(**kw)

    @abstractmethod
    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        """``key`` became resident. ``parent`` is the previous chunk of its chain (None for a root)."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """A hit on resident ``key``. Unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """``key`` left the cache for any reason (evicted, deleted, expired, demoted). Idempotent."""

    @abstractmethod
    def victim(self, skip: SkipFn | None = None) -> Key | None:
        """The next key to evict, without removing it; keys with ``skip(key)`` true are passed over."""

    def admit(self, key: Key, size: int, parent: Key | None = None) -> bool:
        """Admission control: may ``key`` be inserted at all? The default admits everything."""
        return True

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident


def lazy_heap_victim(heap: list[tuple[Any, ...]], current: Callable[[tuple[Any, ...]], bool], skip: SkipFn | None) -> Key | None:
    """The key (last field) of the smallest *current* entry of a lazy heap that ``skip`` passes.

    Entries for which ``current(entry)`` is false are stale and popped for good; skipped ones are
    set aside and pushed back, so the heap is unchanged apart from the stale entries it dropped.
    """
    aside = []
    found = None
    while heap:
        top = heap[0]
        if not current(top):
            heapq.heappop(heap)
            continue
        if skip is not None and skip(top[-1]):
            aside.append(heapq.heappop(heap))
            continue
        found = top[-1]
        break
    for entry in aside:
        heapq.heappush(heap, entry)
    return found
