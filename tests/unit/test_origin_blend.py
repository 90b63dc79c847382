"""The store blends (kdn/origin/blend.py): documents held as segments are recognised in a prompt by
content, in an order never seen, blended at the origin and served as a blend variant whose KV is
the host-side blend's; plain keys never reach it; bad input is refused with a code and a counter.

In process, no sockets: ``OriginServer`` is built (it binds nothing until ``start``) and its
``blend``/``artifact_bytes`` are called directly, as the RPC handlers call them.
"""

from __future__ import annotations

import pytest
import torch

from kdn.artifact import decode_artifact
from kdn.blend import Deviation, Glue, blend, place, prefill_segment
from kdn.blend.verdict import Verdict, write_verdict
from kdn.errors import NotFound
from kdn.keys import DEFAULT_NAMESPACE, ROOT_KEY, ChunkKey, Namespace, chunk_keys
from kdn.origin.config import OriginConfig
from kdn.origin.segments import SegmentCatalog, ingest_segments, segment_tokens
from kdn.origin.server import OriginServer
from kdn.segments import Segment, encode_segment, segment_key

CHUNK = 32
DOCS = {name: f"Document {name}: " + " ".join(f"{name}{i} fact {i * 7 % 13}" for i in range(9)) + ".\n"
        for name in ("alpha", "bravo", "charlie", "delta")}


@pytest.fixture()
def origin(tmp_path, monkeypatch):
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    cfg = OriginConfig(store_dir=str(tmp_path / "store"), models=["tiny"], chunk_size=CHUNK, codecs=["raw"],
                       listen="127.0.0.1:0", fsync=False)
    srv = OriginServer(cfg)
    try:
        yield srv
    finally:
        srv.close()


def _pass(srv, ratio=0.5, passed=True) -> None:
    lm = srv.model()
    write_verdict(Verdict(bytes(lm.fingerprint).hex(), passed, ratio, 1, reason="test verdict"))


def _ingest(srv, names) -> dict[str, list[int]]:
    lm = srv.model()
    ingest_segments(lm, srv.store, [(n, DOCS[n]) for n in names], namespace=DEFAULT_NAMESPACE,
                    catalog=srv.segment_catalog)
    return {n: segment_tokens(lm, DOCS[n]) for n in names}


def _prompt(srv, toks, order, glue="\n") -> tuple[list[int], list[tuple[int, int]]]:
    enc = srv.model().tokenizer.encode
    prompt = enc("System: answer from the documents.\n")
    spans = []
    for i, name in enumerate(order):
        if i:
            prompt += enc(glue)
        spans.append((len(prompt), len(prompt) + len(toks[name])))
        prompt += toks[name]
    return prompt + enc("\nQuestion: what is bravo3?"), spans


def _host_blend(srv, prompt, spans, ratio):
    """The inference host's blend of the same layout (kdn.blend): the reference for the store's."""
    lm = srv.model()
    parts, pos = [], spans[0][0]
    for s, e in spans:
        if s > pos:
            parts.append(Glue(tuple(prompt[pos:s])))
        toks = prompt[s:e]
        key = segment_key(toks, fingerprint=lm.fingerprint, namespace=DEFAULT_NAMESPACE)
        parts.append(Segment(key, tuple(toks), prefill_segment(lm.model, toks)))
        pos = e
    pre = prompt[:spans[0][0]]
    layout = place(lm.model, parts, prefix_tokens=pre, prefix_kv=prefill_segment(lm.model, pre))
    cache, _ = blend(lm.model, layout, Deviation(ratio, 1))
    return torch.stack([torch.stack((l.keys[0], l.values[0])) for l in cache.layers])  # (L, 2, H, N, D)


