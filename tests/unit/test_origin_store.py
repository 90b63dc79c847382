"""OriginStore: content addressing, idempotence, tenant scoping, and the self-check on open."""

from __future__ import annotations

import os

import pytest
import torch

from kdn.artifact import decode_artifact, encode_artifact
from kdn.errors import ArtifactCorrupt, NotFound
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, chunk_keys
from kdn.origin.store import DocumentRecord, OriginStore
from tests.children import dead_pid

FP = ModelFingerprint(b"\x11" * 32)


def _artifacts(n: int = 3, codec: str = "raw", tenant: str = "t") -> list[tuple[ChunkKey, bytes]]:
    keys = chunk_keys(list(range(n * 4)), fingerprint=FP, namespace=Namespace(tenant), chunk_size=4)
    out = []
    for i, k in enumerate(keys):
        kv = torch.randn(2, 2, 2, 4, 8, generator=torch.Generator().manual_seed(i))  # (L, 2, H, T, D)
        out.append((k, encode_artifact(kv, key=k, parent_key=keys[i - 1] if i else ROOT_KEY, fingerprint=FP, codec=codec, chunk_index=i)))
    return out


def test_put_get_roundtrip_and_idempotent(tmp_path):
    s = OriginStore(tmp_path, fsync=False)
    (k, blob), *_ = _artifacts()
    row = s.put(blob, tenant="t")
    assert (row.key, row.codec, row.size, row.chunk_index) == (k, "raw", len(blob), 0)
    again = s.put(blob, tenant="t")
    assert again == row  # same row: no second write
    assert len(list(s.blobs.scan())) == 1
    assert s.get(k, "raw", tenant="t") == blob
    assert s.totals()["artifacts"] == 1


def test_variants_lossless_first_and_stored_keys_need_every_codec(tmp_path):
    s = OriginStore(tmp_path, fsync=False)
    arts_raw = _artifacts(2, "raw")
    arts_int8 = _artifacts(2, "int8")
    for (_, b) in arts_raw + arts_int8[:1]:
        s.put(b, tenant="t")
    k0, k1 = arts_raw[0][0], arts_raw[1][0]
    assert [v.codec for v in s.variants(k0, tenant="t")][0] == "raw"
    assert s.variants(k0, tenant="t")[-1].lossy
    assert s.stored_keys([k0, k1], tenant="t") == {k0, k1}
    assert s.stored_keys([k0, k1], tenant="t", codecs=["raw", "int8"]) == {k0}


def test_other_tenant_sees_nothing(tmp_path):
    s = OriginStore(tmp_path, fsync=False)
    (k, blob), *_ = _artifacts()
    s.put(blob, tenant="t")
    assert s.variants(k, tenant="other") == []
    assert s.stored_keys([k], tenant="other") == set()
    with pytest.raises(NotFound):
        s.get(k, "raw", tenant="other")


def test_corrupt_bytes_are_refused_on_put(tmp_path):
    s = OriginStore(tmp_path, fsync=False)
    (_, blob), *_ = _artifacts()
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises(ArtifactCorrupt):
        s.put(bytes(bad), tenant="t")
    assert s.totals()["artifacts"] == 0


def test_get_drops_an_artifact_corrupted_on_disk(tmp_path):
    s = OriginStore(tmp_path, fsync=False)
    (k, blob), *_ = _artifacts()
    s.put(blob, tenant="t")
    path = next(p for p in (tmp_path / "blobs").rglob("*") if p.is_file())
    raw = bytearray(path.read_bytes())
    raw[-30] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(NotFound, match="dropped"):
        s.get(k, "raw", tenant="t")
    assert s.artifact(k, "raw") is None and not path.exists()


def test_self_check_on_open(tmp_path):
    s = OriginStore(tmp_path, fsync=False)
    arts = _artifacts(4)
    for _, b in arts:
        s.put(b, tenant="t")
    s.close()
    files = sorted((p for p in (tmp_path / "blobs").rglob("*") if p.is_file()), key=lambda p: p.name)
    by_key = {bytes.fromhex(p.name.split(".")[0]): p for p in files}
    # 1: missing blob; 2: truncated blob; 3: bit flip in the middle; 4: healthy
    by_key[bytes(arts[0][0])].unlink()
    p = by_key[bytes(arts[1][0])]
    p.write_bytes(p.read_bytes()[:-7])
    p = by_key[bytes(arts[2][0])]
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    p.write_bytes(bytes(raw))
    # a dead writer's temp file and an orphan blob (row lost) that is complete
    (p.parent / f".dead.{dead_pid()}.abc.tmp").write_bytes(b"partial")
    orphan_dir = tmp_path / "blobs" / "t"
    s2 = OriginStore(tmp_path, fsync=False)
    chk = s2.check
    assert chk is not None
    assert (chk.dropped_missing, chk.dropped_corrupt, chk.artifacts, chk.swept_tmp) == (1, 2, 1, 1)
    assert [a.key for a in s2.artifacts()] == [arts[3][0]]
    assert not list(orphan_dir.rglob(".*.tmp"))
    # the healthy one is still served and decodes
    assert decode_artifact(s2.get(arts[3][0], "raw", tenant="t")).header.chunk_index == 3


