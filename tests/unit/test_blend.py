"""Blending: segments re-placed by rotation, partly recomputed, and the host path around it.

What must hold: a rotation by δ equals a fresh prefill δ positions later for every RoPE variant we
claim (default, linear, llama3, yarn, partial rotary) and anything else is refused; a segment at
position 0 is prefix reuse bit for bit; recomputing every token is a full prefill; the host falls
back, with the answer of a full prefill, when a segment is corrupt or another model's, and when
the model has no passing verdict; blended KV is never written back.
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
import transformers as transformers_attention

from kdn.blend import (
    Deviation, FirstK, Glue, Naive, Random, blend, blend_and_predict, place, prefill_document, prefill_segment, rope_spec,
)
from kdn.blend import attention, recompute
from kdn.blend.verdict import Verdict, read_verdict, write_verdict
from kdn.client import ClientConfig, KdnClient
from kdn.testing import MemoryEdgeTransport
from kdn.errors import InvalidInput, UnsupportedModel
from kdn.integrations.blend import BlendOptions
from kdn.integrations.transformers import generate, prepare
from kdn.keys import DEFAULT_NAMESPACE
from kdn.segments import Segment, encode_segment, segment_key, segment_lead


def _llama(rope: dict | None = None, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=2048)
    if rope is not None:
        cfg["rope_parameters"] = rope
    cfg.update(kw)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def _stablelm_partial():
    from transformers import StableLmConfig, StableLmForCausalLM

    torch.manual_seed(0)
    return StableLmForCausalLM(StableLmConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=2048, partial_rotary_factor=0.25)).eval()


ROPES = {
    "default": lambda: _llama(),
    "linear": lambda: _llama(dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
    "llama3": lambda: _llama(dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=256, rope_theta=500000.0)),
    "yarn": lambda: _llama(dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=512, rope_theta=10000.0)),
    "partial-rotary": _stablelm_partial,
}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", sorted(ROPES))
def test_rotated_segment_equals_a_fresh_prefill_at_the_target_position(variant: str) -> None:
    model = ROPES[variant]()
    spec = rope_spec(model)
    assert (spec.rotary_dim < spec.head_dim) == (variant == "partial-rotary")
    doc, delta = _ids(24, 1), 301
    stored = prefill_segment(model, doc)  # (L, 2, H, n, D) at positions 0..n-1
    with torch.inference_mode():
        fresh = model(input_ids=torch.tensor([doc]), position_ids=torch.arange(delta, delta + 24).unsqueeze(0),
                      use_cache=True).cache
    for l, layer in enumerate(fresh.layers):
        moved = spec.rotate(stored[l, 0], delta)  # (H, n, D)
        torch.testing.assert_close(moved, layer.keys[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stored[l, 1], layer.values[0], rtol=1e-4, atol=1e-4)


def test_sequence_dependent_rope_is_refused_with_a_clear_error() -> None:
    with pytest.raises(UnsupportedModel, match="'dynamic'.*not supported"):
        rope_spec(_llama(dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)))


def test_a_model_that_rotates_differently_is_caught_by_the_check() -> None:
    from transformers import GlmConfig, GlmForCausalLM  # interleaved rotary pairs

    torch.manual_seed(0)
    glm = GlmForCausalLM(GlmConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, pad_token_id=0)).eval()
    with pytest.raises(UnsupportedModel, match="differ from a fresh prefill"):
        rope_spec(glm)


def test_segment_right_after_the_lead_is_prefix_reuse_bit_exact(tiny_model) -> None:
    """A segment is prefilled after the model's lead token (its BOS): placed right after that
    token, naive concatenation is the KV a prefill of ``lead + document`` gives, bit for bit."""
    model = tiny_model.model
    lead = list(segment_lead(model.config))
    assert lead == [model.config.bos_token_id]
    doc, q = _ids(40, 2), _ids(6, 3)
    kv, start = prefill_document(model, doc)
    assert start == len(lead) and kv.shape[3] == len(doc)
    seg = Segment(segment_key(doc, fingerprint=tiny_model.fingerprint, namespace=DEFAULT_NAMESPACE), tuple(doc), kv,
                  start)
    layout = place(model, [seg], prefix_tokens=lead, prefix_kv=prefill_segment(model, lead))
    cache, stats = blend(model, layout, Naive())
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([lead + doc]), use_cache=True).cache
    a = len(lead)
    for got, want in zip(cache.layers, ref.layers):
        # the document's KV bit for bit; the lead's own (a prefix, prefilled alone) to rounding
        assert torch.equal(got.keys[:, :, a:], want.keys[:, :, a:])
        assert torch.equal(got.values[:, :, a:], want.values[:, :, a:])
        assert torch.allclose(got.keys, want.keys, atol=1e-6) and torch.allclose(got.values, want.values, atol=1e-6)
    # and the generated tokens equal prefix reuse of the same document
    edge = MemoryEdgeTransport()
    with KdnClient(ClientConfig(edge="mem"), transport=edge) as client:
        opts = BlendOptions(policy=Naive())
        blended = generate(tiny_model, q, documents=[doc], prefix=lead, client=client, blend=opts, max_new_tokens=6)
        again = generate(tiny_model, q, documents=[doc], prefix=lead, client=client, blend=opts, max_new_tokens=6)
    full = generate(tiny_model, lead + doc + q, max_new_tokens=6)
    assert blended.tokens == again.tokens == full.tokens
    assert again.reused_tokens == len(doc) and again.via == "blend:naive"


def test_a_segment_is_prefilled_after_the_lead_not_alone(tiny_model) -> None:
    """The stored KV is not the document's KV alone: every later token read the lead first."""
    model = tiny_model.model
    doc = _ids(24, 4)
    kv, start = prefill_document(model, doc)
    alone = prefill_segment(model, doc)
    assert start == 1
    per_token = (kv[1:, 1] - alone[1:, 1]).abs().amax(dim=(0, 1, 3))  # values past layer 0, (n,)
    assert bool((per_token > 1e-6).all())
    assert torch.equal(kv[0, 1], alone[0, 1])  # layer 0's values depend on the token alone
    assert segment_lead(type("C", (), {"bos_token_id": None})()) == ()
    assert segment_lead(type("C", (), {"bos_token_id": True})()) == ()


