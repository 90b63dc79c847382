"""Blending: join independently computed segments into one context's KV, recomputing a few tokens.

A prompt is laid out as ``[prefix][segment_1] … [segment_n][question]``. The prefix's KV is exact
(a prefix-chain hit or computed here); each segment's KV was computed on its own, after the model's
lead token (:mod:`kdn.segments`) at positions ``start..``
(:mod:`kdn.segments`). :func:`place` rotates each segment's keys to where it now sits
(:mod:`kdn.blend.rope`) and concatenates: that is *naive concatenation* — right positions, but
every segment token read only its own document, not what now precedes it. :func:`blend` then
recomputes a chosen share of the segment tokens at every layer, attending over the whole mixed
KV, so the tokens whose KV depends most on the missing context get it:

- ``Deviation(ratio, check_layer)`` — CacheBlend's rule. Layers ``0 .. check_layer-1`` run in full
  over every segment token (layer 0's KV depends on the token and position only, so the cached and
  fresh layer-0 KV agree; what changes is the hidden state the layer hands on). At
  ``check_layer`` only the K/V projections run for all of them; the per-token deviation
  ``‖K_fresh − K_cached‖² + ‖V_fresh − V_cached‖²`` (summed over heads and dims) picks the top
  ``ratio`` share, and only those tokens go on through the remaining layers. Every token whose KV
  was computed fresh at a layer gets that fresh KV there; the rest keep the re-placed cached KV.
- ``FirstK(k)`` — EPIC's baseline: the first ``k`` tokens of each segment (the "attention sinks"
  each segment grows when it is computed on its own), recomputed at every layer.
- ``Naive()`` — nothing recomputed.
- ``Random(ratio, check_layer, seed)`` — the control for ``Deviation``: the same passes and the
  same number of tokens, chosen at random.

The question is then prefilled over the blended KV as over any cache, and generation proceeds;
or, with :func:`blend_and_predict`, it is glue at the end of the context, computed in the same
pass, and its next-token logits are read off the pass (the selective pass's attention:
:mod:`kdn.blend.attention`).

Tokens between segments that no segment holds (a separator, a chat template's markers) are
:class:`Glue`: placed with placeholder KV and computed at every layer by every policy.

Where it runs: on the inference host (:mod:`kdn.integrations.blend`: the host has the weights,
the prefix and every other segment of this prompt) and in the store (:mod:`kdn.origin.blend`:
the origin's prefill workers blend for engines that only load KV, such as vLLM, and serve the
result as a blend variant). Either way the blended KV is specific to one prompt: it is never
written back under a chain or segment key (see :mod:`kdn.segments`).

The selective pass drives the model's own decoder layers (``model.model.layers``), embedding and
rotary modules, with an explicit position list, an additive attention mask over the full mixed KV
(query at absolute position ``p`` sees keys ``0..p``) and a small cache object whose ``update``
scatters the fresh K/V of the recomputed positions into the mixed KV. The attention
implementation must apply that mask as given: ``eager`` and ``sdpa`` do (only a full causal pass
under SDPA goes without one, as SDPA is causal by itself there); others are refused. Any HF
model whose attention calls ``cache.update(k, v, layer_idx)`` after rotary and before attention
(Llama, Mistral, Qwen2/3, StableLM …) works; :func:`check_model` refuses the rest.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kdn.blend.attention import GROUPED, QueryGroup, causal_mask, grouped_attention, query_groups
from kdn.blend.rope import RopeSpec, rope_spec
from kdn.errors import InvalidInput, UnsupportedModel
from kdn.kv import cache_from_layers, cache_in_room, forward, layers_to_chunk, output_cache
from kdn.segments import Segment, segment_lead


# -- selection policies ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Naive:
    """Concatenate re-placed segments, recompute nothing."""

    name: str = "naive"


@dataclass(frozen=True, slots=True)
class FirstK:
    """EPIC-style: recompute the first ``k`` tokens of every segment at every layer."""

    k: int = 16
    name: str = "first-k"

    def __post_init__(self) -> None:
        if self.k < 0:
            raise InvalidInput(f"first-k needs k >= 0, got {self.k}")


@dataclass(frozen=True, slots=True)
class Deviation:
    """CacheBlend: recompute the ``ratio`` share of segment tokens whose KV deviates most at
    ``check_layer`` after layers ``0..check_layer-1`` ran in full."""

    ratio: float = 0.15
    check_layer: int = 1
    name: str = "blend"

    def __post_init__(self) -> None:
        _check_ratio(self.ratio, self.check_layer)


@dataclass(frozen=True, slots=True)
class Random:
    """The control for :class:`Deviation`: the same passes and the same number of tokens, chosen
    uniformly at random (seeded) instead of by deviation."""

    ratio: float = 0.15
    check_layer: int = 1
    seed: int = 0
    name: str = "random"

    def __post_init__(self) -> None:
        _check_ratio(self.ratio, self.check_layer)


def _check_ratio(ratio: float, check_layer: int) -> None:
    if not 0.0 <= ratio <= 1.0:
        raise InvalidInput(f"recompute ratio must be in [0, 1], got {ratio}")
    if check_layer < 0:
        raise InvalidInput(f"check_layer must be >= 0, got {check_layer}")


Policy = Naive | FirstK | Deviation | Random


# -- layout ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Glue:
    """Tokens between segments that no segment holds (a separator, a chat template's markers):
    they have no cached KV, so every policy computes them at every layer."""

    tokens: tuple[int, ...]


@dataclass(slots=True)
class Layout:
    """A context of ``N`` tokens: an exact prefix, then re-placed segments (and glue).

    ``keys``/``values``: per layer ``(1, H, N, D)``; ``spans``: each segment's ``[start, end)``;
    ``forced``: positions of glue tokens, sorted (their KV is a placeholder until computed);
    ``rooms``: where ``keys``/``values`` are the first ``N`` positions of longer per-layer tensors
    ``(1, H, N + room, D)``, those (the blend's cache decodes into them: :func:`kdn.kv.cache_in_room`).
    """

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prefix_len: int
    spans: list[tuple[int, int]]
    forced: list[int] = field(default_factory=list)
    rooms: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def n(self) -> int:
        return len(self.tokens)


def place(
    model: Any,
    segments: Sequence[Segment | Glue],
    *,
    prefix_tokens: Sequence[int] = (),
    prefix_kv: torch.Tensor | None = None,
    rope: RopeSpec | None = None,
    room: int = 0,
) -> Layout:
    """Concatenate ``prefix_kv`` ``(L, 2, H, P, D)`` and every segment, each rotated to its place;
    :class:`Glue` gets placeholder KV and is marked for computing. ``room``: positions left after
    the context in every layer's KV, for the tokens decoding will feed back (:attr:`Layout.rooms`)."""
    rope = rope or rope_spec(model)
    P = len(prefix_tokens)
    if (prefix_kv is None) != (P == 0) or (prefix_kv is not None and prefix_kv.shape[3] != P):
        raise InvalidInput("prefix_kv must hold exactly the prefix tokens")
    ref = prefix_kv if prefix_kv is not None else next((s.kv for s in segments if isinstance(s, Segment)), None)
    if ref is None:
        raise InvalidInput("nothing to place: no prefix and no segments")
    L, H, D = ref.shape[0], ref.shape[2], ref.shape[4]
    keys: list[list[torch.Tensor]] = [[] for _ in range(L)]
    values: list[list[torch.Tensor]] = [[] for _ in range(L)]
    if prefix_kv is not None:
        for l in range(L):
            keys[l].append(prefix_kv[l, 0])  # (H, P, D)
            values[l].append(prefix_kv[l, 1])
    tokens = list(prefix_tokens)
    spans: list[tuple[int, int]] = []
    forced: list[int] = []
    pos = P
    for seg in segments:
        if isinstance(seg, Glue):
            n = len(seg.tokens)
            if not n:
                continue
            hole = torch.zeros((H, n, D), dtype=ref.dtype)  # (H, n, D), overwritten by the recompute
            for l in range(L):
                keys[l].append(hole)
                values[l].append(hole)
            tokens += seg.tokens
            forced += range(pos, pos + n)
            pos += n
            continue
        if seg.kv.shape[0] != L or seg.kv.shape[2] != H or seg.kv.shape[4] != D:
            raise InvalidInput(f"segment KV {tuple(seg.kv.shape)} does not match the context's {tuple(ref.shape)}")
        n = len(seg.tokens)
        for l in range(L):
            keys[l].append(rope.rotate(seg.kv[l, 0], pos - seg.start))  # (H, n, D) at positions pos..pos+n-1
            values[l].append(seg.kv[l, 1])  # (H, n, D): values carry no position
        tokens += seg.tokens
        spans.append((pos, pos + n))
        pos += n
    # per layer (H, N, D) -> (1, H, N, D): the first N positions of a fresh tensor the recompute
    # may write into, ``room`` positions longer where decoding will go on (Layout.rooms)
    rooms = []
    for ks, vs in zip(keys, values):
        k_room = torch.empty((1, H, pos + max(0, room), D), dtype=ref.dtype)  # (1, H, N + room, D)
        v_room = torch.empty((1, H, pos + max(0, room), D), dtype=ref.dtype)
        torch.cat(ks, dim=1, out=k_room[0, :, :pos])
        torch.cat(vs, dim=1, out=v_room[0, :, :pos])
        rooms.append((k_room, v_room))
    return Layout(tokens, [k[:, :, :pos] for k, _ in rooms], [v[:, :, :pos] for _, v in rooms], P, spans, forced,
                  rooms if room > 0 else None)


# -- the selective recompute ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlendStats:
    """What a blend cost. ``selected``: segment tokens recomputed through the last layer;
    ``candidates``: segment tokens; ``layer_token_fraction``: (token, layer) pairs of segment
    tokens computed over those a full recompute of the segments would compute (the compute
    share); glue is computed in full and counted apart."""

    policy: str
    candidates: int
    selected: int
    layer_token_fraction: float
    seconds: float
    selected_positions: tuple[int, ...] = field(default_factory=tuple)
    glue: int = 0  # glue tokens computed at every layer (not candidates)

    @property
    def recompute_fraction(self) -> float:
        return self.selected / self.candidates if self.candidates else 0.0


class _Captured(Exception):
    """Raised by :class:`_MixedKV` to stop a layer right after its K/V projections."""


class _MixedKV:
    """The one-layer-at-a-time cache the selective pass hands to the model's attention.

    ``update(k, v, layer)`` receives the fresh K/V ``(1, H, S, D)`` of the positions ``idx`` being
    recomputed, scatters them into that layer's mixed KV ``(1, H, N, D)`` and returns the whole of
    it for attention. With ``capture`` set it records them and stops the layer instead.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values
        self.idx: torch.Tensor = torch.empty(0, dtype=torch.long)
        self.capture = False
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if self.capture:
            self.captured = (key_states, value_states)
            raise _Captured()
        k, v = self.keys[layer_idx], self.values[layer_idx]  # (1, H, N, D)
        k[:, :, self.idx] = key_states.to(k.dtype)  # (1, H, S, D) into positions idx
        v[:, :, self.idx] = value_states.to(v.dtype)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys[layer_idx].shape[2])


SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Attention implementations that apply an explicit additive ``(1, 1, S, N)`` mask as given."""


def attention_implementation(model: Any) -> str:
    """The model's attention implementation (``sdpa`` when the config names none)."""
    cfg = model.config
    name = str(getattr(cfg, "_attn_implementation", None) or getattr(cfg, "attn_implementation", None) or "sdpa")
    return "sdpa" if name == GROUPED else name  # SDPA, with a blend's query groups selected


def check_model(model: Any) -> RopeSpec:
    """Refuse a model the selective pass cannot drive; return its verified :class:`RopeSpec`."""
    check_layers(model)
    return rope_spec(model)


def check_layers(model: Any) -> None:
    """Refuse a model whose layers the pass cannot drive (what a pass needs whatever moves keys)."""
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "rotary_emb"):
        if inner is None or not hasattr(inner, attr):
            raise UnsupportedModel(
                f"{type(model).__name__} lacks model.{attr}: blending drives HF decoder layers "
                "(model.model.embed_tokens/layers/rotary_emb) and cannot run this architecture"
            )
    attn = attention_implementation(model)
    if attn not in SUPPORTED_ATTENTION:
        raise UnsupportedModel(
            f"{type(model).__name__} runs attention {attn!r}; blending needs an implementation that applies an "
            f"explicit mask over the mixed KV ({', '.join(SUPPORTED_ATTENTION)}): load it with "
            "attn_implementation='sdpa'"
        )


def _mask_for(q_pos: torch.Tensor, n: int, attn: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask :func:`_run_layer` gives the layer for positions ``q_pos``: none when ``q_pos`` is
    every position ``0..n-1`` under SDPA (the kernel is causal by itself there, ``is_causal``,
    without materialising ``(S, N)``); the explicit :func:`_mask` otherwise (eager attention
    applies exactly the mask it is given). The positions change only at the check layer, so a
    pass builds it at most twice, not once per layer."""
    everything = q_pos.numel() == n  # q_pos is sorted and distinct: it is arange(n)
    return None if everything and attn == "sdpa" else causal_mask(q_pos, n, dtype)


def _run_layer(layer: Any, h: torch.Tensor, q_pos: torch.Tensor, mixed: _MixedKV, inner: Any,
               mask: torch.Tensor | None, groups: list[QueryGroup] | None = None) -> torch.Tensor:
    """One decoder layer over the hidden states ``h`` ``(1, S, hidden)`` of positions ``q_pos``
    ``(S,)``, with ``mask`` from :func:`_mask_for`; ``groups`` (under
    :func:`kdn.blend.attention.grouped_attention` only): the same mask, run by query groups."""
    pos_ids = q_pos.unsqueeze(0)  # (1, S)
    cos, sin = inner.rotary_emb(h, position_ids=pos_ids)  # (1, S, r) each
    mixed.idx = q_pos
    extra = {} if groups is None else {"kdn_groups": groups}
    out = forward(layer, h, attention_mask=mask, position_ids=pos_ids, cache=mixed, use_cache=True,
                  position_embeddings=(cos, sin), **extra)
    return out[0] if isinstance(out, tuple) else out  # (1, S, hidden)


def _project(layer: Any, h: torch.Tensor, q_pos: torch.Tensor, mixed: _MixedKV, inner: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh K/V ``(1, H, S, D)`` of one layer for ``h``: the layer runs up to its cache update,
    before attention, so it needs no mask."""
    mixed.capture = True
    try:
        _run_layer(layer, h, q_pos, mixed, inner, None)
    except _Captured:
        pass
    finally:
        mixed.capture = False
    if mixed.captured is None:
        raise UnsupportedModel(f"{type(layer).__name__} never called cache.update: cannot measure KV deviation")
    kv, mixed.captured = mixed.captured, None
    return kv


@torch.inference_mode()
def blend(model: Any, layout: Layout, policy: Policy) -> tuple[Any, BlendStats]:
    """Recompute the tokens ``policy`` picks; return a ``DynamicCache`` over the whole context and
    what it cost. ``layout``'s tensors are modified in place (they become the blended KV)."""
    cache, stats, _ = _blend(model, layout, policy)
    return cache, stats


_PASS_ATTR = "_kdn_pass_matches_forward"  # predicts_in_pass's answer, remembered on the model object


def predicts_in_pass(model: Any) -> bool:
    """Whether the layer pass reproduces ``model``'s own forward, so that :func:`blend_and_predict`
    and :func:`prefill_in_place` may read its next-token logits off the pass: layers the pass can
    drive (:func:`check_layers`), a head that is the final norm and the output embedding (no logit
    scaling or soft-capping in its config), and, checked once per model object on a few tokens,
    the logits of the model's own forward. An architecture whose forward does more than the pass
    (scales its embeddings, say) fails the check and keeps its own forward."""
    known = getattr(model, _PASS_ATTR, None)
    if known is not None:
        return bool(known)
    cfg = model.config
    ok = (all(not getattr(cfg, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
          and hasattr(getattr(model, "model", None), "norm") and model.get_output_embeddings() is not None)
    if ok:
        try:
            check_layers(model)
            ok = _pass_matches_forward(model)
        except (UnsupportedModel, InvalidInput):
            ok = False
    try:
        setattr(model, _PASS_ATTR, ok)
    except AttributeError:  # a model object that takes no attributes: checked again next time
        pass
    return ok


@torch.inference_mode()
def _pass_matches_forward(model: Any, cached: int = 8, rest: int = 4) -> bool:
    """The pass's logits for ``rest`` tokens over ``cached`` tokens' KV equal the model's forward
    over all of them, within 5% of the logits' scale (rounding differs between the two; a step the
    pass lacks changes them wholesale)."""
    ids = [3 + i % max(1, int(model.config.vocab_size) - 3) for i in range(cached + rest)]
    out = forward(model, input_ids=torch.tensor([ids[:cached]]), use_cache=True)
    layers = [(layer.keys, layer.values) for layer in output_cache(out).layers]
    k0 = layers[0][0]  # (1, H, cached, D)
    room = torch.empty((len(layers), 2, k0.shape[1], cached + rest, k0.shape[3]), dtype=k0.dtype, device=k0.device)
    for l, (k, v) in enumerate(layers):
        room[l, 0, :, :cached], room[l, 1, :, :cached] = k[0], v[0]
    _, got = _prefill_into(model, room, cached, ids)
    ref = model(input_ids=torch.tensor([ids])).logits[0, -1]
    return bool((got.float() - ref.float()).abs().max() <= 0.05 * (float(ref.float().abs().max()) + 1.0))


@torch.inference_mode()
def blend_and_predict(model: Any, layout: Layout, policy: Policy) -> tuple[Any, BlendStats, torch.Tensor]:
    """:func:`blend` over a context that ends in glue (the question: computed at every layer, as
    glue is), and the next-token logits ``(vocab,)`` at its last position. Those are the logits a
    prefill of the question over the blended cache gives (at every layer the glue attends over
    that layer's final blended KV), without a second pass over the weights: on a CPU a short
    prefill costs about one read of every weight. Only for a model :func:`predicts_in_pass` accepts."""
    if not layout.forced or layout.forced[-1] != layout.n - 1:
        raise InvalidInput("blend_and_predict needs a context that ends in glue (the question)")
    if not predicts_in_pass(model):
        raise UnsupportedModel(f"{type(model).__name__}: the layer pass does not reproduce its forward")
    cache, stats, last = _blend(model, layout, policy)
    return cache, stats, _next_token_logits(model, last)


@torch.inference_mode()
def prefill_in_place(model: Any, kv: torch.Tensor, cached: int, tokens: Sequence[int], *,
                     ready: Callable[[int], None] | None = None) -> tuple[Any, torch.Tensor]:
    """Prefill ``tokens[cached:]`` over the KV of ``tokens[:cached]``, the first ``cached``
    positions of ``kv`` ``(L, 2, H, >= len(tokens), D)``, writing their KV into ``kv`` after it;
    return a ``DynamicCache`` over ``kv``'s first ``len(tokens)`` positions and the next-token
    logits ``(vocab,)``. Tokens decoded over that cache are written into ``kv`` after the prompt
    while there is room (:func:`kdn.kv.cache_in_room`).

    The logits and KV of a forward over a ``DynamicCache`` of the cached KV, without copying it:
    such a cache appends by concatenation (a copy of every layer's KV), and transformers' SDPA
    path copies the KV heads out to the query heads whenever a mask is given. Here the new
    tokens run as glue through :func:`blend`'s pass (no segment token is recomputed), their KV
    lands in place, and the kernel shares the KV heads (:mod:`kdn.blend.attention`). On a 2-core
    Xeon, 45 tokens of smollm2-135m fp32 over 4k cached tokens: 223 ms instead of 336 ms; over
    8k, 347 ms instead of 588 ms (the returned cache holds views of ``kv``, not a copy). Only for
    a model :func:`predicts_in_pass` accepts.

    ``ready(l)``: called before layer ``l`` reads the cached KV, returning once that layer of it
    is in place (a fetch still landing: :mod:`kdn.layered`); what it raises ends the pass."""
    if not predicts_in_pass(model):
        raise UnsupportedModel(f"{type(model).__name__}: the layer pass does not reproduce its forward")
    return _prefill_into(model, kv, cached, tokens, ready)


def _prefill_into(model: Any, kv: torch.Tensor, cached: int, tokens: Sequence[int],
                  ready: Callable[[int], None] | None = None) -> tuple[Any, torch.Tensor]:
    T = len(tokens)
    if not 0 < cached < T or kv.dim() != 5 or kv.shape[3] < T:
        raise InvalidInput(f"prefill_in_place needs 0 < cached ({cached}) < tokens ({T}) <= room ({kv.shape[3]})")
    # the layers' whole rooms: decoding goes on after the prompt, where there is room (no copy per token)
    rooms = [(kv[l, 0].unsqueeze(0), kv[l, 1].unsqueeze(0)) for l in range(kv.shape[0])]  # (1, H, R, D) each
    layout = Layout(list(tokens), [k[:, :, :T] for k, _ in rooms], [v[:, :, :T] for _, v in rooms], cached, [],
                    list(range(cached, T)), rooms)
    cache, _, last = _blend(model, layout, Naive(), moves_keys=False, ready=ready)
    return cache, _next_token_logits(model, last)


def _next_token_logits(model: Any, last: torch.Tensor | None) -> torch.Tensor:
    """The logits ``(vocab,)`` of the last layer's hidden state ``last`` ``(1, 1, hidden)``: the
    final norm, then the output embedding (what :func:`predicts_in_pass` checked)."""
    if last is None:  # glue runs every layer; only a model without layers gets here
        raise UnsupportedModel(f"{type(model).__name__}: the pass did not reach the last layer")
    return model.get_output_embeddings()(model.model.norm(last))[0, -1]


def _blend(model: Any, layout: Layout, policy: Policy, *, moves_keys: bool = True,
           ready: Callable[[int], None] | None = None) -> tuple[Any, BlendStats, torch.Tensor | None]:
    """:func:`blend`, and the last layer's hidden state ``(1, 1, hidden)`` of the context's last
    position when it was computed through every layer (else None). ``moves_keys=False``: the
    layout holds no re-placed segment (its RoPE is not checked). ``ready(l)``: see
    :func:`prefill_in_place` (a policy with a check layer reads the cached KV there too)."""
    t0 = time.perf_counter()
    if moves_keys:
        check_model(model)
    else:
        check_layers(model)
    attn = attention_implementation(model)
    inner = model.model
    layers = list(inner.layers)
    L = len(layers)
    if isinstance(policy, (Deviation, Random)) and policy.check_layer >= L:
        # a check layer the pass never reaches would recompute everything while reporting a blend
        raise InvalidInput(f"check_layer must be below the model's {L} layers, got {policy.check_layer}")
    n = layout.n
    window = getattr(model.config, "sliding_window", None)
    if window and getattr(model.config, "use_sliding_window", True) and n > window:
        raise UnsupportedModel(f"context of {n} tokens exceeds the model's sliding window ({window}); blending "
                               "attends over the whole mixed KV and would not match this model")
    is_glue = torch.zeros(n, dtype=torch.bool)
    is_glue[torch.tensor(layout.forced, dtype=torch.long)] = True
    glue = torch.tensor(layout.forced, dtype=torch.long)  # (G,) sorted positions without cached KV
    is_cand = torch.zeros(n, dtype=torch.bool)
    is_cand[layout.prefix_len:] = True
    is_cand &= ~is_glue
    cand = torch.nonzero(is_cand).flatten()  # (A,) absolute positions of segment tokens
    A = int(cand.numel())
    mixed = _MixedKV(layout.keys, layout.values)
    layer_tokens = 0
    active = glue  # positions being recomputed: glue at least, at every layer
    checked = isinstance(policy, (Deviation, Random))
    if A and isinstance(policy, FirstK):
        first = torch.cat([torch.arange(s, min(e, s + policy.k)) for s, e in layout.spans])
        active = torch.cat((first, glue)).unique(sorted=True)
    elif A and checked and policy.check_layer > 0:
        # layers before the check run in full; the (exact) prefix joins them so that the pass
        # is a plain causal prefill over 0..n-1. Its fresh KV equals its cached KV.
        active = torch.arange(n)
    elif A and checked:
        active = torch.cat((cand, glue)).unique(sorted=True)
    l = -1  # the last layer the pass ran
    with grouped_attention(model) as grouped:  # queries by groups where the model runs SDPA
        if active.numel():
            ids = torch.tensor(layout.tokens, dtype=torch.long)
            h = inner.embed_tokens(ids[active].unsqueeze(0))  # (1, S, hidden)
            check = policy.check_layer if checked and A else -1
            mask, mask_pos = None, None  # the mask of the positions in ``active`` (rebuilt when they change)
            groups: list[QueryGroup] | None = None
            for l, layer in enumerate(layers):
                if ready is not None:
                    ready(l)
                if l == check:
                    past = active >= layout.prefix_len  # drop the prefix: its KV is exact
                    h, active = h[:, past], active[past]
                    k_new, v_new = _project(layer, h, active, mixed, inner)  # (1, H, S, D) each
                    seg = ~is_glue[active]  # (S,) segment tokens among the active
                    keep = min(A, math.ceil(policy.ratio * A - 1e-9))
                    if isinstance(policy, Random):
                        pick = torch.randperm(A, generator=torch.Generator().manual_seed(policy.seed))[:keep]
                    elif keep:
                        k_old = mixed.keys[l][:, :, active]  # (1, H, S, D): the re-placed cached KV
                        v_old = mixed.values[l][:, :, active]
                        dev = ((k_new.float() - k_old.float()) ** 2).sum(dim=(0, 1, 3)) + \
                            ((v_new.float() - v_old.float()) ** 2).sum(dim=(0, 1, 3))  # (S,)
                        pick = torch.topk(dev[seg], keep).indices
                    else:
                        pick = torch.empty(0, dtype=torch.long)
                    # every token with fresh K/V at this layer gets it; only the chosen go on
                    mixed.keys[l][:, :, active] = k_new.to(mixed.keys[l].dtype)
                    mixed.values[l][:, :, active] = v_new.to(mixed.values[l].dtype)
                    chosen = torch.nonzero(seg).flatten()[pick]  # indices into active
                    chosen = torch.cat((chosen, torch.nonzero(~seg).flatten())).unique(sorted=True)
                    h, active = h[:, chosen], active[chosen]
                if not active.numel():
                    break
                if mask_pos is not active:
                    mask, mask_pos = _mask_for(active, n, attn, h.dtype), active
                    # the whole mask goes to the layer even with groups: an attention that ignored
                    # them would still apply the right one (slower), never none
                    groups = query_groups(active, h.dtype) if grouped and mask is not None else None
                h = _run_layer(layer, h, active, mixed, inner, mask, groups)
                layer_tokens += int(is_cand[active].sum())
    last = None
    if active.numel() and int(active[-1]) == n - 1 and l == L - 1:  # the last position ran every layer
        last = h[:, -1:]
    if layout.rooms is not None:  # decoding goes on in the room after the context (no copy per token)
        cache = cache_in_room(layout.rooms, n, model.config)
    else:
        cache = cache_from_layers(list(zip(mixed.keys, mixed.values)), model.config)
    selected = active[is_cand[active]] if active.numel() else active
    stats = BlendStats(
        policy=_describe(policy), candidates=A, selected=int(selected.numel()),
        layer_token_fraction=layer_tokens / (L * A) if A else 0.0, seconds=time.perf_counter() - t0,
        selected_positions=tuple(int(p) for p in selected.tolist()), glue=int(glue.numel()),
    )
    return cache, stats, last


def _describe(policy: Policy) -> str:
    if isinstance(policy, Deviation):
        return f"blend@{policy.ratio:g}"
    if isinstance(policy, Random):
        return f"random@{policy.ratio:g}"
    if isinstance(policy, FirstK):
        return f"first-{policy.k}"
    return "naive"


@torch.inference_mode()
def prefill_segment(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """KV ``(L, 2, H, n, D)`` of ``tokens`` prefilled alone at positions ``0..n-1`` (an exact
    prompt prefix; a segment's own KV comes from :func:`prefill_document`)."""
    if not tokens:
        raise InvalidInput("a segment needs at least one token")
    ids = torch.tensor([list(tokens)], dtype=torch.long)  # (1, n)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return layers_to_chunk(output_cache(out).layers)  # (L, 2, H, n, D)


@torch.inference_mode()
def prefill_document(model: Any, tokens: Sequence[int]) -> tuple[torch.Tensor, int]:
    """A segment's KV ``(L, 2, H, n, D)`` and start ``a``: the document prefilled after the model's
    lead (:func:`kdn.segments.segment_lead`) at positions ``a..a+n-1``, the lead's KV dropped."""
    if not tokens:
        raise InvalidInput("a segment needs at least one token")
    lead = list(segment_lead(model.config))
    a = len(lead)
    kv = prefill_segment(model, lead + list(tokens))  # (L, 2, H, a+n, D)
    return (kv[:, :, :, a:].contiguous() if a else kv), a
