"""The two steering methods, and the key-edit calibration.

KV here is ``(L, 2, H, T, D)`` (layers, keys/values, KV heads, tokens, head dim), keys stored
after rotary embedding at absolute positions ``start .. start+T-1``, as everywhere in KDN.

**key-edit.** For a selected KV head ``h`` of layer ``l`` the calibration holds ``u``, the head's
mean *pre-rotary* query (averaged over calibration prompts at the position that asks the question,
and over the query heads sharing the KV head), restricted to the "slow" dimensions: the rotary
pairs whose angle over ``reach`` tokens stays under one radian, plus any non-rotary dimensions.
A marked token at position ``p`` gets ``Δk = R(p)·(s·√D · u / ‖u‖²)`` added to its stored key
(``R(p)`` the rotation at ``p``, ``s`` the strength in nats). A later query ``q`` at position ``p'``
then scores it higher by ``s · (q_slow · u)/‖u‖² · cos(small angles)``: ``≈ s`` for a query like the
head's typical one, since the slow pairs rotate by at most ~1 rad between ``p`` and ``p'``. The
values are untouched, so what the head reads from a token does not change, only how much.

Head choice (PASTA's profiling, small): on calibration prompts drawn from the training
distribution (never the held-out set) each KV head alone is edited at a probe strength with
correct marks; heads whose edit raises the mean log-probability of the right answer are kept
(best first, at most ``max_heads``), then the strength is picked from a grid by calibration accuracy.

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
from kdn.config import cache_root
from kdn.errors import InvalidInput, UnsupportedModel
from kdn.steer import SteerSpec

DEFAULT_REACH = 1024  # tokens between a marked key and the query that should still see the boost


@dataclass(frozen=True)
class KeyEditCalibration:
    """What key-edit needs of a model: the selected ``(layer, kv_head)`` pairs and their directions."""

    fingerprint: str  # hex of the model fingerprint
    heads: tuple[tuple[int, int], ...]
    directions: torch.Tensor  # (len(heads), D) pre-rotary, slow dimensions only, scaled: u / ‖u‖²
    strength: float  # the calibrated default strength (nats)
    reach: int = DEFAULT_REACH
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps({"fp": self.fingerprint, "heads": [list(x) for x in self.heads], "reach": self.reach},
                            sort_keys=True).encode())
        h.update(self.directions.to(torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {"kind": "kdn-steer-calibration", "fingerprint": self.fingerprint, "heads": [list(x) for x in self.heads],
                "directions": self.directions.tolist(), "strength": self.strength, "reach": self.reach,
                "digest": self.digest, "notes": self.notes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "KeyEditCalibration":
        try:
            if d.get("kind") != "kdn-steer-calibration":
                raise InvalidInput("not a KDN steer calibration file")
            cal = cls(str(d["fingerprint"]), tuple(tuple(int(v) for v in x) for x in d["heads"]),  # type: ignore[misc]
                      torch.tensor(d["directions"], dtype=torch.float32).reshape(len(d["heads"]), -1),
                      float(d["strength"]), int(d.get("reach", DEFAULT_REACH)), dict(d.get("notes", {})))
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
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in out.cache.layers])


@torch.inference_mode()
def query_means(model: Any, prompts: Sequence[tuple[Sequence[int], int]]) -> torch.Tensor:
    """Mean pre-rotary query ``(L, H_kv, D)`` at one position per prompt (``(tokens, position)``),
    averaged over prompts and over the query heads that share each KV head."""
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
            model(input_ids=torch.tensor([list(tokens[: pos + 1])], dtype=torch.long), logits_to_keep=1)
            for li in range(len(layers)):
                q = captured[li][0, pos].reshape(n_q, d).to(torch.float64)  # (Hq, D)
                sums[li] += q.reshape(n_kv, n_q // n_kv, d).mean(1)
    finally:
        for h in hooks:
            h.remove()
    return (sums / max(1, len(prompts))).to(torch.float32)


def directions_for(means: torch.Tensor, heads: Sequence[tuple[int, int]], mask: torch.Tensor) -> torch.Tensor:
    """``u / ‖u‖²`` per selected head, ``u`` the mean query on the slow dimensions (``(n, D)``)."""
    out = torch.zeros(len(heads), means.shape[-1])
    for i, (l, h) in enumerate(heads):
        u = means[l, h] * mask
        n2 = float((u * u).sum())
        if n2 > 0:
            out[i] = u / n2
    return out


def apply_key_edit(kv: torch.Tensor, marks: Sequence[tuple[int, int]], strength: float, cal: KeyEditCalibration,
                   rope: RopeSpec, *, start: int = 0) -> torch.Tensor:
    """A copy of ``kv`` ``(L, 2, H, T, D)`` (positions ``start..``) with the marked tokens' keys edited."""
    out = kv.clone()
    T, D = kv.shape[3], kv.shape[4]
    idx = torch.tensor(sorted({p for s, e in marks for p in range(s, min(e, T))}), dtype=torch.long)
    if idx.numel() == 0 or not cal.heads:
        return out
    scale = float(strength) * math.sqrt(D) / rope.attention_scaling
    for (l, h), u in zip(cal.heads, cal.directions):
        rows = rotate_at((scale * u).to(torch.float32), idx + start, rope)  # (n, D): R(p)·Δ at each token
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


