"""KV codecs judged by the real model: size vs fp16/bf16 KV, next-token agreement, KL, answers.

Runs the ``kdn eval-codec`` protocol (:mod:`kdn.lab.quality`) on ``smollm2-135m`` over held-out
stdlib documents of the *test* part (the calibration part is what codec tuning looked at), at 2k,
4k and ~8k tokens of context, in fp16 and bf16 KV, for the lossless codecs, ``int8`` and the
``kvq`` levels; or records a saved run of the same protocol (``--from FILE``, the JSON of
``kdn eval-codec --json``).

    .venv/bin/python benchmarks/quality.py [--quick] [--documents N] [--from FILE] [--no-append]

Records the run as ``quality`` (``benchmarks/_results.py``) and writes benchmarks/results/quality.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _results import Record

from kdn.codecs.kvq import DEFAULT_LEVEL

REPO = Path(__file__).resolve().parents[1]
PLOT = REPO / "benchmarks" / "results" / "quality.png"
DEFAULT_KVQ = f"kvq:{DEFAULT_LEVEL}"
CODECS = ["raw", "lz4", "zstd:1", "zstd:3", "int8", "kvq:q5", DEFAULT_KVQ, "kvq:k5v4"]
GOAL_RATIO, GOAL_AGREEMENT = 5.0, 99.0
GOAL_LOSSLESS, GOAL_DECODE = 1.3, 1.0

METHOD = """`kdn eval-codec` on smollm2-135m (SmolLM2-135M-Instruct): held-out standard-library documents
of the test part (files never looked at by codec tuning), as a chat's system message. One prefill
per document and KV dtype: fp16 KV is the fp32 model's KV rounded to fp16, bf16 KV is the bf16
model's own (and every pass on it runs in bf16). A context of C tokens is the first C tokens
(whole 256-token chunks). Every chunk goes through encode_artifact / decode_artifact (checksums
verified); the 128 tokens after the context are teacher-forced on raw and on decoded KV: top-1
agreement and mean KL(raw || decoded). Extractive questions about the first C tokens (a class's
base, a method's class, a constant's value, a parameter's default, an import's module, a
function's exception) are answered greedily from raw and from decoded KV; accuracy, answers
changed and an exact McNemar p over the paired outcomes. Ratio: raw KV bytes of the dtype /
artifact bytes; decode GB/s: raw KV bytes per second through decode_artifact, one thread, fastest
of the timing passes. Goal medians are over per-document values at every context."""


def _run(args: argparse.Namespace) -> dict:
    from kdn.lab.quality import EvalSetup, evaluate, load_documents, load_models

    setup = EvalSetup(contexts=(2048,) if args.quick else (2048, 4096, 7936), documents=args.documents,
                      questions=2 if args.quick else 4, answer_tokens=16, timing_repeats=1)
    models = load_models("smollm2-135m", setup.kv_dtypes, 256)
    docs = load_documents(models[setup.kv_dtypes[0]], setup)
    report = evaluate(models, CODECS, setup, docs, progress=lambda m: print(m, file=sys.stderr, flush=True))
    return report.as_dict()


def _short(dtype: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)


def table_rows(results: list[dict]) -> list[list[str]]:
    rows = []
    for r in results:
        if r["questions"]:
            acc = f"{100 * r['accuracy']:.0f}%" + (" (same KV)" if r["identical"] else
                                                   f" ({r['changed']} changed, p={r['mcnemar_p']:.2f})")
            raw_acc = f"{100 * r['accuracy_raw']:.0f}% of {r['questions']}"
        else:
            acc = raw_acc = "-"
        rows.append([
            r["codec"] + (" (default)" if r["codec"] == DEFAULT_KVQ else ""), _short(r["kv_dtype"]), str(r["context"]),
            f"{r['size_ratio']:.2f}x", f"{r['bits_per_value']:.2f}",
            "100% (same KV)" if r["identical"] else f"{100 * r['top1_agreement']:.2f}%",
            "0" if r["identical"] else f"{r['mean_kl']:.5f}", raw_acc, acc, f"{r['decode_gbps']:.2f}",
        ])
    return rows


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["kv_dtype"] for r in results))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        sub = [r for r in results if r["kv_dtype"] == dtype]
        for codec in dict.fromkeys(r["codec"] for r in sub):
            pts = sorted((r["context"], r["size_ratio"], 100 * r["top1_agreement"]) for r in sub if r["codec"] == codec)
            ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", ms=4, label=codec)
            ax.annotate(codec, (pts[-1][1], pts[-1][2]), textcoords="offset points", xytext=(4, -8), fontsize=7)
        ax.axhline(GOAL_AGREEMENT, ls=":", color="grey")
        ax.axvline(GOAL_RATIO, ls=":", color="grey")
        ax.set(xlabel=f"size ratio vs raw {_short(dtype)} KV", ylabel="top-1 agreement with raw KV (%)",
               title=f"{_short(dtype)} KV (points: 2k, 4k, 8k contexts)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("KV codecs on smollm2-135m, held-out documents (goal: >= 5x at >= 99%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _of(results: list[dict], codec: str, dtype: str) -> list[dict]:
    return [r for r in results if r["codec"] == codec and r["kv_dtype"] == dtype]


def pooled_mcnemar(rows: list[dict]) -> tuple[float, int, int]:
    from kdn.lab.docqa import mcnemar_p

    a, b = sum(r["raw_only"] for r in rows), sum(r["codec_only"] for r in rows)
    return mcnemar_p(a, b), a, b


def record(rec: Record, data: dict) -> None:
    results = data["results"]
    setup = data["setup"]
    rec.note(f"Documents ({setup['split']} part): {'; '.join(data['documents'])}. Questions per context: "
             + ", ".join(f"{c}: {sum(k.values())} ({', '.join(f'{n} {kind}' for kind, n in sorted(k.items()))})"
                         for c, k in sorted(data["questions"].items(), key=lambda x: int(x[0])))
             + f". {setup['continuation']} continuation tokens per document and context. Took {data['seconds']:.0f}s.")
    rec.table(["codec", "KV", "context", "ratio", "bits/value", "top-1 agreement", "mean KL", "accuracy (raw KV)",
               "accuracy (decoded)", "decode GB/s"], table_rows(results), title="Every codec, context and KV dtype")
    for dtype in setup["kv_dtypes"]:
        rows = _of(results, DEFAULT_KVQ, dtype)
        if not rows:
            continue
        ratios = [x for r in rows for x in r["doc_ratio"]]
        agree = [100 * x for r in rows for x in r["doc_agreement"]]
        fp16 = dtype == "float16"
        rec.goal(f"kvq default ({DEFAULT_KVQ}): size vs raw {_short(dtype)} KV", f"≥ {GOAL_RATIO:g}x", ratios,
                 at_least=GOAL_RATIO if fp16 else None)
        rec.goal(f"kvq default ({DEFAULT_KVQ}): top-1 next-token agreement with raw {_short(dtype)} KV",
                 f"≥ {GOAL_AGREEMENT:g}%", agree, unit="%", digits=2, at_least=GOAL_AGREEMENT if fp16 else None)
        p, lost, won = pooled_mcnemar(rows)
        q = sum(r["questions"] for r in rows)
        acc_raw = sum(r["accuracy_raw"] * r["questions"] for r in rows) / max(1, q)
        acc = sum(r["accuracy"] * r["questions"] for r in rows) / max(1, q)
        rec.goal(f"kvq default ({DEFAULT_KVQ}), {_short(dtype)}: question accuracy, decoded minus raw KV "
                 f"({q} questions, {100 * acc_raw:.0f}% raw; {lost} lost, {won} gained; McNemar p={p:.2f})",
                 "no measurable loss (p ≥ 0.05)", median=100 * (acc - acc_raw), unit=" points",
                 met=(p >= 0.05 or acc >= acc_raw) if fp16 else None)
    for dtype in setup["kv_dtypes"]:
        lossless = [r for r in results if not r["lossy"] and r["kv_dtype"] == dtype and r["codec"] != "raw"]
        if not lossless:
            continue
        best = max(lossless, key=lambda r: (r["decode_gbps"] >= GOAL_DECODE, r["size_ratio"]))
        ok = best["size_ratio"] >= GOAL_LOSSLESS and best["decode_gbps"] >= GOAL_DECODE
        rec.goal(f"lossless on real {_short(dtype)} KV (best: {best['codec']} at {best['context']} tokens), ratio; "
                 f"decode {best['decode_gbps']:.2f} GB/s through the container",
                 f"≥ {GOAL_LOSSLESS}x, decode ≥ {GOAL_DECODE:g} GB/s", median=best["size_ratio"], met=ok)
    rec.data({"setup": setup, "documents": data["documents"], "questions": data["questions"]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/quality.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one 2k context, 2 questions per document")
    ap.add_argument("--documents", type=int, default=2)
    ap.add_argument("--from", dest="source", type=Path, default=None,
                    help="record this saved `kdn eval-codec --json` run instead of running the protocol")
    ap.add_argument("--no-append", action="store_true", help="print only: record nothing, write no plot")
    args = ap.parse_args(argv)
    command = None
    if args.source:
        data = json.loads(args.source.read_text())
        command = data.get("command")
    rec = None if args.no_append else Record(__file__, "quality", "KV codec quality on the real model (smollm2-135m)",
                                             argv, command=command)
    if not args.source:
        data = _run(args)
    if rec is not None and args.source and "load" in data:
        rec.doc["load"]["start"] = data["load"].get("start")
    print("\n".join(" | ".join(row) for row in table_rows(data["results"])))
    if rec is not None:
        plot(data["results"], PLOT)
        record(rec, data)
        rec.plot(PLOT)
        rec.save(load_end=data["load"].get("end") if args.source and "load" in data else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
