"""Adversarial probes of the store's blend (kdn/origin/blend.py, kdn/origin/segments.py, the origin's
``Blend``, and the vLLM connector's blend requests): bad spans, other tenants' segments and
variants, corrupt or foreign segments, malformed verdicts, variants that cannot be held whole,
glue that changes a variant's KV, lossy variants, documents past the model's window, malformed
``kdn_documents`` and a silent origin. Every one must end in a refusal (a code and a counter) or
an error the client turns into a plain prefill — never in wrong or another tenant's KV.

In process like tests/unit/test_origin_blend.py: ``OriginServer`` is built and its ``blend`` /
``artifact_bytes`` are called as the RPC handlers call them; the client side runs BlendRequests
over a stand-in store that encodes requests as the real one does. No sockets (the gRPC path is
tests/integration/test_store_blend.py's).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kdn.artifact import decode_artifact, read_header
from kdn.blend.verdict import Verdict, verdict_path
from kdn.errors import InvalidInput, LossyRefused, NotFound
from kdn.keys import DEFAULT_NAMESPACE, ChunkKey, Namespace
from kdn.origin.blend import check_spans
from kdn.origin.config import OriginConfig
from kdn.origin.segments import SegmentCatalog, ingest_segments, segment_tokens
from kdn.origin.server import OriginServer
from kdn.segments import segment_key

from tests.unit.test_origin_blend import CHUNK, DOCS, _host_blend, _ingest, _pass, _prompt
from tests.unit.test_vllm_blend_requests import Loop as _Loop

A, B = Namespace("tenant-a"), Namespace("tenant-b")


def _origin(tmp_path, monkeypatch, **over) -> OriginServer:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    cfg = OriginConfig(store_dir=str(tmp_path / "store"), models=["tiny"], chunk_size=CHUNK, codecs=["raw"],
                       listen="127.0.0.1:0", fsync=False, **over)
    return OriginServer(cfg)


@pytest.fixture()
def origin(tmp_path, monkeypatch):
    srv = _origin(tmp_path, monkeypatch)
    try:
        yield srv
    finally:
        srv.close()


def _blend(srv, prompt, ns=DEFAULT_NAMESPACE, spans=None, codec=""):
    return srv.blend(srv.default_fingerprint, np.asarray(prompt, dtype=np.int64), ns, spans, codec)


def _counters(srv) -> dict[str, float]:
    return dict(srv.stats().counters)


def _fetch(srv, key, ns=DEFAULT_NAMESPACE, require_lossless=True):
    return srv.artifact_bytes(ChunkKey(bytes(key)), ns, srv.model().fingerprint, "", require_lossless)


def _ingest_ns(srv, names, ns) -> dict[str, list[int]]:
    lm = srv.model()
    ingest_segments(lm, srv.store, [(n, DOCS[n]) for n in names], namespace=ns, catalog=srv.segment_catalog)
    return {n: segment_tokens(lm, DOCS[n]) for n in names}


def _segments_stored(srv) -> int:
    return len(list((srv.store.root / "blobs").rglob("*.*"))) if (srv.store.root / "blobs").exists() else 0


# -- document spans ----------------------------------------------------------------------------------


def _bad_spans(n: int, s0: int) -> dict[str, list[tuple[int, int]]]:
    return {
        "overlap": [(s0, s0 + 40), (s0 + 20, s0 + 60)],
        "unsorted": [(s0 + 50, s0 + 90), (s0, s0 + 40)],
        "negative": [(-5, 30)],
        "past_end": [(s0, n + 10)],
        "zero_length": [(s0, s0)],
        "reversed": [(s0 + 40, s0)],
        "shorter_than_anchor": [(s0, s0 + 15)],
        "huge_count": [(i, i + 1) for i in range(0, 100_000, 1)],
        "duplicate": [(s0, s0 + 40), (s0, s0 + 40)],
    }


@pytest.mark.parametrize("case", list(_bad_spans(100, 10)))
def test_bad_document_spans_are_refused_before_anything_is_computed_or_stored(origin, case) -> None:
    _pass(origin)
    lm = origin.model()
    toks = {n: segment_tokens(lm, DOCS[n]) for n in ("alpha", "bravo")}
    prompt, spans = _prompt(origin, toks, ["alpha", "bravo"])
    bad = _bad_spans(len(prompt), spans[0][0])[case]
    before = _segments_stored(origin)
    t0 = time.perf_counter()
    resp = _blend(origin, prompt, spans=bad)
    assert time.perf_counter() - t0 < 5.0
    assert resp.refused == "bad_documents" and not resp.keys and resp.reason
    assert _counters(origin)["blend_refused_bad_documents"] == 1
    assert _segments_stored(origin) == before  # no segment computed for a refused request
    assert SegmentCatalog(origin.store.root).count("default", lm.fingerprint) == 0


def test_spans_on_the_wire_come_in_pairs() -> None:
    with pytest.raises(InvalidInput):
        check_spans([1, 2, 3])
    assert check_spans([]) == [] and check_spans([3, 40]) == [(3, 40)]


# -- tenants ---------------------------------------------------------------------------------------


def test_another_tenants_segments_are_never_found_by_content(origin) -> None:
    _pass(origin)
    toks = _ingest_ns(origin, ["alpha", "bravo"], A)
    prompt, _ = _prompt(origin, toks, ["bravo", "alpha"])
    assert not _blend(origin, prompt, A).refused
    for other in (B, Namespace("tenant-a", "other-salt"), DEFAULT_NAMESPACE):
        resp = _blend(origin, prompt, other)
        assert resp.refused == "no_segments" and not resp.keys, other


def test_another_tenants_segments_are_never_read_for_named_spans(origin) -> None:
    _pass(origin)
    toks = _ingest_ns(origin, ["alpha", "bravo"], A)
    prompt, spans = _prompt(origin, toks, ["bravo", "alpha"])
    ra = _blend(origin, prompt, A, spans)
    assert not ra.refused and _counters(origin).get("blend_segments_computed", 0) == 0
    rb = _blend(origin, prompt, B, spans)
    assert not rb.refused
    # B's documents were computed for B (its own segments), not read from A's
    assert _counters(origin)["blend_segments_computed"] == 2
    lm = origin.model()
    assert SegmentCatalog(origin.store.root).count("tenant-b", lm.fingerprint) == 2
    assert not set(ra.keys) & set(rb.keys)


def test_another_tenants_variant_and_segments_are_not_fetchable_by_key(origin) -> None:
    _pass(origin)
    toks = _ingest_ns(origin, ["alpha", "bravo"], A)
    prompt, spans = _prompt(origin, toks, ["alpha", "bravo"])
    ra = _blend(origin, prompt, A)
    assert ra.keys
    _fetch(origin, ra.keys[0], A)
    seg = segment_key(toks["alpha"], fingerprint=origin.model().fingerprint, namespace=A)
    for ns in (B, Namespace("tenant-b", A.salt)):
        for key in (ra.keys[0], bytes(seg)):
            with pytest.raises(NotFound):
                _fetch(origin, key, ns)
    assert not origin.blends.holds("tenant-b", [ChunkKey(k) for k in ra.keys])


# -- stored segments gone bad --------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["truncated", "chain_chunk", "blob_deleted", "lossy_only"])
def test_a_bad_stored_segment_refuses_the_whole_request(origin, case) -> None:
    from kdn.artifact import encode_artifact

    _pass(origin)
    toks = _ingest(origin, ["alpha", "bravo"])
    lm = origin.model()
    key = segment_key(toks["alpha"], fingerprint=lm.fingerprint, namespace=DEFAULT_NAMESPACE)
    path = next((origin.store.root / "blobs").rglob(f"{bytes(key).hex()}.*"))
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif case == "chain_chunk":  # a plain chunk (not a segment) under the segment's key
        origin.store.delete(ChunkKey(key), "raw")
        shape = lm.kv_shape
        kv = torch.zeros(shape.num_layers, 2, shape.num_kv_heads, len(toks["alpha"]), shape.head_dim,
                         dtype=shape.dtype)
        origin.store.put(encode_artifact(kv, key=ChunkKey(key), parent_key=ChunkKey(bytes(32)),
                                         fingerprint=lm.fingerprint, codec="raw"), tenant="default")
    elif case == "blob_deleted":
        origin.store.delete(ChunkKey(key), "raw")
    elif case == "lossy_only":
        from kdn.blend import prefill_segment
        from kdn.segments import Segment, encode_segment

        origin.store.delete(ChunkKey(key), "raw")
        seg = Segment(key, tuple(toks["alpha"]), prefill_segment(lm.model, toks["alpha"]))
        origin.store.put(encode_segment(seg, fingerprint=lm.fingerprint, codec="int8"), tenant="default")
    prompt, _ = _prompt(origin, toks, ["bravo", "alpha"])
    resp = _blend(origin, prompt)
    want = {"truncated": "segment_corrupt", "chain_chunk": "segment_corrupt", "blob_deleted": "segment_missing",
            "lossy_only": "segment_missing"}[case]
    assert resp.refused == want and not resp.keys
    assert _counters(origin)[f"blend_refused_{want}"] == 1
    assert len(origin.blends) == 0  # nothing half-made is held


# -- the verdict -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["not_json", "a_list", "other_model", "missing_fields", "passed_as_string",
                                  "ratio_out_of_range", "ratio_not_a_number", "ratio_nan", "negative_check_layer",
                                  "check_layer_as_string"])
def test_a_malformed_verdict_is_a_refusal_not_an_error_or_a_blend(origin, case) -> None:
    toks = _ingest(origin, ["alpha", "bravo"])
    prompt, _ = _prompt(origin, toks, ["bravo", "alpha"])
    fp = bytes(origin.model().fingerprint).hex()
    good = Verdict(fp, True, 0.5, 1, reason="test").as_dict()
    path = verdict_path(origin.model().fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "not_json": "{passed: true",
        "a_list": json.dumps([good]),
        "other_model": json.dumps({**good, "fingerprint": "00" * 32}),
        "missing_fields": json.dumps({"fingerprint": fp}),
        "passed_as_string": json.dumps({**good, "passed": "false"}),
        "ratio_out_of_range": json.dumps({**good, "ratio": 2.5}),
        "ratio_not_a_number": json.dumps({**good, "ratio": "half"}),
        "ratio_nan": json.dumps({**good, "ratio": math.nan}),
        "negative_check_layer": json.dumps({**good, "check_layer": -1}),
        "check_layer_as_string": json.dumps({**good, "check_layer": "one"}),
    }[case]
    path.write_text(body)
    resp = _blend(origin, prompt)  # never raises
    assert resp.refused == "no_verdict" and not resp.keys and resp.reason
    assert _counters(origin)["blend_refused_no_verdict"] == 1


def test_a_verdict_that_failed_later_stops_serving_the_held_variant(origin) -> None:
    _pass(origin)
    toks = _ingest(origin, ["alpha", "bravo"])
    prompt, _ = _prompt(origin, toks, ["bravo", "alpha"])
    assert _blend(origin, prompt).keys
    _pass(origin, passed=False)
    resp = _blend(origin, prompt)
    assert resp.refused == "verdict_failed" and not resp.keys


# -- what a variant's keys name -----------------------------------------------------------------------


def test_glue_past_the_covered_chunks_is_part_of_the_variant_name(origin) -> None:
    """Two prompts alike up to the variant's last whole chunk but with other glue between that
    chunk and the last document blend differently (the deviation check ranks every document token
    of the blended region together), so they must not share keys: else the second is served the
    first's KV from memory."""
    _pass(origin)
    lm = origin.model()
    enc = lm.tokenizer.encode
    pre = enc("System: use the documents.\n")
    doc_a = segment_tokens(lm, DOCS["alpha"])
    doc_b = enc("Bravo note: ab cd ef gh.")  # short: it ends inside the chunk after the covered ones
    assert 16 <= len(doc_b) < 28
    a_end = len(pre) + len(doc_a)
    cut = -(-a_end // CHUNK) * CHUNK  # the first chunk boundary after document A
    lead = enc("x" * (cut - a_end))  # glue before the boundary: the same in both prompts

    def prompt(tail: str):
        glue = lead + enc(tail)
        b0 = a_end + len(glue)
        toks = pre + doc_a + glue + doc_b + enc(" Question?")
        return toks, [(len(pre), a_end), (b0, b0 + len(doc_b))]

    p1, s1 = prompt(" // ")
    p2, s2 = prompt(" ZQ ")
    assert p1[:cut] == p2[:cut] and p1 != p2 and s1 == s2
    r1, r2 = _blend(origin, p1, spans=s1), _blend(origin, p2, spans=s2)
    assert r1.covered_tokens == r2.covered_tokens == cut
    assert not r2.cached and set(r1.keys).isdisjoint(r2.keys)
    want = _host_blend(origin, p2, s2, 0.5)
    for i, key in enumerate(r2.keys):
        art = decode_artifact(_fetch(origin, key))
        assert torch.allclose(art.kv, want[:, :, :, i * CHUNK:(i + 1) * CHUNK], atol=1e-5), i


def test_a_variant_held_in_a_lossy_codec_is_not_served_to_a_lossless_request(origin) -> None:
    _pass(origin)
    toks = _ingest(origin, ["alpha", "bravo"])
    prompt, _ = _prompt(origin, toks, ["bravo", "alpha"])
    lossy = _blend(origin, prompt, codec="int8")
    assert lossy.keys and read_header(memoryview(_fetch(origin, lossy.keys[0], require_lossless=False))).lossy
    again = _blend(origin, prompt)  # raw asked: the int8 chunks held must not answer it
    assert not again.cached
    for key in again.keys:
        assert not read_header(memoryview(_fetch(origin, key))).lossy


def test_a_lossless_fetch_never_gets_a_lossy_held_chunk(origin) -> None:
    _pass(origin)
    toks = _ingest(origin, ["alpha", "bravo"])
    prompt, _ = _prompt(origin, toks, ["bravo", "alpha"])
    lossy = _blend(origin, prompt, codec="int8")
    with pytest.raises(LossyRefused):
        _fetch(origin, lossy.keys[0], require_lossless=True)


def test_a_variant_the_memory_cannot_hold_whole_is_refused_not_answered_with_missing_keys(origin) -> None:
    from kdn.origin.blend import BlendCache

    _pass(origin)
    toks = _ingest(origin, ["alpha", "bravo", "charlie"])
    prompt, _ = _prompt(origin, toks, ["charlie", "alpha", "bravo"])
    first = _blend(origin, prompt)
    assert len(first.keys) >= 3
    one = len(_fetch(origin, first.keys[0]))
    origin.blends = BlendCache(one + one // 2)  # room for one chunk of the variant, not all
    resp = _blend(origin, prompt)
    assert resp.refused == "no_room" and not resp.keys  # never keys that cannot be fetched
    assert _counters(origin)["blend_refused_no_room"] == 1


def test_documents_past_the_models_window_are_refused(origin) -> None:
    """A plain chain stops at the model's window; a blend reaching past it would serve KV at
    positions the model never produces (and let one request make the origin blend any length)."""
    _pass(origin)
    lm = origin.model()
    window = int(lm.max_positions)
    enc = lm.tokenizer.encode
    doc = segment_tokens(lm, DOCS["alpha"])
    filler = enc("z" * (window - 20))
    prompt = filler + doc + enc(" Question?")
    resp = _blend(origin, prompt, spans=[(len(filler), len(filler) + len(doc))])
    assert resp.refused == "too_long" and not resp.keys
    assert _counters(origin)["blend_refused_too_long"] == 1
    inside = enc("z" * 40) + doc + enc(" Question?")  # the same document inside the window blends
    assert not _blend(origin, inside, spans=[(40, 40 + len(doc))]).refused


# -- the client: malformed parameters, an origin down or silent -------------------------------------------


class _WireStore:
    """Stands in for StoreBlend without a socket: encodes the request as the real client does
    (:func:`kdn.wire.origin.blend_request`), then answers a refusal — or never answers."""

    def __init__(self, silent: bool = False) -> None:
        self.silent = silent
        self.asked: list = []

    async def blend(self, fp, ns, tokens, docs):
        from kdn.integrations.store_blend import BlendAnswer
        from kdn.wire.origin import blend_request

        req = blend_request(fp, ns, tokens, docs)  # raises as the real call would, before any I/O
        self.asked.append(list(req.documents))
        while self.silent:
            await asyncio.sleep(0.01)
        return BlendAnswer((), 0, refused="no_segments", reason="none stored")


def _blend_requests(store: _WireStore, *, timeout_s: float = 5.0):
    from kdn.integrations.vllm_blend import BlendHost, BlendRequests

    loop = _Loop()
    counters: dict[str, int] = {}
    states: dict = {}

    def count(name: str, n: int = 1) -> None:
        counters[name] = counters.get(name, 0) + n

    cfg = SimpleNamespace(blend=False, blend_origin="origin:1", blend_poll_s=0.01, blend_timeout_s=timeout_s,
                          namespace=Namespace("default"), tokens={}, token=None, fetch_timeout_s=1.0,
                          chunk_size=CHUNK, tls=lambda: None)
    host = BlendHost(cfg, bytes(32), 16, states=states, count=count, submit=loop.submit,  # type: ignore[arg-type]
                     new_state=lambda *a, **k: SimpleNamespace(**k), namespace_of=lambda s, p, d: d)
    blends = BlendRequests(host)
    blends._client = lambda tenant: store  # type: ignore[method-assign]
    return blends, counters, states, loop


def _request(docs, rid="r1"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(200)), cache_salt="kdn-blend-x",
                           kv_transfer_params={"kdn_blend": True, "kdn_documents": docs})


def _settle(blends, req, limit_s: float = 10.0) -> float:
    """Drive ``pending`` as the scheduler does; the longest single call, in seconds."""
    longest, t_end = 0.0, time.monotonic() + limit_s
    while time.monotonic() < t_end:
        t0 = time.perf_counter()
        still = blends.pending(req)
        longest = max(longest, time.perf_counter() - t0)
        if not still:
            return longest
    raise AssertionError("the blend request never settled")


@pytest.mark.parametrize("docs", ["abc", 5, {"a": 1}, [[1]], [[None, 40]], [[1, 2, 3]], [["x", 40]],
                                  [[float("nan"), 40]], [[-1, 40]], [[1e30, 40]], [[2**40, 2**40 + 20]]])
def test_malformed_kdn_documents_fall_back_to_a_plain_request_without_raising(docs) -> None:
    blends, counters, states, loop = _blend_requests(_WireStore())
    try:
        _settle(blends, _request(docs))  # never raises into the scheduler
        assert "r1" not in states and counters.get("blend_errors", 0) == 1
    finally:
        loop.close()


def test_an_infinite_span_bound_falls_back_without_raising() -> None:
    blends, counters, states, loop = _blend_requests(_WireStore())
    try:
        _settle(blends, _request(json.loads("[[0, Infinity]]")))
        assert "r1" not in states and counters.get("blend_errors", 0) == 1
    finally:
        loop.close()


@pytest.mark.parametrize("docs", [[[True, 40]], [[0, 40.0]], [(0, 2**31)]])
def test_spans_must_be_integer_token_positions(docs) -> None:
    blends, counters, states, loop = _blend_requests(_WireStore())
    try:
        _settle(blends, _request(docs))
        assert "r1" not in states and counters.get("blend_errors", 0) == 1
    finally:
        loop.close()


@pytest.mark.parametrize("ask", ["false", "true", 1, 0, [], {}])
def test_a_kdn_blend_that_is_not_a_boolean_is_refused_and_never_saved(ask) -> None:
    store = _WireStore()
    blends, counters, states, loop = _blend_requests(store)
    try:
        req = _request([[0, 40]])
        req.kv_transfer_params["kdn_blend"] = ask
        _settle(blends, req)
        assert "r1" not in states and counters.get("blend_errors", 0) == 1 and store.asked == []
        st = SimpleNamespace(keys=[b"k"] * 3, saved=0, first_saved=0, pieces_saved=False)
        blends.never_save(SimpleNamespace(**{**vars(req), "cache_salt": None}), st)
        assert st.saved == 3  # asked, however malformed: its KV is never written back
    finally:
        loop.close()


def test_kdn_blend_false_is_a_plain_request() -> None:
    store = _WireStore()
    blends, counters, states, loop = _blend_requests(store)
    try:
        req = _request([[0, 40]])
        req.kv_transfer_params["kdn_blend"] = False
        assert blends.pending(req) is False and store.asked == [] and counters == {}
    finally:
        loop.close()


def test_a_silent_origin_times_out_without_holding_the_scheduler() -> None:
    store = _WireStore(silent=True)
    blends, counters, states, loop = _blend_requests(store, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        longest = _settle(blends, _request([[0, 40]]))
        assert 0.5 <= time.monotonic() - t0 < 3.0 and longest < 0.25  # each step waits blend_poll_s at most
        assert "r1" not in states and counters == {"blend_requests": 1, "blend_timeouts": 1}
        assert store.asked == [[0, 40]]
    finally:
        store.silent = False
        loop.close()
