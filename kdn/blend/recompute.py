"""Blending: join independently computed segments into one context's KV, recomputing a few tokens.

A prompt is laid out as ``[prefix][segment_1] … [segment_n][question]``. The prefix's KV is exact
(a prefix-chain hit or computed here); each segment's KV was computed alone at positions ``0..``
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
  each segment grew when it was computed alone), recomputed at every layer.
- ``Naive()`` — nothing recomputed.

The question is then prefilled over the blended KV as over any cache, and generation proceeds.

Where each step runs, and why: all of it runs on the **inference host**. Fetching the segments is
the edge's job (they are plain artifacts under segment keys, served and hinted like chunks), but
re-positioning needs only the model's ``inv_freq`` and is a cheap elementwise rotation done while
the bytes are already being copied into the host's cache, and the selective recompute needs the
model's weights, the prefix's KV and every other segment of *this* prompt — all of which the host
has and an edge does not. Running it on an edge would ship the whole blended context back per
request (a new, unshareable artifact) and make the edge a GPU service; on the host it costs the
recomputed share of one prefill, overlapped with nothing else. Blended KV is never written back
(see :mod:`kdn.segments`): it is specific to one prompt and would only flood the cache.

The selective pass drives the model's own decoder layers (``model.model.layers``), embedding and
rotary modules, with an explicit position list, an additive attention mask over the full mixed KV
(query at absolute position ``p`` sees keys ``0..p``) and a small cache object whose ``update``
scatters the fresh K/V of the recomputed positions into the mixed KV. Any HF model whose attention
calls ``cache.update(k, v, layer_idx)`` after rotary and before attention (Llama, Mistral, Qwen2/3,
StableLM …) works; :func:`check_model` refuses the rest.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kdn.blend.rope import RopeSpec, rope_spec
from kdn.errors import InvalidInput, UnsupportedModel
from kdn.kv import cache_from_layers
from kdn.segments import Segment


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
        if not 0.0 <= self.ratio <= 1.0:
            raise InvalidInput(f"recompute ratio must be in [0, 1], got {self.ratio}")
        if self.check_layer < 0:
            raise InvalidInput(f"check_layer must be >= 0, got {self.check_layer}")


Policy = Naive | FirstK | Deviation


# -- layout ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Layout:
    """A context of ``N`` tokens: an exact prefix, then re-placed segments.

    ``keys``/``values``: per layer ``(1, H, N, D)``; ``spans``: each segment's ``[start, end)``.
    """

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prefix_len: int
    spans: list[tuple[int, int]]

    @property
    def n(self) -> int:
        return len(self.tokens)


def place(
    model: Any,
    segments: Sequence[Segment],
    *,
    prefix_tokens: Sequence[int] = (),
    prefix_kv: torch.Tensor | None = None,
    rope: RopeSpec | None = None,
) -> Layout:
    """Concatenate ``prefix_kv`` ``(L, 2, H, P, D)`` and every segment, each rotated to its place."""
    rope = rope or rope_spec(model)
    P = len(prefix_tokens)
    if (prefix_kv is None) != (P == 0) or (prefix_kv is not None and prefix_kv.shape[3] != P):
        raise InvalidInput("prefix_kv must hold exactly the prefix tokens")
    ref = prefix_kv if prefix_kv is not None else (segments[0].kv if segments else None)
    if ref is None:
        raise InvalidInput("nothing to place: no prefix and no segments")
    L = ref.shape[0]
    keys: list[list[torch.Tensor]] = [[] for _ in range(L)]
    values: list[list[torch.Tensor]] = [[] for _ in range(L)]
    if prefix_kv is not None:
        for l in range(L):
            keys[l].append(prefix_kv[l, 0])  # (H, P, D)
            values[l].append(prefix_kv[l, 1])
    tokens = list(prefix_tokens)
    spans = []
    pos = P
    for seg in segments:
        if seg.kv.shape[0] != L or seg.kv.shape[2] != ref.shape[2] or seg.kv.shape[4] != ref.shape[4]:
            raise InvalidInput(f"segment KV {tuple(seg.kv.shape)} does not match the context's {tuple(ref.shape)}")
        n = len(seg.tokens)
        for l in range(L):
            keys[l].append(rope.rotate(seg.kv[l, 0], pos - seg.start))  # (H, n, D) at positions pos..pos+n-1
            values[l].append(seg.kv[l, 1])  # (H, n, D): values carry no position
        tokens += seg.tokens
        spans.append((pos, pos + n))
        pos += n
    # per layer (H, N, D) -> (1, H, N, D), a fresh tensor the recompute may write into
    k_out = [torch.cat(ks, dim=1).unsqueeze(0) for ks in keys]
    v_out = [torch.cat(vs, dim=1).unsqueeze(0) for vs in values]
    return Layout(tokens, k_out, v_out, P, spans)


# -- the selective recompute ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlendStats:
    """What a blend cost. ``selected``: segment tokens recomputed through the last layer;
    ``candidates``: segment tokens; ``layer_token_fraction``: (token, layer) pairs computed over
    those a full recompute of the segments would compute (the compute share)."""

    policy: str
    candidates: int
    selected: int
    layer_token_fraction: float
    seconds: float
    selected_positions: tuple[int, ...] = field(default_factory=tuple)

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


def check_model(model: Any) -> RopeSpec:
    """Refuse a model the selective pass cannot drive; return its verified :class:`RopeSpec`."""
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "rotary_emb"):
        if inner is None or not hasattr(inner, attr):
            raise UnsupportedModel(
                f"{type(model).__name__} lacks model.{attr}: blending drives HF decoder layers "
                "(model.model.embed_tokens/layers/rotary_emb) and cannot run this architecture"
            )
    return rope_spec(model)


def _mask(q_pos: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``(1, 1, S, N)``: the query at absolute position p sees keys 0..p."""
    allowed = torch.arange(n).unsqueeze(0) <= q_pos.unsqueeze(1)  # (S, N)
    m = torch.zeros(allowed.shape, dtype=dtype)
    m.masked_fill_(~allowed, torch.finfo(dtype).min)
    return m.view(1, 1, *allowed.shape)


