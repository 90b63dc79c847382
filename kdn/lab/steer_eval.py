"""``kdn eval-steer``: does steered KV raise accuracy where facts sit mid-context? Measured, with harm.

On a retrieval reference model (``kdn model train-reference --task retrieval``) it builds held-out
prompts ``R : [doc_1 … doc_n] ? KEY`` whose answer sits in the document at the **start** (doc 1),
the **middle** (doc n/2 or n/2+1) or the **end** (doc n) of the context, among distractors. The
context ``R : doc_1 … doc_n`` is what is stored (one document ingested as a prefix chain); the
question is the new request. For each prompt it compares, on the same prompt:

- ``plain`` — the context's ordinary KV;
- ``key-edit`` — keys of the answer document's tokens (the operator's marks) edited in the heads a
  calibration chose, at the calibrated strength (:mod:`kdn.steer.methods`);
- ``key-edit, wrong marks`` — the same edit on a distractor document (an operator who marked the
  wrong thing), to show the harm;
- ``re-read`` — the whole context read twice, the second reading stored (query-independent, no marks);
- ``re-read marked`` / ``re-read marked, wrong marks`` — only the marked document read a second time.

Reuse is simulated as the product does it: the stored KV is cut into full chunks of the model's
chunk size; those are reused, and the tail of the context (a partial chunk) plus the question are
prefilled at reuse with the model's ordinary attention. Calibration (heads and strength of
key-edit) uses prompts from the training distribution (a generator seeded apart from training's and
from the held-out set's), with the answer at random positions, never the held-out prompts.

Reported per variant and position: accuracy (every answer word right, greedy) with a 95% Wilson
interval, the paired difference from plain on the same prompts with a 95% interval, the stored
bytes (raw container; identical by construction: same shape and dtype), and the median time from
cached KV to the answer's logits. Goal: some variant with correct marks raises middle accuracy
by >= 5 points and loses <= 1 point at the start and the end. Figures: ``benchmarks/steer.py``
(BENCHMARKS.md) and ``docs/steering.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kdn.artifact import encode_artifact
from kdn.blend.rope import rope_spec
from kdn.console import plain, report_error
from kdn.errors import InvalidInput, KdnError
from kdn.keys import DEFAULT_NAMESPACE, chunk_keys
from kdn.kv import cache_from_layers
from kdn.models import LoadedModel, load_model
from kdn.steer import SteerSpec, steer_root
from kdn.steer.methods import (CalPrompt, KeyEditCalibration, apply_key_edit, calibrate_key_edit, full_kv, re_read,
                               write_calibration)

POSITIONS = ("start", "middle", "end")
CAL_SEED_OFFSET = 20_000
TEST_SEED_OFFSET = 10_000 + 13
GOAL_GAIN = 0.05
GOAL_LOSS = 0.01


@dataclass(frozen=True, slots=True)
class Case:
    prefix: tuple[int, ...]
    docs: tuple[tuple[int, ...], ...]
    question: tuple[int, ...]
    answer: tuple[int, ...]
    target: int  # index of the answer's document
    wrong: int  # a distractor document (for wrong marks)

    @property
    def context(self) -> list[int]:
        return list(self.prefix) + [t for d in self.docs for t in d]

    def span(self, doc: int) -> tuple[int, int]:
        s = len(self.prefix) + sum(len(d) for d in self.docs[:doc])
        return (s, s + len(self.docs[doc]))

    @property
    def tail(self) -> list[int]:
        return list(self.question) + list(self.answer[:-1])


def target_index(where: str, n_docs: int, gen: torch.Generator) -> int:
    if where == "start":
        return 0
    if where == "end":
        return n_docs - 1
    if where == "middle":
        mids = [(n_docs - 1) // 2, n_docs // 2]
        return mids[int(torch.randint(0, len(mids), (1,), generator=gen))]
    if where == "any":
        return int(torch.randint(0, n_docs, (1,), generator=gen))
    raise InvalidInput(f"unknown position {where!r}")


def prompt_task(model_dir: Path) -> Any:
    """The task a retrieval model was trained on, as far as prompts go: fields this build does not
    know (a newer trainer's curriculum settings) are left out; they change training, not prompts."""
    from dataclasses import fields

    from kdn.lab.retrieval import TaskConfig, load_task

    try:
        return load_task(model_dir)[0].task
    except TypeError:
        meta = json.loads((Path(model_dir) / "kdn_reference.json").read_text())
        known = {f.name for f in fields(TaskConfig)}
        task = {k: v for k, v in meta["train_config"]["task"].items() if k in known}
        if "long_gaps" in task:
            task["long_gaps"] = tuple(task["long_gaps"])  # JSON gives a list
        return TaskConfig(**task)


def make_cases(model_dir: Path, lm: LoadedModel, n: int, n_docs: int, where: str, seed: int) -> list[Case]:
    """``n`` prompts whose answer document sits at ``where``; keys unique within a prompt."""
    from kdn.lab.retrieval import PREFIX_TEXT, _document

    task = prompt_task(model_dir)
    if n_docs < 3:
        raise InvalidInput("steering needs at least 3 documents (start, middle, end)")
    if n_docs * task.facts_per_doc > task.num_keys:
        raise InvalidInput(f"{n_docs} documents need {n_docs * task.facts_per_doc} keys; the task has {task.num_keys}")
    gen = torch.Generator().manual_seed(seed + POSITIONS.index(where) * 7919 if where in POSITIONS else seed)
    enc = lambda words: tuple(lm.tokenizer.encode(" ".join(words)))  # noqa: E731
    cases = []
    for _ in range(n):
        keys = torch.randperm(task.num_keys, generator=gen)[: n_docs * task.facts_per_doc].tolist()
        docs = [_document(task, keys[d * task.facts_per_doc : (d + 1) * task.facts_per_doc], gen) for d in range(n_docs)]
        t = target_index(where, n_docs, gen)
        others = [i for i in range(n_docs) if i != t]
        w = others[int(torch.randint(0, len(others), (1,), generator=gen))]
        facts = docs[t][1]
        key = list(facts)[int(torch.randint(0, len(facts), (1,), generator=gen))]
        cases.append(Case(enc(PREFIX_TEXT.split()), tuple(enc(words) for words, _ in docs), enc(["?", f"k{key}"]),
                          enc([f"v{x}" for x in facts[key]]), t, w))
    return cases


# -- reuse ------------------------------------------------------------------------------------------


@torch.inference_mode()
def reuse(lm: LoadedModel, stored: torch.Tensor, case: Case) -> tuple[bool, float, float]:
    """(answer right, log p(answer), seconds from cached KV to the answer's logits): full chunks of
    ``stored`` reused, the context's tail and the question prefilled on top."""
    ctx = case.context
    C = lm.chunk_size
    hit = (len(ctx) // C) * C
    feed = ctx[hit:] + case.tail
    n_ans = len(case.answer)
    t0 = time.perf_counter()
    cache = cache_from_layers([(stored[l, 0, :, :hit].unsqueeze(0), stored[l, 1, :, :hit].unsqueeze(0))
                               for l in range(stored.shape[0])], lm.config)
    logits = lm.model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True, logits_to_keep=n_ans).logits[0]
    secs = time.perf_counter() - t0
    lp = logits.float().log_softmax(-1)
    ans = list(case.answer)
    return bool(lp.argmax(-1).tolist() == ans), float(lp[torch.arange(n_ans), torch.tensor(ans)].sum()), secs


def stored_bytes(lm: LoadedModel, kv: torch.Tensor, tokens: Sequence[int], spec: SteerSpec | None) -> int:
    """Bytes of the raw containers of every full chunk of ``kv`` (what a reuse fetches)."""
    C = lm.chunk_size
    keys = chunk_keys(tokens, fingerprint=lm.fingerprint, namespace=DEFAULT_NAMESPACE, chunk_size=C,
                      root=steer_root(spec))
    total = 0
    for i, key in enumerate(keys):
        parent = keys[i - 1] if i else steer_root(spec)
        total += len(encode_artifact(kv[:, :, :, i * C : (i + 1) * C].contiguous(), key=key, parent_key=parent,
                                     fingerprint=lm.fingerprint, codec="raw", chunk_index=i,
                                     steer=spec.canonical() if spec else ""))
    return total


# -- the variants -----------------------------------------------------------------------------------


def variants(lm: LoadedModel, cal: KeyEditCalibration, sweep: Sequence[float] = ()) -> dict[str, Callable[[Case, torch.Tensor], tuple[torch.Tensor, SteerSpec | None]]]:
    rope = rope_spec(lm.model)

    def key_edit(marks: Callable[[Case], tuple[int, int]], strength: float | None = None
                 ) -> Callable[[Case, torch.Tensor], tuple[torch.Tensor, SteerSpec]]:
        s = cal.strength if strength is None else strength

        def run(case: Case, base: torch.Tensor) -> tuple[torch.Tensor, SteerSpec]:
            span = marks(case)
            return apply_key_edit(base, [span], s, cal, rope), SteerSpec("key-edit", (span,), s, cal.digest)
        return run

    def reread(marks: Callable[[Case], tuple[int, int]] | None) -> Callable[[Case, torch.Tensor], tuple[torch.Tensor, SteerSpec]]:
        def run(case: Case, base: torch.Tensor) -> tuple[torch.Tensor, SteerSpec]:
            ctx = case.context
            spans = [marks(case)] if marks else [(len(case.prefix), len(ctx))]
            return re_read(lm.model, ctx, spans), SteerSpec("re-read", tuple(spans))
        return run

    out = {
        "plain": lambda case, base: (base, None),
        "key-edit": key_edit(lambda c: c.span(c.target)),
        "key-edit, wrong marks": key_edit(lambda c: c.span(c.wrong)),
        "re-read": reread(None),
        "re-read marked": reread(lambda c: c.span(c.target)),
        "re-read marked, wrong marks": reread(lambda c: c.span(c.wrong)),
    }
    for s in sweep:  # other strengths, for the trade-off (the goal is judged on the calibrated one)
        out[f"key-edit @{s:g}"] = key_edit(lambda c: c.span(c.target), s)
        out[f"key-edit @{s:g}, wrong marks"] = key_edit(lambda c: c.span(c.wrong), s)
    return out


# -- statistics -------------------------------------------------------------------------------------


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, min(p, mid - half)), min(1.0, max(p, mid + half)))  # contains p despite rounding


