"""Adversarial probes of ``kdn ingest`` and the origin's store: bad documents, bad flags, a store
directory that is unusable, full or littered, writes cut short, re-ingest and two tenants.

Each probe asks for one thing: a clear error (an exit code and one line for the CLI; a
:mod:`kdn.errors` exception for the library), nothing lost, and nothing partial ever visible.
In process, with the ``tiny`` model and temporary stores (no Ray, no sockets).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from kdn.artifact import encode_artifact
from kdn.errors import ConfigError, NotFound, StorageFull
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, chunk_keys
from kdn.origin.cli import main_ingest
from kdn.origin.ingest import LocalExecutor, discover, ingest
from kdn.origin.store import DocumentRecord, OriginStore
from kdn.origin.worker import PrefillWorker
from tests.unit.test_origin_ingest import config, executor  # noqa: F401 (fixtures)

FP = ModelFingerprint(b"\x22" * 32)
TEXT = "A good document about caches and their keys. " * 20


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))




def _artifacts(n: int = 2, tenant: str = "t") -> list[tuple[ChunkKey, bytes]]:
    keys = chunk_keys(list(range(n * 4)), fingerprint=FP, namespace=Namespace(tenant), chunk_size=4)
    out = []
    for i, k in enumerate(keys):
        kv = torch.randn(2, 2, 2, 4, 8, generator=torch.Generator().manual_seed(i))
        out.append((k, encode_artifact(kv, key=k, parent_key=keys[i - 1] if i else ROOT_KEY, fingerprint=FP,
                                       codec="raw", chunk_index=i)))
    return out


def _files(root: Path) -> list[Path]:
    """Every file under ``root`` (temporaries included): what a crash leaves behind."""
    return sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink())


def _blob_files(root: Path) -> list[Path]:
    return [p for p in _files(root / "blobs") if not p.name.startswith(".")]


def _one_line(capsys, code: int, expect: int = 2) -> str:
    assert code == expect
    err = capsys.readouterr().err.strip().splitlines()
    err = [e for e in err if not e.startswith("[ingest]")]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def _cli(*args: str) -> int:
    return main_ingest([*args, "--codec", "raw", "--workers", "0", "--no-progress"])


# -- documents -------------------------------------------------------------------------------


def test_unreadable_file_fails_alone(tmp_path, config, executor, monkeypatch):
    """A file that cannot be opened (EACCES) is one failed document saying so; the others are stored."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.md").write_text(TEXT)
    (docs / "secret.md").write_text(TEXT + " secret")
    real_open = os.open

    def deny(path, flags, *a, **kw):  # root reads anything: refuse the way chmod 000 would for a user
        if str(path).endswith("secret.md"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", deny)
    s = ingest([docs], config, executor=executor)
    by = {Path(r.doc_id).name: r for r in s.results}
    assert by["secret.md"].status == "failed" and "cannot read: Permission denied" in by["secret.md"].message
    assert by["ok.md"].status == "stored" and s.exit_code == 1


def test_unreadable_directory_is_reported_not_skipped(tmp_path, config, executor, monkeypatch):
    """A subdirectory that cannot be listed was skipped silently (os.walk drops errors): its
    documents were lost without a word. It is now a failed entry naming the directory."""
    docs = tmp_path / "docs"
    (docs / "locked").mkdir(parents=True)
    (docs / "ok.md").write_text(TEXT)
    (docs / "locked" / "inside.md").write_text(TEXT)
    real_scandir = os.scandir

    def deny(path="."):
        if str(path).endswith("locked"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", deny)
    found = discover([docs])
    assert [p.message for p in found.problems] == ["cannot read the directory: Permission denied"]
    assert found.problems[0].doc_id.endswith("locked")
    s = ingest([docs], config, executor=executor, found=found)
    assert s.failed == 1 and s.count("stored") == 1 and "locked" in s.render()


def test_symbolic_link_loops_and_dangling_links(tmp_path):
    """Loops and links to nothing end in a clear problem (not "does not exist", not "FIFO");
    a link to a directory above is not followed (no endless walk); a link to a file is that file."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "real.md").write_text(TEXT)
    os.symlink("loop.md", docs / "loop.md")  # a link to itself
    os.symlink(docs / "gone.md", docs / "dangling.md")
    os.symlink(docs / "gone.bin", docs / "dangling.bin")  # not text-like: ignored
    os.symlink(docs, docs / "up")  # a directory loop
    os.symlink(docs / "real.md", docs / "alias.md")
    found = discover([docs, docs / "loop.md"])
    assert [s.path.name for s in found.sources] == ["alias.md"]  # resolves to real.md: one document
    assert {Path(s.doc_id).name for s in found.sources} == {"real.md"}
    msgs = {Path(p.doc_id).name: p.message for p in found.problems}
    assert set(msgs) == {"loop.md", "dangling.md"}
    assert all("symbolic link that leads nowhere" in m for m in msgs.values())
    assert len(found.problems) == 3  # loop.md inside the walk and given explicitly
    assert found.not_regular == [] and any(i.endswith("dangling.bin") for i in found.ignored)


def test_non_utf8_file_name_is_refused_up_front(tmp_path, config, executor):
    """A file name with bytes that are not UTF-8 failed *after* its chunks were stored, with a
    UnicodeEncodeError from SQLite (the id could not be recorded), and the id broke strict-UTF-8
    output. It is now refused before any work with a clear reason and a printable id."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.md").write_text(TEXT)
    with open(os.fsencode(docs) + b"/caf\xe9.md", "wb") as f:
        f.write(TEXT.replace("caches", "cafes").encode())
    s = ingest([docs], config, executor=executor)
    (bad,) = [r for r in s.results if r.status == "failed"]
    assert "file name is not valid UTF-8" in bad.message and bad.doc_id.endswith("caf\\xe9.md")
    assert s.count("stored") == 1
    s.render().encode("utf-8")  # strict: printable in any UTF-8 locale
    json.dumps(s.to_json(), ensure_ascii=False).encode("utf-8")
    with OriginStore(config.store_path, verify="none") as store:
        (ok,) = [r for r in s.results if r.status == "stored"]
        assert store.totals()["artifacts"] == len(ok.keys) + len(ok.piece_keys)  # nothing of the refused one


def test_odd_but_valid_file_names_are_ingested(tmp_path, config, executor):
    """Spaces, a newline, a leading dash, quotes and non-ASCII letters are ordinary names."""
    docs = tmp_path / "docs"
    docs.mkdir()
    names = ["with space.md", "new\nline.md", "-dash.md", "quo'te\".md", "naïve 文書.md"]
    for i, n in enumerate(names):
        (docs / n).write_text(f"{i} " + TEXT)
    s = ingest([docs], config, executor=executor)
    assert s.exit_code == 0 and sorted(Path(r.doc_id).name for r in s.results) == sorted(names)
    with OriginStore(config.store_path, verify="none") as store:
        assert sorted(Path(d.doc_id).name for d in store.documents()) == sorted(names)


def test_thousands_of_tiny_files(tmp_path, config, executor):
    """1500 files shorter than a chunk: each reported (short), none failed, in seconds."""
    docs = tmp_path / "docs"
    for i in range(1500):
        d = docs / f"d{i % 30}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.txt").write_text(f"note {i}")
    t0 = time.perf_counter()
    s = ingest([docs], config, executor=executor)
    assert time.perf_counter() - t0 < 30
    assert len(s.results) == 1500 and s.count("short") == 1500 and s.exit_code == 0