def _run_layer(layer: Any, h: torch.Tensor, q_pos: torch.Tensor, mixed: _MixedKV, inner: Any, n: int) -> torch.Tensor:
    """One decoder layer over the hidden states ``h`` ``(1, S, hidden)`` of positions ``q_pos`` ``(S,)``.

    When ``q_pos`` is every position ``0..n-1`` the layer runs as a plain causal prefill (no
    explicit mask, so the attention kernel never materialises the ``(S, N)`` scores)."""
    pos_ids = q_pos.unsqueeze(0)  # (1, S)
    cos, sin = inner.rotary_emb(h, position_ids=pos_ids)  # (1, S, r) each
    mixed.idx = q_pos
    everything = q_pos.numel() == n  # q_pos is sorted and distinct: it is arange(n)
    out = layer(h, attention_mask=None if everything else _mask(q_pos, n, h.dtype), position_ids=pos_ids,
                cache=mixed, use_cache=True, position_embeddings=(cos, sin))
    return out[0] if isinstance(out, tuple) else out  # (1, S, hidden)


def _project(layer: Any, h: torch.Tensor, q_pos: torch.Tensor, mixed: _MixedKV, inner: Any, n: int):
    """Fresh K/V ``(1, H, S, D)`` of one layer for ``h``: the layer runs up to its cache update."""
    mixed.capture = True
    try:
        _run_layer(layer, h, q_pos, mixed, inner, n)
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
    t0 = time.perf_counter()
    check_model(model)
    inner = model.model
    layers = list(inner.layers)
    L = len(layers)
    n = layout.n
    window = getattr(model.config, "sliding_window", None)
    if window and getattr(model.config, "use_sliding_window", True) and n > window:
        raise UnsupportedModel(f"context of {n} tokens exceeds the model's sliding window ({window}); blending "
                               "attends over the whole mixed KV and would not match this model")
    cand = torch.arange(layout.prefix_len, n)  # (A,) absolute positions of segment tokens
    A = int(cand.numel())
    mixed = _MixedKV(layout.keys, layout.values)
    layer_tokens = 0
    active = torch.empty(0, dtype=torch.long)  # positions still being recomputed
    if A and not isinstance(policy, Naive):
        ids = torch.tensor(layout.tokens, dtype=torch.long)
        if isinstance(policy, FirstK):
            active = torch.cat([torch.arange(s, min(e, s + policy.k)) for s, e in layout.spans]) if layout.spans else cand
        elif policy.check_layer > 0:
            # layers before the check run in full; the (exact) prefix joins them so that the pass
            # is a plain causal prefill over 0..n-1. Its fresh KV equals its cached KV.
            active = torch.arange(n)
        else:
            active = cand
        if active.numel():
            h = inner.embed_tokens(ids[active].unsqueeze(0))  # (1, S, hidden)
            check = policy.check_layer if isinstance(policy, Deviation) else -1
            for l, layer in enumerate(layers):
                if l == check and active.numel():
                    if active.numel() > A:  # drop the prefix: only document tokens are candidates
                        h, active = h[:, -A:], active[-A:]
                    k_new, v_new = _project(layer, h, active, mixed, inner, n)  # (1, H, S, D) each
                    k_old = mixed.keys[l][:, :, active]  # (1, H, S, D)
                    v_old = mixed.values[l][:, :, active]
                    dev = ((k_new.float() - k_old.float()) ** 2).sum(dim=(0, 1, 3)) + \
                        ((v_new.float() - v_old.float()) ** 2).sum(dim=(0, 1, 3))  # (S,)
                    keep = min(int(active.numel()), math.ceil(policy.ratio * A - 1e-9))
                    # every token with fresh K/V at this layer gets it; only the top `keep` go on
                    mixed.keys[l][:, :, active] = k_new.to(mixed.keys[l].dtype)
                    mixed.values[l][:, :, active] = v_new.to(mixed.values[l].dtype)
                    top = torch.topk(dev, keep).indices.sort().values if keep else torch.empty(0, dtype=torch.long)
                    h, active = h[:, top], active[top]
                if not active.numel():
                    break
                h = _run_layer(layer, h, active, mixed, inner, n)
                layer_tokens += min(A, int(active.numel()))  # document tokens only
    cache = cache_from_layers(list(zip(mixed.keys, mixed.values)), model.config)
    stats = BlendStats(
        policy=_describe(policy), candidates=A, selected=int(active.numel()),
        layer_token_fraction=layer_tokens / (L * A) if A else 0.0, seconds=time.perf_counter() - t0,
        selected_positions=tuple(int(p) for p in active.tolist()),
    )
    return cache, stats


def _describe(policy: Policy) -> str:
    if isinstance(policy, Deviation):
        return f"blend@{policy.ratio:g}"
    if isinstance(policy, FirstK):
        return f"first-{policy.k}"
    return "naive"


@torch.inference_mode()
def prefill_segment(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """A segment's KV ``(L, 2, H, n, D)``: the document prefilled alone at positions ``0..n-1``."""
    if not tokens:
        raise InvalidInput("a segment needs at least one token")
    ids = torch.tensor([list(tokens)], dtype=torch.long)  # (1, n)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    # per layer keys/values (1, H, n, D) -> (2, H, n, D); stacked -> (L, 2, H, n, D)
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in out.cache.layers])