def steered_kv(model: Any, tokens: Sequence[int], spec: SteerSpec, cal: KeyEditCalibration | None = None) -> torch.Tensor:
    """The stored KV ``(L, 2, H, T, D)`` of a document prefilled at ``0..T-1``, steered by ``spec``."""
    spec.check_fits(len(tokens))
    if spec.method == "re-read":
        return re_read(model, tokens, spec.marks)
    if cal is None or cal.digest != spec.calibration:
        raise InvalidInput("key-edit spec names calibration "
                           f"{spec.calibration[:16]}..., which this origin does not hold for the model")
    return apply_key_edit(full_kv(model, tokens), spec.marks, spec.strength, cal, rope_spec(model))


# -- calibration ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CalPrompt:
    """A training-distribution prompt: ``context`` (stored), ``marks`` in it, then ``tail`` fed
    after it (question + all but the last answer token) and the ``answer`` tokens."""

    context: tuple[int, ...]
    marks: tuple[tuple[int, int], ...]
    tail: tuple[int, ...]
    answer: tuple[int, ...]


@torch.inference_mode()
def answer_logprob(model: Any, kv: torch.Tensor, tail: Sequence[int], answer: Sequence[int]) -> tuple[float, bool]:
    """(sum of log p(answer), all answer tokens greedy-right) reading ``kv`` then ``tail``."""
    from kdn.kv import cache_from_layers

    cache = cache_from_layers([(kv[l, 0].unsqueeze(0), kv[l, 1].unsqueeze(0)) for l in range(kv.shape[0])], model.config)
    logits = model(input_ids=torch.tensor([list(tail)]), cache=cache, use_cache=True, logits_to_keep=len(answer)).logits[0]
    lp = logits.float().log_softmax(-1)
    ans = torch.tensor(list(answer))
    return float(lp[torch.arange(len(answer)), ans].sum()), bool(lp.argmax(-1).tolist() == list(answer))


@torch.inference_mode()
def calibrate_key_edit(model: Any, fingerprint: str, prompts: Sequence[CalPrompt], *, max_heads: int = 4,
                       probe: float = 2.0, strengths: Sequence[float] = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0),
                       reach: int = DEFAULT_REACH, log: Callable[[str], None] = lambda s: None) -> KeyEditCalibration:
    """Pick heads and a strength for key-edit on ``prompts`` (see the module docstring)."""
    if not prompts:
        raise InvalidInput("calibration needs prompts")
    rope = rope_spec(model)
    mask = slow_dims(rope, reach)
    qpos = [(list(p.context) + list(p.tail), len(p.context) + len(p.tail) - len(p.answer)) for p in prompts]
    means = query_means(model, qpos)  # (L, Hkv, D)
    L, H = means.shape[:2]
    base = [full_kv(model, p.context) for p in prompts]
    plain = [answer_logprob(model, kv, p.tail, p.answer) for kv, p in zip(base, prompts)]

    def score(heads: Sequence[tuple[int, int]], s: float) -> tuple[float, float]:
        cal = KeyEditCalibration(fingerprint, tuple(heads), directions_for(means, heads, mask), s, reach)
        lps, hits = 0.0, 0
        for kv, p in zip(base, prompts):
            lp, ok = answer_logprob(model, apply_key_edit(kv, p.marks, s, cal, rope), p.tail, p.answer)
            lps += lp
            hits += ok
        return lps / len(prompts), hits / len(prompts)

    plain_lp = sum(lp for lp, _ in plain) / len(prompts)
    plain_acc = sum(ok for _, ok in plain) / len(prompts)
    gains = {}
    for l in range(L):
        for h in range(H):
            lp, acc = score([(l, h)], probe)
            gains[(l, h)] = lp - plain_lp
            log(f"  head L{l}H{h}: log-prob gain {gains[(l, h)]:+.3f}, accuracy {acc:.3f} (plain {plain_acc:.3f})")
    ranked = [hd for hd, g in sorted(gains.items(), key=lambda kv: -kv[1]) if g > 0][:max_heads]
    if not ranked:
        ranked = [max(gains, key=lambda hd: gains[hd])]
    best: tuple[float, float, float, int] = (-1.0, -math.inf, probe, 1)  # accuracy, log-prob, strength, heads
    for k in range(1, len(ranked) + 1):
        for s in strengths:
            lp, acc = score(ranked[:k], s)
            log(f"  heads {ranked[:k]} strength {s:g}: accuracy {acc:.3f}, log-prob {lp:.3f}")
            if (acc, lp) > best[:2]:
                best = (acc, lp, s, k)
    chosen = ranked[: best[3]]
    notes = {"prompts": len(prompts), "probe": probe, "plain_accuracy": plain_acc, "calibrated_accuracy": best[0],
             "gains": {f"L{l}H{h}": g for (l, h), g in gains.items()}}
    return KeyEditCalibration(fingerprint, tuple(chosen), directions_for(means, chosen, mask), best[2], reach, notes)


# -- where a calibration lives -----------------------------------------------------------------------

CALIBRATION_DIRNAME = "steer-calibrations"


def calibration_root(env: dict[str, str] | None = None) -> Path:
    return cache_root(env) / CALIBRATION_DIRNAME


def write_calibration(cal: KeyEditCalibration, root: Path | None = None) -> Path:
    """Atomically write ``<root>/<fingerprint>.json`` (:func:`kdn.blobstore.write_file_atomic`)."""
    path = (root or calibration_root()) / f"{cal.fingerprint}.json"
    write_file_atomic(path, (json.dumps(cal.to_json()) + "\n").encode())
    return path


def load_calibration(fingerprint: str, root: Path | None = None) -> KeyEditCalibration | None:
    """The model's key-edit calibration, or ``None`` when none was written."""
    path = (root or calibration_root()) / f"{fingerprint}.json"
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
