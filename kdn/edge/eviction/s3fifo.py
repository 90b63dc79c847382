"""``s3fifo``: S3-FIFO (Yang et al., SOSP'23), a small probationary FIFO, a main FIFO with
reinsertion, and a ghost FIFO of recently evicted keys."""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from kdn.edge.eviction.base import EvictionPolicy, Key, SkipFn
from kdn.errors import InvalidInput

__all__ = ["S3FIFO"]


class S3FIFO(EvictionPolicy):
    """S3-FIFO: small FIFO (``small_ratio`` of resident bytes), main FIFO, ghost FIFO.

    New keys enter the small queue, or the main queue when the ghost remembers them. A key leaving
    the small queue moves to main if it was hit there at least ``move_threshold`` times, else it is
    evicted and remembered in the ghost (as many entries as are resident). A key at the head of main
    is reinserted at its tail while its frequency (capped at 3) is positive, decrementing it.
    Pinned keys met at a queue head are moved on (small -> main, main head -> main tail).
    """

    name: ClassVar[str] = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, move_threshold: int = 1, max_freq: int = 3) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise InvalidInput(f"s3fifo small_ratio must be in (0, 1), got {small_ratio}")
        self._small_ratio = small_ratio
        self._move_threshold = move_threshold
        self._max_freq = max_freq
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        self._resident = self._size
        self._small_bytes = 0
        self._total_bytes = 0

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self._size:
            self.touch(key)
            return
        self._size[key] = size
        self._freq[key] = 0
        self._total_bytes += size
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += size

    def touch(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None and f < self._max_freq:
            self._freq[key] = f + 1

    def remove(self, key: Key) -> None:
        size = self._size.pop(key, None)
        if size is None:
            return
        del self._freq[key]
        self._total_bytes -= size
        if key in self._small:
            del self._small[key]
            self._small_bytes -= size
            self._ghost[key] = None
            while len(self._ghost) > max(len(self._size), 1):
                self._ghost.popitem(last=False)
        else:
            del self._main[key]

    def _move_small_to_main(self, key: Key) -> None:
        del self._small[key]
        self._small_bytes -= self._size[key]
        self._main[key] = None
        self._freq[key] = 0

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        # Every step either moves a key small -> main (at most n times) or lowers a main key's
        # frequency / passes a pinned one; so (max_freq + 2) * n + 2 steps bound the loop.
        budget = (self._max_freq + 2) * len(self._size) + 2
        for _ in range(budget):
            if self._small and (self._small_bytes > self._small_ratio * self._total_bytes or not self._main):
                key = next(iter(self._small))
                if (skip is not None and skip(key)) or self._freq[key] >= self._move_threshold:
                    self._move_small_to_main(key)
                    continue
                return key
            if not self._main:
                return None
            key = next(iter(self._main))
            if skip is not None and skip(key):
                self._main.move_to_end(key)
                continue
            f = self._freq[key]
            if f > 0:
                self._freq[key] = f - 1
                self._main.move_to_end(key)
                continue
            return key
        return None
