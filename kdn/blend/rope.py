"""Moving stored keys to another position: a rotation by the position difference.

With rotary position embeddings (RoPE) a key at position ``p`` is stored as
``k_p = s · R(p·θ) k`` where ``R`` rotates each pair of dimensions ``(i, i + r/2)`` of the first
``r`` ("rotary") dimensions by the angle ``p·θ_i``, ``θ = inv_freq``, and ``s`` is the rope type's
attention scaling (1 for most). Rotations compose, so moving a key from ``p`` to ``p + δ`` is
``R(δ·θ) k_p`` — a pure rotation: the scaling ``s`` is already inside ``k_p`` and must not be
applied twice. Values carry no position and do not change.

This holds when ``θ`` does not depend on the sequence (rope types ``default``, ``linear``,
``llama3``, ``yarn``) and the model pairs dimensions as HF's ``rotate_half`` does (first half with
second half of the rotary part). It does not hold for ``dynamic`` or ``longrope`` (their
frequencies change with the sequence length) nor for interleaved-pair models (GLM): those are
refused with :class:`~kdn.errors.UnsupportedModel`. Because "does this model rotate the way we
assume" is a question about code we do not own, :func:`rope_spec` also *checks* it once per model:
it prefills a few tokens at positions ``0..`` and at ``δ..`` and requires the rotated keys to match
the fresh ones at every layer. A model that fails is refused, never served wrong KV.

Everything here uses the model's own rotary module (``model.model.rotary_emb``): its ``inv_freq``
already carries the rope type's scaling (linear, llama3 ...), and its length says how many
dimensions rotate (partial rotary, ``partial_rotary_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kdn.errors import UnsupportedModel
from kdn.kv import output_cache

SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
_CHECK_TOKENS = 6
_CHECK_DELTA = 37
_CHECK_RTOL = 1e-3


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """How a model's keys rotate: ``inv_freq`` (r/2,) float32 over the first ``rotary_dim`` of
    ``head_dim`` dimensions, pairs ``(i, i + r/2)``."""

    rope_type: str
    inv_freq: torch.Tensor  # (r/2,)
    rotary_dim: int
    head_dim: int
    attention_scaling: float

    def rotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys ``(..., T, head_dim)`` computed at positions ``p`` as if computed at ``p + delta``.

        ``delta == 0`` returns ``keys`` itself (bit-exact). Angles are taken in float64 and the
        rotation in float32, then cast back to the keys' dtype.
        """
        if delta == 0:
            return keys
        r = self.rotary_dim
        ang = float(delta) * self.inv_freq.to(torch.float64)  # (r/2,)
        cos = torch.cat((ang.cos(), ang.cos())).to(torch.float32)  # (r,)
        sin = torch.cat((ang.sin(), ang.sin())).to(torch.float32)  # (r,)
        k = keys.to(torch.float32)
        rot, rest = k[..., :r], k[..., r:]  # (..., T, r), (..., T, D - r)
        half = r // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)  # HF rotate_half
        out = torch.cat((rot * cos + rotated_half * sin, rest), dim=-1)  # (..., T, D)
        return out.to(keys.dtype)


def rotary_module(model: Any) -> Any:
    """The model's rotary embedding module (HF Llama family: ``model.model.rotary_emb``)."""
    inner = getattr(model, "model", model)
    rot = getattr(inner, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise UnsupportedModel(
            f"{type(model).__name__} has no rotary embedding module with inv_freq (model.model.rotary_emb): "
            "cannot move its keys to another position"
        )
    return rot


def _rope_type(model: Any, rot: Any) -> str:
    rt = getattr(rot, "rope_type", None)
    if rt is None:
        params = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
        rt = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    return str(rt)


_SPEC_ATTR = "_kdn_rope_spec"  # the verified spec, remembered on the model object itself


def rope_spec(model: Any, *, verify: bool = True) -> RopeSpec:
    """The model's :class:`RopeSpec`, refusing what cannot be moved by a rotation.

    ``verify`` (default): check once per model object that rotated keys equal a fresh prefill at
    the shifted positions at every layer (a few tokens; see the module docstring). A verified spec
    is remembered on the model object; a model whose weights change afterwards keeps it.
    """
    cached = getattr(model, _SPEC_ATTR, None)
    if cached is not None and verify:
        return cached
    rot = rotary_module(model)
    rt = _rope_type(model, rot)
    if rt not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"RoPE type {rt!r} of {type(model).__name__} is not supported for re-positioning "
            f"(supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}); its frequencies depend on the "
            "sequence, so a rotation by the position difference would give wrong keys. Use prefix reuse."
        )
    cfg = model.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    inv_freq = rot.inv_freq.detach().to(torch.float32).clone()  # (r/2,)
    rotary_dim = 2 * int(inv_freq.numel())
    if rotary_dim > head_dim or rotary_dim == 0:
        raise UnsupportedModel(f"rotary dimension {rotary_dim} does not fit head_dim {head_dim}")
    spec = RopeSpec(rt, inv_freq, rotary_dim, head_dim, float(getattr(rot, "attention_scaling", 1.0)))
    if verify:
        _verify(model, spec)
        model.__dict__[_SPEC_ATTR] = spec  # a plain attribute, not a submodule or buffer
    return spec


@torch.inference_mode()
def _verify(model: Any, spec: RopeSpec) -> None:
    """Prefill ``_CHECK_TOKENS`` tokens at positions 0.. and at ``δ..``; rotated keys must match."""
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, max(4, vocab), (1, _CHECK_TOKENS), generator=gen)  # (1, T)
    pos0 = torch.arange(_CHECK_TOKENS).unsqueeze(0)  # (1, T)
    a = output_cache(model(input_ids=ids, position_ids=pos0, use_cache=True, logits_to_keep=1))
    b = output_cache(model(input_ids=ids, position_ids=pos0 + _CHECK_DELTA, use_cache=True, logits_to_keep=1))
    for i, (la, lb) in enumerate(zip(a.layers, b.layers)):
        want = lb.keys.float()  # (1, H, T, D)
        got = spec.rotate(la.keys, _CHECK_DELTA).float()
        err = float((got - want).abs().max())
        scale = float(want.abs().max()) + 1e-6
        vals = float((la.values.float() - lb.values.float()).abs().max())
        if err > _CHECK_RTOL * scale or vals > _CHECK_RTOL * (float(lb.values.abs().max()) + 1e-6):
            raise UnsupportedModel(
                f"{type(model).__name__}: keys rotated by {_CHECK_DELTA} positions differ from a fresh prefill there "
                f"at layer {i} (max error {err:.3g} of {scale:.3g}); this model's rotary embedding is not the "
                "half-split RoPE KDN can move (interleaved pairs? sequence-dependent frequencies?). Use prefix reuse."
            )
