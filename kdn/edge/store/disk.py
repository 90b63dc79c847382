"""The disk tier: one crash-safe file per entry, under a directory that survives restarts.

:class:`DiskTier` sits on :class:`kdn.blobstore.BlobStore` (atomic temp-file + rename writes), one
blob per entry at ``root/<tenant>/<key hex[:2]>/<key hex>``. On open it rebuilds its index by
scanning the blobs: each must have a verified header (:func:`kdn.artifact.read_header`) whose key
matches its file name and the artifact trailer magic at its end; anything else — a file truncated
or bit-flipped by a crash or a bad disk — is deleted and counted in ``dropped_on_open``. Temporary
files of writers that died mid-write are swept by the blob store and never become visible.
Full checksums of a disk blob are verified by the store on every read. Files at the root (names
starting with ``.``, which no tenant may take) are the store's own state.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

from kdn.artifact import MAX_HEADER, TRAILER_BYTES, TRAILER_MAGIC, read_header, verify_artifact
from kdn.blobstore import BlobStore
from kdn.edge.store.tiers import EntryId, EntryMeta, Ledger, StorageTier, check_tenant
from kdn.errors import KdnError

__all__ = ["DiskTier"]

_HEAD_BYTES = 12 + MAX_HEADER + 8  # container prefix + largest header + header checksum


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
        fsync: bool,
        verify_on_open: bool,
    ) -> None:
        """``fsync`` and ``verify_on_open``: ``EdgeConfig.disk_fsync`` and ``disk_verify_on_open``."""
        super().__init__(name, capacity_bytes)
        self.root = Path(root)
        self._blobs = BlobStore(self.root, fsync=fsync)
        self.swept_tmp = self._blobs.swept
        self._verify_on_open = verify_on_open
        self._index: Ledger[EntryMeta] = Ledger()
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
            self._index.put(meta.eid, meta, meta.size)

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
        return self._index.used

    @staticmethod
    def _name(eid: EntryId) -> tuple[str, str]:
        return eid.tenant, bytes(eid.key).hex()

    def get(self, eid: EntryId) -> bytes | None:
        return self._blobs.get(*self._name(eid))

    def put(self, meta: EntryMeta, data: bytes) -> None:
        self._blobs.put(*self._name(meta.eid), data)  # StorageFull on ENOSPC; old blob untouched
        self._index.put(meta.eid, meta, meta.size)

    def contains(self, eid: EntryId) -> bool:
        return eid in self._index.items

    def delete(self, eid: EntryId) -> None:
        self._index.pop(eid)
        self._blobs.delete(*self._name(eid))

    def metas(self) -> Iterable[EntryMeta]:
        return self._index.values()

    def state_dir(self) -> Path | None:
        return self.root  # blobs live in tenant subdirectories; files at the root are ours

    def blob_path(self, eid: EntryId) -> Path:
        """Where the entry's file lives (tests and the shared-memory path use it)."""
        return self._blobs.path(*self._name(eid))
