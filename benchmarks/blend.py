"""Documents reused anywhere in the prompt (blend): quality, TTFT and whether reuse decays.

1. **Quality on the retrieval reference model** (``kdn model train-reference --task retrieval``):
   held-out prompts of ``--docs`` documents (each 128 tokens, the length it was trained on) drawn
   from a pool of 50 in random subsets and orders; full prefill, prefix-only reuse, naive
   concatenation, first-k (EPIC) and blend at 5/10/15/30% (``kdn.lab.blend_eval``).
2. **Agreement and KL for each model the project ships**: ``tiny``, ``tiny-mha``, ``small-125m``
   (seeded random init), the stdlib reference model and the retrieval model when trained.
3. **TTFT on small-125m**, 8 documents x 512 tokens after a short prefix, through the host path
   (``generate(..., documents=...)`` with the segments on an in-process edge, so fetch + verify +
   decode are included) vs a full prefill through the same function; medians of ``--repeat`` runs
   in alternating order, load average reported.
4. **Reuse does not decay**: 200 RAG-style queries over a pool of 50 documents (8 per query,
   random subsets and orders) on the retrieval model through ``generate(..., documents=...)``:
   edge bytes stored vs the pool's segment bytes, and the reused-token fraction per 20 queries.

    .venv/bin/python benchmarks/blend.py [--quick] [--prompts N] [--repeat R] [--no-append] [--json]

Records each part it measured as ``blend-retrieval``, ``blend-models``, ``blend-ttft`` and
``blend-decay`` (``benchmarks/_results.py``); ``--skip`` leaves a skipped part's record as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from _results import Record
from kdn.blend import Deviation, Naive
from kdn.client import ClientConfig, KdnClient
from kdn.client_transport import MemoryEdgeTransport
from kdn.integrations.blend import BlendOptions
from kdn.integrations.transformers import generate, prepare
from kdn.lab import blend_eval
from kdn.lab.reference import default_reference_dir
from kdn.lab.retrieval import default_retrieval_dir
from kdn.models import load_model

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

METHOD = {
    "blend-retrieval": """Held-out prompts of the retrieval reference model (`kdn model train-reference --task
retrieval`): 8 documents of 128 tokens, drawn from a pool of 50 in random subsets and orders, then a
question whose answer sits in one of them. Each document's KV is computed alone and re-placed; the
methods are full prefill, prefix-only reuse, naive concatenation, first-k recompute (EPIC) and
blend at 5/10/15/30% recompute (CacheBlend's deviation rule). Accuracy is scored on the answer;
top-1 agreement and KL compare each method's predictions with full prefill's. The goal is judged
only on a model that reads (full-prefill accuracy at least 0.90).""",
    "blend-models": """The same comparison on each model the project ships (seeded random-init `tiny`,
`tiny-mha`, `small-125m`, the trained reference model and the retrieval model when present):
agreement and KL with full prefill on the scored tokens (the answer for the retrieval model, the
question's next-token predictions otherwise).""",
    "blend-ttft": """TTFT on small-125m fp32, 8 documents of 512 tokens after a short prefix, through the host
path (`generate(..., documents=...)` with the segments on an in-process edge, so fetch, verify and
decode are included) against a full prefill through the same function; medians of repeated runs
in alternating order.""",
    "blend-decay": """200 RAG-style queries over a pool of 50 documents (8 per query, random subsets and orders)
through `generate(..., documents=...)` with blend at 15%: the edge's stored bytes against the
pool's segment bytes, and the reused-token fraction per 20 queries. Blended KV is never written
back, so the edge should hold exactly the segments.""",
}


def quality(model: str, prompts: int, docs: int) -> dict[str, Any]:
    lm, info, results = blend_eval.run(model, prompts=prompts, docs=docs, doc_tokens=128,
                                       ratios=blend_eval.DEFAULT_RATIOS, first_k=16, seed=0)
    verdict = blend_eval.verdict_for(lm, results, blend_eval.DEFAULT_RATIOS, 1)
    return {**info, "methods": {k: r.as_dict() for k, r in results.items()},
            "verdict": {"passed": verdict.passed, "ratio": verdict.ratio, "reason": verdict.reason}}


@torch.inference_mode()
def ttft(repeat: int, doc_tokens: int = 512, n_docs: int = 8, ratio: float = 0.15, spec: str = "small-125m") -> dict[str, Any]:
    lm = load_model(spec)
    km = prepare(lm)
    gen = torch.Generator().manual_seed(5)
    vocab = int(lm.config.vocab_size)
    docs = [torch.randint(3, vocab, (doc_tokens,), generator=gen).tolist() for _ in range(n_docs)]
    prefix = torch.randint(3, vocab, (16,), generator=gen).tolist()
    question = torch.randint(3, vocab, (16,), generator=gen).tolist()
    edge = MemoryEdgeTransport()
    out: dict[str, list[float]] = {"full": [], "blend": [], "naive": []}
    breakdown: dict[str, Any] = {}
    with KdnClient(ClientConfig(edge="mem"), transport=edge) as client:
        opts = BlendOptions(policy=Deviation(ratio))
        generate(km, question, documents=docs, prefix=prefix, client=client, blend=opts, max_new_tokens=1)  # stores segments
        client.flush(60)
        stored = sum(len(v) for v in edge.store.values())
        for i in range(repeat):
            order = ["full", "blend", "naive"] if i % 2 == 0 else ["naive", "blend", "full"]
            for mode in order:
                if mode == "full":
                    r = generate(km, prefix + sum(docs, []) + question, max_new_tokens=1)
                else:
                    pol = Deviation(ratio) if mode == "blend" else Naive()
                    r = generate(km, question, documents=docs, prefix=prefix, client=client,
                                 blend=BlendOptions(policy=pol), max_new_tokens=1)
                    assert r.via.startswith("blend"), r.warnings
                    if mode == "blend":
                        breakdown = {"fetch_ms": r.timings.fetch_s * 1e3, "blend_ms": r.timings.blend_s * 1e3,
                                     "question_prefill_ms": r.timings.prefill_s * 1e3,
                                     "recomputed": r.blend.recompute_fraction if r.blend else None,
                                     "compute": r.blend.layer_token_fraction if r.blend else None}
                out[mode].append(r.timings.ttft_s)
    med = {k: statistics.median(v) for k, v in out.items()}
    return {"model": spec, "documents": n_docs, "doc_tokens": doc_tokens, "prompt_tokens": 16 + n_docs * doc_tokens + 16,
            "ratio": ratio, "repeat": repeat, "median_s": med, "all_s": out, "speedup_blend": med["full"] / med["blend"],
            "speedup_naive": med["full"] / med["naive"], "segment_bytes_on_edge": stored, "blend_breakdown": breakdown,
            "load_average": os.getloadavg()}


@torch.inference_mode()
def no_decay(model_dir: Path | None, queries: int = 200, pool: int = 50, per_query: int = 8, ratio: float = 0.15) -> dict[str, Any]:
    """Edge bytes and reuse over a stream of queries (on the retrieval model when given, else ``tiny``)."""
    lm = load_model(str(model_dir) if model_dir is not None else "tiny")
    km = prepare(lm)
    # a pool of 50 documents of 128 tokens (held-out stdlib text), 8 per query in random subsets and
    # orders; the retrieval task's own pool is smaller (documents with disjoint keys)
    cases = blend_eval.generic_cases(lm, queries, per_query, 128, seed=1)
    pool_docs = sorted({d for c in cases for d in c.docs})
    edge = MemoryEdgeTransport()
    windows: list[dict[str, float]] = []
    reused = prompt = 0
    right = 0
    with KdnClient(ClientConfig(edge="mem"), transport=edge) as client:
        for i, c in enumerate(cases):
            r = generate(km, list(c.question), documents=[list(d) for d in c.docs], prefix=list(c.prefix),
                         client=client, blend=BlendOptions(policy=Deviation(ratio)), max_new_tokens=2)
            client.flush(10)
            reused += r.reused_tokens
            prompt += r.prompt_tokens
            right += int(bool(c.answer) and r.tokens == list(c.answer))
            if (i + 1) % 20 == 0:
                windows.append({"queries": i + 1, "reused_fraction": reused / prompt,
                                "edge_bytes": sum(len(v) for v in edge.store.values()), "edge_artifacts": len(edge.store),
                                "accuracy": right / 20})
                reused = prompt = right = 0
    seg_bytes = blend_eval.SegmentCache(lm)
    for d in pool_docs:
        seg_bytes.get(d)
    return {"model": lm.spec, "queries": queries, "pool_documents": len(pool_docs), "per_query": per_query, "ratio": ratio,
            "pool_segment_kv_bytes": seg_bytes.stored_bytes, "windows": windows}


def plot(q: dict[str, Any] | None, t: dict[str, Any] | None, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [x for x in (q, t) if x is not None]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    axes = list(axes[0]) if q is not None else [None, *axes[0]]  # axes[0]: quality, axes[1]: TTFT
    if q is not None:
        m = q["methods"]
        ratios = [float(k.split("@")[1]) for k in m if k.startswith("blend@")]
        acc = [m[f"blend@{r:g}"]["accuracy"] for r in ratios]
        agr = [m[f"blend@{r:g}"]["agreement"] for r in ratios]
        ax = axes[0]
        ax.plot([r * 100 for r in ratios], acc, "o-", label="blend accuracy")
        ax.plot([r * 100 for r in ratios], agr, "s--", label="blend top-1 agreement")
        for name, style in (("full", "k-"), ("naive", "r:"), ("prefix-only", "g-."), ("first-16", "m--")):
            if name in m and m[name]["accuracy"] is not None:
                ax.axhline(m[name]["accuracy"], color=style[0], linestyle=style[1:], label=f"{name} accuracy")
        ax.set_xlabel("recompute ratio (%)")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"retrieval model, {q['documents']} docs, {q['prompts']} held-out prompts")
        ax.legend(fontsize=7)
    if t is not None:
        ax = axes[1]
        names = ["full", "blend", "naive"]
        ax.bar(names, [t["median_s"][n] * 1e3 for n in names], color=["grey", "tab:blue", "tab:red"])
        ax.set_ylabel("TTFT, ms (median)")
        ax.set_title(f"small-125m, {t['documents']} x {t['doc_tokens']} tokens; blend {t['speedup_blend']:.2f}x")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


PARTS = {  # record name, title, what res holds it under
    "retrieval": ("blend-retrieval", "Blend: accuracy on the retrieval reference model"),
    "models": ("blend-models", "Blend: agreement with full prefill, per model"),
    "ttft": ("blend-ttft", "Blend: TTFT vs full prefill, small-125m"),
    "no_decay": ("blend-decay", "Blend: reuse does not decay"),
}


def part_lines(res: dict[str, Any], part: str) -> list[str]:
    """The Markdown of one measured part (empty when the run skipped it)."""
    lines: list[str] = []
    q = res.get("retrieval")
    if q and part == "retrieval":
        lines += [f"**Retrieval reference model** (`{q['model']}`, {q['layers']} layers): {q['prompts']} held-out prompts, "
                  f"{q['documents']} documents of {q['document_tokens'][0]} tokens in random subsets and orders "
                  f"({q['context_tokens']} context tokens), check layer {q['check_layer']}.", "",
                  "| method | accuracy | top-1 agreement | KL (nats) | doc tokens recomputed | compute share | prompt tokens reused | TTFT ms (median) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in q["methods"].values():
            acc = "—" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
            lines.append(f"| {r['name']} | {acc} | {r['agreement']:.3f} | {r['kl']:.4f} | {r['recomputed']:.1%} | "
                         f"{r['compute']:.1%} | {r['reused']:.1%} | {r['ttft_ms']:.1f} |")
        full = q["methods"]["full"]["accuracy"] or 0.0
        b15 = q["methods"].get("blend@0.15")
        if full < 0.9:
            lines += ["", f"**This model does not meet the task's bar** (full-prefill accuracy {full:.3f} < 0.90): accuracy "
                      "columns say nothing about blending, and the goal (blend at ≤ 15% recompute keeps ≥ 98% of "
                      "full-prefill accuracy) is NOT SHOWN. Agreement and KL still compare each method's predictions "
                      f"with full prefill's on the answer tokens of a {q['layers']}-layer model trained on this input "
                      "distribution."]
        elif b15 and full:
            kept = b15["accuracy"] / full
            lines += ["", f"blend@0.15 keeps {kept:.1%} of full prefill's accuracy ({b15['accuracy']:.3f} vs {full:.3f}), "
                      f"agreement {b15['agreement']:.3f}. Verdict: {'PASS' if q['verdict']['passed'] else 'FAIL'} "
                      f"({q['verdict']['reason']})."]
    models = res.get("models") or []
    if models and part == "models":
        lines += ["", "**Agreement and KL with full prefill, per model** (scored tokens: the answer for the retrieval "
                  "model, the question's next-token predictions otherwise):", "",
                  "| model | layers | prompts | naive agree / KL | first-16 agree / KL | blend@0.15 agree / KL | blend@0.3 agree / KL |",
                  "|---|---|---|---|---|---|---|"]
        for m in models:
            cell = lambda k: f"{m['methods'][k]['agreement']:.3f} / {m['methods'][k]['kl']:.4f}"  # noqa: E731
            lines.append(f"| {m['model']} | {m['layers']} | {m['prompts']} | {cell('naive')} | {cell('first-16')} | "
                         f"{cell('blend@0.15')} | {cell('blend@0.3')} |")
    t = res.get("ttft")
    if t and part == "ttft":
        med = t["median_s"]
        lines += ["", f"**TTFT, small-125m** fp32, {t['documents']} documents x {t['doc_tokens']} tokens + 16-token prefix + "
                  f"16-token question ({t['prompt_tokens']} tokens), segments on an in-process edge (fetch + verify + decode "
                  f"timed); medians of {t['repeat']} runs:", "",
                  "| mode | TTFT ms | vs full prefill |", "|---|---|---|",
                  f"| full prefill | {med['full'] * 1e3:.0f} | 1.00x |",
                  f"| blend @ {t['ratio']:.0%} | {med['blend'] * 1e3:.0f} | {t['speedup_blend']:.2f}x |",
                  f"| naive (no recompute) | {med['naive'] * 1e3:.0f} | {t['speedup_naive']:.2f}x |", "",
                  f"Blend breakdown (ms): {', '.join(f'{k} {v:.1f}' if isinstance(v, float) else f'{k} {v}' for k, v in t['blend_breakdown'].items())}."]
    d = res.get("no_decay")
    if d and part == "no_decay":
        lines += ["", f"**Reuse does not decay** (`{d['model']}`): {d['queries']} queries over a pool of {d['pool_documents']} documents "
                  f"({d['per_query']} per query, random subsets and orders), blend @ {d['ratio']:.0%} through "
                  f"`generate(..., documents=...)`. Pool's segment KV: {d['pool_segment_kv_bytes'] / 1e6:.2f} MB.", "",
                  "| queries | edge artifacts | edge bytes | reused-token fraction (last 20) | accuracy (last 20) |",
                  "|---|---|---|---|---|"]
        for w in d["windows"]:
            lines.append(f"| {w['queries']} | {w['edge_artifacts']} | {w['edge_bytes'] / 1e6:.2f} MB | "
                         f"{w['reused_fraction']:.3f} | — |")
    return lines


def markdown(res: dict[str, Any]) -> str:
    """What the terminal shows: every measured part."""
    lines = [f"Blend: `{res['command']}` (load average at the end {res['load_average'][0]:.1f})"]
    for part in PARTS:
        lines += part_lines(res, part)
    return "\n".join(lines) + "\n"


def record(res: dict[str, Any], argv: list[str], load_start: float) -> None:
    """One record per part the run measured (a run that skips a part leaves its record as it was)."""
    for part, (name, title) in PARTS.items():
        if not res.get(part):
            continue
        rec = Record(__file__, name, title, argv, command=res["command"])
        rec.doc["load"]["start"] = load_start
        if part == "retrieval":
            q = res["retrieval"]
            full = q["methods"]["full"]["accuracy"] or 0.0
            b15 = q["methods"].get("blend@0.15")
            if full < 0.9:
                rec.goal("full-prefill accuracy of the model (the task's bar; below it blending is not judged)",
                         "≥ 0.90", median=full, unit="", digits=3, at_least=0.9)
            elif b15:
                rec.goal("blend @ 15%: share of full-prefill accuracy kept", "≥ 98%", median=100 * b15["accuracy"] / full,
                         unit="%", digits=1, at_least=98)
                rec.goal("blend @ 15%: answer top-1 agreement with full prefill", "≥ 95%",
                         median=100 * b15["agreement"], unit="%", digits=1, at_least=95)
        if part == "ttft":
            t = res["ttft"]
            rec.set_rounds(t["repeat"])
            rec.goal(f"blend @ {t['ratio']:.0%} recompute vs full prefill, {t['documents']} x {t['doc_tokens']} tokens",
                     "≥ 3x", median=t["speedup_blend"], at_least=3.0, rounds=t["repeat"])
        rec.markdown(part_lines(res, part))
        if res.get("plot") and part in ("retrieval", "ttft"):
            rec.plot(RESULTS / res["plot"])
        rec.save(load_end=round(res["load_average"][0], 2))




def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--retrieval", type=Path, default=default_retrieval_dir())
    p.add_argument("--reference", type=Path, default=default_reference_dir())
    p.add_argument("--skip", default="", help="comma list of sections to skip: retrieval,models,ttft,decay")
    p.add_argument("--no-append", action="store_true", help="print only; record nothing")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    load_start = round(os.getloadavg()[0], 2)
    torch.set_num_threads(1)
    skip = set(filter(None, args.skip.split(",")))
    prompts = 20 if args.quick else args.prompts
    res: dict[str, Any] = {"command": "python benchmarks/blend.py " + " ".join(argv)}
    have_retrieval = (args.retrieval / "config.json").is_file()
    if have_retrieval and "retrieval" not in skip:
        print("retrieval model quality ...", file=sys.stderr)
        res["retrieval"] = quality(str(args.retrieval), prompts, 8)
    if "models" not in skip:
        res["models"] = []
        specs = [("tiny", prompts), ("tiny-mha", prompts), ("small-125m", 3 if args.quick else 6)]
        if (args.reference / "config.json").is_file():
            specs.append((str(args.reference), prompts))
        for spec, n in specs:
            print(f"agreement/KL: {spec} ...", file=sys.stderr)
            res["models"].append(quality(spec, n, 8))
        if "retrieval" in res:
            res["models"].append(res["retrieval"])
    if "ttft" not in skip:
        print("TTFT small-125m ...", file=sys.stderr)
        res["ttft"] = ttft(1 if args.quick else args.repeat)
    if "decay" not in skip:
        print("no-decay ...", file=sys.stderr)
        res["no_decay"] = no_decay(args.retrieval if have_retrieval else None, queries=60 if args.quick else 200)
    res["load_average"] = os.getloadavg()
    # a run that skips a section plots only what it measured, under its own name (so a quality-only
    # run does not replace the plot of a run that measured TTFT with an empty panel)
    name = {(True, True): "blend.png", (True, False): "blend-quality.png", (False, True): "blend-ttft.png"}.get(
        (res.get("retrieval") is not None, res.get("ttft") is not None))
    res["plot"] = name if name and plot(res.get("retrieval"), res.get("ttft"), RESULTS / name) else None
    md = markdown(res)
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        print(md)
    if not args.no_append:
        record(res, argv, load_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
