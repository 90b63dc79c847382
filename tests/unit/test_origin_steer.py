"""``kdn ingest --emphasize``: the origin stores a steered variant beside the plain chain, under its
own keys, each header naming its spec; bad emphasis is refused with one line (issue 14)."""

from __future__ import annotations

import json

import pytest
import torch

from kdn.artifact import decode_artifact
from kdn.client import ClientConfig
from kdn.keys import DEFAULT_NAMESPACE, PIECE_TOKENS, chunk_keys, piece_keys
from kdn.kv import build_cache, forward, layers_to_chunk
from kdn.models import load_model
from kdn.origin.cli import main_ingest
from kdn.origin.steer import Emphasis
from kdn.origin.store import OriginStore
from kdn.steer import SteerSpec, parse_variant
from kdn.steer.methods import KeyEditCalibration, write_calibration

CHUNK = 64
TEXT = "".join(f"{'POLICY: keep the cache warm' if i % 5 == 2 else 'filler text of no interest'} {i}\n" for i in range(12))


def _ingest(tmp_path, *extra: str) -> tuple[int, dict]:
    doc = tmp_path / "doc.md"
    doc.write_text(TEXT)
    code = main_ingest([str(doc), "--model", "tiny", "--codec", "raw", "--workers", "0", "--no-progress",
                        "--chunk-size", str(CHUNK), "--store", str(tmp_path / "store"), "--json", *extra])
    return code, doc


