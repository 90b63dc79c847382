"""``lru``: least recently used, the baseline."""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from kdn.edge.eviction.base import EvictionPolicy, Key, SkipFn

__all__ = ["LRU"]


class LRU(EvictionPolicy):
    """Least recently used. An ordered dict: oldest first."""

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()
        self._resident = self._order

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        for key in self._order:
            if skip is None or not skip(key):
                return key
        return None
