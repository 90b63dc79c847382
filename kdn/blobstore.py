"""Crash-safe files by name: the disk layer under the origin store and the edge's disk tier.

A blob is written to a temporary file in its final directory, flushed and fsynced, then renamed
into place (and the directory fsynced), so a reader sees either nothing or the whole blob — never
a partial one, whatever instant the writer dies at. Temporary files left by a killed writer are
swept on open. The store does not interpret bytes: callers verify artifact checksums on read.

Layout: ``root/<prefix>/<name[:2]>/<name>`` where ``prefix`` groups blobs (a tenant, a codec).
Names are restricted to ``[A-Za-z0-9_.-]`` so no name can escape the root.

Small state files beside the blobs (an edge's retention hints and hint schedules, the cluster
state) use the same write with the same durability: :func:`write_file_atomic` /
:func:`write_json_atomic`, the one atomic writer of the tree.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kdn.errors import InvalidInput, StorageFull
from kdn.procs import pid_alive

__all__ = ["BlobStore", "sweep_file_tmp", "write_file_atomic", "write_json_atomic"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
_TMP_SUFFIX = ".tmp"


@dataclass(frozen=True, slots=True)
class BlobInfo:
    prefix: str
    name: str
    size: int
    mtime: float
    shard: str = ""  # the directory it was found in: ``name[:2]`` unless it was moved there by hand


class BlobStore:
    """Atomic, durable blobs on local disk."""

    def __init__(self, root: str | Path, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self.swept = self._sweep_tmp()

    # -- paths ---------------------------------------------------------------------------------

    def path(self, prefix: str, name: str) -> Path:
        for part, what in ((prefix, "prefix"), (name, "name")):
            if not _valid_name(part):
                raise InvalidInput(f"blob {what} {part!r} is not allowed")
        return self.root / prefix / name[:2] / name

    # -- operations ----------------------------------------------------------------------------

    def put(self, prefix: str, name: str, data: bytes | memoryview) -> int:
        """Write atomically; replaces an existing blob of the same name. Returns the size.

        A full disk (or quota) raises StorageFull, whichever step hits it; nothing partial is left."""
        final = self.path(prefix, name)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{id(data):x}{_TMP_SUFFIX}")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            _write_replace(final, tmp, data, fsync=self._fsync)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFull(f"disk full writing {final}: {exc.strerror}") from exc
            raise
        return len(data)

    def get(self, prefix: str, name: str) -> bytes | None:
        """The blob's bytes; None when no regular file has that name (a FIFO or a directory put
        there by hand is never read: a FIFO would block)."""
        try:
            fd = os.open(self.path(prefix, name), os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, IsADirectoryError):
            return None
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return fh.read()

    def contains(self, prefix: str, name: str) -> bool:
        return self.path(prefix, name).is_file()

    def size(self, prefix: str, name: str) -> int | None:
        try:
            return self.path(prefix, name).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, prefix: str, name: str) -> bool:
        try:
            self.path(prefix, name).unlink()
            return True
        except FileNotFoundError:
            return False

    def scan(self, skipped: list[str] | None = None) -> Iterator[BlobInfo]:
        """Every complete blob on disk (indexes are rebuilt from it on restart): regular files
        with a blob's name in the shard directories of prefix directories with a prefix's name.
        Anything else found there (FIFOs, directories, broken or looping symbolic links, files of
        other names) is not a blob: it is left alone and, given ``skipped``, its path is appended
        to it. Writers' temporaries are not listed (see the sweep on open)."""
        if not self.root.is_dir():
            return
        for prefix_dir in self.root.iterdir():
            if not prefix_dir.is_dir() or not _valid_name(prefix_dir.name):
                _skip(skipped, prefix_dir)
                continue
            for shard in prefix_dir.iterdir():
                if not shard.is_dir():
                    _skip(skipped, shard)
                    continue
                for f in shard.iterdir():
                    if f.name.startswith(".") and f.name.endswith(_TMP_SUFFIX):
                        continue
                    try:
                        st = f.stat()
                    except FileNotFoundError:
                        if f.is_symlink():  # a link to nothing
                            _skip(skipped, f)
                        continue
                    except OSError:  # a symbolic link loop, an unreadable entry
                        _skip(skipped, f)
                        continue
                    if not stat.S_ISREG(st.st_mode) or f.name.startswith(".") or not _valid_name(f.name):
                        _skip(skipped, f)
                        continue
                    yield BlobInfo(prefix_dir.name, f.name, st.st_size, st.st_mtime, shard.name)

    def _sweep_tmp(self) -> int:
        """Remove temporaries of writers that died mid-write. Returns how many were removed.

        A temporary's name carries its writer's pid; one whose writer is still alive (another
        process writing into the same store right now) is left alone."""
        removed = 0
        for tmp in self.root.glob(f"*/*/.*{_TMP_SUFFIX}"):
            if _writer_alive(tmp.name):
                continue
            tmp.unlink(missing_ok=True)
            removed += 1
        return removed


def _valid_name(part: str) -> bool:
    return bool(_NAME.match(part)) and part not in (".", "..")


def _skip(skipped: list[str] | None, p: Path) -> None:
    if skipped is not None:
        skipped.append(p.as_posix())


def _writer_alive(tmp_name: str) -> bool:
    """``.<name>.<pid>.<id>.tmp``: is that pid a live process other than a recycled one of ours?"""
    parts = tmp_name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False  # this process is opening the store: none of its writes are in flight yet
    return pid_alive(pid)


def write_file_atomic(path: str | Path, data: bytes) -> None:
    """Replace the small file ``path`` with ``data``, durably: a temporary beside it
    (``.<name>.<pid>.tmp``), flushed and fsynced, renamed over ``path``, then the directory fsynced.

    A reader sees the old file or the new one, never a mix; a writer killed midway leaves only its
    temporary, which :func:`sweep_file_tmp` removes. Raises OSError (the temporary removed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_replace(path, _file_tmp(path, str(os.getpid())), data, fsync=True)


def write_json_atomic(path: str | Path, doc: object, **dumps: Any) -> None:
    """:func:`write_file_atomic` of ``json.dumps(doc, **dumps)`` (UTF-8)."""
    write_file_atomic(path, json.dumps(doc, **dumps).encode("utf-8"))


def sweep_file_tmp(path: str | Path) -> None:
    """Remove the temporaries that writers of ``path`` killed before their rename left behind."""
    path = Path(path)
    for stale in path.parent.glob(_file_tmp(path, "*").name):
        stale.unlink(missing_ok=True)


def _file_tmp(path: Path, pid: str) -> Path:
    return path.with_name(f".{path.name.lstrip('.')}.{pid}{_TMP_SUFFIX}")


def _write_replace(final: Path, tmp: Path, data: bytes | memoryview, *, fsync: bool) -> None:
    """Write ``tmp``, rename it over ``final``; fsync both (``fsync``). The temporary never survives a failure."""
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, final)
        if fsync:
            _fsync_dir(final.parent)
    except BaseException:  # OSError, and an interrupt or any other exception between write and rename
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