def _out(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_re_read_variant_is_stored_beside_the_plain_chain_under_its_own_keys(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    code, _ = _ingest(tmp_path)
    assert code == 0
    plain_only = _out(capsys)["results"][0]
    code, _ = _ingest(tmp_path, "--emphasize", "re-read", "--emphasize-regex", "^POLICY")
    assert code == 0
    r = _out(capsys)["results"][0]
    assert r["status"] == "stored" and r["steer_variant"] and r["steer_keys"] == r["keys"] == plain_only["keys"]
    spec = SteerSpec.from_canonical(r["steer"])
    assert spec.method == "re-read" and len(spec.marks) >= 2  # two POLICY lines inside the stored chunks
    lm = load_model("tiny", chunk_size=CHUNK)
    toks = lm.tokenizer.encode(TEXT)
    assert lm.tokenizer.decode(toks[spec.marks[0][0] : spec.marks[0][1]]).startswith("POLICY")
    store = OriginStore(tmp_path / "store")
    try:
        rec = store.document("default", lm.fingerprint, str(tmp_path / "doc.md") + "#steer") or next(
            d for d in store.documents() if d.doc_id.endswith("#steer"))
        plain_keys = chunk_keys(toks, fingerprint=lm.fingerprint, namespace=DEFAULT_NAMESPACE, chunk_size=CHUNK)
        client_keys = chunk_keys(toks, fingerprint=lm.fingerprint, namespace=DEFAULT_NAMESPACE, chunk_size=CHUNK,
                                 root=parse_variant(ClientConfig(edge="mem", steer=r["steer_variant"]).steer))
        # the variant's chunks, then its tail pieces: under the chain a client naming the variant computes
        n = r["steer_keys"]
        client_pieces = piece_keys(toks[n * CHUNK :], after=client_keys[n - 1], fingerprint=lm.fingerprint,
                                   namespace=DEFAULT_NAMESPACE, chunk_size=CHUNK)
        assert n == len(toks) // CHUNK and r["steer_pieces"] == len(client_pieces) == (len(toks) % CHUNK) // PIECE_TOKENS >= 1
        assert list(rec.keys) == client_keys[:n] + client_pieces and not set(rec.keys) & set(plain_keys)
        for k in rec.keys:
            art = decode_artifact(store.get(k, "raw", tenant="default"))
            assert SteerSpec.from_canonical(art.header.steer) == spec  # method and marks in the header
        for k in plain_keys[:n]:
            assert decode_artifact(store.get(k, "raw", tenant="default")).header.steer == ""
    finally:
        store.close()


def test_key_edit_needs_a_calibration_then_uses_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    code, _ = _ingest(tmp_path, "--emphasize", "key-edit", "--emphasize-regex", "POLICY")
    assert code == 1
    r = _out(capsys)["results"][0]
    assert r["status"] == "failed" and "no key-edit calibration" in r["message"] and "plain KV stored" in r["message"]
    lm = load_model("tiny", chunk_size=CHUNK)
    D = lm.kv_shape.head_dim
    cal = KeyEditCalibration(bytes(lm.fingerprint).hex(), ((1, 0),), torch.ones(1, D) / D, 2.5)
    write_calibration(cal)
    code, _ = _ingest(tmp_path, "--emphasize", "key-edit", "--emphasize-spans", "3:20,40:50")
    assert code == 0
    r = _out(capsys)["results"][0]
    spec = SteerSpec.from_canonical(r["steer"])
    assert (spec.method, spec.marks, spec.strength, spec.calibration) == ("key-edit", ((3, 20), (40, 50)), 2.5, cal.digest)


@pytest.mark.parametrize("args, message", [
    (["--emphasize", "boost"], "unknown --emphasize method"),
    (["--emphasize", "key-edit", "--emphasize-regex", "(["], "bad --emphasize regex"),
    (["--emphasize", "key-edit", "--emphasize-regex", "x", "--emphasize-strength", "9"], "must be in (0, 8]"),
    (["--emphasize", "key-edit", "--emphasize-regex", "x", "--emphasize-strength", "0"], "must be in (0, 8]"),
    (["--emphasize", "key-edit"], "key-edit needs marks"),
    (["--emphasize", "re-read", "--emphasize-strength", "2"], "re-read takes no"),
    (["--emphasize", "re-read", "--emphasize-spans", "5-9"], "bad --emphasize-spans item"),
    (["--emphasize", "re-read", "--emphasize-spans", "9:5"], "empty or negative"),
    (["--emphasize-regex", "x"], "need --emphasize METHOD"),
    (["--emphasize", "re-read", "--emphasize-regex", "x", "--emphasize-spans", "1:2"], "exclude each other"),
])
def test_bad_emphasis_is_one_clear_error_before_any_work(tmp_path, capsys, args, message):
    code, _ = _ingest(tmp_path, *args)
    assert code == 2
    err = _out(capsys)
    assert message in err["message"], err
    assert not (tmp_path / "store").exists()  # nothing was made


def test_marks_out_of_range_or_matching_nothing_fail_that_document_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    n_doc = len(TEXT.encode())  # tiny's byte tokens: one per byte, no BOS
    # a span past the document's end, even beside a good one: one clear error naming it, no variant
    code, _ = _ingest(tmp_path, "--emphasize", "re-read", "--emphasize-spans", f"0:8,{n_doc - 4}:{n_doc + 6}")
    assert code == 1
    r = _out(capsys)["results"][0]
    assert r["status"] == "failed" and f"[{n_doc - 4}, {n_doc + 6}) lies outside the document" in r["message"]
    assert f"has {n_doc} tokens" in r["message"]
    assert r["keys"] > 0 and not r["steer_variant"]  # the plain chain is stored, no variant
    # inside the document but only in its partial tail (recomputed plain at reuse): nothing to steer
    full = n_doc // CHUNK * CHUNK
    code, _ = _ingest(tmp_path, "--emphasize", "re-read", "--emphasize-spans", f"{full + 1}:{n_doc}")
    assert code == 1
    r = _out(capsys)["results"][0]
    assert r["status"] == "failed" and "past the document's stored chunks" in r["message"]
    code, _ = _ingest(tmp_path, "--emphasize", "re-read", "--emphasize-regex", "^NOTHING")
    assert code == 1 and "matches no line" in _out(capsys)["results"][0]["message"]


def test_emphasis_round_trips():
    em = Emphasis("key-edit", spans=((5, 9), (0, 3)), strength=1.5)
    assert Emphasis.from_json(em.to_json()) == em and em.spans == ((0, 3), (5, 9))
    assert Emphasis.parse_spans("0:3, 5:9") == ((0, 3), (5, 9))


def test_an_ingested_variant_is_reused_only_by_a_client_that_names_it(tmp_path, capsys, monkeypatch):
    """Origin (kdn ingest --emphasize) -> edge (bytes by key) -> the transformers integration."""
    from kdn.client import KdnClient
    from kdn.testing import MemoryEdgeTransport
    from kdn.integrations.transformers import generate

    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    code, _ = _ingest(tmp_path, "--emphasize", "re-read")
    assert code == 0
    r = _out(capsys)["results"][0]
    edge = MemoryEdgeTransport()
    store = OriginStore(tmp_path / "store")
    try:
        rec = next(d for d in store.documents() if d.doc_id.endswith("#steer"))
        assert len(rec.keys) == r["steer_keys"] + r["steer_pieces"] and r["steer_keys"] > 0 and r["steer_pieces"] > 0
        for key in rec.keys:  # only the steered chain goes to the edge
            edge.store[("default", bytes(key))] = store.get(key, "raw", tenant="default")
    finally:
        store.close()
    lm = load_model("tiny", chunk_size=CHUNK)
    tokens = lm.tokenizer.encode(TEXT) + lm.tokenizer.encode(" Q?")
    with KdnClient(ClientConfig(edge="mem"), transport=edge) as plain:
        got = generate(lm, tokens, client=plain, max_new_tokens=1)
        assert got.reused_tokens == 0  # the default never gets a variant
        plain.flush(5)
    puts = edge.calls.get("put", 0)  # the plain client wrote plain KV back under plain keys: fine
    with KdnClient(ClientConfig(edge="mem", steer=r["steer_variant"]), transport=edge) as steered:
        got = generate(lm, tokens, client=steered, max_new_tokens=1)
        steered.flush(5)
    assert got.reused_tokens == r["steer_keys"] * CHUNK + r["steer_pieces"] * PIECE_TOKENS  # chunks and tail pieces
    assert edge.calls.get("put", 0) == puts  # the steered client wrote nothing back


def test_a_steered_hit_with_the_stored_tail_answers_as_one_that_reads_the_tail_itself(tmp_path, capsys, monkeypatch):
    """The variant's tail pieces are the tail read on top of the steered chunks: a client that
    reuses them gets the tokens of a client that finds only the chunks and prefills the tail."""
    from kdn.client import KdnClient
    from kdn.integrations.transformers import generate
    from kdn.testing import MemoryEdgeTransport

    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    lm = load_model("tiny", chunk_size=CHUNK)
    D = lm.kv_shape.head_dim  # a strong edit in layer 0, so the tail's layer-1 KV depends on it
    write_calibration(KeyEditCalibration(bytes(lm.fingerprint).hex(), ((0, 0), (0, 1)), torch.ones(2, D) / D ** 0.5, 8.0))
    code, _ = _ingest(tmp_path, "--emphasize", "key-edit", "--emphasize-regex", "^POLICY")
    assert code == 0
    r = _out(capsys)["results"][0]
    whole, chunks_only = MemoryEdgeTransport(), MemoryEdgeTransport()
    store = OriginStore(tmp_path / "store")
    try:
        rec = next(d for d in store.documents() if d.doc_id.endswith("#steer"))
        for i, key in enumerate(rec.keys):
            blob = store.get(key, "raw", tenant="default")
            whole.store[("default", bytes(key))] = blob
            if i < r["steer_keys"]:
                chunks_only.store[("default", bytes(key))] = blob
    finally:
        store.close()
    tokens = lm.tokenizer.encode(TEXT) + lm.tokenizer.encode(" Which POLICY?")
    got = {}
    for name, edge in (("whole", whole), ("chunks", chunks_only)):
        with KdnClient(ClientConfig(edge="mem", steer=r["steer_variant"]), transport=edge) as client:
            got[name] = generate(lm, tokens, client=client, max_new_tokens=12)
    assert got["whole"].reused_tokens == got["chunks"].reused_tokens + r["steer_pieces"] * PIECE_TOKENS
    assert got["whole"].tokens == got["chunks"].tokens
    # and the pieces hold the tail as read after the *steered* chunks: not the plain tail's KV
    n, C = r["steer_keys"], CHUNK
    steered = [decode_artifact(whole.store[("default", bytes(k))]).kv for k in rec.keys]
    toks = lm.tokenizer.encode(TEXT)
    cache = build_cache(steered[:n], lm.config)
    with torch.inference_mode():
        forward(lm.model, input_ids=torch.tensor([toks[n * C : n * C + PIECE_TOKENS]]), cache=cache, use_cache=True)
    mine = layers_to_chunk([(layer.keys, layer.values) for layer in cache.layers], n * C, n * C + PIECE_TOKENS)
    torch.testing.assert_close(steered[n], mine, rtol=1e-4, atol=1e-5)
    plain_store = OriginStore(tmp_path / "store")
    try:
        plain_rec = next(d for d in plain_store.documents() if not d.doc_id.endswith("#steer"))
        plain_piece = decode_artifact(plain_store.get(plain_rec.keys[n], "raw", tenant="default")).kv
    finally:
        plain_store.close()
    assert (plain_piece - steered[n]).abs().max() > 1e-3


def test_hints_reach_the_variant_by_document_name(tmp_path, capsys, monkeypatch):
    """Pin / TTL / prefetch resolve a document by name at the origin: ``<doc>#steer`` names the
    variant's chain, and the plain name still names only the plain chain."""
    from kdn.origin.ingest.documents import document_matches

    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    code, _ = _ingest(tmp_path, "--emphasize", "re-read")
    assert code == 0
    lm = load_model("tiny", chunk_size=CHUNK)
    store = OriginStore(tmp_path / "store")
    try:
        ids = store.document_ids("default", lm.fingerprint)
        (steer_id,) = document_matches("doc.md#steer", ids)
        (plain_id,) = document_matches("doc.md", ids)
        steered = store.document("default", lm.fingerprint, steer_id).keys
        plain = store.document("default", lm.fingerprint, plain_id).keys
        assert steered and plain and not set(steered) & set(plain)
    finally:
        store.close()


def test_task_and_result_carry_the_emphasis_across_processes_as_plain_data():
    from kdn.origin.worker import DocumentResult, DocumentTask

    em = Emphasis("re-read", regex="^POLICY").to_json()
    t = DocumentTask("d", "text", "h", "default", emphasize=em)
    assert DocumentTask(**t.to_dict()) == t
    r = DocumentResult("d", "stored", steer='{"v":1}', steer_variant="ab" * 32, steer_keys=("cd" * 32,))
    assert DocumentResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r
