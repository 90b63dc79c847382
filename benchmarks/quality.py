"""Lossy and lossless KV codecs judged by the model: size vs next-token agreement and KL.

Drives :mod:`kdn.lab.quality` (the same code as ``kdn eval-codec``) on the trained reference model
(``kdn model train-reference``; default ``~/.cache/kdn/reference-model``) over its held-out
stdlib text, for every ``kvq`` level, ``int8`` and the lossless codecs. The baseline is the same
KV stored as fp16 (``raw``), measured in the same run; the model's outputs on exact fp32 KV are the
reference for agreement and KL. The lossless codecs and ``kvq`` are also run on the KV of a
seeded random-init twin (same architecture and tokenizer), beside the trained KV.

    .venv/bin/python benchmarks/quality.py [--quick] [--model DIR] [--windows N] [--no-append] [--json]

Records the run as ``quality`` (``benchmarks/_results.py``) and writes benchmarks/results/quality.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from _results import Record
from kdn.codecs.kvq import DEFAULT_LEVEL, LEVELS
from kdn.models import load_model
from kdn.codecs import SectionInfo
from kdn.codecs.kvq import MODE_DELTA, KvqCodec
from kdn.lab.quality import (
    CodecQuality,
    EvalSetup,
    ExactRun,
    calibrate_kvq,
    default_texts,
    evaluate,
    evaluate_codec,
    exact_runs,
    make_windows,
    random_init_twin,
)
from kdn.lab.reference import META_FILE, default_reference_dir

REPO = Path(__file__).resolve().parents[1]

METHOD = """The trained reference model (`kdn model train-reference`) over held-out standard-library text:
windows of exact context are encoded with each codec into a container and decoded, then the next
tokens are teacher-forced and compared with the run on exact fp32 KV (top-1 agreement, mean KL,
perplexity change). Size is fp16 KV bytes over artifact bytes, measured in the same run; GB/s are
fp16 KV bytes per second through encode and decode, checksums included. The lossless codecs and
the default kvq level also run on a seeded random-init twin of the model. A stricter window scores
only the tokens right after the context, where the decoded KV weighs most."""
PLOT = REPO / "benchmarks" / "results" / "quality.png"
KVQ = [f"kvq:{lvl}" for lvl in LEVELS]
LOSSLESS = ["raw", "lz4", "zstd:3"]
DEFAULT_KVQ = f"kvq:{DEFAULT_LEVEL}"


def _cross(r: CodecQuality) -> str:
    if r.crossover_gbps <= 0:
        return "never"
    gbit = 8 * r.crossover_gbps
    return "always" if math.isinf(gbit) else f"{r.crossover_gbps:.2f} GB/s ({gbit:.1f} Gbit/s)"


def delta_share(runs: list[ExactRun], levels: list[str]) -> tuple[int, int]:
    """(sections the kvq encoder stored in delta form, sections) over the runs' chunks and levels."""
    used = total = 0
    for level in levels:
        codec = KvqCodec(level)
        for run in runs:
            for chunk in run.chunks:
                x = chunk.half()  # (L, 2, H, T, D)
                for layer in range(x.shape[0]):
                    for i, kind in enumerate("kv"):
                        info = SectionInfo(layer, x.shape[0], kind, tuple(x.shape[2:]), torch.float16)
                        used += codec.encode(x[layer, i].contiguous(), info)[1] == MODE_DELTA
                        total += 1
    return used, total


