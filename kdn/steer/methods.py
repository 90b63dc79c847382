"""The two steering methods, and what a key-edit calibration holds.

KV here is ``(L, 2, H, T, D)`` (layers, keys/values, KV heads, tokens, head dim), keys stored
after rotary embedding at absolute positions ``start .. start+T-1``, as everywhere in KDN.

**key-edit.** For a selected KV head ``h`` of layer ``l`` the calibration holds ``u``, the head's
mean *pre-rotary* query (averaged over calibration prompts at the position that asks the question,
and over the query heads sharing the KV head), restricted to the "slow" dimensions: the rotary
pairs whose angle over ``reach`` tokens stays under one radian, plus any non-rotary dimensions.
A marked token at position ``p`` gets ``Δk = R(p)·(s(p)·√D · u / ‖u‖²)`` added to its stored key
(``R(p)`` the rotation at ``p``). A later query ``q`` at position ``p'`` then scores it higher by
``s(p) · (q_slow · u)/‖u‖² · cos(small angles)``: ``≈ s(p)`` nats for a query like the head's
typical one, since the slow pairs rotate by at most ~1 rad between ``p`` and ``p'``. The values
are untouched, so what the head reads from a token does not change, only how much.

The calibration's ``profile`` says how ``s(p)`` depends on where the token sits in the stored
document of ``n`` tokens: ``flat`` gives every marked token the spec's strength ``s``; ``ramp``
gives ``s · (n - p) / n``, the full strength at the document's first token falling to zero at its
end — it counters a model's recency bias (later tokens win ties between lookalike facts) instead of
singling one fact out, so it can be fixed per document without knowing any question.

A calibration (heads, directions, profile, default strength) is chosen once per model on
calibration prompts that never overlap the held-out ones (:mod:`kdn.lab.steer_eval`); its digest
is part of every spec that uses it.

**re-read.** ``tokens ‖ tokens[span]`` is prefilled once; the KV of the second reading (which
attended to the whole first copy) is rotated back by the offset to the span's own positions and
replaces the first reading's KV there. Values carry no position and are taken as they are.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kdn.blend.rope import RopeSpec, rope_spec
from kdn.blobstore import write_file_atomic
from kdn.config import cache_root, measured_file
from kdn.errors import InvalidInput, UnsupportedModel
from kdn.kv import forward, layers_to_chunk, output_cache
from kdn.steer import SteerSpec

DEFAULT_REACH = 1024  # tokens between a marked key and the query that should still see the boost
PROFILES = ("flat", "ramp")


@dataclass(frozen=True)
class KeyEditCalibration:
    """What key-edit needs of a model: the selected ``(layer, kv_head)`` pairs and their directions."""

    fingerprint: str  # hex of the model fingerprint
    heads: tuple[tuple[int, int], ...]
    directions: torch.Tensor  # (len(heads), D) pre-rotary, slow dimensions only, scaled: u / ‖u‖²
    strength: float  # the calibrated default strength (nats)
    reach: int = DEFAULT_REACH
    notes: dict[str, Any] = field(default_factory=dict)
    profile: str = "flat"  # how the strength depends on a token's place in the document (module docstring)

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise InvalidInput(f"unknown key-edit profile {self.profile!r}; choose one of {', '.join(PROFILES)}")

    @property
    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        what: dict[str, Any] = {"fp": self.fingerprint, "heads": [list(x) for x in self.heads], "reach": self.reach}
        if self.profile != "flat":  # a flat calibration keeps the digest it always had
            what["profile"] = self.profile
        h.update(json.dumps(what, sort_keys=True).encode())
        h.update(self.directions.to(torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {"kind": "kdn-steer-calibration", "fingerprint": self.fingerprint, "heads": [list(x) for x in self.heads],
                "directions": self.directions.tolist(), "strength": self.strength, "reach": self.reach,
                "profile": self.profile, "digest": self.digest, "notes": self.notes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "KeyEditCalibration":
        try:
            if d.get("kind") != "kdn-steer-calibration":
                raise InvalidInput("not a KDN steer calibration file")
            cal = cls(str(d["fingerprint"]), tuple(tuple(int(v) for v in x) for x in d["heads"]),  # type: ignore[misc]
                      torch.tensor(d["directions"], dtype=torch.float32).reshape(len(d["heads"]), -1),
                      float(d["strength"]), int(d.get("reach", DEFAULT_REACH)), dict(d.get("notes", {})),
                      str(d.get("profile", "flat")))
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            if isinstance(exc, InvalidInput):
                raise
            raise InvalidInput(f"malformed steer calibration: {exc}") from exc
        if d.get("digest") not in (None, cal.digest):
            raise InvalidInput("steer calibration digest does not match its contents (edited or corrupt file)")
        return cal


# -- helpers ----------------------------------------------------------------------------------------


def _layers(model: Any) -> Any:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(layers[0], "self_attn") or not hasattr(layers[0].self_attn, "q_proj"):
        raise UnsupportedModel(f"{type(model).__name__}: key-edit needs decoder layers with self_attn.q_proj (Llama family)")
    return layers


def slow_dims(spec: RopeSpec, reach: int) -> torch.Tensor:
    """Boolean mask (D,) of dimensions that rotate by at most 1 rad over ``reach`` tokens."""
    half = spec.rotary_dim // 2
    mask = torch.zeros(spec.head_dim, dtype=torch.bool)
    slow = spec.inv_freq.to(torch.float64) * reach <= 1.0  # (r/2,)
    mask[:half] = slow
    mask[half : spec.rotary_dim] = slow
    mask[spec.rotary_dim :] = True
    if not bool(mask.any()):
        raise UnsupportedModel(f"no rotary dimension of this model is slow enough for a reach of {reach} tokens")
    return mask


def rotate_at(vec: torch.Tensor, positions: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """``vec`` (D,) rotated to each of ``positions`` (n,): ``(n, D)``, HF's half-split RoPE pairs."""
    r, half = rope.rotary_dim, rope.rotary_dim // 2
    ang = positions.to(torch.float64)[:, None] * rope.inv_freq.to(torch.float64)[None, :]  # (n, r/2)
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(torch.float32)  # (n, r)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(torch.float32)
    rot, rest = vec[:r], vec[r:]
    rotated_half = torch.cat((-rot[half:], rot[:half]))  # (r,)
    return torch.cat((rot * cos + rotated_half * sin, rest.expand(len(positions), -1)), -1)