# -- flags -----------------------------------------------------------------------------------


def test_empty_flag_values_are_refused_not_defaulted(tmp_path, capsys, monkeypatch):
    """``--store "$UNSET"`` wrote the store into the current directory and ``--model "$UNSET"``
    silently loaded the default model: both are now a one-line ConfigError, and nothing is made."""
    doc = tmp_path / "doc.md"
    doc.write_text(TEXT)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    err = _one_line(capsys, _cli(str(doc), "--model", "tiny", "--store", ""))
    assert "ConfigError" in err and "store_dir" in err
    err = _one_line(capsys, _cli(str(doc), "--model", "", "--store", str(tmp_path / "s")))
    assert "ConfigError" in err and "model spec is empty" in err
    err = _one_line(capsys, _cli(str(doc), "--model", "tiny", "--store", str(tmp_path / "s"), "--namespace", ""))
    assert "ConfigError" in err and "namespace" in err
    assert list(work.iterdir()) == [] and not (tmp_path / "s").exists()


@pytest.mark.parametrize("flags, words", [
    (["--namespace", ".."], ["namespace", "'..'"]),
    (["--namespace", ".:salt"], ["namespace", "'.'"]),
    (["--chunk-size", "0"], ["chunk_size"]),
    (["--chunk-size", "-4"], ["chunk_size"]),
    (["--dtype", "int3"], ["dtype", "int3"]),
    (["--codec", "zstd:99"], ["codecs", "zstd"]),
    (["--codec", "nope"], ["codecs", "nope"]),
    (["--layout", "system"], ["no chat template"]),
    (["--model", "no-such-model"], ["UnknownModel", "no-such-model"]),
])
def test_wrong_flag_values_are_one_line_and_make_nothing(tmp_path, capsys, flags, words):
    """Before: ``--namespace ..`` (or ``.``) passed, then every document failed on a blob path."""
    doc = tmp_path / "doc.md"
    doc.write_text(TEXT)
    store = tmp_path / "store"
    model = [] if "--model" in flags else ["--model", "tiny"]
    err = _one_line(capsys, _cli(str(doc), *model, "--store", str(store), *flags))
    for w in words:
        assert w in err, err
    assert not _blob_files(store) if store.exists() else True


