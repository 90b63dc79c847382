"""``sieve``: SIEVE (Zhang et al., NSDI'24), one FIFO, a visited bit and a moving hand."""

from __future__ import annotations

from typing import ClassVar

from kdn.edge.eviction.base import EvictionPolicy, Key, SkipFn

__all__ = ["Sieve"]


class Sieve(EvictionPolicy):
    """SIEVE: a FIFO with a visited bit and a hand that sweeps from the oldest key to the newest.

    Hits only set the bit (no list move). The hand clears set bits as it passes and stops at the
    first unvisited key, which is the victim; when the hand falls off the newest end it wraps to the
    oldest. The list is a doubly linked list over dicts (``_newer``/``_older``).
    """

    name: ClassVar[str] = "sieve"

    def __init__(self) -> None:
        self._visited: dict[Key, bool] = {}
        self._resident = self._visited
        self._newer: dict[Key, Key | None] = {}
        self._older: dict[Key, Key | None] = {}
        self._oldest: Key | None = None
        self._newest: Key | None = None
        self._hand: Key | None = None

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self._visited:
            self._visited[key] = True
            return
        self._visited[key] = False
        self._older[key] = self._newest
        self._newer[key] = None
        if self._newest is not None:
            self._newer[self._newest] = key
        else:
            self._oldest = key
        self._newest = key

    def touch(self, key: Key) -> None:
        if key in self._visited:
            self._visited[key] = True

    def remove(self, key: Key) -> None:
        if self._visited.pop(key, None) is None:
            return
        newer = self._newer.pop(key)
        older = self._older.pop(key)
        if self._hand == key:
            self._hand = newer
        if newer is not None:
            self._older[newer] = older
        else:
            self._newest = older
        if older is not None:
            self._newer[older] = newer
        else:
            self._oldest = newer

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        # Two sweeps suffice: the first clears every visited bit it meets.
        hand = self._hand
        for _ in range(2 * len(self._visited) + 1):
            if hand is None:
                hand = self._oldest
                if hand is None:
                    return None
            if skip is not None and skip(hand):
                hand = self._newer[hand]
                continue
            if self._visited[hand]:
                self._visited[hand] = False
                hand = self._newer[hand]
                continue
            self._hand = hand
            return hand
        self._hand = hand
        return None