def test_recomputing_every_token_is_a_full_prefill(tiny_mha_model) -> None:
    model = tiny_mha_model.model
    prefix, docs, q = _ids(5, 4), [_ids(30, 5), _ids(20, 6), _ids(25, 7)], _ids(7, 8)
    segs = [Segment(segment_key(d, fingerprint=tiny_mha_model.fingerprint, namespace=DEFAULT_NAMESPACE), tuple(d),
                    prefill_segment(model, d)) for d in docs]
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([prefix + sum(docs, []) + q])).logits[0, -len(q):]
    for policy in (Deviation(1.0, check_layer=0), Deviation(1.0, check_layer=1), FirstK(10_000)):
        layout = place(model, segs, prefix_tokens=prefix, prefix_kv=prefill_segment(model, prefix))
        cache, stats = blend(model, layout, policy)
        assert stats.selected == stats.candidates == 75
        with torch.inference_mode():
            got = model(input_ids=torch.tensor([q]), cache=cache, use_cache=True).logits[0]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    layout = place(model, segs, prefix_tokens=prefix, prefix_kv=prefill_segment(model, prefix))
    _, stats = blend(model, layout, Deviation(0.15))
    assert stats.selected == 12 and len(set(stats.selected_positions)) == 12
    assert all(5 <= p < 80 for p in stats.selected_positions)  # only document tokens, never the prefix


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_recomputing_every_token_matches_full_prefill_for_every_attention_implementation(attn: str, monkeypatch) -> None:
    """At 100% recompute, with the check layer's full pass over every position (where SDPA needs no
    mask but eager attention must be given the causal one), glue between documents and a random
    control: the logits are a full prefill's (eager without the mask was off by ~1e-1). Under
    SDPA the queries run in groups of 9–10 rows (8 groups), each over its own keys."""
    monkeypatch.setattr(attention, "MIN_ROWS", 8)
    model = _llama(attn_implementation=attn)
    assert model.config._attn_implementation == attn
    prefix, docs, q = _ids(5, 14), [_ids(30, 15), _ids(20, 16), _ids(25, 17)], _ids(7, 18)
    glue = _ids(3, 19)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([prefix + docs[0] + glue + docs[1] + docs[2] + q])).logits[0, -len(q):]
    parts = [Segment(segment_key(d, fingerprint=bytes(32), namespace=DEFAULT_NAMESPACE), tuple(d), prefill_segment(model, d))
             for d in docs]
    for policy in (Deviation(1.0, check_layer=1), Deviation(1.0, check_layer=0), Random(1.0, check_layer=2), FirstK(99)):
        layout = place(model, [parts[0], Glue(tuple(glue)), parts[1], parts[2]], prefix_tokens=prefix,
                       prefix_kv=prefill_segment(model, prefix))
        assert layout.forced == [35, 36, 37] and layout.spans == [(5, 35), (38, 58), (58, 83)]
        cache, stats = blend(model, layout, policy)
        assert stats.selected == stats.candidates == 75 and stats.glue == 3
        with torch.inference_mode():
            got = model(input_ids=torch.tensor([q]), cache=cache, use_cache=True).logits[0]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_query_groups_give_the_kv_and_logits_of_one_masked_call(monkeypatch) -> None:
    """A partial blend under SDPA with its queries in groups (each over the keys up to its last
    position, KV heads shared) leaves the KV and picks of the same blend run as one masked call,
    and the model's implementation is plain SDPA again afterwards."""
    model = _llama(attn_implementation="sdpa")
    docs, glue, q = [_ids(120, 30), _ids(90, 31), _ids(150, 32)], _ids(3, 33), _ids(9, 34)
    parts = [Segment(segment_key(d, fingerprint=bytes(32), namespace=DEFAULT_NAMESPACE), tuple(d), prefill_segment(model, d))
             for d in docs]
    calls: list[int] = []
    real = attention.grouped_sdpa

    def counting(*args, kdn_groups=None, **kw):
        calls.append(len(kdn_groups) if kdn_groups else 0)
        return real(*args, kdn_groups=kdn_groups, **kw)

    monkeypatch.setattr(attention, "MIN_ROWS", 16)
    attention.register()  # before the counting stand-in replaces it
    runs = {}
    for grouped in (True, False):
        if not grouped:  # the same pass with one (S, N) mask per layer
            monkeypatch.setattr(recompute, "grouped_attention", lambda m: contextlib.nullcontext(False))
        transformers_attention.AttentionInterface.register(attention.GROUPED, counting)
        try:
            layout = place(model, [parts[0], Glue(tuple(glue)), parts[1], parts[2]])
            cache, stats = blend(model, layout, Deviation(0.4, check_layer=1))
        finally:
            transformers_attention.AttentionInterface.register(attention.GROUPED, real)
        assert model.config._attn_implementation == "sdpa"
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([q]), cache=cache, use_cache=True).logits[0]
        runs[grouped] = (layout, stats, logits)
    assert max(calls) == 8  # 147 rows (144 picked, 3 glue) of 16 or more: 8 groups after the check
    (lg, sg, og), (lm, sm, om) = runs[True], runs[False]
    assert sg.selected_positions == sm.selected_positions and sg.selected == 144
    for a, b in zip(lg.keys + lg.values, lm.keys + lm.values):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(og, om, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_question_as_glue_predicts_what_a_prefill_over_the_blend_predicts(attn: str) -> None:
    """blend_and_predict with the prefix and the question as glue: the same KV and next-token
    logits as a blend over the prefilled prefix followed by a prefill of the question; and at
    100% recompute the logits of a full prefill."""
    model = _llama(attn_implementation=attn)
    prefix, docs, q = _ids(6, 40), [_ids(50, 41), _ids(70, 42)], _ids(8, 43)
    segs = [Segment(segment_key(d, fingerprint=bytes(32), namespace=DEFAULT_NAMESPACE), tuple(d), prefill_segment(model, d))
            for d in docs]
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([prefix + sum(docs, []) + q])).logits[0, -1]
    for policy, ref_full in ((Deviation(0.3), False), (Deviation(1.0), True)):
        layout = place(model, [Glue(tuple(prefix)), *segs, Glue(tuple(q))])
        cache, stats, logits = blend_and_predict(model, layout, policy)
        assert stats.glue == 14 and stats.selected == math.ceil(policy.ratio * 120)
        apart = place(model, segs, prefix_tokens=prefix, prefix_kv=prefill_segment(model, prefix))
        ref_cache, ref_stats = blend(model, apart, policy)
        assert ref_stats.selected_positions == stats.selected_positions
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([q]), cache=ref_cache, use_cache=True)
        torch.testing.assert_close(logits, out.logits[0, -1], rtol=1e-5, atol=1e-5)
        for (k, v), (rk, rv) in zip(((l.keys, l.values) for l in cache.layers), ((l.keys, l.values) for l in out.cache.layers)):
            torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)
        if ref_full:
            torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidInput, match="ends in glue"):
        blend_and_predict(model, place(model, segs), Deviation(0.3))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_blend_with_room_blends_the_same_and_decodes_into_its_room(attn: str) -> None:
    """place(room=r): the same picks, KV and logits as without room, and greedy decoding over the
    blend's cache gives the same logits while writing its tokens into the layout's rooms (not a
    copy of every layer per token)."""
    from kdn.prefill import greedy_tail

    model = _llama(attn_implementation=attn)
    prefix, docs, q = _ids(6, 50), [_ids(50, 51), _ids(70, 52)], _ids(8, 53)
    segs = [Segment(segment_key(d, fingerprint=bytes(32), namespace=DEFAULT_NAMESPACE), tuple(d), prefill_segment(model, d))
            for d in docs]
    parts = [Glue(tuple(prefix)), *segs, Glue(tuple(q))]
    plain, roomy = place(model, parts), place(model, parts, room=4)
    assert plain.rooms is None and roomy.rooms is not None and roomy.rooms[0][0].shape[2] == roomy.n + 4
    c0, s0, l0 = blend_and_predict(model, plain, Deviation(0.3))
    c1, s1, l1 = blend_and_predict(model, roomy, Deviation(0.3))
    assert s0.selected_positions == s1.selected_positions
    torch.testing.assert_close(l0, l1, rtol=0, atol=0)
    first = int(torch.argmax(l0))
    with torch.inference_mode():
        t0 = greedy_tail(model, c0, first, max_new_tokens=5, eos_ids=set())
        t1 = greedy_tail(model, c1, first, max_new_tokens=5, eos_ids=set())
    assert t0 == t1
    for layer, (k_room, v_room), ref in zip(c1.layers, roomy.rooms, c0.layers):
        assert layer.keys.data_ptr() == k_room.data_ptr() and layer.keys.shape[2] == roomy.n + 4  # in the room, full
        torch.testing.assert_close(layer.keys, ref.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values, ref.values, rtol=1e-5, atol=1e-5)


