"""Documents reused anywhere in the prompt (blend), on the trained model: quality, TTFT, no decay.

    .venv/bin/python benchmarks/blend.py                          # every part
    .venv/bin/python benchmarks/blend.py --parts quality          # the table of kdn eval-blend (resumes its cache)
    .venv/bin/python benchmarks/blend.py --parts ttft,vllm --rounds 10

1. **quality** — ``kdn eval-blend`` on ``smollm2-135m`` (:mod:`kdn.lab.blend_eval`, the needle task:
   held-out files, 240 paired prompts of 8 shuffled 128-token documents): every method's accuracy
   with its 95% interval, KL to full prefill, McNemar p-values, and the issue's claims.
2. **ttft** — transformers, an 8-document RAG prompt (8 x 512 tokens of held-out files after the
   chat prefix, a question after them: ~4.1k tokens), fp32. Per round a novel combination of a
   pool of documents whose segments an in-process edge holds: the host blend at 15%
   (``generate(..., documents=...)``: fetch, verify, re-place, recompute, question, first token)
   against a full prefill of the same prompt through the same function. Per-round ratios.
3. **vllm** — the same prompts in vLLM 0.32 (CPU, fp32; ``--vllm-python``): per round a request
   that opts in to the store's blend (the origin, in the child process, holds the pool as
   segments and blends at its verdict's ratio; the connector loads the variant) against a full
   prefill by vLLM (KDN off for the request, prefix cache reset). TTFT is ``LLM.generate``'s wall
   time with ``max_tokens=1``.
4. **decay** — 200 novel combinations (8 of a pool of 64 documents of 128 tokens, random
   subsets and orders) through ``generate(..., documents=...)`` at 15%, segments on an in-process
   edge: per 20 queries the reused-token share, the TTFT gain over full prefill (every 4th query
   is also fully prefilled) and what the edge holds (artifacts, bytes).

Records ``blend-quality``, ``blend-ttft``, ``blend-vllm`` (``-split`` with ``--split-cores``; at
15% with ``--timing-verdict``, else at the model's own verdict: ``blend-vllm-verdict``) and
``blend-decay``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"
CHUNK = 256
RATIO = 0.15

METHOD = {
    "blend-quality": """`kdn eval-blend --model smollm2-135m` (kdn/lab/blend_eval.py): 240 prompts, each 8
