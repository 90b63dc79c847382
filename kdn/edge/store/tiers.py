"""Storage tiers of the edge: what an entry is, and the one small interface every tier implements.

A tier holds bytes by :class:`EntryId` — the pair *(tenant, chunk key)* — and the
:class:`EntryMeta` of each entry. It does no eviction and no budget enforcement: the
:class:`~kdn.edge.store.tiered.TieredStore` above it decides what goes where and when (the tier's
``capacity_bytes`` is the budget the store keeps it under). Tiers never verify checksums either;
the store verifies artifacts on the way in and when they come back from a ``durable`` tier.

Entries are scoped by tenant at the lowest level: two tenants holding the same chunk key hold two
separate entries, so one tenant can neither read, overwrite nor detect another's artifact.

The tiers: :class:`~kdn.edge.store.memory.MemoryTier` (RAM) and
:class:`~kdn.edge.store.disk.DiskTier` (crash-safe files).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Generic, NamedTuple, TypeVar

from kdn.errors import InvalidInput
from kdn.keys import KEY_BYTES, ROOT_KEY, ChunkKey, Namespace

if TYPE_CHECKING:
    from kdn.proto.kdn_pb2 import ArtifactHeader

__all__ = ["EntryId", "EntryMeta", "Ledger", "StorageTier", "check_key", "check_tenant"]

class EntryId(NamedTuple):
    """Identity of a stored entry: a chunk key *as owned by* a tenant."""

    tenant: str
    key: ChunkKey


@dataclass(frozen=True, slots=True)
class EntryMeta:
    """What the store knows about one artifact without reading it (taken from its verified header).

    ``parent`` is the previous chunk's key (``ROOT_KEY`` for the first chunk of a chain);
    ``size`` is the artifact's length in bytes.
    """

    key: ChunkKey
    tenant: str
    fingerprint: bytes
    parent: ChunkKey
    size: int
    codec: str
    lossy: bool
    chunk_index: int
    token_count: int = 0

    @property
    def eid(self) -> EntryId:
        return EntryId(self.tenant, self.key)

    @property
    def parent_eid(self) -> EntryId | None:
        """The parent's identity in the same tenant, or None for the first chunk of a chain."""
        if self.parent == ROOT_KEY or self.chunk_index == 0:
            return None
        return EntryId(self.tenant, self.parent)

    @classmethod
    def from_header(cls, header: ArtifactHeader, *, tenant: str, size: int) -> "EntryMeta":
        codec = f"{header.codec}:{header.codec_level}" if header.codec_level else header.codec
        return cls(
            key=ChunkKey(bytes(header.key)),
            tenant=tenant,
            fingerprint=bytes(header.fingerprint),
            parent=ChunkKey(bytes(header.parent_key)),
            size=size,
            codec=codec,
            lossy=bool(header.lossy),
            chunk_index=int(header.chunk_index),
            token_count=int(header.token_count),
        )


def check_tenant(tenant: str) -> str:
    """Tenants name disk directories too: the rule of :class:`kdn.keys.Namespace`, minus a
    leading dot (the disk tier keeps its own state in dot-files beside the tenant directories)."""
    if not isinstance(tenant, str):
        raise InvalidInput(f"tenant must be a string, got {type(tenant).__name__}")
    Namespace(tenant)  # raises InvalidInput naming the rule
    if tenant.startswith("."):
        raise InvalidInput(f"tenant {tenant!r}: names starting with '.' are reserved for the edge's own files")
    return tenant


def check_key(key: bytes) -> ChunkKey:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise InvalidInput(f"malformed chunk key: expected {KEY_BYTES} bytes")
    return ChunkKey(bytes(key))


class StorageTier(ABC):
    """One level of the edge's cache. Not responsible for budgets, eviction or verification.

    ``durable``: bytes survive a restart (their index is rebuilt by :meth:`metas` on open) and may
    have rotted, so the store verifies them on read; ``slow``: operations do real I/O, so the store
    calls :meth:`put` and :meth:`get` outside its lock. Implementations must be thread-safe for
    calls on *different* entries; the store never issues two writes of one entry at once.
    """

    durable: ClassVar[bool] = False
    slow: ClassVar[bool] = False

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise InvalidInput(f"tier {name!r}: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = int(capacity_bytes)

    @property
    @abstractmethod
    def bytes_used(self) -> int: ...

    @abstractmethod
    def get(self, eid: EntryId) -> bytes | None:
        """The entry's bytes, or None if it is not here."""

    @abstractmethod
    def put(self, meta: EntryMeta, data: bytes) -> None:
        """Store (or replace) an entry. May raise :class:`~kdn.errors.StorageFull`."""

    @abstractmethod
    def contains(self, eid: EntryId) -> bool: ...

    @abstractmethod
    def delete(self, eid: EntryId) -> None:
        """Drop an entry; absent entries are ignored."""

    @abstractmethod
    def metas(self) -> Iterable[EntryMeta]:
        """Metadata of every entry held, oldest first (the store rebuilds its index from it)."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release resources. The default does nothing."""

    def state_dir(self) -> Path | None:
        """A directory that survives restarts with this tier, where the store may keep its own
        small state files (pins, TTLs). None for volatile tiers."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, capacity_bytes={self.capacity_bytes})"


V = TypeVar("V")


class Ledger(Generic[V]):
    """What a tier holds, by entry, and the sum of the entries' sizes: kept together under one lock."""

    def __init__(self) -> None:
        self.items: dict[EntryId, V] = {}
        self._sizes: dict[EntryId, int] = {}
        self.used = 0
        self.lock = threading.Lock()

    def put(self, eid: EntryId, item: V, size: int) -> None:
        with self.lock:
            self.used += size - self._sizes.get(eid, 0)
            self.items[eid] = item
            self._sizes[eid] = size

    def pop(self, eid: EntryId) -> None:
        with self.lock:
            if self.items.pop(eid, None) is not None:
                self.used -= self._sizes.pop(eid)

    def values(self) -> list[V]:
        with self.lock:
            return list(self.items.values())

    def clear(self) -> None:
        with self.lock:
            self.items.clear()
            self._sizes.clear()
            self.used = 0
