"""Judge a KV codec by what the model does with the decoded KV, not by tensor error alone.

Method (teacher forcing over a continuation window), for each of ``windows`` windows of held-out
text — ``context`` tokens (whole chunks) followed by ``continuation`` tokens:

1. prefill the context with the model: the *exact* KV, cut into chunks ``(L, 2, H, T, D)``;
2. for each codec, every chunk goes through the real artifact path — cast to the stored KV dtype
   (fp16 by default), :func:`kdn.artifact.encode_artifact`, then
   :func:`kdn.artifact.decode_artifact` with the model's fingerprint expected (checksums verified);
3. run the continuation on top of the exact KV and on top of the decoded KV, and compare the
   next-token distributions at every continuation position: top-1 agreement, mean
   ``KL(p_exact ‖ p_codec)``, and the perplexity of the continuation's true next tokens.

Sizes are measured against the same KV stored as fp16 (``raw`` at ``--kv-dtype float16``), speeds
as GB of fp16 KV per second through the whole container path. The *crossover* bandwidth is where
fetching the smaller artifact and decoding it stops beating fetching fp16 KV::

    fetch(fp16) = S / B      fetch(codec) + decode = S_c / B + t_dec   =>   B* = (S - S_c) / t_dec

Works on any local Hugging Face causal LM directory (``--model DIR``) or a built-in spec. By
default the text is the held-out split of the reference corpus (stdlib files never trained on).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from kdn.artifact import decode_artifact, encode_artifact
from kdn.codecs import Codec, get_codec
from kdn.console import plain, report_error
from kdn.errors import InvalidInput, KdnError
from kdn.keys import ROOT_KEY, ChunkKey
from kdn.kv import build_cache, split_cache
from kdn.models import DTYPES, LoadedModel, load_model, model_fingerprint


@dataclass(frozen=True, slots=True)
class EvalSetup:
    """What text the harness reads and how."""

    windows: int = 32
    context_chunks: int = 1
    continuation: int = 128
    kv_dtype: str = "float16"  # the dtype KV is stored in (sizes are measured against fp16)
    max_text_chars: int = 2_000_000
    timing_repeats: int = 3  # encode/decode timings: best of this many passes

    def __post_init__(self) -> None:
        if self.windows <= 0 or self.context_chunks <= 0 or self.continuation < 2 or self.timing_repeats < 1:
            raise InvalidInput("windows, context_chunks and timing_repeats must be positive, continuation at least 2")
        if self.kv_dtype not in DTYPES:
            raise InvalidInput(f"unknown kv dtype {self.kv_dtype!r}; choose one of {sorted(DTYPES)}")


@dataclass(frozen=True, slots=True)
class Window:
    context: torch.Tensor  # (C,) token ids, C = context_chunks * chunk_size
    continuation: torch.Tensor  # (W,)


@dataclass(slots=True)
class ExactRun:
    """The reference pass of one window: exact KV chunks and the continuation's logits."""

    window: Window
    chunks: list[torch.Tensor]  # each (L, 2, H, T, D), model dtype
    logits: torch.Tensor  # (W, V) float32


@dataclass(frozen=True, slots=True)
class CodecQuality:
    codec: str
    lossy: bool
    predictions: int
    top1_agreement: float
    mean_kl: float
    max_kl: float
    ppl_exact: float
    ppl_codec: float
    ppl_change: float  # ppl_codec / ppl_exact - 1
    fp16_bytes: int
    encoded_bytes: int
    size_ratio: float  # fp16 bytes / artifact bytes
    bits_per_value: float
    encode_gbps: float  # GB of fp16 KV per second
    decode_gbps: float
    crossover_gbps: float  # below this link bandwidth, fetch+decode beats fetching fp16 (inf: always)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- text and windows ---------------------------------------------------------------------------


def default_texts() -> list[str]:
    from kdn.lab.reference import heldout_texts

    return heldout_texts()


def make_windows(lm: LoadedModel, texts: Sequence[str], setup: EvalSetup) -> list[Window]:
    """``setup.windows`` windows spread evenly over the tokenised texts (deterministic)."""
    ctx = setup.context_chunks * lm.chunk_size
    need = ctx + setup.continuation
    if lm.max_positions and need > lm.max_positions:
        raise InvalidInput(
            f"a window of {need} tokens exceeds the model's {lm.max_positions} positions; "
            "use fewer context chunks or a shorter continuation"
        )
    text = "\n\n".join(texts)[: setup.max_text_chars]
    ids = torch.tensor(lm.tokenizer.encode(text), dtype=torch.long)  # (N,)
    if ids.numel() < need:
        raise InvalidInput(f"the text has {ids.numel()} tokens, a window needs {need}")
    span = ids.numel() - need
    starts = [round(i * span / max(1, setup.windows - 1)) for i in range(setup.windows)] if setup.windows > 1 else [0]
    return [Window(ids[s : s + ctx], ids[s + ctx : s + need]) for s in starts]


