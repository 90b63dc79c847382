"""Steered KV: accuracy by the fact's position (start / middle / end) plain vs each steered variant,
with wrong marks, on held-out prompts of a retrieval reference model; reuse time and bytes fetched.

    python benchmarks/steer.py --model /path/to/retrieval-model [--prompts 200] [--no-append]
    python benchmarks/steer.py --render benchmarks/results/steer/<tag>.json   # record a saved run again

Prints a table, writes the harness's raw results to ``benchmarks/results/steer/<tag>.json`` and the
plot to ``benchmarks/results/steer-<tag>.png``, and records the run as ``steer-<tag>`` (one record
per model, document count and seed; ``benchmarks/_results.py``). The harness is
:mod:`kdn.lab.steer_eval` (``kdn eval-steer``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from _results import Record
from kdn.lab import steer_eval
from kdn.lab.steer_eval import POSITIONS

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RAW = RESULTS / "steer"

METHOD = """Held-out prompts `R : doc_1 … doc_n ? KEY` of a retrieval reference model, with the answer's
document at the start, in the middle or at the end of the context; the context is stored as chunks
and reused, the partial last chunk and the question prefilled at reuse. Each variant (plain,
key-edit with the calibrated heads and strength, re-read, re-read of the marked document, each also
with wrong marks on a distractor) is scored on the same prompts: accuracy with a 95% Wilson
interval, and the paired difference from plain with its 95% interval. Marks are the answer's
document (an operator who knows where the answer is). Goal: a variant with correct marks raises
middle accuracy by at least 5 points and loses at most 1 point at the start and the end."""


def plot(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n in res["variants"] if "@" not in n]
    strengths = sorted({float(n.split("@")[1].split(",")[0]) for n in res["variants"] if "@" in n}
                       | {res["calibration"]["strength"]})
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.4), gridspec_kw={"width_ratios": [3, 1.3]})
    ax = axes[0]
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        row = res["variants"][name]
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(POSITIONS))]
        acc = [row[p]["accuracy"] for p in POSITIONS]
        lo = [max(0.0, row[p]["accuracy"] - row[p]["ci95"][0]) for p in POSITIONS]
        hi = [max(0.0, row[p]["ci95"][1] - row[p]["accuracy"]) for p in POSITIONS]
        ax.bar(xs, acc, width, yerr=[lo, hi], capsize=2, label=name)
    if len(strengths) > 1:
        cal = res["calibration"]["strength"]
        name_at = lambda s, wrong: ("key-edit" if s == cal else f"key-edit @{s:g}") + (", wrong marks" if wrong else "")  # noqa: E731
        for i, (p, style) in enumerate(zip(POSITIONS, ("o", "s", "^"))):
            for wrong, ls in ((False, "-"), (True, ":")):
                ys = [res["variants"][name_at(s, wrong)][p]["accuracy"] for s in strengths]
                axes[1].plot(strengths, ys, ls, marker=style, color=f"C{i}", label=f"{p}{', wrong marks' if wrong else ''}")
            axes[1].axhline(res["variants"]["plain"][p]["accuracy"], color=f"C{i}", lw=0.8, ls="--", alpha=0.5)
        axes[1].set_xlabel("key-edit strength (nats); dashed: plain")
        axes[1].set_ylabel("accuracy")
        axes[1].set_ylim(0, 1)
        axes[1].set_title("key-edit strength", fontsize=9)
        axes[1].legend(fontsize=6)
    else:
        axes[1].axis("off")
    ax.set_xticks(range(len(POSITIONS)))
    ax.set_xticklabels([f"fact at the {p}" for p in POSITIONS])
    ax.set_ylabel("accuracy (95% Wilson CI)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{Path(res['model']).name}: {res['documents']} documents ({res['context_tokens']} tokens), "
                 f"{res['prompts_per_position']} held-out prompts per position")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def body(res: dict[str, Any]) -> list[str]:
    """The run's description, its table and the bytes note, as Markdown lines."""
    c = res["calibration"]
    lines = [f"Model `{res['model']}` ({res['layers']} layers, {res['heads']} KV heads); held-out prompts `R : doc_1 … "
             f"doc_{res['documents']} ? KEY` ({res['context_tokens']} context tokens, stored as chunks of "
             f"{res['chunk_size']}; the partial last chunk and the question are prefilled at reuse), "
             f"{res['prompts_per_position']} per position; the answer's document is the first (start), the "
             f"{res['documents'] // 2}th or {res['documents'] // 2 + 1}th (middle) or the last (end). Marks = the answer's "
             f"document (the operator knows where the answer is: PASTA's setting); wrong marks = a random distractor document. Key-edit calibrated on {c['prompts']} "
             f"training-distribution prompts (not held-out): heads {['L%dH%d' % tuple(h) for h in c['heads']]}, "
             f"strength {c['strength']:g} nats. Accuracy with 95% Wilson interval; Δ = paired difference from plain on "
             f"the same prompts, points, 95% interval.", "",
             "| variant | start | Δ start | middle | Δ middle | end | Δ end | reuse ms (median, middle) | bytes fetched (raw) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in res["variants"].items():
        cells = []
        for p in POSITIONS:
            x = row[p]
            cells.append(f"{x['accuracy']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]")
            cells.append("—" if name == "plain" else
                         f"{x['delta'] * 100:+.1f} [{x['delta_ci95'][0] * 100:+.1f}, {x['delta_ci95'][1] * 100:+.1f}]")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['middle']['reuse_ms_median']:.2f} | "
                     f"{row['middle']['stored_bytes']:,} |")
    plain_b = res["variants"]["plain"]["middle"]["stored_bytes"]
    extra = ", ".join(f"{n}: {r['middle']['stored_bytes'] - plain_b:+,} B" for n, r in res["variants"].items() if n != "plain")
    lines += ["", f"Bytes fetched at reuse: the KV payload is identical for every variant (same shape and dtype); a "
              f"steered chunk's header also carries its spec, so its container is a little larger "
              f"({extra} over {plain_b:,} B plain). Reuse time is the same code path (load cached KV, prefill tail + question)."]
    return lines