def test_a_model_whose_forward_does_more_than_the_pass_keeps_its_forward() -> None:
    """predicts_in_pass checks once per model that the pass gives the forward's logits: here the
    model's own forward scales its last hidden state (as some architectures scale embeddings), the
    pass does not, so neither blend_and_predict nor prefill_in_place runs it."""
    from kdn.blend import predicts_in_pass, prefill_in_place

    plain, scaled = _llama(), _llama()

    def scale(module, args, out) -> None:
        out.last_hidden_state.mul_(3.0)

    scaled.model.register_forward_hook(scale)
    assert predicts_in_pass(plain) and not predicts_in_pass(scaled)
    room = torch.zeros((3, 2, 2, 20, 16))
    with pytest.raises(UnsupportedModel, match="does not reproduce"):
        prefill_in_place(scaled, room, 10, _ids(20, 44))
    with pytest.raises(UnsupportedModel, match="does not reproduce"):
        d = _ids(12, 45)
        seg = Segment(segment_key(d, fingerprint=bytes(32), namespace=DEFAULT_NAMESPACE), tuple(d), prefill_segment(scaled, d))
        blend_and_predict(scaled, place(scaled, [seg, Glue(tuple(_ids(5, 46)))]), Naive())


def test_grouped_attention_is_sdpa_for_other_calls_and_overlapping_passes_restore_it() -> None:
    model = _llama(attn_implementation="sdpa")
    ids = torch.tensor([_ids(40, 35)])
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
        with attention.grouped_attention(model) as outer:
            with attention.grouped_attention(model) as inner:  # a second pass on the same model
                assert outer and inner and model.config._attn_implementation == attention.GROUPED
                torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=0, atol=0)
            assert model.config._attn_implementation == attention.GROUPED
        assert model.config._attn_implementation == "sdpa"
    eager = _llama(attn_implementation="eager")
    with attention.grouped_attention(eager) as selected:
        assert not selected and eager.config._attn_implementation == "eager"