excerpts of 128 tokens of held-out standard-library files (split by file; a pool of excerpts, at
most 8 per file) in a random order after a ChatML system prefix; the question repeats the first 10
tokens of a line of one of them (its position cycles through all 8, the line is unique among
them); a prompt is right when the line's next token is the model's top-1, and `exact` counts
prompts whose next 4 tokens all are (teacher forced). Every method runs on the same
prompts; segments are each excerpt's KV computed alone. Accuracy with Wilson 95% intervals, KL to
full prefill with normal 95% intervals, exact McNemar tests of the answers, and an exact sign test
of the per-prompt KL against blend@15%'s (prompts where a method is closer to full prefill than
blend@15% / further from it): the random control is judged by that test. prefix-only is computed
on the first 40 prompts (its reuse share on all), blend@1 on the first 30. The model's verdict is
the smallest ratio of the ladder (5, 15, 30, 50, 70%) with top-1 agreement >= 0.95 and >= 98% of
full prefill's accuracy; the run writes it where KDN ships it (kdn/blend/verdicts/).""",
    "blend-ttft": """transformers 5, fp32, smollm2-135m: a chat prefix, 8 excerpts of 512 tokens of held-out
files, a question (about 4.1k tokens). Per round a combination of 8 documents of a pool of 16
that no earlier round used (subset and order); the pool's segments sit in an in-process edge
(MemoryEdgeTransport). Blend: `generate(km, question, documents=..., prefix=..., blend=
BlendOptions(policy=Deviation(0.15)))` (fetch, verify, re-place, recompute, question, first token);
full prefill: `generate(km, whole prompt)` without a client. Where the model's verdict names
another ratio, a third request gives `generate` no policy, so the verdict decides, as it does for
any user. TTFT inside `generate`; the requests run back to back in an order that rotates by
round; the ratio is per round.""",
    "blend-vllm": """vLLM 0.32 CPU, fp32, smollm2-135m, the prompts of blend-ttft (token ids). The origin runs
in the benchmark's child process with the pool stored as segments (`store_segment`, not timed),
its prefill worker on every core (`worker_threads`), and blends at the ratio of the model's
verdict (`kdn eval-blend`, or the one KDN ships for the model; `--timing-verdict`: one at 15%
written for the run); the KDN connector
(`blend_origin`) loads the variant for requests with `kv_transfer_params: {"kdn_blend": true}`
and a `kdn-blend` cache salt. Full prefill: the same prompt with KDN off for the request. Prefix
cache reset before every request; TTFT is `LLM.generate`'s wall time with `max_tokens=1`; the
ratio is per round, the two requests back to back in alternating order.""",
    "blend-vllm-split": """blend-vllm's rounds with the machine's cores split in two halves (`--split-cores`):
vLLM on the first half (its forward threads bound there by `VLLM_CPU_OMP_THREADS_BIND`, and every
thread of the processes `LLM` starts, engine core and worker, moved there once the engine is up),
the benchmark's child (the origin, which blends, and the LLM front end) on the second. This is the
deployed shape, the origin's workers on their own machine and vLLM's scheduler on the inference
host, emulated on one: co-located (blend-vllm), vLLM's idle worker spins (its message queue
busy-waits with `sched_yield` for a second after each message, and a request waiting for remote
KV sends one every scheduler step) and takes a core from the origin's blend. Both sides get half
the cores, so full prefill is slower here than in blend-vllm and the ratio compares equal
hardware. In records before the one of 2026-12-07 14:53 UTC the engine core stayed on the
origin's half.""",
    "blend-vllm-verdict": """blend-vllm's rounds without `--timing-verdict`: the store blends at the ratio of the
model's own verdict (the one KDN ships for smollm2-135m: 50%), what a vLLM request that opts in
meets by default.""",
    "blend-vllm-verdict-split": """blend-vllm-split's rounds (`--split-cores`) without `--timing-verdict`: the store
blends at the ratio of the model's own verdict (the one KDN ships for smollm2-135m: 50%), what a
vLLM request that opts in meets by default, with the origin on its own cores as deployed.""",
    "blend-decay": """smollm2-135m fp32: 200 queries, each 8 of a pool of 64 excerpts of 128 tokens (held-out
files) in a subset and order no earlier query used, through `generate(..., documents=...)` at
15% with the pool's segments on an in-process edge. Every 4th query is also fully prefilled for
the TTFT gain. Per 20 queries: the share of prompt tokens reused, the median gain, what the edge
holds.""",
}


def _save(rec: Any) -> None:
    rec.save()


def _print_only(rec: Any) -> None:
    print(json.dumps({"goals": rec.doc["goals"], "body": rec.doc["body"]}, indent=1, default=str))


SAVE = _save  # --no-record: print instead


def _record(name: str, title: str, argv: list[str], load_start: float) -> Any:
    from _results import Record

    rec = Record(__file__, name, title, argv, method=METHOD[name])
    rec.doc["load"]["start"] = load_start
    return rec


# -- prompts ----------------------------------------------------------------------------------------


def rag_pool(lm: Any, doc_tokens: int, n: int, per_file: int = 2) -> list[list[int]]:
    from kdn.lab.blend_tasks import document_pool
    from kdn.lab.reference import corpus_split

    cs = corpus_split()
    pool = document_pool(lm.tokenizer, cs.heldout, cs.root, doc_tokens=doc_tokens, per_file=per_file)
    if len(pool) < n:
        raise SystemExit(f"only {len(pool)} documents of {doc_tokens} tokens in the held-out files, need {n}")
    rng = random.Random(7)
    return [list(d.tokens) for d in rng.sample(pool, n)]