# -- model passes -------------------------------------------------------------------------------


@torch.no_grad()
def _continue(lm: LoadedModel, chunks: Sequence[torch.Tensor], continuation: torch.Tensor) -> torch.Tensor:
    """Logits ``(W, V)`` of the continuation, conditioned on the given KV chunks."""
    dtype = next(lm.model.parameters()).dtype
    cache = build_cache([c.to(dtype) for c in chunks], lm.config)
    out = lm.model(input_ids=continuation.unsqueeze(0), cache=cache, use_cache=True)
    return out.logits[0].float()  # (W, V)


@torch.no_grad()
def exact_runs(lm: LoadedModel, windows: Sequence[Window]) -> list[ExactRun]:
    runs = []
    for w in windows:
        out = lm.model(input_ids=w.context.unsqueeze(0), use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        chunks = split_cache(cache, lm.chunk_size)  # each (L, 2, H, T, D)
        runs.append(ExactRun(w, chunks, _continue(lm, chunks, w.continuation)))
    return runs


def _chain_keys(n: int) -> list[tuple[ChunkKey, ChunkKey]]:
    """Placeholder keys for the harness's artifacts (they never leave the process)."""
    import hashlib

    keys = [ROOT_KEY]
    for i in range(n):
        keys.append(ChunkKey(hashlib.blake2b(keys[-1] + i.to_bytes(4, "little"), digest_size=32).digest()))
    return [(keys[i + 1], keys[i]) for i in range(n)]


def evaluate_codec(
    lm: LoadedModel, runs: Sequence[ExactRun], codec: Codec | str, setup: EvalSetup, *, label: str | None = None
) -> CodecQuality:
    """Send every exact chunk through ``codec`` (container included) and compare the model's outputs."""
    codec = get_codec(codec) if isinstance(codec, str) else codec
    kv_dtype = DTYPES[setup.kv_dtype]
    agree = kl_sum = 0.0
    kl_max = 0.0
    nll_exact = nll_codec = 0.0
    n_pred = n_nll = 0
    fp16_bytes = enc_bytes = 0
    t_enc = t_dec = 0.0
    for run in runs:
        xs = [chunk.to(kv_dtype).contiguous() for chunk in run.chunks]  # each (L, 2, H, T, D)
        keys = _chain_keys(len(xs))
        # best of `timing_repeats` passes over the window's chunks: a busy machine only adds time
        te = td = math.inf
        for _ in range(setup.timing_repeats):
            t0 = time.perf_counter()
            blobs = [
                encode_artifact(x, key=k, parent_key=p, fingerprint=lm.fingerprint, codec=codec, chunk_index=i)
                for i, (x, (k, p)) in enumerate(zip(xs, keys))
            ]
            t1 = time.perf_counter()
            arts = [decode_artifact(b, expect_fingerprint=lm.fingerprint, expect_key=k) for b, (k, _) in zip(blobs, keys)]
            t2 = time.perf_counter()
            te, td = min(te, t1 - t0), min(td, t2 - t1)
        t_enc, t_dec = t_enc + te, t_dec + td
        fp16_bytes += sum(x.numel() * 2 for x in xs)
        enc_bytes += sum(len(b) for b in blobs)
        decoded = [a.kv for a in arts]
        logits = _continue(lm, decoded, run.window.continuation)  # (W, V)
        ref = run.logits  # (W, V)
        agree += float((logits.argmax(-1) == ref.argmax(-1)).sum())
        lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)  # (W, V)
        kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0.0)  # (W,)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        n_pred += kl.numel()
        target = run.window.continuation[1:]  # (W-1,)
        nll_exact -= float(lp_ref[:-1].gather(-1, target[:, None]).sum())
        nll_codec -= float(lp[:-1].gather(-1, target[:, None]).sum())
        n_nll += target.numel()
    ppl_e, ppl_c = math.exp(nll_exact / n_nll), math.exp(nll_codec / n_nll)
    saved = fp16_bytes - enc_bytes
    crossover = math.inf if t_dec <= 0 else saved / t_dec / 1e9
    return CodecQuality(
        codec=label or codec.spec, lossy=codec.lossy, predictions=n_pred,
        top1_agreement=agree / n_pred, mean_kl=kl_sum / n_pred, max_kl=kl_max,
        ppl_exact=ppl_e, ppl_codec=ppl_c, ppl_change=ppl_c / ppl_e - 1,
        fp16_bytes=fp16_bytes, encoded_bytes=enc_bytes, size_ratio=fp16_bytes / enc_bytes,
        bits_per_value=8 * enc_bytes / (fp16_bytes / 2),
        encode_gbps=fp16_bytes / t_enc / 1e9, decode_gbps=fp16_bytes / t_dec / 1e9,
        crossover_gbps=max(0.0, crossover),
    )


