"""Belady's offline optimum: the bound no online policy can beat (benchmarks and tests only).

It needs the future access sequence, so it is not in the registry.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import ClassVar

from kdn.edge.eviction.base import EvictionPolicy, Key, SkipFn, lazy_heap_victim
from kdn.errors import InvalidInput

__all__ = ["Belady"]


class Belady(EvictionPolicy):
    """Belady's offline optimum at block level: evict the key whose next use is farthest away.

    Constructed with the full future access sequence; every ``insert``/``touch`` must follow it in
    order (one call per access), which is how the policy knows "now". Keys never used again go
    first. Not in :data:`POLICIES`: no online cache can build it.
    """

    name: ClassVar[str] = "belady"

    def __init__(self, accesses: Sequence[Key]) -> None:
        self._accesses = accesses
        n = len(accesses)
        nxt = [n] * n  # index of the next access of the same key; n = never again
        last: dict[Key, int] = {}
        for i in range(n - 1, -1, -1):
            k = accesses[i]
            nxt[i] = last.get(k, n)
            last[k] = i
        self._next = nxt
        self._pos = 0
        self._live: dict[Key, int] = {}  # key -> next use index (also its heap entry's identity)
        self._resident = self._live
        self._heap: list[tuple[int, Key]] = []  # (-next_use, key)

    def _advance(self, key: Key) -> int:
        i = self._pos
        if i >= len(self._accesses) or self._accesses[i] != key:
            raise InvalidInput(f"belady: access {i} is {key!r}, not the one in the sequence it was given")
        self._pos = i + 1
        return self._next[i]

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        self._set(key, self._advance(key))

    def touch(self, key: Key) -> None:
        nxt = self._advance(key)
        if key in self._live:
            self._set(key, nxt)

    def _set(self, key: Key, nxt: int) -> None:
        self._live[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))
        if len(self._heap) > 4 * len(self._live) + 64:
            self._heap = [(-v, k) for k, v in self._live.items()]
            heapq.heapify(self._heap)

    def remove(self, key: Key) -> None:
        self._live.pop(key, None)

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        live = self._live
        return lazy_heap_victim(self._heap, lambda e: live.get(e[1]) == -e[0], skip)
