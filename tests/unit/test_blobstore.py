"""The crash-safe blob store: atomic writes, sweep of dead writers' temporaries, scan, delete,
name validation, and a full disk surfacing as StorageFull."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kdn.blobstore import BlobStore
from kdn.errors import InvalidInput, StorageFull


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs", fsync=False)


def test_put_get_contains_size_delete(store: BlobStore) -> None:
    assert store.get("t", "abc") is None and not store.contains("t", "abc") and store.size("t", "abc") is None
    assert store.put("t", "abc", b"hello") == 5
    assert store.get("t", "abc") == b"hello"
    assert store.contains("t", "abc") and store.size("t", "abc") == 5
    store.put("t", "abc", memoryview(b"replaced!"))
    assert store.get("t", "abc") == b"replaced!"
    assert store.delete("t", "abc") is True
    assert store.delete("t", "abc") is False
    assert store.get("t", "abc") is None


def test_scan_lists_exactly_the_complete_blobs(store: BlobStore) -> None:
    blobs = {("t1", "aa01"): b"x" * 3, ("t1", "ab02"): b"y", ("t2", "aa01"): b"zz"}
    for (prefix, name), data in blobs.items():
        store.put(prefix, name, data)
    found = {(b.prefix, b.name): b.size for b in store.scan()}
    assert found == {k: len(v) for k, v in blobs.items()}
    store.delete("t1", "ab02")
    assert {(b.prefix, b.name) for b in store.scan()} == {("t1", "aa01"), ("t2", "aa01")}


def test_scan_of_an_empty_store(tmp_path: Path) -> None:
    assert list(BlobStore(tmp_path / "new", fsync=False).scan()) == []


_KILLED_WRITER = """
import os, signal, sys
from kdn.blobstore import BlobStore
store = BlobStore(sys.argv[1], fsync=True)
# die the hard way at the worst moment: the data is written and fsynced, the rename not done yet
os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)
store.put("t", "dead", b"half of an artifact" * 1000)
"""


def test_writer_killed_before_rename_leaves_nothing_visible_and_is_swept(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    store = BlobStore(root, fsync=False)
    store.put("t", "keep", b"complete")
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(root)], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = [p for p in root.rglob("*.tmp")]
    assert len(leftovers) == 1, "the killed writer should have left its temporary behind"
    assert store.get("t", "dead") is None and not store.contains("t", "dead")
    assert [b.name for b in store.scan()] == ["keep"]
    reopened = BlobStore(root, fsync=False)  # restart
    assert reopened.swept == 1
    assert list(root.rglob("*.tmp")) == []
    assert reopened.get("t", "keep") == b"complete"
    assert [b.name for b in reopened.scan()] == ["keep"]


def test_write_failure_before_rename_leaves_old_blob_and_no_temporary(
    store: BlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put("t", "blob", b"old")

    def dying_replace(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "simulated I/O error")

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(OSError):
        store.put("t", "blob", b"new and longer")
    monkeypatch.undo()
    assert store.get("t", "blob") == b"old"
    leftovers = [p for p in store.root.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    assert leftovers == []


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_disk_full_raises_storage_full_and_leaves_nothing(
    store: BlobStore, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    import builtins

    real_open = builtins.open

    class FullFile:
        def __init__(self, fh):  # type: ignore[no-untyped-def]
            self._fh = fh

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc: object) -> None:
            self._fh.close()

        def write(self, data: bytes) -> int:
            self._fh.write(bytes(data[: len(data) // 2]))  # part of it made it to disk
            raise OSError(err, os.strerror(err))

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(self._fh, name)

    def full_open(path, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
        fh = real_open(path, mode, *args, **kwargs)
        return FullFile(fh) if "w" in mode else fh

    monkeypatch.setattr(builtins, "open", full_open)
    with pytest.raises(StorageFull, match="disk full"):
        store.put("t", "big", b"x" * 4096)
    monkeypatch.undo()
    assert store.get("t", "big") is None
    assert list(store.scan()) == []
    assert [p for p in store.root.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(
    "prefix,name",
    [("t", "../escape"), ("..", "abc"), ("t", "a/b"), ("t", ""), ("", "abc"), ("t", "."), ("t", ".."),
     ("t", "x" * 201), ("t/u", "abc"), ("t", "nul\x00"), ("t", "sp ace")],
)
def test_bad_names_are_refused(store: BlobStore, prefix: str, name: str) -> None:
    for op in (lambda: store.put(prefix, name, b"x"), lambda: store.get(prefix, name),
               lambda: store.delete(prefix, name), lambda: store.contains(prefix, name)):
        with pytest.raises(InvalidInput):
            op()
    assert [p for p in store.root.rglob("*") if p.is_file()] == []


def test_durable_mode_fsyncs_file_and_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    store = BlobStore(tmp_path / "durable")
    store.put("t", "abc", b"data")
    assert len(synced) >= 2  # the file, then its directory
    assert store.get("t", "abc") == b"data"


def test_sweep_leaves_a_live_writers_temporary_alone(tmp_path):
    import subprocess
    import sys

    from kdn.blobstore import BlobStore

    store = BlobStore(tmp_path)
    final = store.path("t", "ab" * 32)
    final.parent.mkdir(parents=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine = final.with_name(f".{final.name}.{live.pid}.1.tmp")  # a writer in another live process
        dead = final.with_name(f".{final.name}.999999999.1.tmp")  # a writer that died
        mine.write_bytes(b"partial")
        dead.write_bytes(b"partial")
        reopened = BlobStore(tmp_path)
        assert mine.exists() and not dead.exists()
        assert reopened.swept == 1
        assert list(reopened.scan()) == []  # neither temporary is ever visible as a blob
    finally:
        live.kill()
        live.wait()