def test_bad_workers_and_layout_flags_exit_2(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(TEXT)
    assert main_ingest([str(doc), "--model", "tiny", "--store", str(tmp_path / "s"), "--workers", "-1",
                        "--no-progress"]) == 2
    assert "workers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main_ingest([str(doc), "--layout", "sideways"])
    assert exc.value.code == 2 and "sideways" in capsys.readouterr().err


def test_a_codec_given_twice_is_stored_and_counted_once(tmp_path, capsys):
    """``--codec raw --codec raw`` wrote each blob twice at once and reported double the bytes."""
    doc = tmp_path / "doc.md"
    doc.write_text(TEXT)
    store = tmp_path / "store"
    assert _cli(str(doc), "--model", "tiny", "--store", str(store), "--codec", "raw", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["codecs"] == ["raw"]
    assert out["bytes_written"] == sum(p.stat().st_size for p in _blob_files(store))


# -- the store directory ---------------------------------------------------------------------


def test_store_directory_not_writable_is_one_line(tmp_path, capsys, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text(TEXT)
    store = tmp_path / "store"
    store.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == store else real_access(p, mode, **kw))
    err = _one_line(capsys, _cli(str(doc), "--model", "tiny", "--store", str(store)))
    assert "ConfigError" in err and "not writable" in err
    with pytest.raises(ConfigError, match="not writable"):
        OriginStore(store)


def _enospc(*_a, **_kw):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_fails_each_document_clearly_and_leaves_nothing(tmp_path, config, tiny_model, monkeypatch):
    """ENOSPC at fsync: StorageFull per document, no blob, temporary or row visible; once there is
    room again a re-run stores everything (nothing lost)."""
    cfg = config.model_copy(update={"fsync": True})
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.md").write_text(f"{i} " + TEXT)
    ex = LocalExecutor(PrefillWorker(cfg, "tiny", lm=tiny_model))
    try:
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", _enospc)
            s = ingest([docs], cfg, executor=ex)
        assert s.failed == 3 and s.exit_code == 1
        assert all("StorageFull" in r.message and "disk full" in r.message for r in s.results)
        assert _files(cfg.store_path / "blobs") == []
        with OriginStore(cfg.store_path, verify="full") as store:
            assert store.totals()["artifacts"] == 0 and store.check is not None and store.check.swept_tmp == 0
        s2 = ingest([docs], cfg, executor=ex)
        assert s2.count("stored") == 3 and s2.exit_code == 0
    finally:
        ex.close()


def test_disk_full_making_a_shard_directory_is_storage_full(tmp_path, monkeypatch):
    """ENOSPC creating a blob's directory escaped as a bare OSError."""
    s = OriginStore(tmp_path, fsync=False)
    (_, blob), *_ = _artifacts(1)
    monkeypatch.setattr(Path, "mkdir", _enospc)
    with pytest.raises(StorageFull, match="disk full"):
        s.put(blob, tenant="t")
    monkeypatch.undo()
    assert s.totals()["artifacts"] == 0 and _files(tmp_path / "blobs") == []


def test_disk_full_under_the_manifest_is_storage_full_and_the_blob_is_adopted(tmp_path):
    """SQLite's "database or disk is full" escaped as sqlite3.OperationalError. It is StorageFull;
    the whole blob written just before is not served, and the next open adopts it."""
    s = OriginStore(tmp_path, fsync=False)
    (pages,), = s._query("PRAGMA page_count", ())
    s._execute(f"PRAGMA max_page_count={pages + 1}", ())  # the manifest's file cannot grow: SQLITE_FULL
    with pytest.raises(StorageFull, match="disk is full"):
        s.record_document(DocumentRecord("t", FP, "/big.md", "h", 1, tuple(_artifacts(1)[0][:1]) * 5000, 0, 1.0))
    full = None
    for k, blob in _artifacts(120):
        try:
            s.put(blob, tenant="t")
        except StorageFull:
            full = (k, blob)
            break
    assert full is not None, "the manifest never filled"
    assert s.artifact(full[0], "raw") is None  # not served: no row
    stored = s.totals()["artifacts"]
    s.close()
    s2 = OriginStore(tmp_path, fsync=False)
    assert s2.check is not None and (s2.check.adopted, s2.check.artifacts) == (1, stored + 1)
    assert s2.get(full[0], "raw", tenant="t") == full[1]


def test_write_interrupted_between_write_and_rename_leaves_no_temporary(tmp_path, monkeypatch):
    """An exception that is not an OSError (an interrupt, a bug) between write and rename left the
    temporary on disk until the next open; the writer now removes it whatever the exception."""
    s = OriginStore(tmp_path, fsync=False)
    (k, blob), *_ = _artifacts(1)

    def interrupted(*_a):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.put(blob, tenant="t")
    monkeypatch.undo()
    assert _files(tmp_path / "blobs") == [] and s.artifact(k, "raw") is None
    s.close()
    assert OriginStore(tmp_path).totals()["artifacts"] == 0


_CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    from kdn.artifact import encode_artifact
    from kdn.keys import ROOT_KEY, ModelFingerprint, Namespace, chunk_keys
    from kdn.origin.store import DocumentRecord, OriginStore

    root, where = sys.argv[1], sys.argv[2]
    fp = ModelFingerprint(b"\\x33" * 32)
    (k,) = chunk_keys(list(range(4)), fingerprint=fp, namespace=Namespace("t"), chunk_size=4)
    blob = encode_artifact(torch.ones(2, 2, 2, 4, 8), key=k, parent_key=ROOT_KEY, fingerprint=fp, codec="raw", chunk_index=0)
    store = OriginStore(root, fsync=True)
    die = lambda *a, **kw: os.kill(os.getpid(), signal.SIGKILL)
    if where == "before-rename":
        os.replace = die
    else:
        OriginStore._insert = die
    store.put(blob, tenant="t")
    print("not killed")
""")


@pytest.mark.parametrize("where, swept, adopted", [("before-rename", 1, 0), ("before-row", 0, 1)])
def test_writer_killed_mid_write_leaves_only_whole_artifacts(tmp_path, where, swept, adopted):
    """SIGKILL after the bytes are written but before the rename: only a hidden temporary, swept on
    the next open. SIGKILL after the rename but before the manifest row: a whole blob, adopted."""
    root = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(root), where], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert proc.returncode == -9, proc.stderr
    if where == "before-rename":
        (tmp,) = _files(root / "blobs")
        assert tmp.name.startswith(".") and tmp.name.endswith(".tmp")
    s = OriginStore(root)
    assert s.check is not None and (s.check.swept_tmp, s.check.adopted, s.check.artifacts) == (swept, adopted, adopted)
    assert all(not p.name.startswith(".") for p in _files(root / "blobs"))


# -- a littered or damaged store -------------------------------------------------------------


def test_junk_among_the_blobs_is_skipped_counted_and_never_served(tmp_path):
    """A FIFO named like a blob hung the store's open forever; a directory or a link loop named
    like one, or a prefix directory with a name no tenant has, made it raise. All are now left
    alone and counted; the healthy artifact is still served; nothing is served from junk."""
    s = OriginStore(tmp_path, fsync=False)
    (k, blob), (k2, blob2) = _artifacts(2)
    s.put(blob, tenant="t")
    s.close()
    blobs = tmp_path / "blobs"
    real = next(p for p in _blob_files(tmp_path))
    shard = real.parent
    fifo = shard / f"{bytes(k2).hex()}.raw"
    os.mkfifo(fifo)
    (shard / f"{'ab' * 32}.raw").mkdir()  # a directory with a blob's name (in its own shard below)
    (blobs / "t" / "ab").mkdir(exist_ok=True)
    (blobs / "t" / "ab" / f"{'ab' * 32}.raw").mkdir()
    os.symlink("loop.raw", shard / "loop.raw")
    (blobs / "bad name" / "zz").mkdir(parents=True)
    (blobs / "bad name" / "zz" / "x.raw").write_bytes(blob)
    (blobs / "stray.txt").write_text("notes")
    (shard / ".DS_Store").write_bytes(b"\x00")
    moved = blobs / "t" / "zz"
    moved.mkdir()
    shutil.copy(real, moved / real.name)  # a copy of a healthy blob in the wrong shard directory

    result: dict[str, object] = {}

    def open_store() -> None:
        try:
            result["store"] = OriginStore(tmp_path, fsync=False)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=open_store, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # release the reader stuck on the FIFO, then fail
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail("opening the store blocked on a FIFO among the blobs")
    assert "error" not in result, result.get("error")
    s2 = result["store"]
    assert isinstance(s2, OriginStore) and s2.check is not None
    assert (s2.check.artifacts, s2.check.dropped_corrupt, s2.check.dropped_missing) == (1, 0, 0)
    assert s2.check.skipped == 8
    assert s2.get(k, "raw", tenant="t") == blob
    with pytest.raises(NotFound):
        s2.get(k2, "raw", tenant="t")
    assert fifo.exists() and (moved / real.name).exists() and (blobs / "stray.txt").exists()  # left alone
    s2.close()


def test_a_damaged_manifest_is_a_clear_error_and_the_rebuild_keeps_only_whole_artifacts(tmp_path):
    """A manifest damaged inside: ConfigError saying to move it aside. Moved aside, the next open
    re-indexes every whole blob and drops the truncated one (counted), never serving it."""
    s = OriginStore(tmp_path, fsync=False)
    arts = _artifacts(3)
    for _, b in arts:
        s.put(b, tenant="t")
    s.close()
    manifest = tmp_path / "manifest.sqlite"
    raw = bytearray(manifest.read_bytes())
    raw[100:4096] = b"\xa5" * (4096 - 100)  # the first page's b-tree
    manifest.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="move it"):
        OriginStore(tmp_path, fsync=False)
    for p in tmp_path.glob("manifest.sqlite*"):
        p.rename(p.with_name(p.name + ".bad"))
    victim = next(p for p in _blob_files(tmp_path) if p.name.startswith(bytes(arts[0][0]).hex()))
    victim.write_bytes(victim.read_bytes()[:-9])
    s2 = OriginStore(tmp_path, fsync=False)
    assert s2.check is not None and (s2.check.adopted, s2.check.removed_orphans) == (2, 1)
    assert [a.key for a in s2.artifacts()] == sorted([arts[1][0], arts[2][0]], key=bytes)
    with pytest.raises(NotFound):
        s2.get(arts[0][0], "raw", tenant="t")
    assert s2.get(arts[1][0], "raw", tenant="t") == arts[1][1]


# -- re-ingest and tenants -------------------------------------------------------------------


def test_reingest_is_idempotent_to_the_byte(tmp_path, config, executor):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text(TEXT)
    (docs / "b.md").write_text("Another one. " * 60)
    s1 = ingest([docs], config, executor=executor)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in _blob_files(config.store_path)}
    s2 = ingest([docs, docs / "a.md"], config, executor=executor)  # a.md twice: still one document
    assert s1.count("stored") == 2 and len(s2.results) == 2 and s2.count("skipped") == 2
    assert s2.bytes_written == 0 and s2.computed_chunks == 0
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in _blob_files(config.store_path)} == before
    with OriginStore(config.store_path, verify="none") as store:
        assert store.totals()["documents"] == 2


def test_two_tenants_ingesting_one_document_stay_apart(tmp_path, config, executor):
    """The same bytes under two tenants: two sets of keys and blobs; neither reads the other's."""
    doc = tmp_path / "shared.md"
    doc.write_text(TEXT)
    a = ingest([doc], config, executor=executor)
    b = ingest([doc], config.model_copy(update={"namespace": "globex"}), executor=executor)
    (ra,), (rb,) = a.results, b.results
    assert ra.status == rb.status == "stored"  # the second tenant is not "skipped" on the first's KV
    assert set(ra.keys).isdisjoint(rb.keys) and ra.n_chunks == rb.n_chunks > 0
    assert {p.name for p in (config.store_path / "blobs").iterdir()} == {"acme", "globex"}
    with OriginStore(config.store_path, verify="none") as store:
        for mine, theirs, tenant in ((ra, rb, "acme"), (rb, ra, "globex")):
            for k in mine.keys:
                store.get(ChunkKey(bytes.fromhex(k)), "raw", tenant=tenant)
            for k in theirs.keys:
                with pytest.raises(NotFound):
                    store.get(ChunkKey(bytes.fromhex(k)), "raw", tenant=tenant)
            assert store.stored_keys([ChunkKey(bytes.fromhex(k)) for k in theirs.keys], tenant=tenant) == set()
        fp = ModelFingerprint(bytes.fromhex(a.fingerprint))
        assert store.document("acme", fp, ra.doc_id).keys != store.document("globex", fp, rb.doc_id).keys


def test_a_short_document_says_what_was_stored(tmp_path, config, executor, tiny_model):
    """A document shorter than a chunk but longer than a tail piece has its pieces stored; its
    message said "nothing to store" beside the bytes written."""
    doc = tmp_path / "short.md"
    doc.write_text("Short but not tiny: a few sentences about caches. " * 4)
    (r,) = ingest([doc], config, executor=executor).results
    assert r.status == "short" and r.n_chunks == 0 and r.n_tokens < tiny_model.chunk_size
    assert r.piece_keys and r.bytes_written > 0
    assert "nothing to store" not in r.message and f"{len(r.piece_keys)} tail pieces" in r.message