def test_glue_is_computed_by_every_policy_and_random_picks_other_tokens_than_deviation() -> None:
    model = _llama()
    docs, glue = [_ids(40, 20), _ids(40, 21)], _ids(4, 22)
    parts = [Segment(segment_key(d, fingerprint=bytes(32), namespace=DEFAULT_NAMESPACE), tuple(d), prefill_segment(model, d))
             for d in docs]
    picked = {}
    for policy in (Naive(), FirstK(2), Deviation(0.25), Random(0.25, seed=3)):
        layout = place(model, [parts[0], Glue(tuple(glue)), parts[1]])
        _, stats = blend(model, layout, policy)
        assert stats.glue == 4 and not set(stats.selected_positions) & {40, 41, 42, 43}
        picked[type(policy).__name__] = set(stats.selected_positions)
        # glue has real KV now: no placeholder zeros are left at its positions
        assert all(float(k[0, :, 40:44].abs().sum()) > 0 for k in layout.keys)
    assert len(picked["Deviation"]) == len(picked["Random"]) == 20 and picked["Deviation"] != picked["Random"]
    assert picked["Naive"] == set() and picked["FirstK"] == {0, 1, 44, 45}


def test_attention_without_an_explicit_mask_is_refused() -> None:
    from types import SimpleNamespace

    from kdn.blend import check_model

    inner = _llama().model
    stand_in = SimpleNamespace(model=inner, config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(UnsupportedModel, match="flash_attention_2"):
        check_model(stand_in)


def _client(edge: MemoryEdgeTransport, **kw) -> KdnClient:
    return KdnClient(ClientConfig(edge="mem", **kw), transport=edge)


def test_segments_are_stored_once_and_blends_are_never_written_back(tiny_model) -> None:
    docs, q = [_ids(30, 10), _ids(30, 11), _ids(30, 12)], _ids(5, 13)
    edge = MemoryEdgeTransport()
    opts = BlendOptions(policy=Deviation(0.2))
    with _client(edge) as client:
        first = generate(tiny_model, q, documents=docs, client=client, blend=opts, max_new_tokens=3)
        client.flush(5)
        assert len(edge.store) == 3 and first.warnings  # three segments computed here and stored
        second = generate(tiny_model, q, documents=docs[::-1], client=client, blend=opts, max_new_tokens=3)
        client.flush(5)
    keys = {bytes(segment_key(d, fingerprint=tiny_model.fingerprint, namespace=DEFAULT_NAMESPACE)) for d in docs}
    assert {k for _, k in edge.store} == keys  # nothing but the three segments, after two blends
    assert second.reused_tokens >= 90 - second.blend.selected and not second.warnings


@pytest.mark.parametrize("fault", ["corrupt", "wrong-model"])
def test_a_bad_segment_falls_back_to_full_recompute_with_the_same_answer(tiny_model, tiny_mha_model, fault) -> None:
    docs, q = [_ids(30, 20), _ids(30, 21)], _ids(5, 22)
    edge = MemoryEdgeTransport()
    key = segment_key(docs[1], fingerprint=tiny_model.fingerprint, namespace=DEFAULT_NAMESPACE)
    if fault == "corrupt":
        seg = Segment(key, tuple(docs[1]), prefill_segment(tiny_model.model, docs[1]))
        edge.store[("default", bytes(key))] = encode_segment(seg, fingerprint=tiny_model.fingerprint)
        edge.corrupt.add(bytes(key))
    else:  # another model's KV under this key (same shape: tiny-mha has more KV heads, so use its own fp)
        other = Segment(key, tuple(docs[1]), prefill_segment(tiny_model.model, docs[1]))
        edge.store[("default", bytes(key))] = encode_segment(other, fingerprint=tiny_mha_model.fingerprint)
    with _client(edge, write_back=False) as client:
        r = generate(tiny_model, q, documents=docs, client=client, blend=BlendOptions(policy=Naive()), max_new_tokens=5)
    full = generate(tiny_model, docs[0] + docs[1] + q, max_new_tokens=5)
    assert r.tokens == full.tokens and r.reused_tokens == 0
    assert any("segment fetch failed" in w for w in r.warnings)


def test_no_or_failing_verdict_means_prefix_reuse_and_says_so(tiny_model, tmp_path) -> None:
    docs, q = [_ids(30, 30), _ids(30, 31)], _ids(5, 32)
    full = generate(tiny_model, docs[0] + docs[1] + q, max_new_tokens=4)
    with _client(MemoryEdgeTransport()) as client:
        r = generate(tiny_model, q, documents=docs, client=client, blend=BlendOptions(verdict_root=tmp_path),
                     max_new_tokens=4)
        assert r.tokens == full.tokens and "no blend verdict" in r.warnings[0] and r.blend is None
        fp = bytes(tiny_model.fingerprint).hex()
        write_verdict(Verdict(fp, passed=False, ratio=0.15, reason="agreement 0.50 < 0.95"), tmp_path)
        r = generate(tiny_model, q, documents=docs, client=client, blend=BlendOptions(verdict_root=tmp_path),
                     max_new_tokens=4)
        assert r.tokens == full.tokens and "failed the blend quality gate" in r.warnings[0]
        write_verdict(Verdict(fp, passed=True, ratio=0.3), tmp_path)
        assert read_verdict(tiny_model.fingerprint, tmp_path).ratio == 0.3
        r = generate(tiny_model, q, documents=docs, client=client, blend=BlendOptions(verdict_root=tmp_path),
                     max_new_tokens=4)
        assert r.via == "blend:blend@0.3" and r.blend.selected == 18


def test_a_shipped_verdict_answers_where_the_cache_has_none_and_the_users_own_wins(
        tiny_model, tmp_path, monkeypatch) -> None:
    from kdn.blend import verdict as verdicts

    shipped, cache = tmp_path / "shipped", tmp_path / "cache"
    monkeypatch.setattr(verdicts, "SHIPPED_ROOT", shipped)
    monkeypatch.setenv("KDN_CACHE", str(cache))
    fp = bytes(tiny_model.fingerprint).hex()
    docs, q = [_ids(30, 30), _ids(30, 31)], _ids(5, 32)
    assert read_verdict(tiny_model.fingerprint) is None
    write_verdict(Verdict(fp, passed=True, ratio=0.5, reason="shipped"), shipped)
    assert read_verdict(tiny_model.fingerprint).ratio == 0.5  # nothing in $KDN_CACHE: the shipped one
    assert read_verdict(tiny_model.fingerprint, cache / "blend-verdicts") is None  # an explicit root: only it
    with _client(MemoryEdgeTransport()) as client:
        r = generate(tiny_model, q, documents=docs, client=client, max_new_tokens=4)
        assert r.via == "blend:blend@0.5" and not any("verdict" in w for w in r.warnings)
        # the user's own measurement, here a failing one, overrides what shipped
        write_verdict(Verdict(fp, passed=False, ratio=0.5, reason="agreement 0.90 < 0.95"))
        r = generate(tiny_model, q, documents=docs, client=client, max_new_tokens=4)
    assert r.blend is None and "failed the blend quality gate" in r.warnings[0]
    assert r.tokens == generate(tiny_model, docs[0] + docs[1] + q, max_new_tokens=4).tokens
    # a shipped file that names another model is refused, not used
    (shipped / f"{fp}.json").write_text((shipped / f"{fp}.json").read_text().replace(fp, "00" * 32))
    (cache / "blend-verdicts" / f"{fp}.json").unlink()
    with pytest.raises(InvalidInput, match="names another model"):
        read_verdict(tiny_model.fingerprint)


def test_unsupported_rope_falls_back_with_the_reason(tmp_path) -> None:
    model = prepare(_llama(dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)))
    docs, q = [_ids(20, 40), _ids(20, 41)], _ids(4, 42)
    with _client(MemoryEdgeTransport()) as client:
        r = generate(model, q, documents=docs, client=client, blend=BlendOptions(policy=Deviation(0.15)),
                     max_new_tokens=3)
    assert r.tokens == generate(model, docs[0] + docs[1] + q, max_new_tokens=3).tokens
    assert "blending refused" in r.warnings[0] and "dynamic" in r.warnings[0]