def markdown(trained: list[CodecQuality], rand: dict[str, CodecQuality], info: dict, command: str, secs: float) -> str:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    s = info["setup"]
    lines = [
        "", f"## KV codec quality on the trained reference model, kdn.quality ({now})", "",
        f"Command: `{command}`  ",
        f"Model: `{info['model']}` ({info['params'] / 1e6:.2f}M params, {info['layers']} layers, "
        f"{info['kv_heads']} KV heads x {info['head_dim']}, held-out loss {info['heldout_loss']:.3f} nats/token "
        f"vs uniform {info['uniform_loss']:.3f}). Text: held-out stdlib files (never trained on). "
        f"{s['windows']} windows: {s['context_chunks']} chunk(s) of {info['chunk_size']} tokens of exact context "
        f"encoded -> container -> decoded, then {s['continuation']} teacher-forced tokens compared with the "
        f"exact-KV run ({trained[0].predictions} predictions per codec). Ratio = fp16 KV bytes / artifact "
        f"bytes (same run); GB/s = fp16 KV bytes per second through encode_artifact / decode_artifact "
        f"(checksums included), 2 shared CPU cores. Crossover: link bandwidth below which fetching the "
        f"artifact and decoding it beats fetching fp16 KV, (S - S_c) / t_decode. Took {secs:.0f}s.", "",
        "| codec | ratio vs fp16 (trained KV) | ratio (random-init KV) | bits/value | top-1 agreement | mean KL (nats) "
        "| ppl change | encode GB/s | decode GB/s | crossover |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in trained:
        rr = rand.get(r.codec)
        lines.append(
            f"| {r.codec}{' (default)' if r.codec == DEFAULT_KVQ else ''} | {r.size_ratio:.2f}x | "
            f"{f'{rr.size_ratio:.2f}x' if rr else '-'} | {r.bits_per_value:.2f} | {100 * r.top1_agreement:.2f}% | "
            f"{r.mean_kl:.5f} | {100 * r.ppl_change:+.2f}% | {r.encode_gbps:.2f} | {r.decode_gbps:.2f} | {_cross(r)} |"
        )
    d = next(r for r in trained if r.codec == DEFAULT_KVQ)
    ok = d.size_ratio >= 4 and d.top1_agreement >= 0.99
    lines += [
        "",
        f"goal (kvq default >= 4x smaller than fp16 with >= 99% top-1 agreement): {'MET' if ok else 'NOT MET'} "
        f"({DEFAULT_KVQ}: {d.size_ratio:.2f}x, {100 * d.top1_agreement:.2f}%). "
        f"ppl of the exact run: {d.ppl_exact:.2f}. Plot: `benchmarks/results/quality.png`.",
        "",
        f"Stricter window — only the {info['near'][0].predictions // (2 * s['windows'])} tokens right after the "
        f"context ({2 * s['windows']} windows, {info['near'][0].predictions} predictions), where the decoded KV "
        "weighs most: " + ", ".join(f"{r.codec} {r.size_ratio:.2f}x {100 * r.top1_agreement:.2f}% (KL {r.mean_kl:.5f})"
                                    for r in info["near"]) + ".",
        "",
        f"Token-locality deltas: the kvq encoder kept the delta form in {info['delta'][0]} of {info['delta'][1]} "
        "sections (it keeps it only where it is smaller at the same step); this small model's neighbouring "
        "tokens are not alike enough, so the ratios above come from bit allocation, packing and entropy coding.",
        "",
        "Calibration run (`kdn eval-codec --calibrate q5`): mean KL when only one layer's K or V is coarse "
        f"({info['cal'].probe_bits} bits, all else 8): "
        + ", ".join(f"L{l} K {k:.5f} V {v:.5f}" for l, (k, v) in enumerate(info["cal"].kl))
        + f"; bit table it chose (K, V per layer): {[list(x) for x in info['cal'].plan.table]}.",
        "",
    ]
    return "\n".join(lines)


def plot(results: list[CodecQuality], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        color = "tab:blue" if r.codec.startswith("kvq") else "tab:orange" if r.lossy else "tab:green"
        for ax, y in ((a1, 100 * r.top1_agreement), (a2, max(r.mean_kl, 1e-7))):
            ax.scatter(r.size_ratio, y, color=color, s=30)
            ax.annotate(r.codec, (r.size_ratio, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    a1.axhline(99, ls=":", color="grey")
    a1.axvline(4, ls=":", color="grey")
    a1.set(xlabel="size ratio vs fp16 KV", ylabel="top-1 next-token agreement (%)", title="agreement vs size")
    a2.set(xlabel="size ratio vs fp16 KV", ylabel="mean KL(exact || codec), nats", yscale="log", title="KL vs size")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.suptitle("KV codecs on the trained reference model (blue: kvq ladder, orange: int8, green: lossless)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/quality.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the trained reference model)")
    ap.add_argument("--quick", action="store_true", help="8 windows of 64 tokens")
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--no-append", action="store_true", help="print only: record nothing, write no plot")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    spec = args.model or str(default_reference_dir())
    if not (Path(spec) / "config.json").is_file():
        print(f"no model at {spec}: run `kdn model train-reference` first", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    rec = None if args.no_append else Record(__file__, "quality", "KV codec quality on the trained reference model",
                                             argv)
    setup = EvalSetup(windows=args.windows or (8 if args.quick else 32), continuation=64 if args.quick else 128)
    lm = load_model(spec)
    t0 = time.perf_counter()
    codecs = LOSSLESS + ["int8"] + KVQ
    runs = exact_runs(lm, make_windows(lm, default_texts(), setup))
    results = [evaluate_codec(lm, runs, c, setup) for c in codecs]
    cal = calibrate_kvq(lm, runs, DEFAULT_LEVEL, setup)
    results.insert(codecs.index(DEFAULT_KVQ) + 1, evaluate_codec(
        lm, runs, KvqCodec(DEFAULT_LEVEL, cal.plan), setup, label=f"{DEFAULT_KVQ}+cal"))
    print("trained done", flush=True)
    rand = {r.codec: r for r in evaluate(random_init_twin(lm), LOSSLESS + ["int8", DEFAULT_KVQ], setup).results}
    delta = delta_share(runs[:8], list(LEVELS))
    # stricter: only the first tokens after the context, where the decoded KV weighs most
    near_setup = EvalSetup(windows=2 * setup.windows, continuation=32, timing_repeats=1)
    near_runs = exact_runs(lm, make_windows(lm, default_texts(), near_setup))
    near = [evaluate_codec(lm, near_runs, c, near_setup) for c in ("int8", "kvq:q6", DEFAULT_KVQ, "kvq:q4")]
    secs = time.perf_counter() - t0
    meta = json.loads((Path(spec) / META_FILE).read_text())["result"] if (Path(spec) / META_FILE).is_file() else {}
    info = {
        "model": spec, "setup": asdict(setup), "delta": delta, "cal": cal, "near": near, "params": sum(p.numel() for p in lm.model.parameters()),
        "layers": lm.kv_shape.num_layers, "kv_heads": lm.kv_shape.num_kv_heads, "head_dim": lm.kv_shape.head_dim,
        "chunk_size": lm.chunk_size, "heldout_loss": meta.get("heldout_loss", float("nan")),
        "uniform_loss": meta.get("uniform_loss", float("nan")),
    }
    command = "python benchmarks/quality.py" + (" --quick" if args.quick else "") + (
        f" --windows {args.windows}" if args.windows else "")
    text = markdown(results, rand, info, command, secs)
    print(text)
    if args.json:
        print(json.dumps({"trained": [r.as_dict() for r in results],
                          "random_init": {k: v.as_dict() for k, v in rand.items()}}, indent=1, default=str))
    if rec is not None:
        plot(results, PLOT)
        d = next(r for r in results if r.codec == DEFAULT_KVQ)
        rec.goal(f"kvq default ({DEFAULT_KVQ}): size vs fp16", "≥ 4x", median=d.size_ratio, at_least=4.0)
        rec.goal(f"kvq default ({DEFAULT_KVQ}): top-1 next-token agreement", "≥ 99%", median=100 * d.top1_agreement,
                 unit="%", digits=2, at_least=99.0)
        rec.markdown(line for line in text.splitlines()
                     if not line.startswith(("## KV codec quality", "Command: ", "goal (kvq")))
        rec.note(f"Perplexity of the exact-KV run: {d.ppl_exact:.2f}.")
        rec.plot(PLOT)
        rec.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
