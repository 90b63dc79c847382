"""The ingest pipeline in-process (no Ray): bad input, skip-what-is-stored, keys, config."""

from __future__ import annotations

import pytest

from kdn.artifact import decode_artifact
from kdn.errors import ConfigError, InvalidInput, UnknownModel
from kdn.keys import Namespace, chunk_keys
from kdn.prefill import document_tokens
from kdn.origin.config import OriginConfig
from kdn.origin.ingest import LocalExecutor, check_model_spec, discover, ingest, read_document
from kdn.origin.store import OriginStore
from kdn.origin.worker import PrefillWorker


@pytest.fixture
def docs(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "guide.md").write_text("# Guide\n\n" + "Reuse the KV cache of long contexts. " * 30)
    (d / "sub" / "code.py").write_text("def double(x):\n    return 2 * x\n\n" * 25)
    (d / ".hidden.md").write_text("never ingested " * 100)
    (d / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    return d


@pytest.fixture
def config(tmp_path):
    return OriginConfig(store_dir=str(tmp_path / "store"), models=["tiny"], codecs=["raw"], fsync=False, namespace="acme")


@pytest.fixture
def executor(config, tiny_model):
    ex = LocalExecutor(PrefillWorker(config, "tiny", lm=tiny_model))
    yield ex
    ex.close()


def test_read_document_refuses_bad_files(tmp_path):
    cases = {
        "empty.txt": (b"", "empty file"),
        "blank.txt": (b"  \n\t\n", "only whitespace"),
        "bin.txt": (b"ELF\x00\x01\x02" * 10, "binary file"),
        "latin1.txt": ("café crème".encode("latin-1"), "not valid UTF-8"),
    }
    for name, (data, msg) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(InvalidInput, match=msg):
            read_document(tmp_path / name)
    (tmp_path / "ok.txt").write_text("héllo")
    text, digest = read_document(tmp_path / "ok.txt")
    assert text == "héllo" and len(digest) == 32


def test_discover_walks_text_files_and_reports_missing(docs, tmp_path):
    found = discover([docs, docs / "guide.md", tmp_path / "missing.txt"])
    names = sorted(s.path.name for s in found.sources)
    assert names == ["code.py", "guide.md"]  # no duplicate, hidden skipped, png ignored
    assert [p.message for p in found.problems] == ["path does not exist"]
    assert any(i.endswith("logo.png") for i in found.ignored)


def test_unknown_model_is_refused_up_front():
    with pytest.raises(UnknownModel, match="no-such-model"):
        check_model_spec("no-such-model")


def test_config_validates():
    with pytest.raises(ConfigError, match="codecs"):
        OriginConfig.build(codecs=["nope"])
    with pytest.raises(ConfigError, match="bogus"):
        OriginConfig.build(bogus=1)
    assert OriginConfig.build(workers=2).workers == 2


def test_bad_batch_reports_each_problem_and_the_rest_succeeds(docs, tmp_path, config, executor, tiny_model):
    (docs / "empty.txt").write_bytes(b"")
    (docs / "blob.txt").write_bytes(b"\x00\x01\x02binary")
    (docs / "latin.txt").write_bytes("naïve façade ".encode("latin-1") * 40)
    (docs / "long.txt").write_text("x" * (tiny_model.max_positions + 1000))
    s = ingest([docs, tmp_path / "nope"], config, executor=executor)
    by = {r.doc_id.rsplit("/", 1)[-1]: r for r in s.results}
    assert by["empty.txt"].status == "failed" and "empty" in by["empty.txt"].message
    assert by["blob.txt"].status == "failed" and "binary" in by["blob.txt"].message
    assert by["latin.txt"].status == "failed" and "UTF-8" in by["latin.txt"].message
    assert by["nope"].status == "failed" and "does not exist" in by["nope"].message
    assert by["long.txt"].status == "truncated" and "beyond the model window" in by["long.txt"].message
    assert by["long.txt"].n_chunks == tiny_model.max_positions // tiny_model.chunk_size
    assert by["guide.md"].status == "stored" and by["code.py"].status == "stored"
    assert s.failed == 4 and s.exit_code == 1
    text = s.render()
    for word in ("empty", "binary", "UTF-8", "does not exist", "beyond the model window"):
        assert word in text


def test_keys_match_the_inference_host_and_reingest_skips(docs, config, executor, tiny_model):
    s1 = ingest([docs], config, executor=executor)
    assert s1.exit_code == 0 and s1.computed_chunks > 0
    ns = Namespace("acme")
    store = OriginStore(config.store_path, verify="none")
    for r in s1.results:
        text = (docs / r.doc_id.split("/docs/", 1)[1]).read_text()
        toks = document_tokens(tiny_model, text)
        host = chunk_keys(toks, fingerprint=tiny_model.fingerprint, namespace=ns, chunk_size=tiny_model.chunk_size)
        assert [bytes.fromhex(k) for k in r.keys] == host
        for i, k in enumerate(host):
            art = decode_artifact(store.get(k, "raw", tenant="acme"), expect_key=k)
            assert art.header.chunk_index == i
    n_blobs = len(list(store.blobs.scan()))
    s2 = ingest([docs], config, executor=executor)
    assert s2.computed_chunks == 0 and s2.bytes_written == 0
    assert {r.status for r in s2.results} == {"skipped"}
    # drop one artifact: only that chunk is recomputed
    victim = bytes.fromhex(s1.results[0].keys[1])
    assert store.delete(victim, "raw")
    s3 = ingest([docs], config, executor=executor)
    assert s3.computed_chunks == 1
    assert len(list(store.blobs.scan())) == n_blobs
    store.close()


def test_a_huge_document_is_tokenized_only_up_to_the_window(tmp_path, config, executor, tiny_model, monkeypatch):
    """Issue 19 item 5: a 64 MB document costs the tokenizer (and memory) about a window, not GBs,
    and the chunks stored are those of the whole document's tokenization."""
    import tracemalloc

    line = "Reuse the KV cache of long contexts, chunk by chunk. "
    huge = tmp_path / "huge.txt"
    with open(huge, "w") as f:
        for _ in range(64):
            f.write(line * (1_000_000 // len(line) + 1))  # ~1 MB each
    seen: list[int] = []
    real = type(tiny_model.tokenizer).encode
    monkeypatch.setattr(type(tiny_model.tokenizer), "encode", lambda self, text: seen.append(len(text)) or real(self, text))
    tracemalloc.start()
    try:
        s = ingest([huge], config, executor=executor)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (r,) = s.results
    assert r.status == "truncated" and "beyond the model window" in r.message
    assert r.n_chunks == tiny_model.max_positions // tiny_model.chunk_size
    assert seen and max(seen) <= 1 << 20  # the tokenizer never saw more than 1 MiB of the 64 MB
    assert peak < 64 << 20, f"peak traced memory {peak / 2**20:.0f} MiB"
    head = huge.read_text()[: 2 * tiny_model.max_positions]
    whole = chunk_keys(real(tiny_model.tokenizer, head)[: tiny_model.max_positions], fingerprint=tiny_model.fingerprint,
                       namespace=Namespace("acme"), chunk_size=tiny_model.chunk_size)
    assert list(r.keys) == [bytes(k).hex() for k in whole]


def test_read_text_keeps_a_prefix_but_checks_and_hashes_the_whole_file(tmp_path):
    from kdn.origin.ingest.documents import read_text

    p = tmp_path / "doc.txt"
    p.write_bytes("é".encode() * 1000 + b"\xff")  # invalid UTF-8 far past the prefix
    with pytest.raises(InvalidInput, match="not valid UTF-8"):
        read_text(p, 10)
    p.write_text("é" * 1000)
    full, cut = read_text(p), read_text(p, 11)  # 11 bytes: the cut splits a 2-byte character
    assert full.complete and not cut.complete and cut.text == "é" * 5 and cut.digest == full.digest


def test_plain_summary_names_every_document_and_the_full_fingerprint(docs, config, executor):
    """Issue 17 item 1: the hint commands need the fingerprint and the ids; the plain summary has both."""
    s = ingest([docs], config, executor=executor)
    text = s.render()
    assert f"fingerprint {s.fingerprint}" in text and len(s.fingerprint) == 64
    for r in s.results:
        assert r.doc_id in text
