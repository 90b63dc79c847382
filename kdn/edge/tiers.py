"""Storage tiers of the edge: one small interface, a memory tier and a local-disk tier.

A tier holds bytes by :class:`EntryId` — the pair *(tenant, chunk key)* — and the
:class:`EntryMeta` of each entry. It does no eviction and no budget enforcement: the
:class:`~kdn.edge.store.TieredStore` above it decides what goes where and when (the tier's
``capacity_bytes`` is the budget the store keeps it under). Tiers never verify checksums either;
the store verifies artifacts on the way in and when they come back from a ``durable`` tier.

Entries are scoped by tenant at the lowest level: two tenants holding the same chunk key hold two
separate entries, so one tenant can neither read, overwrite nor detect another's artifact.

:class:`DiskTier` sits on :class:`kdn.blobstore.BlobStore` (atomic temp-file + rename writes), one
blob per entry at ``root/<tenant>/<key hex[:2]>/<key hex>``. On open it rebuilds its index by
scanning the blobs: each must have a verified header (:func:`kdn.artifact.read_header`) whose key
matches its file name and the artifact trailer magic at its end; anything else — a file truncated
or bit-flipped by a crash or a bad disk — is deleted and counted in ``dropped_on_open``. Temporary
files of writers that died mid-write are swept by the blob store and never become visible.
Full checksums of a disk blob are verified by the store on every read.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

from kdn.artifact import MAX_HEADER, TRAILER_BYTES, TRAILER_MAGIC, read_header, verify_artifact
from kdn.blobstore import BlobStore
from kdn.errors import InvalidInput, KdnError
from kdn.keys import KEY_BYTES, ROOT_KEY, ChunkKey, Namespace
from kdn.proto import kdn_pb2 as pb

__all__ = ["DiskTier", "EntryId", "EntryMeta", "MemoryTier", "StorageTier", "check_key", "check_tenant"]

_HEAD_BYTES = 12 + MAX_HEADER + 8  # container prefix + largest header + header checksum


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
    def from_header(cls, header: pb.ArtifactHeader, *, tenant: str, size: int) -> "EntryMeta":
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
        """Metadata of every entry held, oldest first (used to rebuild the store's index)."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release resources. The default does nothing."""

    def state_dir(self) -> Path | None:
        """A directory that survives restarts with this tier, where the store may keep its own
        small state files (pins, TTLs). None for volatile tiers."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, capacity_bytes={self.capacity_bytes})"


class MemoryTier(StorageTier):
    """Bytes in this process's RAM, in a dict. Empty on start."""

    def __init__(self, capacity_bytes: int, *, name: str = "memory") -> None:
        super().__init__(name, capacity_bytes)
        self._items: dict[EntryId, tuple[EntryMeta, bytes]] = {}
        self._used = 0
        self._lock = threading.Lock()

    @property
    def bytes_used(self) -> int:
        return self._used

    def get(self, eid: EntryId) -> bytes | None:
        item = self._items.get(eid)
        return None if item is None else item[1]

    def put(self, meta: EntryMeta, data: bytes) -> None:
        with self._lock:
            old = self._items.get(meta.eid)
            if old is not None:
                self._used -= len(old[1])
            self._items[meta.eid] = (meta, data)
            self._used += len(data)

    def contains(self, eid: EntryId) -> bool:
        return eid in self._items

    def delete(self, eid: EntryId) -> None:
        with self._lock:
            old = self._items.pop(eid, None)
            if old is not None:
                self._used -= len(old[1])

    def metas(self) -> Iterable[EntryMeta]:
        with self._lock:
            return [meta for meta, _ in self._items.values()]

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self._used = 0


class DiskTier(StorageTier):
    """Artifacts as crash-safe files under ``root`` (see the module docstring for the layout).

    ``fsync=False`` skips the fsyncs (faster; a power cut may then lose recent writes, but never
    exposes a partial artifact: the index rebuild drops what does not verify).
    ``verify_on_open=True`` checks every checksum of every blob on open instead of header and
    trailer only (reads the whole tier: slow for big tiers).
    """

    durable: ClassVar[bool] = True
    slow: ClassVar[bool] = True

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        *,
        name: str = "disk",
        fsync: bool = True,
        verify_on_open: bool = False,
    ) -> None:
        super().__init__(name, capacity_bytes)
        self.root = Path(root)
        self._blobs = BlobStore(self.root, fsync=fsync)
        self.swept_tmp = self._blobs.swept
        self._verify_on_open = verify_on_open
        self._lock = threading.Lock()
        self._index: dict[EntryId, EntryMeta] = {}
        self._used = 0
        self.dropped_on_open = 0
        self._rebuild()

    # -- index rebuild -------------------------------------------------------------------------

    def _rebuild(self) -> None:
        found = []
        for info in self._blobs.scan():
            meta = self._check_blob(info.prefix, info.name, info.size)
            if meta is None:
                self._remove_anywhere(info.prefix, info.name)
                self.dropped_on_open += 1
            else:
                found.append((info.mtime, meta))
        found.sort(key=lambda item: item[0])
        for _, meta in found:
            self._index[meta.eid] = meta
            self._used += meta.size

    def _remove_anywhere(self, prefix: str, name: str) -> None:
        """Delete a bad blob, also when it sits in the wrong shard directory."""
        for path in (self.root / prefix).glob(f"*/{name}"):
            path.unlink(missing_ok=True)

    def _check_blob(self, tenant: str, name: str, size: int) -> EntryMeta | None:
        """The blob's metadata if it is a complete artifact stored under the right name, else None."""
        try:
            check_tenant(tenant)
            path = self._blobs.path(tenant, name)
            if not path.is_file():  # scanned in a shard directory that does not match its name
                return None
            with open(path, "rb") as fh:
                if self._verify_on_open:
                    header = verify_artifact(fh.read())
                else:
                    header = read_header(fh.read(min(size, _HEAD_BYTES)))
                    if size < TRAILER_BYTES:
                        return None
                    fh.seek(size - TRAILER_BYTES)
                    if fh.read(len(TRAILER_MAGIC)) != TRAILER_MAGIC:
                        return None
        except (KdnError, OSError):
            return None
        if bytes(header.key).hex() != name:
            return None
        return EntryMeta.from_header(header, tenant=tenant, size=size)

    # -- interface -----------------------------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        return self._used

    @staticmethod
    def _name(eid: EntryId) -> tuple[str, str]:
        return eid.tenant, bytes(eid.key).hex()

    def get(self, eid: EntryId) -> bytes | None:
        return self._blobs.get(*self._name(eid))

    def put(self, meta: EntryMeta, data: bytes) -> None:
        self._blobs.put(*self._name(meta.eid), data)  # StorageFull on ENOSPC; old blob untouched
        with self._lock:
            old = self._index.get(meta.eid)
            if old is not None:
                self._used -= old.size
            self._index[meta.eid] = meta
            self._used += meta.size

    def contains(self, eid: EntryId) -> bool:
        return eid in self._index

    def delete(self, eid: EntryId) -> None:
        with self._lock:
            old = self._index.pop(eid, None)
            if old is not None:
                self._used -= old.size
        self._blobs.delete(*self._name(eid))

    def metas(self) -> Iterable[EntryMeta]:
        with self._lock:
            return list(self._index.values())

    def state_dir(self) -> Path | None:
        return self.root  # blobs live in tenant subdirectories; files at the root are ours

    def blob_path(self, eid: EntryId) -> Path:
        """Where the entry's file lives (tests and the shared-memory path use it)."""
        return self._blobs.path(*self._name(eid))