@dataclass(frozen=True, slots=True)
class Calibration:
    """Per-layer sensitivity of K and V, and the bit plan it leads to."""

    level: str
    probe_bits: int
    kl: tuple[tuple[float, float], ...]  # per layer: (mean KL with only its K coarse, only its V coarse)
    plan: Any  # kdn.codecs.kvq.BitPlan

    def as_dict(self) -> dict[str, Any]:
        return {"level": self.level, "probe_bits": self.probe_bits, "kl": [list(x) for x in self.kl],
                "table": [list(x) for x in self.plan.table]}


def calibrate_kvq(lm: LoadedModel, runs: Sequence[ExactRun], level: str, setup: EvalSetup) -> Calibration:
    """A calibration run: which layers' K and V hurt most when coarse, and a plan that spends bits there.

    Every (layer, K|V) slot is probed alone at ``probe_bits`` (the level's bits minus one) with
    everything else at 8 bits; the slots whose probe moves the next-token distribution most (KL)
    get one extra bit — as many slots as the shape rule's early-layer bonus would give, so the
    budget stays comparable, but spent where this model needs it.
    """
    from kdn.codecs.kvq import LEVELS, BitPlan, KvqCodec

    if level not in LEVELS:
        raise InvalidInput(f"unknown kvq level {level!r}; choose one of {', '.join(LEVELS)}")
    k_bits, v_bits = LEVELS[level]
    n = lm.kv_shape.num_layers
    probe = max(2, min(k_bits, v_bits) - 1)
    quick = EvalSetup(setup.windows, setup.context_chunks, setup.continuation, setup.kv_dtype, setup.max_text_chars, 1)
    kl = []
    for layer in range(n):
        row = []
        for slot in (0, 1):
            table = [(8, 8)] * n
            table[layer] = (probe, 8) if slot == 0 else (8, probe)
            codec = KvqCodec(level, BitPlan(k_bits, v_bits, table=tuple(table)))
            row.append(evaluate_codec(lm, runs, codec, quick).mean_kl)
        kl.append((row[0], row[1]))
    rule = BitPlan(k_bits, v_bits)
    bonus_slots = 2 * math.ceil(rule.early_frac * n)
    ranked = sorted(((kl[l][s], l, s) for l in range(n) for s in (0, 1)), reverse=True)[:bonus_slots]
    table = [[k_bits, v_bits] for _ in range(n)]
    for _, layer, slot in ranked:
        table[layer][slot] = min(8, table[layer][slot] + rule.early_bonus)
    plan = BitPlan(k_bits, v_bits, table=tuple((k, v) for k, v in table))
    return Calibration(level, probe, tuple(kl), plan)


