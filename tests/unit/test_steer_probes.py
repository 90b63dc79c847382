"""Adversarial probes of steered variants (issue 14): bad marks, bad regexes, malformed variant ids,
another tenant's variant, wrong types from an engine's request. Each is one clear error or a plain
hit with a warning, never a steered answer the request did not ask for."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from kdn.artifact import decode_artifact, encode_artifact
from kdn.client import ClientConfig, KdnClient
from kdn.errors import ArtifactCorrupt, InvalidInput, NotFound
from kdn.integrations.vllm_steer import check_variant_header, requested_variant
from kdn.keys import ROOT_KEY, Namespace, chunk_keys
from kdn.models import load_model
from kdn.origin.cli import main_ingest
from kdn.origin.steer import resolve, store_steered_chain
from kdn.origin.store import OriginStore
from kdn.steer import Emphasis, SteerSpec, parse_variant, steer_root
from kdn.steer.methods import re_read, steered_kv
from kdn.testing import MemoryEdgeTransport

CHUNK = 32
TEXT = "".join(f"{'POLICY: keep it warm' if i % 4 == 1 else 'plain filler line'} {i}\n\n" for i in range(10))
CAL = "ab" * 16


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", chunk_size=CHUNK)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))  # no calibration unless a test writes one


# -- marks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spans, message", [
    ("9:5", "empty or negative"),  # reversed
    ("-3:5", "empty or negative"),  # negative
    ("5:5", "empty or negative"),  # zero-length
    ("0:1e3", "bad --emphasize-spans item"),
    ("0:5:7", "bad --emphasize-spans item"),
    (",,", "is empty"),
    (",".join(f"{2 * i}:{2 * i + 1}" for i in range(4097)), "at most 4096"),
])
def test_bad_spans_are_one_clear_error(spans, message):
    with pytest.raises(InvalidInput, match=message):
        Emphasis.parse_spans(spans)


def test_overlapping_and_adjacent_spans_merge_into_one_variant():
    assert Emphasis.parse_spans("5:15,0:10,15:20") == ((0, 20),)
    assert SteerSpec("re-read", ((0, 10), (5, 15))).variant_id == SteerSpec("re-read", ((0, 15),)).variant_id


def test_a_span_past_the_end_is_refused_naming_it(lm):
    n_doc = len(lm.tokenizer.encode(TEXT))
    with pytest.raises(InvalidInput, match=rf"\[{n_doc - 1}, {n_doc + 1}\) lies outside the document"):
        resolve(Emphasis("re-read", spans=((0, 4), (n_doc - 1, n_doc + 1))), lm, TEXT, n_doc // CHUNK * CHUNK, None)


@pytest.mark.parametrize("regex", ["^$", r"^\s*$", "^(?!.)"])
def test_a_regex_matching_only_empty_lines_is_refused_not_a_whole_document_re_read(lm, regex):
    # re-read with no marks means "re-read the whole document": a regex that marks nothing must not become that
    n_stored = len(lm.tokenizer.encode(TEXT)) // CHUNK * CHUNK
    with pytest.raises(InvalidInput, match="matches only empty lines"):
        resolve(Emphasis("re-read", regex=regex), lm, TEXT, n_stored, None)


def test_regex_matching_nothing_or_invalid_is_one_clear_error(lm):
    with pytest.raises(InvalidInput, match="matches no line"):
        resolve(Emphasis("re-read", regex="^NOTHING"), lm, TEXT, 256, None)
    with pytest.raises(InvalidInput, match="bad --emphasize regex"):
        Emphasis("re-read", regex="(?P<x")
    # everything: every non-empty line, one merged span per run of lines, inside the stored chunks
    spec = resolve(Emphasis("re-read", regex="."), lm, TEXT, 128, None)
    assert spec.marks and spec.marks[-1][1] <= 128


def test_a_catastrophic_regex_is_refused_within_its_budget_not_left_running():
    # (a|aa)+$ backtracks exponentially on a line of a's that ends otherwise, in re and regex alike
    code = ("import time\nfrom kdn.errors import InvalidInput\nfrom kdn.steer import regex_lines\n"
            "t = time.monotonic()\ntry:\n    regex_lines('a' * 60 + '!\\n', '(a|aa)+$', budget_s=0.5)\n"
            "except InvalidInput as exc:\n    print(round(time.monotonic() - t, 2), exc)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], timeout=60, check=True, capture_output=True, text=True)
    except subprocess.TimeoutExpired:  # subprocess.run kills the child it started
        pytest.fail("regex_lines ran on past its budget")
    took, _, message = out.stdout.strip().partition(" ")
    assert "ran past 0.5 s" in message and float(took) < 2.0


def test_an_empty_span_or_regex_option_is_refused_not_the_whole_document(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(TEXT)
    base = [str(doc), "--model", "tiny", "--codec", "raw", "--workers", "0", "--no-progress", "--chunk-size",
            str(CHUNK), "--store", str(tmp_path / "store"), "--json", "--emphasize", "re-read"]
    for extra, message in ((["--emphasize-spans", ""], "--emphasize-spans is empty"),
                           (["--emphasize-regex", ""], "--emphasize-regex is empty")):
        assert main_ingest(base + extra) == 2
        assert message in json.loads(capsys.readouterr().out)["message"]
    assert not (tmp_path / "store").exists()


def test_edge_emphasize_refuses_an_empty_span_or_regex_option_before_sending(capsys):
    from kdn.edge.cli import main as edge_main

    for extra, message in ((["--spans", ""], "--emphasize-spans is empty"), (["--regex", ""], "--regex is empty")):
        rc = edge_main(["emphasize", "--edge", "127.0.0.1:1", "--document", "a.md", "--fingerprint", "ab" * 32,
                        "--deadline", "0.5", "--json", "--method", "re-read", *extra])
        assert rc == 1
        assert message in json.loads(capsys.readouterr().out)["message"]


# -- strength ---------------------------------------------------------------------------------------


def test_a_strength_that_rounds_to_zero_is_refused_not_stored_unreadable():
    # the canonical spec (key and header) rounds the strength: a spec must be what its header says,
    # or every artifact of it is refused when read back
    with pytest.raises(InvalidInput, match="strength"):
        SteerSpec("key-edit", ((0, 4),), 1e-7, CAL)
    with pytest.raises(InvalidInput, match="strength"):
        Emphasis("key-edit", spans=((0, 4),), strength=1e-9)
    spec = SteerSpec("key-edit", ((0, 4),), 2.0000004, CAL)
    assert SteerSpec.from_canonical(spec.canonical()) == spec  # computed with the strength its header names


@pytest.mark.parametrize("strength", [float("nan"), float("inf"), -1.0, 8.5])
def test_nonsense_strengths_are_refused(strength):
    with pytest.raises(InvalidInput, match="strength"):
        SteerSpec("key-edit", ((0, 4),), strength, CAL)
    with pytest.raises(InvalidInput, match="strength"):
        Emphasis("key-edit", spans=((0, 4),), strength=strength)


# -- malformed JSON from the wire ----------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "", "null", "[]", '"re-read"', '{"method": 5}', '{"method": "re-read", "spans": "0:5"}',
    '{"method": "re-read", "spans": [[0, 5, 6]]}', '{"method": "re-read", "spans": [[0, true]]}',
    '{"method": "re-read", "spans": [[0.0, 5.0]]}', '{"method": "re-read", "regex": 5}',
    '{"method": "re-read", "regex": ["x"]}', '{"method": "key-edit", "spans": [[0, 5]], "strength": "x"}',
    '{"method": "key-edit", "spans": [[0, 5]], "strength": [1]}', '{"method": "re-read", "strength": 1}',
])
def test_a_malformed_emphasis_from_the_wire_is_invalid_input(text):
    with pytest.raises(InvalidInput):
        Emphasis.from_json(text)


@pytest.mark.parametrize("text", [
    "garbage", "[]", '{"v": 2, "method": "re-read", "marks": [], "strength": 1, "calibration": ""}',
    '{"v": 1, "method": "re-read", "marks": [5], "strength": 1, "calibration": ""}',
    '{"v": 1, "method": "key-edit", "marks": [[0, 4]], "strength": 1, "calibration": 7}',
    '{"v": 1, "method": "key-edit", "marks": [[0, 4]], "strength": 0.0, "calibration": "' + CAL + '"}',
])
def test_a_malformed_header_spec_is_refused(text):
    with pytest.raises(InvalidInput):
        SteerSpec.from_canonical(text)


@pytest.mark.parametrize("value, message", [
    ("zz" * 32, "not hex"), ("ab" * 31, "31 bytes"), ("ab" * 33, "33 bytes"), ("PLAIN", "not hex"),
])
def test_malformed_variant_ids_are_refused(value, message):
    with pytest.raises(InvalidInput, match=message):
        parse_variant(value)
    assert parse_variant("") == parse_variant(None) == parse_variant("plain") == ROOT_KEY


# -- an engine's request (vLLM kv_transfer_params) ---------------------------------------------------


VID = SteerSpec("re-read", ((0, 4),)).variant_id


@pytest.mark.parametrize("params", ["kdn_steer", ["kdn_steer", VID], 7])
def test_kv_transfer_params_of_the_wrong_type_are_invalid_input_not_a_crash(params):
    # the connector turns InvalidInput into "not cached, warned"; anything else escapes into vLLM's scheduler
    with pytest.raises(InvalidInput, match="kv_transfer_params must be an object"):
        requested_variant(f"kdn-steer-{VID}", params)


@pytest.mark.parametrize("value", [True, False, 0, 1.5, [VID], {"id": VID}])
def test_a_variant_field_of_the_wrong_type_is_refused(value):
    with pytest.raises(InvalidInput, match="variant id"):
        requested_variant(f"kdn-steer-{VID}", {"kdn_steer": value})


def test_a_variant_whose_salt_names_another_variant_is_refused():
    other = SteerSpec("re-read", ((0, 5),)).variant_id
    with pytest.raises(InvalidInput, match="cache_salt that contains the variant id"):
        requested_variant(f"kdn-steer-{other}", {"kdn_steer": VID})


def test_a_header_with_a_malformed_spec_is_artifact_corrupt():
    class Header:
        steer = '{"v": 1, "method": "boost"}'

    with pytest.raises(ArtifactCorrupt):
        check_variant_header(Header(), bytes(steer_root(SteerSpec("re-read"))))


# -- tenants ------------------------------------------------------------------------------------------


def test_another_tenants_variant_is_a_plain_miss_said_aloud_and_counted(lm):
    doc = list(range(3, 3 + 2 * CHUNK))
    spec = SteerSpec("re-read")
    acme = Namespace("acme")
    edge = MemoryEdgeTransport()
    kv = re_read(lm.model, doc)
    root = steer_root(spec)
    keys = chunk_keys(doc, fingerprint=lm.fingerprint, namespace=acme, chunk_size=CHUNK, root=root)
    for i, key in enumerate(keys):
        edge.store[("acme", bytes(key))] = encode_artifact(
            kv[:, :, :, i * CHUNK : (i + 1) * CHUNK].contiguous(), key=key, parent_key=keys[i - 1] if i else root,
            fingerprint=lm.fingerprint, chunk_index=i, steer=spec.canonical())
    with KdnClient(ClientConfig(edge="mem", tenant="acme", steer=spec.variant_id), transport=edge) as c:
        assert c.reuse(doc, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK).chunks == 2
    with KdnClient(ClientConfig(edge="mem", tenant="other", steer=spec.variant_id), transport=edge) as c:
        r = c.reuse(doc, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert r.chunks == 0 and r.kv is None
        assert "is not held for tenant 'other'" in (r.warning or "") and c.counters["steer_misses"] == 1


@pytest.fixture()
def origin(tmp_path, lm):
    from kdn.origin.ingest.documents import read_text
    from kdn.origin.worker import DocumentTask
    from tests.origins import origin_in_process

    srv, inproc = origin_in_process(tmp_path / "origin", lm, chunk_size=CHUNK,
                                    tokens={"tok-acme": ["acme"], "tok-other": ["other"]})
    doc = tmp_path / "policy.md"
    doc.write_text(TEXT)
    d = read_text(doc)
    assert srv.compute.ingest(lm.fingerprint, DocumentTask(str(doc), d.text, d.digest, "acme")).status == "stored"
    yield srv, inproc, doc
    srv.close()


def _emphasize(lm, inproc, document: str, emphasis: str, tenant: str) -> tuple[list, str]:
    from kdn.edge.config import EdgeConfig
    from kdn.edge.upstream import origin_upstream

    async def go():
        up = origin_upstream(EdgeConfig(), address="inproc:origin", channel=inproc.channel())
        try:
            return await up.emphasize(document, emphasis, fingerprint=lm.fingerprint, namespace=Namespace(tenant),
                                      token=f"tok-{tenant}")
        finally:
            await up.close()

    return asyncio.run(go())


def test_emphasize_of_another_tenants_document_cannot_tell_it_exists(lm, origin):
    srv, inproc, doc = origin
    em = Emphasis("re-read", regex="^POLICY").to_json()
    keys, variant = _emphasize(lm, inproc, "policy.md", em, "acme")
    assert keys and variant
    errors = []
    for name in ("policy.md", "absent.md"):
        with pytest.raises(NotFound) as exc:
            _emphasize(lm, inproc, name, em, "other")
        errors.append(str(exc.value).replace(name, "NAME"))
    assert errors[0] == errors[1]
    assert not any(r.tenant == "other" for r in srv.store.documents())


def test_emphasize_at_the_origin_refuses_bad_marks_and_an_uncalibrated_key_edit(lm, origin):
    _, inproc, _ = origin
    n_doc = len(lm.tokenizer.encode(TEXT))
    for em, message in (
        (Emphasis("key-edit", regex="^POLICY"), "no key-edit calibration"),
        (Emphasis("re-read", spans=((0, 4), (n_doc, n_doc + 3))), "lies outside the document"),
        (Emphasis("re-read", regex="^$"), "matches only empty lines"),
    ):
        with pytest.raises(InvalidInput, match=message):
            _emphasize(lm, inproc, "policy.md", em.to_json(), "acme")
    with pytest.raises(InvalidInput):
        _emphasize(lm, inproc, "policy.md", '{"method": "re-read", "spans": [[5, 2]]}', "acme")


# -- what a variant's key names ------------------------------------------------------------------------


def test_a_steered_chunk_key_names_its_content_across_documents(lm, tmp_path):
    head = list(range(10, 10 + CHUNK))
    doc_a = head + [200 + i % 40 for i in range(CHUNK)]
    doc_b = head + [120 - i % 40 for i in range(CHUNK)]
    spec = SteerSpec("re-read")  # `kdn ingest --emphasize re-read DIR`: one spec for every document
    ns = Namespace("default")
    store = OriginStore(tmp_path / "store")
    try:
        store_steered_chain(lm, store, doc_a, spec, ns, ["raw"], None)
        keys_b = store_steered_chain(lm, store, doc_b, spec, ns, ["raw"], None).keys
        served = decode_artifact(store.get(keys_b[0], "raw", tenant="default")).kv
    finally:
        store.close()
    own = steered_kv(lm.model, doc_b, spec)[:, :, :, :CHUNK]
    assert not torch.equal(own, steered_kv(lm.model, doc_a, spec)[:, :, :, :CHUNK])  # the content does differ
    torch.testing.assert_close(served, own, rtol=1e-4, atol=1e-5)  # doc B must get its own reading
