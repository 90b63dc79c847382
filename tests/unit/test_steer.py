"""Steered KV (issue 14): specs and their keys, the header, both methods' math, calibration files,
and the eval harness end to end on a tiny retrieval model (accuracy there is not the point)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kdn.artifact import ArtifactReader, decode_artifact, encode_artifact
from kdn.blend.rope import rope_spec
from kdn.errors import ArtifactCorrupt, InvalidInput
from kdn.keys import DEFAULT_NAMESPACE, ROOT_KEY, chunk_keys
from kdn.models import load_model
from kdn.steer import (MAX_STRENGTH, SteerSpec, chars_to_tokens, marks_from_regex, parse_variant, steer_root)
from kdn.steer.methods import (KeyEditCalibration, apply_key_edit, directions_for, full_kv, load_calibration,
                               query_means, re_read, slow_dims, steered_kv, write_calibration)

FP = bytes(range(32))
CAL = "ab" * 16


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-mha")


def test_plain_keys_do_not_change_and_variants_never_collide_with_them() -> None:
    toks = list(range(1000, 1000 + 4 * 64))
    plain = chunk_keys(toks, fingerprint=FP, namespace=DEFAULT_NAMESPACE, chunk_size=64)
    assert plain == chunk_keys(toks, fingerprint=FP, namespace=DEFAULT_NAMESPACE, chunk_size=64, root=ROOT_KEY)
    assert steer_root(None) == ROOT_KEY and parse_variant("") == ROOT_KEY and parse_variant(None) == ROOT_KEY
    specs = [SteerSpec("re-read"), SteerSpec("re-read", ((0, 10),)), SteerSpec("key-edit", ((0, 10),), 2.0, CAL),
             SteerSpec("key-edit", ((0, 10),), 3.0, CAL), SteerSpec("key-edit", ((0, 11),), 2.0, CAL),
             SteerSpec("key-edit", ((0, 10),), 2.0, "cd" * 16)]
    seen = set(plain)
    for spec in specs:
        keys = chunk_keys(toks, fingerprint=FP, namespace=DEFAULT_NAMESPACE, chunk_size=64, root=steer_root(spec))
        assert len(keys) == len(plain)
        assert not seen & set(keys), spec  # no steered key equals a plain key or another variant's
        seen |= set(keys)
        # the same spec gives the same keys; the variant id names the root
        assert keys == chunk_keys(toks, fingerprint=FP, namespace=DEFAULT_NAMESPACE, chunk_size=64,
                                  root=parse_variant(spec.variant_id))


def test_spec_is_canonical_and_round_trips() -> None:
    a = SteerSpec("key-edit", ((20, 30), (0, 10), (5, 12)), 2, CAL)
    assert a.marks == ((0, 12), (20, 30))  # merged, sorted
    assert SteerSpec.from_canonical(a.canonical()) == a
    assert a.variant_id == SteerSpec("key-edit", ((0, 12), (20, 30)), 2.0, CAL).variant_id
    assert json.loads(a.canonical())["method"] == "key-edit"


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="boost", marks=((0, 1),)), "unknown steer method"),
    (dict(method="key-edit", marks=(), calibration=CAL), "at least one marked span"),
    (dict(method="key-edit", marks=((0, 1),), strength=0.0, calibration=CAL), "strength must be in"),
    (dict(method="key-edit", marks=((0, 1),), strength=MAX_STRENGTH + 0.1, calibration=CAL), "strength must be in"),
    (dict(method="key-edit", marks=((0, 1),), strength=float("nan"), calibration=CAL), "strength must be in"),
    (dict(method="key-edit", marks=((0, 1),), strength=1.0, calibration=""), "calibration"),
    (dict(method="key-edit", marks=((5, 5),), calibration=CAL), "empty or negative"),
    (dict(method="key-edit", marks=((-1, 5),), calibration=CAL), "empty or negative"),
    (dict(method="key-edit", marks=((0, 1, 2),), calibration=CAL), "(start, end)"),
    (dict(method="re-read", strength=2.0), "takes no strength"),
])
def test_bad_specs_are_refused_with_a_clear_error(kwargs, message) -> None:
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        SteerSpec(**kwargs)


def test_marks_out_of_range_bad_regex_and_malformed_specs() -> None:
    with pytest.raises(InvalidInput, match=r"out of range: the document has 10 tokens"):
        SteerSpec("re-read", ((5, 11),)).check_fits(10)
    SteerSpec("re-read", ((5, 10),)).check_fits(10)
    offsets = [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(InvalidInput, match="bad --emphasize regex"):
        marks_from_regex("abc", "([", offsets)
    with pytest.raises(InvalidInput, match="matches no line"):
        marks_from_regex("abc", "zzz", offsets)
    for bad in ("{", '{"v": 9}', '{"v": 1, "method": "re-read"}', "[]"):
        with pytest.raises(InvalidInput):
            SteerSpec.from_canonical(bad)
    for bad in ("xyz", "ab"):
        with pytest.raises(InvalidInput, match="variant id"):
            parse_variant(bad)


def test_regex_marks_whole_matching_lines() -> None:
    text = "intro line\nPOLICY: keep it\nfiller\nPOLICY: again\n"
    words = []
    pos = 0
    for w in text.split():
        s = text.index(w, pos)
        words.append((s, s + len(w)))
        pos = s + len(w)
    marks = marks_from_regex(text, r"^POLICY", words)
    assert [" ".join(text[a:b] for a, b in words[s:e]) for s, e in marks] == ["POLICY: keep it", "POLICY: again"]
    assert chars_to_tokens([(0, 3)], words) == ((0, 1),)


def test_a_steered_artifact_carries_its_spec_and_a_plain_reader_refuses_it() -> None:
    kv = torch.randn(2, 2, 2, 4, 8)
    spec = SteerSpec("key-edit", ((1, 3),), 2.0, CAL)
    key = chunk_keys(list(range(4)), fingerprint=FP, namespace=DEFAULT_NAMESPACE, chunk_size=4, root=steer_root(spec))[0]
    blob = encode_artifact(kv, key=key, parent_key=steer_root(spec), fingerprint=FP, steer=spec.canonical())
    art = decode_artifact(blob)
    assert SteerSpec.from_canonical(art.header.steer) == spec  # method and marks in the header
    assert art.header.steer and json.loads(art.header.steer)["marks"] == [[1, 3]]
    plain = encode_artifact(kv, key=key, parent_key=ROOT_KEY, fingerprint=FP)
    assert decode_artifact(plain).header.steer == ""
    assert len(plain) + len(spec.canonical()) + 3 == len(blob)  # same KV bytes; the header holds the spec (+ tag, length)
    with pytest.raises(ArtifactCorrupt, match="steered variant"):
        ArtifactReader(expect_steer="").feed(blob)
    with pytest.raises(ArtifactCorrupt, match="plain KV"):
        ArtifactReader(expect_steer=spec.canonical()).feed(plain)


def test_key_edit_adds_strength_nats_for_the_mean_query_and_touches_nothing_else(tiny) -> None:
    model = tiny.model
    rope = rope_spec(model)
    toks = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    means = query_means(model, [(toks, 39)])  # (L, H, D)
    heads = ((1, 2),)
    mask = slow_dims(rope, 1024)
    cal = KeyEditCalibration(bytes(tiny.fingerprint).hex(), heads, directions_for(means, heads, mask), 2.0)
    base = full_kv(model, toks)
    edited = apply_key_edit(base, [(10, 20)], 3.0, cal, rope)
    changed = (edited != base).any(-1)  # (L, 2, H, T)
    assert changed[1, 0, 2, 10:20].all()
    changed[1, 0, 2, 10:20] = False
    assert not changed.any()  # values, other heads, other layers, other tokens: untouched
    # a query equal to the mean query (its slow part), placed at position 39, scores marked keys +3 nats
    u = means[1, 2] * mask
    D = base.shape[-1]
    q39 = rope.rotate(u.reshape(1, D), 39)[0]
    gain = (edited[1, 0, 2, 10:20] - base[1, 0, 2, 10:20]) @ q39 / math.sqrt(D)
    assert torch.allclose(gain, torch.full_like(gain, 3.0), atol=0.05), gain


def test_re_read_keeps_the_first_reading_outside_its_span_and_layer0_exactly(tiny) -> None:
    model = tiny.model
    toks = torch.randint(3, 200, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    base = full_kv(model, toks)
    rr = re_read(model, toks, [(10, 20)])
    assert rr.shape == base.shape
    # outside the span: the first reading (a longer prefill, so equal up to float rounding)
    assert torch.allclose(rr[:, :, :, :10], base[:, :, :, :10], atol=1e-5)
    assert torch.allclose(rr[:, :, :, 20:], base[:, :, :, 20:], atol=1e-5)
    # layer 0's KV depends on the token and its position only: the second reading, rotated back to
    # the first copy's positions, equals the first (this checks the rotation back)
    assert torch.allclose(rr[0, :, :, 10:20], base[0, :, :, 10:20], atol=1e-4)
    assert not torch.allclose(rr[1, :, :, 10:20], base[1, :, :, 10:20], atol=1e-4)  # a later layer read it again
    whole = steered_kv(model, toks, SteerSpec("re-read"))
    assert torch.allclose(whole[0], base[0], atol=1e-4) and whole.shape == base.shape
    with pytest.raises(InvalidInput, match="out of range"):
        steered_kv(model, toks, SteerSpec("re-read", ((0, 31),)))


def test_key_edit_needs_the_named_calibration(tiny, tmp_path: Path) -> None:
    fp = bytes(tiny.fingerprint).hex()
    cal = KeyEditCalibration(fp, ((0, 1),), torch.ones(1, 32), 1.5)
    with pytest.raises(InvalidInput, match="calibration"):
        steered_kv(tiny.model, [5, 6, 7], SteerSpec("key-edit", ((0, 2),), 1.0, "00" * 16), cal)
    out = steered_kv(tiny.model, [5, 6, 7], SteerSpec("key-edit", ((0, 2),), 1.0, cal.digest), cal)
    assert out.shape[3] == 3
    path = write_calibration(cal, tmp_path)
    back = load_calibration(fp, tmp_path)
    assert back is not None and back.digest == cal.digest and back.heads == cal.heads
    assert load_calibration("ff" * 32, tmp_path) is None
    data = json.loads(path.read_text())
    data["directions"][0][0] = 9.0  # edited by hand: the digest no longer matches
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidInput, match="digest does not match"):
        load_calibration(fp, tmp_path)
    path.write_text("{not json")
    with pytest.raises(InvalidInput, match="malformed"):
        load_calibration(fp, tmp_path)


def test_ramp_profile_falls_from_full_strength_to_zero_and_names_another_calibration(tiny) -> None:
    from kdn.steer.methods import token_strengths

    pos = torch.tensor([0, 25, 50, 99])
    assert torch.allclose(token_strengths(pos, 100, 2.0, "ramp"), torch.tensor([2.0, 1.5, 1.0, 0.02]))
    assert torch.allclose(token_strengths(pos, 100, 2.0, "flat"), torch.full((4,), 2.0))
    fp = bytes(tiny.fingerprint).hex()
    flat = KeyEditCalibration(fp, ((1, 2),), torch.ones(1, 32), 2.0)
    ramp = KeyEditCalibration(fp, ((1, 2),), torch.ones(1, 32), 2.0, profile="ramp")
    assert ramp.digest != flat.digest
    assert KeyEditCalibration.from_json(ramp.to_json()).profile == "ramp"
    old = flat.to_json()
    old.pop("profile")  # a file written before profiles existed reads as flat, under the same digest
    assert KeyEditCalibration.from_json(old).digest == flat.digest
    with pytest.raises(InvalidInput, match="unknown key-edit profile"):
        KeyEditCalibration(fp, ((1, 2),), torch.ones(1, 32), 2.0, profile="wave")
    # the edit itself: a token at the document's start gets the full strength, one near its end almost none
    model = tiny.model
    rope = rope_spec(model)
    toks = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    means = query_means(model, [(toks, 39)])
    mask = slow_dims(rope, 1024)
    heads = ((1, 2),)
    cal = KeyEditCalibration(fp, heads, directions_for(means, heads, mask), 3.0, profile="ramp")
    base = full_kv(model, toks)
    edited = apply_key_edit(base, [(0, 40)], 3.0, cal, rope)
    D = base.shape[-1]
    q39 = rope.rotate((means[1, 2] * mask).reshape(1, D), 39)[0]
    gain = (edited[1, 0, 2] - base[1, 0, 2]) @ q39 / math.sqrt(D)  # (T,)
    want = 3.0 * (40 - torch.arange(40, dtype=torch.float32)) / 40
    assert torch.allclose(gain, want, atol=0.05), (gain, want)


def test_re_read_from_the_plain_kv_equals_a_second_prefill(tiny) -> None:
    from kdn.steer.methods import re_read_from

    model = tiny.model
    toks = torch.randint(3, 200, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    spans = [(5, 12), (30, 40)]
    want = re_read(model, toks, spans)
    got = re_read_from(model, full_kv(model, toks), toks, spans)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got[1, :, :, 30:40], full_kv(model, toks)[1, :, :, 30:40], atol=1e-4)