@pytest.mark.parametrize("documents, message", [
    (5, "documents must be a list"), ("some text", "documents must be a list"),
    ([["a", "b"]], "token ids must be integers"), ([[1.5, 2.0]], "token ids must be integers"),
    ([[None]], "token ids must be integers"), ([{"a": 1}], "sequence of token ids"),
    ([[-1, 3]], "outside the model's vocabulary"), ([[10**9]], "outside the model's vocabulary"),
])
def test_bad_documents_are_refused_with_what_was_wrong(tiny_model, documents, message) -> None:
    with pytest.raises(InvalidInput, match=message):
        generate(tiny_model, _ids(5, 40), documents=documents, client=None, max_new_tokens=2)


def test_bad_blend_options_are_refused(tiny_model) -> None:
    with pytest.raises(InvalidInput, match="BlendOptions.policy"):
        BlendOptions(policy="cacheblend")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="blend must be a BlendOptions"):
        generate(tiny_model, _ids(5, 41), documents=[_ids(10, 42)], blend="deviation",  # type: ignore[arg-type]
                 max_new_tokens=2)
    # a check layer the pass never reaches would be a full recompute reported as a blend
    L = tiny_model.kv_shape.num_layers
    with _client(MemoryEdgeTransport()) as client, pytest.raises(InvalidInput, match="check_layer"):
        generate(tiny_model, _ids(5, 43), documents=[_ids(30, 44)], client=client,
                 blend=BlendOptions(policy=Deviation(0.2, L)), max_new_tokens=2)


def test_kdn_model_info_says_whether_and_at_what_ratio_documents_are_blended(tmp_path, capsys, monkeypatch) -> None:
    from kdn.blend import verdict as verdicts
    from kdn.models import load_model
    from kdn.ops.model import main as model_main

    monkeypatch.setattr(verdicts, "SHIPPED_ROOT", tmp_path / "shipped")
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    fp = bytes(load_model("tiny").fingerprint).hex()

    def info() -> dict:
        assert model_main(["info", "tiny", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["blend"]

    assert info() == {"blends": False, "problem": "no blend verdict for this model (kdn eval-blend --model MODEL)"}
    write_verdict(Verdict(fp, passed=True, ratio=0.5, reason="blend@0.5: agreement 0.960"), tmp_path / "shipped")
    got = info()
    assert got["blends"] and got["ratio"] == 0.5 and got["source"] == "shipped with KDN"
    write_verdict(Verdict(fp, passed=False, ratio=0.7, reason="no ratio passed"))
    got = info()
    assert not got["blends"] and got["ratio"] is None and got["source"].startswith("measured on this machine")