def test_documents_in_an_order_never_seen_are_found_by_content_and_blended_as_the_host_does(origin) -> None:
    _pass(origin)
    toks = _ingest(origin, ["alpha", "bravo", "charlie"])
    prompt, spans = _prompt(origin, toks, ["charlie", "alpha", "bravo"])
    resp = origin.blend(origin.default_fingerprint, torch.tensor(prompt).numpy(), DEFAULT_NAMESPACE)
    assert not resp.refused and resp.documents == 3 and not resp.cached
    assert resp.covered_tokens == len(resp.keys) * CHUNK and resp.covered_tokens <= spans[-1][1]
    want = _host_blend(origin, prompt, spans, 0.5)
    lm = origin.model()
    for i, key in enumerate(resp.keys):
        art = decode_artifact(origin.artifact_bytes(ChunkKey(key), DEFAULT_NAMESPACE, lm.fingerprint, "", True))
        assert torch.allclose(art.kv, want[:, :, :, i * CHUNK:(i + 1) * CHUNK], atol=1e-5), i
    # a variant is keyed apart from plain KV: a client that did not ask computes plain keys, which
    # the origin holds nothing under, and the variant never enters the durable store
    plain = chunk_keys(prompt, fingerprint=lm.fingerprint, namespace=DEFAULT_NAMESPACE, chunk_size=CHUNK)
    assert not set(map(bytes, plain)) & set(resp.keys)
    with pytest.raises(NotFound):
        origin.artifact_bytes(plain[0], DEFAULT_NAMESPACE, lm.fingerprint, "", True)
    assert not origin.store.variants(ChunkKey(resp.keys[0]), tenant="default")
    # another tenant cannot fetch the variant, and a repeat is served from memory
    with pytest.raises(NotFound):
        origin.artifact_bytes(ChunkKey(resp.keys[0]), Namespace("other"), lm.fingerprint, "", True)
    again = origin.blend(origin.default_fingerprint, torch.tensor(prompt).numpy(), DEFAULT_NAMESPACE)
    assert again.cached and list(again.keys) == list(resp.keys)


def test_another_order_or_policy_is_another_variant(origin) -> None:
    _pass(origin)
    toks = _ingest(origin, ["alpha", "bravo"])
    a, _ = _prompt(origin, toks, ["alpha", "bravo"])
    b, _ = _prompt(origin, toks, ["bravo", "alpha"])
    ka = origin.blend(origin.default_fingerprint, torch.tensor(a).numpy(), DEFAULT_NAMESPACE).keys
    kb = origin.blend(origin.default_fingerprint, torch.tensor(b).numpy(), DEFAULT_NAMESPACE).keys
    _pass(origin, ratio=0.25)
    kc = origin.blend(origin.default_fingerprint, torch.tensor(a).numpy(), DEFAULT_NAMESPACE).keys
    assert ka and kb and kc and ka[0] != kb[0] and ka[0] != kc[0]


@pytest.mark.parametrize("case", ["no_verdict", "verdict_failed", "no_segments", "segment_corrupt",
                                  "segment_fingerprint"])
def test_bad_input_is_refused_with_a_code_and_a_counter(origin, case) -> None:
    if case != "no_verdict":
        _pass(origin, passed=case != "verdict_failed")
    toks = _ingest(origin, ["alpha", "bravo"] if case != "no_segments" else [])
    if case == "no_segments":
        toks = {n: segment_tokens(origin.model(), DOCS[n]) for n in ("alpha", "bravo")}
    lm = origin.model()
    key = segment_key(toks.get("alpha", [1] * 20), fingerprint=lm.fingerprint, namespace=DEFAULT_NAMESPACE)
    if case == "segment_corrupt":
        path = next((origin.store.root / "blobs").rglob(f"{bytes(key).hex()}.*"))
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    if case == "segment_fingerprint":  # a segment of another model stored under this one's key
        other = ChunkKey(bytes(32))
        seg = Segment(key, tuple(toks["alpha"]), prefill_segment(lm.model, toks["alpha"]))
        origin.store.delete(ChunkKey(key), "raw")
        origin.store.put(encode_segment(seg, fingerprint=other), tenant="default")
    prompt, _ = _prompt(origin, toks, ["bravo", "alpha"])
    resp = origin.blend(origin.default_fingerprint, torch.tensor(prompt).numpy(), DEFAULT_NAMESPACE)
    assert resp.refused == case and not resp.keys and resp.reason
    counters = {k: v for k, v in origin.stats().counters.items()}
    assert counters[f"blend_refused_{case}"] == 1