def test_orphan_blob_is_adopted_and_garbage_removed(tmp_path):
    s = OriginStore(tmp_path, fsync=False)
    (k, blob), *_ = _artifacts(1)
    s.put(blob, tenant="t")
    s._execute("DELETE FROM artifacts", ())  # as if the writer died between blob and row
    name = f"{'ab' * 32}.raw"
    s.blobs.put("t", name, b"not an artifact")
    s.close()
    s2 = OriginStore(tmp_path, fsync=False)
    assert s2.check is not None and (s2.check.adopted, s2.check.removed_orphans) == (1, 1)
    row = s2.artifact(k, "raw")
    assert row is not None and row.tenant == "t" and row.size == len(blob)
    assert not s2.blobs.contains("t", name)


def test_documents_roundtrip(tmp_path):
    s = OriginStore(tmp_path, fsync=False)
    keys = tuple(k for k, _ in _artifacts(3))
    rec = DocumentRecord("t", FP, "/docs/a.md", "h1", 12, keys, 0, 1.0)
    s.record_document(rec)
    assert s.document("t", FP, "/docs/a.md") == rec
    assert s.document("other", FP, "/docs/a.md") is None
    s.record_document(DocumentRecord("t", FP, "/docs/a.md", "h2", 8, keys[:2], 0, 2.0))
    assert s.document("t", FP, "/docs/a.md").keys == keys[:2]  # type: ignore[union-attr]
    assert s.totals()["documents"] == 1


def test_store_survives_reopen_from_another_process_view(tmp_path):
    s = OriginStore(tmp_path, fsync=True)
    arts = _artifacts(2)
    for _, b in arts:
        s.put(b, tenant="t")
    other = OriginStore(tmp_path, verify="none")  # a worker's view while the first is open
    assert other.stored_keys([k for k, _ in arts], tenant="t") == {k for k, _ in arts}
    other.close()
    s.close()
    assert os.path.exists(tmp_path / "manifest.sqlite")


def test_a_blob_in_an_unknown_codec_never_stops_the_store(tmp_path, caplog):
    """Issue 19 item 9: a newer version wrote blobs in a codec this one does not know (then was
    rolled back). Opening with a full check skips them (kept on disk, counted, warned about) and
    serves the rest; get() answers NotFound, never an unexpected error."""
    from kdn.origin.store import _blob_name
    from tests.reframe import frame, split

    s = OriginStore(tmp_path, fsync=False)
    (k0, good), (k1, b1), (k2, b2) = _artifacts(3)
    s.put(good, tenant="t")
    newer = {}
    for k, b in ((k1, b1), (k2, b2)):
        _, header, payloads = split(b)
        header.codec = "zstd-next"
        newer[k] = frame(header, payloads)
        s.blobs.put("t", _blob_name(k, "zstd-next"), newer[k])
    s._execute("INSERT INTO artifacts VALUES (?,?,?,?,?,?,?,?,?)", (bytes(k1), "zstd-next", "t", bytes(FP), len(newer[k1]), 4, 1, 0, 0.0))
    s.close()  # k1 has its row (written by the newer version), k2 is an orphan blob
    with caplog.at_level("WARNING", logger="kdn.origin.store"):
        s2 = OriginStore(tmp_path, fsync=False, verify="full")
    assert s2.check is not None and s2.check.unknown_codec == 2 and s2.check.artifacts == 1
    assert "does not know" in caplog.text
    assert s2.get(k0, "raw", tenant="t") == good
    assert s2.variants(k1, tenant="t") == []
    with pytest.raises(NotFound, match="zstd-next"):
        s2.get(k1, "zstd-next", tenant="t")
    for k in (k1, k2):  # kept for the version that wrote them
        assert s2.blobs.get("t", _blob_name(k, "zstd-next")) == newer[k]
    assert s2.artifact(k1, "zstd-next") is not None
    s2.close()



def _open_at_once(root: str, barrier, errors) -> None:
    barrier.wait()
    try:
        OriginStore(root, fsync=False, verify="none")
    except Exception as exc:  # reported to the parent, which asserts on it
        errors.put(repr(exc))


def test_processes_opening_a_fresh_store_together_all_get_it(tmp_path):
    # Ray starts an origin's PrefillWorkers in parallel and each opens the store; SQLite refuses
    # the switch to WAL at once while another connection holds the lock, so an open must wait
    # that out like any other statement instead of failing with "database is locked".
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs, errors = 6, ctx.SimpleQueue()
    for trial in range(10):
        barrier = ctx.Barrier(procs)
        workers = [ctx.Process(target=_open_at_once, args=(str(tmp_path / f"store{trial}"), barrier, errors))
                   for _ in range(procs)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert [w.exitcode for w in workers] == [0] * procs
    assert errors.empty(), errors.get()