def random_init_twin(lm: LoadedModel, seed: int = 0) -> LoadedModel:
    """The same architecture and tokenizer with seeded random weights (for 'real vs random' KV)."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = type(lm.model)(lm.config).to(next(lm.model.parameters()).dtype).eval()
    finally:
        torch.random.set_rng_state(state)
    fp = model_fingerprint(lm.config, weights_id=f"random-init:seed={seed}", dtype=lm.dtype, chunk_size=lm.chunk_size)
    return LoadedModel(f"{lm.spec}#random-init", model, lm.tokenizer, fp, lm.dtype, lm.chunk_size)


@dataclass(slots=True)
class Report:
    model: str
    setup: EvalSetup
    results: list[CodecQuality] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "setup": asdict(self.setup), "results": [r.as_dict() for r in self.results]}


def evaluate(
    lm: LoadedModel, codecs: Sequence[str], setup: EvalSetup = EvalSetup(), texts: Sequence[str] | None = None
) -> Report:
    """One exact pass per window, then every codec against it."""
    codec_objs = [get_codec(c) for c in codecs]  # fail on a bad spec before any model work
    windows = make_windows(lm, default_texts() if texts is None else texts, setup)
    runs = exact_runs(lm, windows)
    return Report(lm.spec, setup, [evaluate_codec(lm, runs, c, setup) for c in codec_objs])


def format_table(results: Sequence[CodecQuality]) -> str:
    head = (f"{'codec':<10} {'ratio':>6} {'bits/v':>6} {'top1':>8} {'mean KL':>9} {'ppl Δ':>8} "
            f"{'enc GB/s':>8} {'dec GB/s':>8} {'crossover':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        cross = ("always" if math.isinf(r.crossover_gbps) else "never" if r.crossover_gbps <= 0
                 else f"{r.crossover_gbps:.2f} GB/s")
        lines.append(
            f"{r.codec:<10} {r.size_ratio:>5.2f}x {r.bits_per_value:>6.2f} {100 * r.top1_agreement:>7.2f}% "
            f"{r.mean_kl:>9.5f} {100 * r.ppl_change:>+7.2f}% {r.encode_gbps:>8.2f} {r.decode_gbps:>8.2f} {cross:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from kdn.lab.reference import default_reference_dir

    defaults = EvalSetup()
    parser = argparse.ArgumentParser(prog="kdn eval-codec", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("--model", default=None, help="built-in spec or HF model dir (default: the reference model)")
    parser.add_argument("--codec", action="append", required=True,
                        help="NAME[:LEVEL]; repeat or comma-separate to compare several")
    parser.add_argument("--windows", type=int, default=defaults.windows,
                        help=f"windows of held-out text judged (default {defaults.windows})")
    parser.add_argument("--context-chunks", type=int, default=defaults.context_chunks,
                        help=f"whole chunks of cached context per window, encoded by the codec (default {defaults.context_chunks})")
    parser.add_argument("--continuation", type=int, default=defaults.continuation,
                        help=f"teacher-forced tokens after the context, where predictions are compared (default {defaults.continuation})")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default 256)")
    parser.add_argument("--kv-dtype", default=defaults.kv_dtype, choices=sorted(DTYPES),
                        help=f"dtype the KV is stored in before encoding (default {defaults.kv_dtype})")
    parser.add_argument("--text", type=Path, action="append", help="text file(s) to read (default: held-out stdlib)")
    parser.add_argument("--calibrate", metavar="LEVEL", default=None,
                        help="also run a kvq calibration at LEVEL (per-layer sensitivity) and judge its bit plan")
    parser.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    args = parser.parse_args(argv)
    codecs = [c for spec in args.codec for c in spec.split(",") if c]
    calibration = None
    try:
        setup = EvalSetup(args.windows, args.context_chunks, args.continuation, args.kv_dtype)
        spec = args.model or str(default_reference_dir())
        for c in codecs:
            get_codec(c)
        lm = load_model(spec, chunk_size=args.chunk_size)
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in args.text] if args.text else None
        runs = exact_runs(lm, make_windows(lm, default_texts() if texts is None else texts, setup))
        report = Report(lm.spec, setup, [evaluate_codec(lm, runs, c, setup) for c in codecs])
        if args.calibrate:
            from kdn.codecs.kvq import KvqCodec

            calibration = calibrate_kvq(lm, runs, args.calibrate, setup)
            report.results.append(evaluate_codec(
                lm, runs, KvqCodec(args.calibrate, calibration.plan), setup, label=f"kvq:{args.calibrate}+cal"))
    except (KdnError, OSError) as exc:
        report_error("eval-codec", exc, as_json=args.json)
        return 2
    if args.json:
        out = report.as_dict()
        if calibration is not None:
            out["calibration"] = calibration.as_dict()
        print(json.dumps(out, indent=2, default=str))
    else:
        if calibration is not None:
            print(f"calibration at {calibration.level} (probe {calibration.probe_bits} bits), mean KL per layer (K, V):")
            for layer, ((kk, vv), bits) in enumerate(zip(calibration.kl, calibration.plan.table)):
                print(f"  layer {layer:>2}: K {kk:.5f}  V {vv:.5f}  -> bits K {bits[0]} V {bits[1]}")
        print(f"model {report.model}: {setup.windows} windows x {setup.continuation} tokens after "
              f"{setup.context_chunks} chunk(s) of {lm.chunk_size}; sizes vs {setup.kv_dtype} KV stored as fp16")
        print(format_table(report.results))
    return 0