def test_named_document_spans_are_computed_on_demand_and_then_found_by_content(origin) -> None:
    _pass(origin)
    lm = origin.model()
    toks = {n: segment_tokens(lm, DOCS[n]) for n in ("charlie", "delta")}
    prompt, spans = _prompt(origin, toks, ["delta", "charlie"])
    resp = origin.blend(origin.default_fingerprint, torch.tensor(prompt).numpy(), DEFAULT_NAMESPACE, spans)
    assert not resp.refused and resp.documents == 2
    assert origin.stats().counters["blend_segments_computed"] == 2
    assert SegmentCatalog(origin.store.root).count("default", lm.fingerprint) == 2
    by_content = origin.blend(origin.default_fingerprint, torch.tensor(prompt).numpy(), DEFAULT_NAMESPACE)
    assert by_content.documents == 2 and list(by_content.keys) == list(resp.keys)
    bad = origin.blend(origin.default_fingerprint, torch.tensor(prompt).numpy(), DEFAULT_NAMESPACE, [(5, 3)])
    assert bad.refused == "bad_documents"


def test_blend_keys_chain_from_the_variant_root_not_the_plain_root(origin) -> None:
    _pass(origin)
    toks = _ingest(origin, ["alpha", "bravo"])
    prompt, _ = _prompt(origin, toks, ["alpha", "bravo"])
    resp = origin.blend(origin.default_fingerprint, torch.tensor(prompt).numpy(), DEFAULT_NAMESPACE)
    root = ChunkKey(bytes.fromhex(resp.variant))
    lm = origin.model()
    assert root != ROOT_KEY
    assert [bytes(k) for k in chunk_keys(prompt[:resp.covered_tokens], fingerprint=lm.fingerprint,
                                         namespace=DEFAULT_NAMESPACE, chunk_size=CHUNK, root=root)] == list(resp.keys)


def test_kdn_ingest_segments_stores_and_catalogues_each_document_once(tmp_path, capsys) -> None:
    import json

    from kdn.models import load_model
    from kdn.origin.cli import main_ingest

    for name in ("alpha", "bravo"):
        (tmp_path / f"{name}.txt").write_text(DOCS[name])
    argv = [str(tmp_path / "alpha.txt"), str(tmp_path / "bravo.txt"), "--model", "tiny", "--workers", "0",
            "--chunk-size", str(CHUNK), "--codec", "raw", "--store", str(tmp_path / "store"), "--segments",
            "--no-progress", "--json"]
    assert main_ingest(argv) == 0
    first = json.loads(capsys.readouterr().out)["results"]
    assert all(r["segment_key"] and r["segment_tokens"] for r in first)
    assert main_ingest(argv) == 0
    again = json.loads(capsys.readouterr().out)["results"]
    assert [r["status"] for r in again] == ["skipped", "skipped"]
    assert sorted(r["segment_key"] for r in again) == sorted(r["segment_key"] for r in first)
    lm = load_model("tiny", chunk_size=CHUNK)
    cat = SegmentCatalog(tmp_path / "store")
    try:
        assert cat.count("default", lm.fingerprint) == 2
        prompt = lm.tokenizer.encode("Q: ") + segment_tokens(lm, DOCS["bravo"]) + segment_tokens(lm, DOCS["alpha"])
        found = cat.match(prompt, fingerprint=lm.fingerprint, namespace=DEFAULT_NAMESPACE)
        assert [bytes(m.key).hex() for m in found] == [r["segment_key"] for r in sorted(first, key=lambda r: "alpha" in r["doc_id"])]
    finally:
        cat.close()
