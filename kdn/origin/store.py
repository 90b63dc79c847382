"""The origin store: durable, content-addressed artifacts on local disk, plus a SQLite manifest.

Blobs live in a :class:`kdn.blobstore.BlobStore` at ``root/blobs/<tenant>/<kk>/<key-hex>.<codec>``
(the codec spec with ``:`` written as ``-``), written atomically (temp file, fsync, rename). The
manifest ``root/manifest.sqlite`` (WAL) indexes them:

- ``artifacts``: one row per (key, codec): tenant, fingerprint, size, tokens, chunk index, lossy,
  created time;
- ``documents``: (tenant, fingerprint, document id) -> content hash, token count, chunk keys in
  order, tokens beyond the model window, update time.

Invariants:
- a manifest row exists only for a blob that was complete when the row was written (blob first,
  row second), so "row present" means "servable"; a blob without a row (writer killed between the
  two) is adopted on the next open after its checksums pass;
- keys are content addresses (they hash the model, namespace and every token up to the chunk), so
  writing the same key twice is a no-op: retries and concurrent writers cannot duplicate;
- on open the store checks itself: temp files of dead writers are swept, rows whose blob is
  missing, truncated or (with ``verify="full"``) fails its checksums are dropped with the blob;
- a blob in a codec this version does not know (a newer version wrote it, then was rolled back)
  never stops the store from opening: it is kept on disk untouched, counted and warned about on
  open, left out of :meth:`OriginStore.variants`, and :meth:`OriginStore.get` answers NotFound;
- anything among the blobs that is no blob (a FIFO, a directory, a stray file or link, a blob moved
  to another shard directory) is left alone, counted (:attr:`StoreCheck.skipped`) and never served;
- a full disk, under a blob or the manifest, raises StorageFull and leaves nothing partial.

Several processes (Ray workers on one node) may open the same root: SQLite serialises writers.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal, Sequence

from kdn.artifact import ArtifactHeader, verify_artifact
from kdn.blobstore import BlobStore
from kdn.codecs import get_codec
from kdn.errors import ArtifactError, ConfigError, InvalidInput, NotFound, StorageFull, UnknownCodec
from kdn.keys import KEY_BYTES, ChunkKey, ModelFingerprint
from kdn.origin.config import OriginConfig

__all__ = ["DocumentRecord", "OriginStore", "StoredArtifact"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS artifacts (
    key BLOB NOT NULL,
    codec TEXT NOT NULL,
    tenant TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    size INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    chunk_index INTEGER NOT NULL,
    lossy INTEGER NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (key, codec)
);
CREATE TABLE IF NOT EXISTS documents (
    tenant TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    doc_id TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    keys BLOB NOT NULL,
    beyond_window_tokens INTEGER NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (tenant, fingerprint, doc_id)
);
"""

log = logging.getLogger(__name__)

_BLOB_DIR = "blobs"
_MANIFEST = "manifest.sqlite"
_BUSY_S = 60.0  # how long a manifest statement waits for another process's lock


@dataclass(frozen=True, slots=True)
class StoredArtifact:
    """One manifest row: an artifact that is on disk, complete, in one codec."""

    key: ChunkKey
    codec: str  # codec spec, e.g. "zstd:3"
    tenant: str
    fingerprint: ModelFingerprint
    size: int
    tokens: int
    chunk_index: int
    lossy: bool
    created: float


@dataclass(frozen=True, slots=True)
class DocumentRecord:
    """A document's stored keys as last ingested: its chunk chain, then the pieces of its tail
    (:func:`kdn.keys.piece_keys`), so a hint on the document (pin, prefetch) covers all of it."""

    tenant: str
    fingerprint: ModelFingerprint
    doc_id: str
    content_hash: str
    n_tokens: int
    keys: tuple[ChunkKey, ...]
    beyond_window_tokens: int
    updated: float