@torch.inference_mode()
def full_kv(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """KV ``(L, 2, H, T, D)`` of a prefill of ``tokens`` at positions ``0..T-1``."""
    out = model(input_ids=torch.tensor([list(tokens)], dtype=torch.long), use_cache=True, logits_to_keep=1)
    return layers_to_chunk(output_cache(out).layers)


@torch.inference_mode()
def query_sums(model: Any, prompts: Sequence[tuple[Sequence[int], int]], *,
               cache: Callable[[], Any] | None = None) -> torch.Tensor:
    """Sum over prompts (``(tokens, position)``) of each KV head's pre-rotary query at that
    position, ``(L, H_kv, D)`` in float64, averaged over the query heads that share each KV head.
    ``cache``: a function giving, per prompt, the KV cache its tokens follow; None: the tokens alone."""
    layers = _layers(model)
    cfg = model.config
    n_q = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_q)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q)
    sums = torch.zeros(len(layers), n_kv, d, dtype=torch.float64)
    captured: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda _m, _i, out, li=li: captured.__setitem__(li, out.detach())) for li, layer in enumerate(layers)]
    try:
        for tokens, pos in prompts:
            forward(model, input_ids=torch.tensor([list(tokens[: pos + 1])], dtype=torch.long),
                    cache=None if cache is None else cache(), use_cache=cache is not None, logits_to_keep=1)
            for li in range(len(layers)):
                q = captured[li][0, pos].reshape(n_q, d).to(torch.float64)  # (Hq, D)
                sums[li] += q.reshape(n_kv, n_q // n_kv, d).mean(1)
    finally:
        for h in hooks:
            h.remove()
    return sums


def query_means(model: Any, prompts: Sequence[tuple[Sequence[int], int]]) -> torch.Tensor:
    """Mean pre-rotary query ``(L, H_kv, D)`` at one position per prompt (``(tokens, position)``),
    averaged over prompts and over the query heads that share each KV head."""
    return (query_sums(model, prompts) / max(1, len(prompts))).to(torch.float32)


def directions_for(means: torch.Tensor, heads: Sequence[tuple[int, int]], mask: torch.Tensor) -> torch.Tensor:
    """``u / ‖u‖²`` per selected head, ``u`` the mean query on the slow dimensions (``(n, D)``)."""
    out = torch.zeros(len(heads), means.shape[-1])
    for i, (l, h) in enumerate(heads):
        u = means[l, h] * mask
        n2 = float((u * u).sum())
        if n2 > 0:
            out[i] = u / n2
    return out


def token_strengths(positions: torch.Tensor, n: int, strength: float, profile: str) -> torch.Tensor:
    """``s(p)`` for document positions ``positions`` (n,) of a document of ``n`` tokens (module docstring)."""
    if profile == "flat":
        return torch.full((len(positions),), float(strength))
    if profile == "ramp":
        return float(strength) * (n - positions.to(torch.float64)).clamp(min=0).to(torch.float32) / max(1, n)
    raise InvalidInput(f"unknown key-edit profile {profile!r}")


def apply_key_edit(kv: torch.Tensor, marks: Sequence[tuple[int, int]], strength: float, cal: KeyEditCalibration,
                   rope: RopeSpec, *, start: int = 0) -> torch.Tensor:
    """A copy of ``kv`` ``(L, 2, H, T, D)`` (positions ``start..``) with the marked tokens' keys edited;
    the profile's document is the ``T`` tokens of ``kv``."""
    out = kv.clone()
    T, D = kv.shape[3], kv.shape[4]
    idx = torch.tensor(sorted({p for s, e in marks for p in range(s, min(e, T))}), dtype=torch.long)
    if idx.numel() == 0 or not cal.heads:
        return out
    scale = math.sqrt(D) / rope.attention_scaling
    w = token_strengths(idx, T, strength, cal.profile)[:, None]  # (n, 1) nats per marked token
    for (l, h), u in zip(cal.heads, cal.directions):
        rows = rotate_at((scale * u).to(torch.float32), idx + start, rope) * w  # (n, D): R(p)·Δ at each token
        out[l, 0, h, idx] = (out[l, 0, h, idx].float() + rows).to(kv.dtype)
    return out


@torch.inference_mode()
def re_read(model: Any, tokens: Sequence[int], spans: Sequence[tuple[int, int]] = (), *, keep: int = 0) -> torch.Tensor:
    """KV ``(L, 2, H, T, D)`` of ``tokens`` whose ``spans`` (default: everything from ``keep``) hold
    the model's second reading, rotated back to the first copy's positions."""
    T = len(tokens)
    spans = list(spans) or [(keep, T)]
    rope = rope_spec(model)
    second = [t for s, e in spans for t in tokens[s:e]]
    kv = full_kv(model, list(tokens) + second)  # (L, 2, H, T + n2, D)
    out = kv[:, :, :, :T].clone()
    at = T
    for s, e in spans:
        n = e - s
        sec = kv[:, :, :, at : at + n]  # (L, 2, H, n, D) read at positions at..at+n-1
        out[:, 1, :, s:e] = sec[:, 1]
        out[:, 0, :, s:e] = rope.rotate(sec[:, 0], s - at)
        at += n
    return out


@torch.inference_mode()
def read_after(model: Any, kv: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """KV ``(L, 2, H, len(tokens), D)`` of ``tokens`` read after the cache ``kv`` ``(L, 2, H, T, D)``:
    their positions follow it (``T..``), and it is left as it was."""
    from kdn.kv import build_cache

    T = kv.shape[3]
    cache = build_cache([kv], model.config)
    forward(model, input_ids=torch.tensor([list(tokens)], dtype=torch.long), cache=cache, use_cache=True,
            logits_to_keep=1)
    return layers_to_chunk(cache.layers, T, T + len(tokens))


@torch.inference_mode()
def re_read_from(model: Any, kv: torch.Tensor, tokens: Sequence[int], spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """:func:`re_read` given the plain KV ``kv`` ``(L, 2, H, T, D)`` of ``tokens`` (positions
    ``0..T-1``): only the second reading is computed, on top of ``kv`` (same result up to rounding)."""
    T = len(tokens)
    spans = list(spans) or [(0, T)]
    second = [t for s, e in spans for t in tokens[s:e]]
    out = kv.clone()
    if not second:
        return out
    rope = rope_spec(model)
    read = read_after(model, kv, second)  # (L, 2, H, len(second), D) at positions T..
    at = 0
    for s, e in spans:
        n = e - s
        out[:, 1, :, s:e] = read[:, 1, :, at : at + n]
        out[:, 0, :, s:e] = rope.rotate(read[:, 0, :, at : at + n], s - (T + at))
        at += n
    return out


def steered_kv(model: Any, tokens: Sequence[int], spec: SteerSpec, cal: KeyEditCalibration | None = None) -> torch.Tensor:
    """The stored KV ``(L, 2, H, T, D)`` of a document prefilled at ``0..T-1``, steered by ``spec``."""
    spec.check_fits(len(tokens))
    if spec.method == "re-read":
        return re_read(model, tokens, spec.marks)
    if cal is None or cal.digest != spec.calibration:
        raise InvalidInput("key-edit spec names calibration "
                           f"{spec.calibration[:16]}..., which this origin does not hold for the model")
    return apply_key_edit(full_kv(model, tokens), spec.marks, spec.strength, cal, rope_spec(model))


# -- where a calibration lives -----------------------------------------------------------------------

CALIBRATION_DIRNAME = "steer-calibrations"
SHIPPED_ROOT = Path(__file__).with_name("calibrations")  # the built-in models' calibrations, measured here


def calibration_root(env: dict[str, str] | None = None) -> Path:
    return cache_root(env) / CALIBRATION_DIRNAME


def write_calibration(cal: KeyEditCalibration, root: Path | None = None) -> Path:
    """Atomically write ``<root>/<fingerprint>.json`` (:func:`kdn.blobstore.write_file_atomic`)."""
    path = (root or calibration_root()) / f"{cal.fingerprint}.json"
    write_file_atomic(path, (json.dumps(cal.to_json()) + "\n").encode())
    return path


def calibration_file(fingerprint: str, root: Path | None = None) -> Path:
    """The file the model's calibration is read from. ``root`` None: ``$KDN_CACHE``'s (a user's own
    ``kdn eval-steer``), else the one shipped with KDN for a built-in model (:data:`SHIPPED_ROOT`,
    written from the record of ``benchmarks/steer.py``, its measured effect in its notes); an
    explicit ``root``: that directory only. It may not exist."""
    return measured_file(f"{fingerprint}.json", root, calibration_root(), SHIPPED_ROOT)


def load_calibration(fingerprint: str, root: Path | None = None) -> KeyEditCalibration | None:
    """The model's key-edit calibration (from :func:`calibration_file`), or ``None`` when none was
    written."""
    path = calibration_file(fingerprint, root)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise InvalidInput(f"{path}: malformed steer calibration ({exc})") from exc
    cal = KeyEditCalibration.from_json(data)
    if cal.fingerprint != fingerprint:
        raise InvalidInput(f"{path}: calibration is for model {cal.fingerprint[:16]}..., not {fingerprint[:16]}...")
    return cal


def calibration_summary(fingerprint: str, root: Path | None = None) -> dict[str, Any]:
    """What an operator sees of a model's steering (``kdn model info``, the origin's stats): whether
    key-edit is calibrated, how (profile, heads, default strength) and what it was measured to do.
    ``re-read`` needs no calibration and is always available."""
    path = calibration_file(fingerprint, root)
    try:
        cal = load_calibration(fingerprint, path.parent)
    except InvalidInput as exc:
        return {"methods": ["re-read"], "key_edit": None, "problem": str(exc)}
    if cal is None:
        return {"methods": ["re-read"], "key_edit": None,
                "problem": "key-edit is not calibrated for this model (kdn eval-steer --model MODEL --out DIR)"}
    layers = sorted({l for l, _ in cal.heads})
    out: dict[str, Any] = {"methods": ["key-edit", "re-read"], "key_edit": {
        "calibration": cal.digest, "profile": cal.profile, "strength": cal.strength, "heads": len(cal.heads),
        "layers": f"{layers[0]}-{layers[-1]}" if layers else "", "rule": cal.notes.get("rule"),
        "source": "shipped with KDN" if path.parent == SHIPPED_ROOT else "measured on this machine (kdn eval-steer)"}}
    measured = cal.notes.get("measured")
    if measured:
        rows = measured.get("by_depth", {})
        out["key_edit"]["measured"] = {
            "haystacks": measured.get("haystacks"), "weak_depths": measured.get("weak_depths"),
            **{kind: {d: round(c["delta"] * 100, 1) for d, c in row.items()} for kind, row in rows.items()},
            "claims_met": {k: bool(v.get("met")) for k, v in measured.get("claims", {}).items()}}
    return out