def combinations(pool_n: int, k: int, n: int, seed: int) -> list[list[int]]:
    """``n`` distinct (subset, order) picks of ``k`` of ``pool_n`` documents."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    out = []
    while len(out) < n:
        pick = tuple(rng.sample(range(pool_n), k))
        if pick not in seen:
            seen.add(pick)
            out.append(list(pick))
    return out


def question_for(lm: Any, doc: list[int]) -> list[int]:
    from kdn.lab.blend_tasks import chat_parts

    _, ask = chat_parts(lm.tokenizer)
    return ask + doc[len(doc) // 2 : len(doc) // 2 + 10]


# -- parts ------------------------------------------------------------------------------------------


def part_quality(argv: list[str], load_start: float, budget_s: float | None) -> dict[str, Any]:
    from kdn.lab import blend_eval

    lm, info, summary = blend_eval.run(MODEL, prompts=240, docs=8, doc_tokens=128, ratios=blend_eval.DEFAULT_RATIOS,
                                       first_k=16, seed=0, progress=True, budget_s=budget_s)
    out = {**info, **summary}
    rec = _record("blend-quality", "Blend on the trained model: accuracy, KL, paired tests (needle task)", argv,
                  load_start)
    rows = []
    for m in summary["methods"].values():
        acc = "—" if m["accuracy"] is None else f"{m['accuracy']:.3f} [{m['accuracy_ci'][0]:.3f}, {m['accuracy_ci'][1]:.3f}]"
        p_full = m.get("vs_full", {}).get("p")
        p_b15 = m.get("vs_blend@0.15", {}).get("p")
        ex = "—" if m.get("exact") is None else f"{m['exact']:.3f}"
        s15 = m.get("kl_vs_blend@0.15")
        kl15 = "—" if s15 is None else f"{s15['lower_this']} / {s15['lower_other']}, p={s15['p']:.2g}"
        rows.append([m["name"], m["prompts"], acc, ex, f"{m['kl']:.4f} [{m['kl_ci'][0]:.4f}, {m['kl_ci'][1]:.4f}]",
                     f"{m['agreement']:.3f}", f"{m['recomputed']:.1%}", f"{m['compute']:.1%}",
                     f"{m.get('reused_all_prompts', m['reused']):.1%}", "—" if p_full is None else f"{p_full:.2g}",
                     "—" if p_b15 is None else f"{p_b15:.2g}", kl15])
    rec.table(["method", "prompts", "accuracy [95% CI]", "exact (4 tokens)", "KL to full [95% CI]", "top-1 agreement",
               "doc tokens recomputed",
               "compute share", "prompt tokens reused", "McNemar p vs full", "McNemar p vs blend@15%",
               "KL vs blend@15%: prompts lower / higher, sign test p"], rows)
    for c in summary["claims"]:
        rec.goal(c["what"], c["goal"], median=c["value"], met=c["met"], unit="", digits=4)
    rec.note(f"{info['prompts_done']} of {info['prompts']} prompts; pool {info.get('pool_documents')} documents from "
             f"{info.get('files')} held-out files; context {info['context_tokens']} tokens; check layer "
             f"{info['check_layer']}; {info['threads']} torch threads.")
    if "blend@1" in summary["methods"]:
        rec.note(f"blend@1 (every token recomputed) vs full prefill: largest logit difference "
                 f"{summary['methods']['blend@1'].get('max_logit_diff', float('nan')):.2e}.")
    verdict = ship_verdict(lm, info, summary)
    if verdict is not None:
        rec.note(f"The model's verdict (the smallest ratio of {', '.join(f'{r:g}' for r in blend_eval.DEFAULT_RATIOS)} "
                 f"with top-1 agreement >= 0.95 and >= 98% of full prefill's accuracy): "
                 f"{'PASS' if verdict.passed else 'FAIL'}, {verdict.reason}; shipped with KDN for {MODEL} fp32 "
                 f"(kdn/blend/verdicts/), so the host and the store blend it at that ratio by default.")
    rec.set_rounds(info["prompts_done"])
    rec.data({"methods": summary["methods"], "claims": summary["claims"],
              "verdict": None if verdict is None else {"passed": verdict.passed, "ratio": verdict.ratio}})
    SAVE(rec)
    return out


def ship_verdict(lm: Any, info: dict[str, Any], summary: dict[str, Any]) -> Any:
    """Write the built-in model's verdict where KDN ships it (:data:`kdn.blend.verdict.SHIPPED_ROOT`),
    from a complete run over the whole ladder; None (nothing written) for a partial run."""
    from kdn.blend.verdict import SHIPPED_ROOT, write_verdict
    from kdn.lab import blend_eval

    if info["prompts_done"] != info["prompts"]:
        return None
    verdict = blend_eval.verdict_for(lm, summary, blend_eval.DEFAULT_RATIOS, info["check_layer"])
    path = write_verdict(verdict, SHIPPED_ROOT)
    print(f"verdict: {'PASS' if verdict.passed else 'FAIL'} — {verdict.reason} (shipped: {path.relative_to(ROOT)})")
    return verdict


def part_ttft(argv: list[str], load_start: float, rounds: int, doc_tokens: int = 512) -> dict[str, Any]:
    from kdn.blend import Deviation
    from kdn.client import ClientConfig, KdnClient
    from kdn.testing import MemoryEdgeTransport
    from kdn.blend.verdict import read_verdict
    from kdn.integrations.blend import BlendOptions
    from kdn.integrations.transformers import generate, prepare
    from kdn.lab.blend_tasks import chat_parts
    from kdn.models import load_model

    lm = load_model(MODEL)
    km = prepare(lm)
    pool = rag_pool(lm, doc_tokens, 16)
    prefix, _ = chat_parts(lm.tokenizer)
    combos = combinations(len(pool), 8, rounds + 1, seed=11)
    edge = MemoryEdgeTransport()
    rows, ratios, defaults = [], [], []
    verdict = read_verdict(lm.fingerprint)  # what a host blends at by default (the shipped verdict, or the user's)
    by_default = verdict is not None and verdict.passed and verdict.ratio != RATIO
    with KdnClient(ClientConfig(edge="mem"), transport=edge) as client:
        opts = BlendOptions(policy=Deviation(RATIO))
        for d in pool:  # the pool's segments on the edge, not timed
            generate(km, [13], documents=[d], client=client, blend=opts, max_new_tokens=1)
        client.flush(120)
        for r, combo in enumerate(combos):
            docs = [pool[i] for i in combo]
            q = question_for(lm, docs[r % 8])
            flat = prefix + sum(docs, []) + q
            got: dict[str, Any] = {}
            modes = ["full", "blend"] + (["default"] if by_default else [])
            for mode in modes[r % len(modes):] + modes[: r % len(modes)]:  # the order rotates by round
                if mode == "full":
                    got[mode] = generate(km, flat, max_new_tokens=1)
                else:  # "default": no policy given, so the model's verdict decides, as for any user
                    got[mode] = generate(km, q, documents=docs, prefix=prefix, client=client,
                                         blend=opts if mode == "blend" else None, max_new_tokens=1)
                    assert got[mode].via.startswith("blend"), got[mode].warnings
            if r == 0:
                continue  # warm-up
            f, b = got["full"].timings.ttft_s, got["blend"].timings.ttft_s
            ratios.append(f / b)
            d = got["default"].timings.ttft_s if by_default else None
            if d is not None:
                defaults.append(f / d)
            rows.append([r, len(flat), f"{f * 1e3:.0f}", f"{b * 1e3:.0f}", f"{f / b:.2f}x",
                         f"{got['blend'].timings.fetch_s * 1e3:.0f}", f"{got['blend'].timings.blend_s * 1e3:.0f}",
                         f"{got['blend'].blend.recompute_fraction:.1%}" if got["blend"].blend else "—",
                         "—" if d is None else f"{d * 1e3:.0f} ({f / d:.2f}x)"])
    rec = _record("blend-ttft", "Blend TTFT vs full prefill, 8-document RAG prompt, transformers", argv, load_start)
    rec.goal(f"blend @ {RATIO:.0%} vs full prefill, 8 x {doc_tokens} tokens, smollm2-135m fp32, transformers", "≥ 3x",
             ratios, at_least=3.0)
    rec.table(["round", "prompt tokens", "full prefill ms", "blend ms", "ratio", "fetch ms", "blend ms (recompute)",
               "recomputed", "at the verdict's ratio ms (vs full)"], rows)
    if defaults:
        rec.note(f"What a host blends at by default, the model's verdict ({verdict.ratio:.0%}: "
                 f"[blend-quality](#blend-quality)), vs full prefill, per round: median {statistics.median(defaults):.2f}x "
                 f"[{min(defaults):.2f}–{max(defaults):.2f}] (no policy given to `generate`).")
    elif verdict is None or not verdict.passed:
        rec.note("The model has no passing verdict: a host given no policy reuses the documents as an exact prefix only.")
    rec.set_rounds(len(ratios))
    rec.data({"ratios": ratios, "verdict_ratio": verdict.ratio if by_default else None, "default_ratios": defaults})
    SAVE(rec)
    return {"ratios": ratios, "median": statistics.median(ratios)}


def part_decay(argv: list[str], load_start: float, queries: int = 200) -> dict[str, Any]:
    from kdn.blend import Deviation
    from kdn.client import ClientConfig, KdnClient
    from kdn.testing import MemoryEdgeTransport
    from kdn.integrations.blend import BlendOptions
    from kdn.integrations.transformers import generate, prepare
    from kdn.lab.blend_tasks import chat_parts
    from kdn.models import load_model

    lm = load_model(MODEL)
    km = prepare(lm)
    pool = rag_pool(lm, 128, 64, per_file=8)
    prefix, _ = chat_parts(lm.tokenizer)
    combos = combinations(len(pool), 8, queries, seed=23)
    edge = MemoryEdgeTransport()
    opts = BlendOptions(policy=Deviation(RATIO))
    windows, rows = [], []
    with KdnClient(ClientConfig(edge="mem"), transport=edge) as client:
        for d in pool:
            generate(km, [13], documents=[d], client=client, blend=opts, max_new_tokens=1)
        client.flush(120)
        seg_artifacts = len(edge.store)
        reused = prompt = 0
        gains: list[float] = []
        ttfts: list[float] = []
        for i, combo in enumerate(combos):
            docs = [pool[j] for j in combo]
            q = question_for(lm, docs[i % 8])
            r = generate(km, q, documents=docs, prefix=prefix, client=client, blend=opts, max_new_tokens=1)
            client.flush(10)
            reused += r.reused_tokens
            prompt += r.prompt_tokens
            ttfts.append(r.timings.ttft_s)
            if i % 4 == 0:
                f = generate(km, prefix + sum(docs, []) + q, max_new_tokens=1)
                gains.append(f.timings.ttft_s / r.timings.ttft_s)
            if (i + 1) % 20 == 0:
                w = {"queries": i + 1, "reused_fraction": reused / prompt, "gain_median": statistics.median(gains),
                     "blend_ttft_ms": statistics.median(ttfts) * 1e3, "edge_artifacts": len(edge.store),
                     "edge_bytes": sum(len(v) for v in edge.store.values())}
                windows.append(w)
                rows.append([w["queries"], f"{w['reused_fraction']:.3f}", f"{w['gain_median']:.2f}x",
                             f"{w['blend_ttft_ms']:.0f}", w["edge_artifacts"], f"{w['edge_bytes'] / 1e6:.1f} MB"])
                reused = prompt = 0
                gains, ttfts = [], []
    first, last = windows[0], windows[-1]
    rec = _record("blend-decay", "Blend reuse does not decay over novel combinations", argv, load_start)
    rec.goal(f"reused-token share, last 20 of {queries} queries vs first 20", "≥ 0.95x",
             median=last["reused_fraction"] / first["reused_fraction"], at_least=0.95, digits=3)
    rec.goal(f"TTFT gain over full prefill, last 20 queries vs first 20", "≥ 0.8x",
             median=last["gain_median"] / first["gain_median"], at_least=0.8, digits=3)
    rec.goal("edge artifacts after the queries vs the pool's segments", "= 1.00x",
             median=last["edge_artifacts"] / seg_artifacts, met=last["edge_artifacts"] == seg_artifacts, digits=2)
    rec.table(["queries", "reused-token share (last 20)", "TTFT gain (median, last 20)", "blend TTFT ms (median)",
               "edge artifacts", "edge bytes"], rows)
    rec.note(f"{len(pool)} documents, {queries} queries of 8, every (subset, order) new; {seg_artifacts} segments on "
             "the edge before the first query.")
    rec.set_rounds(queries)
    rec.data({"windows": windows})
    SAVE(rec)
    return {"windows": windows}


def part_vllm(argv: list[str], load_start: float, rounds: int, python: str,
              timing_verdict: bool = False, split_cores: bool = False) -> dict[str, Any] | None:
    if not Path(python).is_file():
        print(f"[blend] no vLLM environment at {python} (deploy/install-vllm.sh): vLLM part skipped", file=sys.stderr)
        return None
    cores = sorted(os.sched_getaffinity(0))
    if split_cores and len(cores) < 2:
        raise SystemExit("--split-cores needs at least 2 cores")
    engine_cores, origin_cores = cores[: len(cores) // 2], cores[len(cores) // 2 :]
    with tempfile.TemporaryDirectory(prefix="kdn-blend-vllm-") as tmp:
        out = Path(tmp) / "vllm.json"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               "PYTHONPATH": str(ROOT)}
        if split_cores:  # vLLM's forward binds its threads to engine_cores; the child (the origin) runs on the rest
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, engine_cores))
            env["KDN_BENCH_ENGINE_CORES"] = env["VLLM_CPU_OMP_THREADS_BIND"]  # the engine's processes go there too
        proc = subprocess.run([python, __file__, "--vllm-child", str(out), "--rounds", str(rounds),
                               *(["--timing-verdict"] if timing_verdict else [])], env=env, cwd=ROOT, timeout=3600,
                              preexec_fn=(lambda: os.sched_setaffinity(0, origin_cores)) if split_cores else None)
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"vLLM child failed ({proc.returncode})")
        res = json.loads(out.read_text())
    # at the model's own verdict (not --timing-verdict's 15%): what a user meets, recorded apart
    own = "" if timing_verdict else "-verdict"
    at = "" if timing_verdict else f", at the model's verdict ({res['verdict_ratio']:.0%})"
    if split_cores:
        rec = _record(f"blend-vllm{own}-split", f"Blend TTFT in vLLM through the store's blend, origin on its own "
                      f"cores{at}", argv, load_start)
        rec.note(f"vLLM (its engine core, scheduler and worker) on core(s) {engine_cores}, the origin on "
                 f"{origin_cores}: as deployed, where the origin's workers are not the inference host's cores.")
    else:
        rec = _record(f"blend-vllm{own}", f"Blend TTFT vs full prefill in an unmodified vLLM, through the store's "
                      f"blend{at}", argv, load_start)
    ratios = [r["ratio"] for r in res["rounds"]]
    where = ", origin on its own cores" if split_cores else ""
    rec.goal(f"store-side blend (ratio {res['verdict_ratio']:g}) vs vLLM full prefill, 8 x 512 tokens, fp32{where}",
             "≥ 3x", ratios, at_least=3.0)
    rec.table(["round", "prompt tokens", "vLLM full prefill ms", "vLLM + store blend ms", "ratio", "cached tokens",
               "same first token"],
              [[r["round"], r["prompt_tokens"], f"{r['full_s'] * 1e3:.0f}", f"{r['blend_s'] * 1e3:.0f}",
                f"{r['ratio']:.2f}x", r["cached"], r["same_first_token"]] for r in res["rounds"]])
    rec.note(f"blend verdict: {res.get('verdict', '—')}; engine start {res['engine_start_s']:.0f} s; origin counters "
             "after the rounds: "
             + ", ".join(f"{k} {v:g}" for k, v in sorted(res["origin"].items())))
    rec.set_rounds(len(ratios))
    rec.data(res)
    SAVE(rec)
    return res


def _pin_engine(cores: set[int]) -> None:
    """Every thread of this process's descendants (the processes ``LLM`` started: vLLM's engine
    core, its scheduler, and the worker) onto ``cores``. They inherit this process's cores, the
    origin's; on an inference host they are the engine's. While a request waits for its variant the
    engine core steps every ``blend_poll_s`` and then spins (``sched_yield``) waiting on the
    worker's answer, which on the origin's core takes time from the blend."""
    import psutil

    for proc in psutil.Process().children(recursive=True):
        for thread in proc.threads():
            try:
                os.sched_setaffinity(thread.id, cores)
            except OSError:  # a thread that ended meanwhile
                pass


def vllm_child(out: Path, rounds: int, timing_verdict: bool = False) -> int:
    """In the vLLM environment: an origin in this process, an engine with the connector, the rounds."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kdn.blend.verdict import Verdict, read_verdict, write_verdict
    from kdn.keys import DEFAULT_NAMESPACE
    from kdn.lab.blend_tasks import chat_parts
    from kdn.origin.config import OriginConfig
    from kdn.origin.segments import store_segment
    from kdn.origin.server import OriginServer
    from kdn.pretrained import model_dir

    model = model_dir(MODEL)
    tmp = Path(tempfile.mkdtemp(prefix="kdn-blend-origin-"))
    # the origin blends while the engine waits for its KV: it gets the machine's cores, as vLLM's
    # own prefill does (the default, one torch thread per prefill worker, halves its speed)
    origin = OriginServer(OriginConfig(store_dir=str(tmp / "store"), models=[str(model)], dtype="float32",
                                       chunk_size=CHUNK, codecs=["raw"], listen="127.0.0.1:0", fsync=False,
                                       worker_threads=len(os.sched_getaffinity(0)) or 1))
    origin.start()
    try:
        lm = origin.model()
        v = read_verdict(lm.fingerprint)
        if timing_verdict:
            # timing at RATIO: a verdict in this run's own cache, so the store blends at it whatever
            # the model's own verdict says (the report says so); the user's cache is untouched
            os.environ["KDN_CACHE"] = str(tmp / "cache")
            v = Verdict(bytes(lm.fingerprint).hex(), True, RATIO, 1, reason="benchmarks/blend.py --timing-verdict")
            write_verdict(v)
        elif v is None or not v.passed:
            raise SystemExit(f"no passing blend verdict for {MODEL} fp32 (run kdn eval-blend first, or time "
                             f"the path at {RATIO:g} with --timing-verdict): {v}")
        pool = rag_pool(lm, 512, 16)
        for i, d in enumerate(pool):
            store_segment(lm, origin.store, origin.segment_catalog, d, namespace=DEFAULT_NAMESPACE, doc_id=f"pool-{i}")
        prefix, _ = chat_parts(lm.tokenizer)
        combos = combinations(len(pool), 8, rounds + 1, seed=11)
        t0 = time.time()
        llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=4608, enable_prefix_caching=True,
                  max_num_seqs=2, seed=0,
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="KdnConnector", kv_connector_module_path="kdn.integrations.vllm",
                      kv_role="kv_both", kv_load_failure_policy="recompute",
                      kv_connector_extra_config={"blend_origin": origin.address, "chunk_size": CHUNK,
                                                 "write_back": False}))
        start_s = time.time() - t0
        engine_cores = os.environ.get("KDN_BENCH_ENGINE_CORES")
        if engine_cores:
            _pin_engine({int(c) for c in engine_cores.split(",")})
        sp = SamplingParams(temperature=0.0, max_tokens=1)
        results = []
        for r, combo in enumerate(combos):
            docs = [pool[i] for i in combo]
            q = question_for(lm, docs[r % 8])
            prompt = prefix + sum(docs, []) + q
            got: dict[str, Any] = {}
            for mode in (["full", "blend"] if r % 2 == 0 else ["blend", "full"]):
                s = sp.clone()
                p: dict[str, Any] = {"prompt_token_ids": prompt}
                if mode == "blend":
                    p["cache_salt"] = f"kdn-blend-{r}"
                    s.extra_args = {"kv_transfer_params": {"kdn_blend": True}}
                else:
                    s.extra_args = {"kv_transfer_params": {"kdn": False}}
                llm.reset_prefix_cache()
                t = time.perf_counter()
                o = llm.generate([p], s, use_tqdm=False)[0]
                got[mode] = (time.perf_counter() - t, int(o.num_cached_tokens or 0), list(o.outputs[0].token_ids))
            if r == 0:
                continue  # warm-up
            (fs, _, ft), (bs, bc, bt) = got["full"], got["blend"]
            results.append({"round": r, "prompt_tokens": len(prompt), "full_s": fs, "blend_s": bs, "ratio": fs / bs,
                            "cached": bc, "same_first_token": ft[:1] == bt[:1]})
            print(f"round {r}: full {fs:.2f}s blend {bs:.2f}s ({fs / bs:.2f}x), cached {bc}", flush=True)
        counters = {k: v for k, v in origin.stats().counters.items() if k.startswith("blend")}
        out.write_text(json.dumps({"rounds": results, "engine_start_s": start_s, "verdict_ratio": v.ratio,
                                   "verdict": v.reason or "the model's own (kdn eval-blend)",
                                   "origin": counters, "torch": torch.__version__}))
        return 0
    finally:
        origin.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="quality,ttft,vllm,decay", help="comma list of quality, ttft, vllm, decay")
    p.add_argument("--rounds", type=int, default=10, help="TTFT rounds (each a novel combination; one more warms up)")
    p.add_argument("--queries", type=int, default=200, help="decay: queries")
    p.add_argument("--budget-s", type=float, default=None, help="quality: stop the evaluation after this long")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--doc-tokens", type=int, default=512, help="ttft: tokens per document (default 512)")
    p.add_argument("--no-record", action="store_true", help="print the figures; record nothing")
    p.add_argument("--timing-verdict", action="store_true",
                   help=f"vllm: time the store's blend at {RATIO:g} whatever the model's own verdict says (a "
                        "verdict written in the run's own cache; the report says so)")
    p.add_argument("--split-cores", action="store_true",
                   help="vllm: the engine's forward on half the cores, the origin on the other half (an origin on "
                        "its own machine, as deployed); recorded as blend-vllm-split")
    p.add_argument("--vllm-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global SAVE
    if args.no_record:
        SAVE = _print_only
    if args.vllm_child is not None:
        return vllm_child(args.vllm_child, args.rounds, args.timing_verdict)
    argv = list(argv if argv is not None else sys.argv[1:])
    parts = [x for x in args.parts.split(",") if x]
    for part in parts:
        load_start = round(os.getloadavg()[0], 2)
        print(f"[blend] {part} (load {load_start})", file=sys.stderr, flush=True)
        if part == "quality":
            part_quality(argv, load_start, args.budget_s)
        elif part == "ttft":
            part_ttft(argv, load_start, args.rounds, args.doc_tokens)
        elif part == "vllm":
            part_vllm(argv, load_start, args.rounds, args.vllm_python, args.timing_verdict, args.split_cores)
        elif part == "decay":
            part_decay(argv, load_start, args.queries)
        else:
            raise SystemExit(f"unknown part {part!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