def paired(a: Sequence[float], b: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean of ``b - a`` with a normal 95% interval (paired, same prompts)."""
    d = [y - x for x, y in zip(a, b)]
    if not d:
        return (0.0, 0.0, 0.0)
    m = statistics.fmean(d)
    sd = statistics.pstdev(d) if len(d) > 1 else 0.0
    h = z * sd / math.sqrt(len(d))
    return (m, max(-1.0, m - h), min(1.0, m + h))


@dataclass(slots=True)
class Cell:
    right: list[float] = field(default_factory=list)
    logprob: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    bytes: int = 0


# -- the run ----------------------------------------------------------------------------------------


def calibration_prompts(model_dir: Path, lm: LoadedModel, n: int, n_docs: int, seed: int) -> list[CalPrompt]:
    cases = make_cases(model_dir, lm, n, n_docs, "any", seed + CAL_SEED_OFFSET)
    return [CalPrompt(tuple(c.context), (c.span(c.target),), tuple(c.tail), c.answer) for c in cases]


@torch.inference_mode()
def run(model: str, *, prompts: int, docs: int, cal_prompts: int, seed: int, max_heads: int = 4,
        chunk_size: int = 256, sweep: Sequence[float] = (), log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    model_dir = Path(model)
    meta = model_dir / "kdn_reference.json"
    if not meta.is_file() or json.loads(meta.read_text()).get("task") != "retrieval":
        raise InvalidInput(f"{model} is not a retrieval reference model (kdn model train-reference --task retrieval)")
    lm = load_model(model, chunk_size=chunk_size)
    fp = bytes(lm.fingerprint).hex()
    t0 = time.perf_counter()
    log(f"calibrating key-edit on {cal_prompts} training-distribution prompts ...")
    cal = calibrate_key_edit(lm.model, fp, calibration_prompts(model_dir, lm, cal_prompts, docs, seed),
                             max_heads=max_heads, log=log)
    log(f"  chose heads {list(cal.heads)} at strength {cal.strength:g}")
    cal_seconds = time.perf_counter() - t0
    vs = variants(lm, cal, [x for x in sweep if x != cal.strength])
    cells: dict[str, dict[str, Cell]] = {v: {p: Cell() for p in POSITIONS} for v in vs}
    for where in POSITIONS:
        cases = make_cases(model_dir, lm, prompts, docs, where, seed + TEST_SEED_OFFSET)
        for i, case in enumerate(cases):
            base = full_kv(lm.model, case.context)
            for name, fn in vs.items():
                kv, spec = fn(case, base)
                right, lp, secs = reuse(lm, kv, case)
                c = cells[name][where]
                c.right.append(float(right))
                c.logprob.append(lp)
                c.seconds.append(secs)
                if i == 0:
                    c.bytes = stored_bytes(lm, kv, case.context, spec)
            if (i + 1) % 50 == 0:
                log(f"  {where}: {i + 1}/{len(cases)} prompts")
    table: dict[str, dict[str, Any]] = {}
    for name, by_pos in cells.items():
        row = {}
        for where, c in by_pos.items():
            k, n = int(sum(c.right)), len(c.right)
            d, lo, hi = paired(cells["plain"][where].right, c.right)
            row[where] = {"accuracy": k / max(1, n), "n": n, "ci95": wilson(k, n), "delta": d, "delta_ci95": (lo, hi),
                          "mean_logprob": statistics.fmean(c.logprob) if c.logprob else 0.0,
                          "reuse_ms_median": statistics.median(c.seconds) * 1e3 if c.seconds else 0.0,
                          "stored_bytes": c.bytes}
        table[name] = row
    goal = {}
    for name in ("key-edit", "re-read", "re-read marked"):
        r = table[name]
        gain, ls, le = r["middle"]["delta"], r["start"]["delta"], r["end"]["delta"]
        goal[name] = {"middle_gain": gain, "start_change": ls, "end_change": le,
                      "middle_gain_ci95": r["middle"]["delta_ci95"], "start_ci95": r["start"]["delta_ci95"],
                      "end_ci95": r["end"]["delta_ci95"],
                      "met": gain >= GOAL_GAIN and ls >= -GOAL_LOSS and le >= -GOAL_LOSS}
    ctx_tokens = len(make_cases(model_dir, lm, 1, docs, "start", seed)[0].context)
    return {"model": model, "fingerprint": fp, "layers": lm.kv_shape.num_layers, "heads": lm.kv_shape.num_kv_heads,
            "documents": docs, "context_tokens": ctx_tokens, "chunk_size": lm.chunk_size, "prompts_per_position": prompts,
            "calibration": {"prompts": cal_prompts, "heads": [list(h) for h in cal.heads], "strength": cal.strength,
                            "digest": cal.digest, "seconds": cal_seconds, "notes": cal.notes},
            "variants": table, "goal": goal, "sweep": list(sweep), "seconds": time.perf_counter() - t0, "_cal": cal}


def format_table(res: dict[str, Any]) -> str:
    head = f"{'variant':<28} " + " ".join(f"{p + ' (95% CI)':>22} {'Δ vs plain':>17}" for p in POSITIONS)
    lines = [head, "-" * len(head)]
    for name, row in res["variants"].items():
        cells = []
        for p in POSITIONS:
            c = row[p]
            lo, hi = c["ci95"]
            dl, dh = c["delta_ci95"]
            cells.append(f"{c['accuracy']:>6.3f} [{lo:.3f},{hi:.3f}] " + (f"{c['delta'] * 100:>+5.1f} [{dl * 100:+.1f},{dh * 100:+.1f}]"
                                                                        if name != "plain" else f"{'—':>17}"))
        lines.append(f"{name:<28} " + " ".join(f"{x:>40}" for x in cells))
    return "\n".join(lines)


def goal_lines(res: dict[str, Any]) -> list[str]:
    out = []
    for name, g in res["goal"].items():
        ci = lambda k: f"[{g[k][0] * 100:+.1f}, {g[k][1] * 100:+.1f}]"  # noqa: E731
        out.append(f"{name}: middle {g['middle_gain'] * 100:+.1f} points {ci('middle_gain_ci95')}, start "
                   f"{g['start_change'] * 100:+.1f} {ci('start_ci95')}, end {g['end_change'] * 100:+.1f} {ci('end_ci95')} "
                   f"-> goal (>= +5 middle, >= -1 elsewhere; point estimates) {'MET' if g['met'] else 'NOT MET'}")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kdn eval-steer", description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("--model", required=True, help="a retrieval reference model directory")
    p.add_argument("--prompts", type=int, default=200, help="held-out prompts per position (default 200)")
    p.add_argument("--docs", type=int, default=8, help="documents per prompt (default 8)")
    p.add_argument("--cal-prompts", type=int, default=64, help="training-distribution prompts for calibration (default 64)")
    p.add_argument("--max-heads", type=int, default=4, help="most heads key-edit may edit (default 4)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the generated prompts (default 0)")
    p.add_argument("--chunk-size", type=int, default=256, help="chunk size of the stored KV (default 256)")
    p.add_argument("--sweep", default="", help="also key-edit at these strengths, e.g. 1,2,4 (comma list)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--no-calibration", action="store_true", help="do not write the model's key-edit calibration")
    p.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        if args.prompts < 1 or args.cal_prompts < 1:
            raise InvalidInput("--prompts and --cal-prompts must be >= 1")
        res = run(args.model, prompts=args.prompts, docs=args.docs, cal_prompts=args.cal_prompts, seed=args.seed,
                  max_heads=args.max_heads, chunk_size=args.chunk_size,
                  sweep=[float(x) for x in args.sweep.split(",") if x], log=(lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr)))
        cal = res.pop("_cal")
        res["calibration"]["path"] = None if args.no_calibration else str(write_calibration(cal))
    except (KdnError, ValueError) as exc:
        report_error("eval-steer", exc, as_json=args.json)
        return 2
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        c = res["calibration"]
        print(f"{res['model']}: {res['prompts_per_position']} held-out prompts per position, {res['documents']} documents "
              f"({res['context_tokens']} context tokens); key-edit heads {c['heads']} at strength {c['strength']:g}")
        print(format_table(res))
        for line in goal_lines(res):
            print(line)
    return 0