@dataclass(frozen=True, slots=True)
class StoreCheck:
    """What the self-check on open found and did."""

    artifacts: int  # rows kept
    dropped_missing: int  # rows whose blob was gone
    dropped_corrupt: int  # rows (and blobs) whose size or checksums were wrong
    adopted: int  # complete blobs without a row, now indexed
    removed_orphans: int  # blobs without a row that failed verification, deleted
    swept_tmp: int  # temp files of dead writers
    seconds: float
    unknown_codec: int = 0  # blobs in a codec this version does not know: kept on disk, not served
    skipped: int = 0  # entries among the blobs that are no blob (FIFOs, directories, stray files): left alone, not served


def codec_spec_of(header: ArtifactHeader) -> str:
    return f"{header.codec}:{header.codec_level}" if header.codec_level else header.codec


def known_codec(spec: str) -> bool:
    """Whether this version can decode ``spec`` (a newer one may have written codecs it cannot)."""
    try:
        get_codec(spec)
    except UnknownCodec:
        return False
    return True


def _enter_wal(db: sqlite3.Connection) -> None:
    """Put the manifest in WAL mode, waiting out other processes opening it at the same moment.

    Switching the journal mode takes an exclusive lock and SQLite answers "database is locked" at
    once instead of calling the busy handler, so workers that open a fresh store together (Ray
    starts an origin's PrefillWorkers in parallel) would fail; they retry here for as long as any
    other statement would wait.
    """
    deadline = time.monotonic() + _BUSY_S
    delay = 0.005
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _is_full(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL


@contextmanager
def _disk_full_is_storage_full(root: Path) -> Iterator[None]:
    """A manifest write that meets a full disk raises StorageFull (SQLite rolls the statement back)."""
    try:
        yield
    except sqlite3.Error as exc:
        if _is_full(exc):
            raise StorageFull(f"origin store {root}: the disk is full writing its manifest ({exc})") from exc
        raise


def _blob_name(key: ChunkKey, codec: str) -> str:
    return f"{bytes(key).hex()}.{codec.replace(':', '-')}"


class OriginStore:
    """Content-addressed artifacts by (key, codec), scoped by tenant, with a document manifest."""

    def __init__(
        self,
        root: str | Path,
        *,
        fsync: bool = OriginConfig.default("fsync"),
        verify: Literal["full", "size", "none"] = OriginConfig.default("verify_on_start"),
    ) -> None:
        self.root = Path(root).expanduser()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable")
            self.blobs = BlobStore(self.root / _BLOB_DIR, fsync=fsync)
        except OSError as exc:
            what = ("it exists and is not a directory" if isinstance(exc, FileExistsError)
                    else "a part of its path is a file" if isinstance(exc, NotADirectoryError) else exc.strerror or exc)
            raise ConfigError(f"origin store {self.root}: cannot use it as a store directory ({what})") from exc
        self._lock = threading.Lock()
        manifest = self.root / _MANIFEST
        try:
            self._db = sqlite3.connect(manifest, timeout=_BUSY_S, check_same_thread=False, isolation_level=None)
            _enter_wal(self._db)
            self._db.execute("PRAGMA synchronous=NORMAL")  # blobs are fsynced; lost rows are re-adopted
            self._db.execute(f"PRAGMA busy_timeout={int(_BUSY_S * 1000)}")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            if _is_full(exc):
                raise StorageFull(f"origin store {self.root}: the disk is full opening its manifest ({exc})") from exc
            raise ConfigError(
                f"origin store manifest {manifest} is not usable ({exc}); move it (and any -wal/-shm beside it) "
                "aside: the next open re-indexes the artifacts on disk, document records are lost"
            ) from exc
        self.check: StoreCheck | None = None
        if verify != "none":
            try:
                self.check = self._self_check(full=verify == "full", swept=self.blobs.swept)
            except sqlite3.DatabaseError as exc:  # a manifest that opens but is damaged inside
                self._db.close()
                raise ConfigError(
                    f"origin store manifest {manifest} is damaged ({exc}); move it (and any -wal/-shm beside it) "
                    "aside: the next open re-indexes the artifacts on disk, document records are lost"
                ) from exc

    # -- artifacts ------------------------------------------------------------------------------

    def put(self, data: bytes | memoryview, *, tenant: str) -> StoredArtifact:
        """Verify and store one container; a no-op when (key, codec) is already stored."""
        header = verify_artifact(data)  # raises ArtifactCorrupt / UnsupportedVersion
        key, codec = ChunkKey(bytes(header.key)), codec_spec_of(header)
        existing = self.artifact(key, codec)
        if existing is not None:
            if existing.tenant != tenant:
                raise InvalidInput("key already stored under another tenant")  # cannot happen with honest keys
            return existing
        name = _blob_name(key, codec)
        for attempt in range(3):
            try:
                self.blobs.put(tenant, name, data)
                break
            except FileNotFoundError:
                # another process opening the store swept our temp file mid-write; the write is
                # idempotent, so just write again
                if attempt == 2:
                    raise
        row = StoredArtifact(
            key=key,
            codec=codec,
            tenant=tenant,
            fingerprint=ModelFingerprint(bytes(header.fingerprint)),
            size=len(data),
            tokens=header.token_count,
            chunk_index=header.chunk_index,
            lossy=header.lossy,
            created=time.time(),
        )
        self._insert(row)
        return row

    def artifact(self, key: ChunkKey, codec: str) -> StoredArtifact | None:
        rows = self._query("SELECT * FROM artifacts WHERE key=? AND codec=?", (bytes(key), codec))
        return _row_artifact(rows[0]) if rows else None

    def variants(self, key: ChunkKey, *, tenant: str) -> list[StoredArtifact]:
        """Every codec this version knows this key is stored in for ``tenant`` (lossless first,
        then by name)."""
        rows = self._query("SELECT * FROM artifacts WHERE key=? AND tenant=?", (bytes(key), tenant))
        found = (_row_artifact(r) for r in rows)
        return sorted((a for a in found if known_codec(a.codec)), key=lambda a: (a.lossy, a.codec))

    def stored_keys(self, keys: Iterable[ChunkKey], *, tenant: str, codecs: Sequence[str] | None = None) -> set[ChunkKey]:
        """The subset of ``keys`` stored for ``tenant`` (in every codec of ``codecs`` when given,
        else in at least one codec this version knows: one it can serve)."""
        keys = [bytes(k) for k in keys]
        out: set[ChunkKey] = set()
        for start in range(0, len(keys), 500):
            batch = keys[start : start + 500]
            marks = ",".join("?" * len(batch))
            sql = f"SELECT key, codec FROM artifacts WHERE tenant=? AND key IN ({marks})"
            have: dict[bytes, set[str]] = {}
            for k, c in self._query(sql, (tenant, *batch)):
                have.setdefault(bytes(k), set()).add(c)
            for k, cs in have.items():
                if set(codecs) <= cs if codecs is not None else any(known_codec(c) for c in cs):
                    out.add(ChunkKey(k))
        return out

    def get(self, key: ChunkKey, codec: str, *, tenant: str, verify: bool = True) -> bytes:
        """The container bytes of (key, codec) for ``tenant``. A blob that vanished or fails its
        checksums is dropped from the manifest and reported as NotFound (never served)."""
        row = self.artifact(key, codec)
        if row is None or row.tenant != tenant:
            raise NotFound(f"artifact {bytes(key).hex()[:16]}… ({codec}) is not stored")
        if not known_codec(codec):  # kept for the version that wrote it; never dropped here
            raise NotFound(
                f"artifact {bytes(key).hex()[:16]}… is stored only in codec {codec!r}, which this version does not know"
            )
        data = self.blobs.get(tenant, _blob_name(key, codec))
        problem = None
        if data is None:
            problem = "its file is missing"
        elif verify:
            try:
                verify_artifact(data, expect_key=key)
            except ArtifactError as exc:
                problem = f"it failed verification ({exc})"
        if problem is not None:
            self._drop(row)
            raise NotFound(f"artifact {bytes(key).hex()[:16]}… ({codec}) was dropped: {problem}")
        assert data is not None
        return data

    def delete(self, key: ChunkKey, codec: str) -> bool:
        row = self.artifact(key, codec)
        if row is None:
            return False
        self._drop(row)
        return True

    def artifacts(self) -> list[StoredArtifact]:
        return [_row_artifact(r) for r in self._query("SELECT * FROM artifacts ORDER BY key, codec", ())]

    # -- documents -----------------------------------------------------------------------------

    def record_document(self, rec: DocumentRecord) -> None:
        self._execute(
            "INSERT OR REPLACE INTO documents VALUES (?,?,?,?,?,?,?,?)",
            (
                rec.tenant,
                bytes(rec.fingerprint),
                rec.doc_id,
                rec.content_hash,
                rec.n_tokens,
                b"".join(bytes(k) for k in rec.keys),
                rec.beyond_window_tokens,
                rec.updated,
            ),
        )

    def document(self, tenant: str, fingerprint: ModelFingerprint, doc_id: str) -> DocumentRecord | None:
        rows = self._query(
            "SELECT * FROM documents WHERE tenant=? AND fingerprint=? AND doc_id=?", (tenant, bytes(fingerprint), doc_id)
        )
        return _row_document(rows[0]) if rows else None

    def document_ids(self, tenant: str, fingerprint: ModelFingerprint) -> list[str]:
        """Every document id stored for this tenant and model, sorted (for "did you mean")."""
        rows = self._query("SELECT doc_id FROM documents WHERE tenant=? AND fingerprint=? ORDER BY doc_id",
                           (tenant, bytes(fingerprint)))
        return [r[0] for r in rows]

    def documents(self) -> list[DocumentRecord]:
        return [_row_document(r) for r in self._query("SELECT * FROM documents ORDER BY doc_id", ())]

    # -- bookkeeping ---------------------------------------------------------------------------

    def totals(self) -> dict[str, int]:
        (n, size), = self._query("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM artifacts", ())
        (docs,), = self._query("SELECT COUNT(*) FROM documents", ())
        (keys,), = self._query("SELECT COUNT(DISTINCT key) FROM artifacts", ())
        return {"artifacts": int(n), "bytes": int(size), "documents": int(docs), "keys": int(keys)}

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "OriginStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _query(self, sql: str, args: tuple) -> list[tuple]:
        with self._lock, _disk_full_is_storage_full(self.root):
            return self._db.execute(sql, args).fetchall()

    def _execute(self, sql: str, args: tuple) -> None:
        with self._lock, _disk_full_is_storage_full(self.root):
            self._db.execute(sql, args)

    def _insert(self, a: StoredArtifact) -> None:
        self._execute(
            "INSERT OR IGNORE INTO artifacts VALUES (?,?,?,?,?,?,?,?,?)",
            (bytes(a.key), a.codec, a.tenant, bytes(a.fingerprint), a.size, a.tokens, a.chunk_index, int(a.lossy), a.created),
        )

    def _drop(self, a: StoredArtifact) -> None:
        self._execute("DELETE FROM artifacts WHERE key=? AND codec=?", (bytes(a.key), a.codec))
        self.blobs.delete(a.tenant, _blob_name(a.key, a.codec))

    def _self_check(self, *, full: bool, swept: int) -> StoreCheck:
        t0 = time.perf_counter()
        rows = [_row_artifact(r) for r in self._query("SELECT * FROM artifacts", ())]
        by_file = {(r.tenant, _blob_name(r.key, r.codec)): r for r in rows}
        seen: set[tuple[str, str]] = set()
        kept = dropped_corrupt = adopted = removed = unknown = 0
        junk: list[str] = []
        for info in self.blobs.scan(junk):
            if info.shard != info.name[:2]:  # moved by hand: never where a read looks for it
                junk.append(f"{info.prefix}/{info.shard}/{info.name}")
                continue
            key_hex, _, _codec_file = info.name.partition(".")
            try:
                key = bytes.fromhex(key_hex)
            except ValueError:
                key = b""
            row = by_file.get((info.prefix, info.name))
            if row is not None:
                seen.add((info.prefix, info.name))
                if not known_codec(row.codec):
                    unknown += 1
                    continue
                ok = row.size == info.size
                if ok and full:
                    ok = _blob_valid(self.blobs, info.prefix, info.name, key)
                if ok:
                    kept += 1
                else:
                    self._drop(row)
                    dropped_corrupt += 1
                continue
            # a blob without a row: its writer died between the two steps (or the WAL lost the row)
            data = self.blobs.get(info.prefix, info.name)
            header = None
            if data is not None and len(key) == KEY_BYTES:
                try:
                    header = verify_artifact(data, expect_key=ChunkKey(key))
                except UnknownCodec:
                    unknown += 1  # a newer version's blob: leave it for that version
                    continue
                except ArtifactError:
                    header = None
            if header is not None and _blob_name(ChunkKey(key), codec_spec_of(header)) == info.name:
                self._insert(
                    StoredArtifact(
                        key=ChunkKey(key),
                        codec=codec_spec_of(header),
                        tenant=info.prefix,
                        fingerprint=ModelFingerprint(bytes(header.fingerprint)),
                        size=len(data),
                        tokens=header.token_count,
                        chunk_index=header.chunk_index,
                        lossy=header.lossy,
                        created=info.mtime,
                    )
                )
                adopted += 1
            else:
                self.blobs.delete(info.prefix, info.name)
                removed += 1
        missing = [r for f, r in by_file.items() if f not in seen]
        for r in missing:
            self._execute("DELETE FROM artifacts WHERE key=? AND codec=?", (bytes(r.key), r.codec))
        if junk:
            log.warning("origin store %s: skipped %d entries among the blobs that are not blobs (e.g. %s); "
                        "left alone, not served", self.root, len(junk), junk[0])
        if unknown:
            log.warning("origin store %s: %d artifacts are in codecs this version does not know; "
                        "kept on disk, not served", self.root, unknown)
        return StoreCheck(
            artifacts=kept + adopted,
            dropped_missing=len(missing),
            dropped_corrupt=dropped_corrupt,
            adopted=adopted,
            removed_orphans=removed,
            swept_tmp=swept,
            seconds=time.perf_counter() - t0,
            unknown_codec=unknown,
            skipped=len(junk),
        )


def _blob_valid(blobs: BlobStore, tenant: str, name: str, key: bytes) -> bool:
    """Whether the blob ``name`` is on disk and a whole artifact of ``key``."""
    data = blobs.get(tenant, name)
    if data is None:
        return False
    try:
        verify_artifact(data, expect_key=ChunkKey(key))
    except ArtifactError:
        return False
    return True


def _row_artifact(r: tuple) -> StoredArtifact:
    return StoredArtifact(
        key=ChunkKey(bytes(r[0])),
        codec=r[1],
        tenant=r[2],
        fingerprint=ModelFingerprint(bytes(r[3])),
        size=int(r[4]),
        tokens=int(r[5]),
        chunk_index=int(r[6]),
        lossy=bool(r[7]),
        created=float(r[8]),
    )


def _row_document(r: tuple) -> DocumentRecord:
    blob = bytes(r[5])
    return DocumentRecord(
        tenant=r[0],
        fingerprint=ModelFingerprint(bytes(r[1])),
        doc_id=r[2],
        content_hash=r[3],
        n_tokens=int(r[4]),
        keys=tuple(ChunkKey(blob[i : i + KEY_BYTES]) for i in range(0, len(blob), KEY_BYTES)),
        beyond_window_tokens=int(r[6]),
        updated=float(r[7]),
    )
