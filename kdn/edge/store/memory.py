"""The memory tier: bytes in this process's RAM. Volatile: empty on start."""

from __future__ import annotations

from collections.abc import Iterable

from kdn.edge.store.tiers import EntryId, EntryMeta, Ledger, StorageTier

__all__ = ["MemoryTier"]


class MemoryTier(StorageTier):
    """Bytes in this process's RAM, in a dict. Empty on start."""

    def __init__(self, capacity_bytes: int, *, name: str = "memory") -> None:
        super().__init__(name, capacity_bytes)
        self._held: Ledger[tuple[EntryMeta, bytes]] = Ledger()

    @property
    def bytes_used(self) -> int:
        return self._held.used

    def get(self, eid: EntryId) -> bytes | None:
        item = self._held.items.get(eid)
        return None if item is None else item[1]

    def put(self, meta: EntryMeta, data: bytes) -> None:
        self._held.put(meta.eid, (meta, data), len(data))

    def contains(self, eid: EntryId) -> bool:
        return eid in self._held.items

    def delete(self, eid: EntryId) -> None:
        self._held.pop(eid)

    def metas(self) -> Iterable[EntryMeta]:
        return [meta for meta, _ in self._held.values()]

    def close(self) -> None:
        self._held.clear()