def markdown(res: dict[str, Any]) -> str:
    """What the terminal shows: the body and one line per goal."""
    lines = [f"Steered KV, {res.get('when', '')}: `{res['command']}`", "", *body(res), ""]
    lines += [f"- {line}" for line in steer_eval.goal_lines(res)]
    return "\n".join(lines) + "\n"


def record(res: dict[str, Any], tag: str, argv: list[str], load_start: float | None) -> None:
    docs = f", {res['documents']} documents" + (f", seed {res['seed']}" if res.get("seed") else "")
    rec = Record(__file__, f"steer-{tag}", f"Steered KV: {Path(res['model']).name}{docs}", argv, method="steer",
                 command=res["command"])
    if res.get("when"):
        rec.doc["utc"] = res["when"]
    rec.doc["load"]["start"] = load_start
    for name, g in res["goal"].items():
        rec.goal(f"{name}, correct marks: middle Δ (95% CI); start {g['start_change'] * 100:+.1f}, "
                 f"end {g['end_change'] * 100:+.1f}", "≥ +5 points in the middle, ≥ −1 elsewhere",
                 median=g["middle_gain"] * 100, lo=g["middle_gain_ci95"][0] * 100, hi=g["middle_gain_ci95"][1] * 100,
                 unit="points", digits=1, met=bool(g["met"]))
    rec.markdown(body(res))
    if res.get("plot"):
        rec.plot(REPO / res["plot"])
    rec.save(load_end=round(res["load_average"][0], 2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--cal-prompts", type=int, default=64)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", default="1,2,4", help="other key-edit strengths shown beside the calibrated one")
    p.add_argument("--no-append", action="store_true", help="print only; record nothing")
    p.add_argument("--json", action="store_true")
    p.add_argument("--render", type=Path, help="record a saved raw results JSON again (no run)")
    args = p.parse_args(argv)
    if args.render:
        res = json.loads(args.render.read_text())
        if res.get("plot"):
            plot(res, REPO / res["plot"])
        print(markdown(res))
        if not args.no_append:
            record(res, args.render.stem, argv if argv is not None else sys.argv[1:], None)
        return 0
    argv = list(argv if argv is not None else sys.argv[1:])
    load_start = round(os.getloadavg()[0], 2)
    torch.set_num_threads(1)
    res = steer_eval.run(str(args.model), prompts=args.prompts, docs=args.docs, cal_prompts=args.cal_prompts,
                         seed=args.seed, sweep=[float(x) for x in args.sweep.split(",") if x], log=lambda s: print(s, file=sys.stderr))
    res.pop("_cal")
    res["command"] = "python benchmarks/steer.py " + " ".join(argv)
    res["seed"] = args.seed
    res["load_average"] = os.getloadavg()
    res["when"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    tag = (args.model.name + (f"-seed{args.seed}" if args.seed else "") + (f"-docs{args.docs}" if args.docs != 8 else ""))
    png = RESULTS / f"steer-{tag}.png"
    RAW.mkdir(parents=True, exist_ok=True)
    (RAW / f"{tag}.json").write_text(json.dumps(res, indent=2, default=str) + "\n")  # kept if the plot fails
    res["plot"] = str(png.relative_to(REPO)) if plot(res, png) else None
    (RAW / f"{tag}.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps(res, indent=2, default=str) if args.json else markdown(res))
    if not args.no_append:
        record(res, tag, argv, load_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
