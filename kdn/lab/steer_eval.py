"""``kdn eval-steer``: does steered KV raise a trained model's accuracy where it is weak? Measured, with harm.

The task is :mod:`kdn.lab.steer_task`: a haystack of source-file documents, each carrying one
lookalike note (``# NOTE: the access code for the cobalt vault is 4821.``); a question asks for one
vault's code, with the asked note at one of five depths. Three stages, each of which can fail:

1. **deficit** — plain accuracy by depth and length on test haystacks. Steering is worth measuring
   only where the model is weak: a depth whose plain accuracy is at least 10 points below the best
   depth's (the answer's document alone is the ceiling).
2. **calibrate** — on calibration haystacks (their own files: never a test file), the query means
   of every KV head at the answer position give key-edit its directions; then every setting of the
   grid (key-edit: head set × profile × strength; re-read of the marked spans) is scored with the
   *realistic* marks (the operator's question-blind rule). The weak depths are those of the
   calibration split's plain accuracy; the setting chosen is the one that raises a weak depth by
   >= 5 points losing nothing at every other depth, with the largest mean gain (else the largest
   mean gain, else the best log-probability). "Losing" on this small split: more than 1 point and
   more than one question net, or a fall of the answer's mean log-probability by more than 0.1
   nats (accuracy on 40 haystacks cannot see a 1-point loss; log-probability can). The chosen calibration is written for the
   model (``kdn ingest --emphasize key-edit`` uses it).
3. **test** — on test haystacks, the chosen setting with every mark kind (realistic, headings,
   oracle, wrong, random, everything), beside plain and the ceiling, on the same questions.

Reuse is simulated as the product does it: the stored document's full chunks (plain or steered)
are reused; the partial last chunk is prefilled on top of them, then each question. One plain
prefill per haystack serves every variant (steering edits stored KV; re-read continues from it).
A question is right when every digit of the code is the greedy token (teacher-forced: exactly the
greedy answer); its log-probability is the code's. Results are appended per haystack to
``<out>/<stage>.jsonl`` and a stage resumes where it stopped.

Statistics: accuracy with a 95% Wilson interval; a variant against plain on the same questions:
the paired difference, its 95% interval, and the exact McNemar test (two-sided binomial on the
discordant pairs). Claims: gain >= +5 points at a weak depth with p < 0.05; a loss elsewhere of at
most 1 point (point estimate); wrong marks harmful (a depth with a loss, p < 0.05); random marks
harmless (no depth losing more than 1 point with p < 0.05).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from kdn.blend.rope import RopeSpec, rope_spec
from kdn.console import plain, report_error
from kdn.errors import InvalidInput, KdnError
from kdn.kv import cache_from_layers, forward, layers_to_chunk
from kdn.lab.steer_task import (DEPTHS, MARK_KINDS, NOTE_RULE, QUESTION_BLIND, VAULTS, Haystack, Question, SourcePool,
                                ceiling_question, char_spans_to_tokens, make_haystack, mark_chars)
from kdn.models import LoadedModel, load_model
from kdn.pretrained import DEFAULT_MODEL
from kdn.steer.methods import (KeyEditCalibration, apply_key_edit, directions_for, full_kv, re_read_from,
                               slow_dims, write_calibration)

GOAL_DEFICIT = 0.10
GOAL_GAIN = 0.05
GOAL_LOSS = 0.01
ALPHA = 0.05
# the calibration's log-probability guard (nats): on the built-in model's first test split a mean
# fall of 0.16 nats at the last depth came with a 2-point accuracy loss there
LOGPROB_GUARD = 0.1
DEFAULT_REACH = 4096
HEAD_SETS = ("late", "all")
STRENGTHS = (1.0, 2.0, 3.0)
TEST_KINDS = ("realistic", "oracle", "wrong", "random", "everything")
PROFILES = ("flat", "ramp")


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


def mcnemar_exact(base: Sequence[bool], other: Sequence[bool]) -> tuple[int, int, float]:
    """(``b`` questions only ``other`` gets right, ``c`` only ``base`` gets right, two-sided exact p)."""
    b = sum(1 for x, y in zip(base, other) if y and not x)
    c = sum(1 for x, y in zip(base, other) if x and not y)
    n = b + c
    if n == 0:
        return b, c, 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return b, c, min(1.0, 2 * tail)


# -- scoring ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Score:
    right: bool
    logprob: float
    said: str  # the greedy code


def _cache(kv: torch.Tensor, config: Any) -> Any:
    return cache_from_layers([(kv[l, 0].unsqueeze(0), kv[l, 1].unsqueeze(0)) for l in range(kv.shape[0])], config)


def stored_tokens(lm: LoadedModel, doc: Sequence[int]) -> int:
    """Tokens of ``doc`` held as full chunks (what a reuse loads)."""
    return len(doc) // lm.chunk_size * lm.chunk_size


@torch.inference_mode()
def score(lm: LoadedModel, stored: torch.Tensor, doc: Sequence[int], questions: Sequence[Question]) -> list[Score]:
    """Reuse ``stored`` ``(L, 2, H, >= hit, D)`` for the full chunks of ``doc``, prefill the partial
    chunk on top, then score each question on that."""
    hit = stored_tokens(lm, doc)
    kv = stored[:, :, :, :hit]
    if hit < len(doc):
        cache = _cache(kv, lm.config)
        forward(lm.model, input_ids=torch.tensor([list(doc[hit:])]), cache=cache, use_cache=True, logits_to_keep=1)
        kv = layers_to_chunk(cache.layers)
    out = []
    for q in questions:
        logits = forward(lm.model, input_ids=torch.tensor([list(q.tail)]), cache=_cache(kv, lm.config), use_cache=True,
                          logits_to_keep=len(q.answer)).logits[0]
        lp = logits.float().log_softmax(-1)
        ans = list(q.answer)
        said = lp.argmax(-1).tolist()
        out.append(Score(said == ans, float(lp[torch.arange(len(ans)), torch.tensor(ans)].sum()),
                         lm.tokenizer.decode(said).strip()))
    return out


@torch.inference_mode()
def answer_query_means(lm: LoadedModel, kv: torch.Tensor, questions: Sequence[Question]) -> torch.Tensor:
    """Sum over ``questions`` of each KV head's pre-rotary query at the answer's first position,
    ``(L, H_kv, D)``, averaged over the query heads sharing the KV head (``kv``: the whole document's)."""
    from kdn.steer.methods import query_sums

    # the tail token whose logits give the first digit
    prompts = [(q.tail, len(q.tail) - len(q.answer)) for q in questions]
    return query_sums(lm.model, prompts, cache=lambda: _cache(kv, lm.config))


# -- settings and variants --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setting:
    """One steering method at one setting. ``key-edit``: a head set, a profile and a strength
    (nats); ``re-read``: the marked spans read again (nothing to set)."""

    method: str
    heads: str = ""
    profile: str = "flat"
    strength: float = 0.0

    @property
    def name(self) -> str:
        if self.method == "re-read":
            return "re-read"
        return f"key-edit {self.heads} {self.profile} {self.strength:g}"


def grid(head_sets: Sequence[str] = HEAD_SETS, profiles: Sequence[str] = PROFILES,
         strengths: Sequence[float] = STRENGTHS, reread: bool = True) -> list[Setting]:
    out = [Setting("key-edit", h, p, s) for h in head_sets for p in profiles for s in strengths]
    return out + ([Setting("re-read")] if reread else [])


def head_set(name: str, n_layers: int, n_heads: int) -> tuple[tuple[int, int], ...]:
    if name == "all":
        return tuple((l, h) for l in range(n_layers) for h in range(n_heads))
    if name == "late":
        return tuple((l, h) for l in range(n_layers // 2, n_layers) for h in range(n_heads))
    raise InvalidInput(f"unknown head set {name!r}; choose one of {', '.join(HEAD_SETS)}")


def calibration_of(setting: Setting, lm: LoadedModel, means: torch.Tensor, reach: int,
                   notes: dict[str, Any] | None = None) -> KeyEditCalibration:
    """The key-edit calibration a setting stands for (directions from ``means`` ``(L, H, D)``)."""
    rope = rope_spec(lm.model)
    heads = head_set(setting.heads, means.shape[0], means.shape[1])
    return KeyEditCalibration(bytes(lm.fingerprint).hex(), heads, directions_for(means, heads, slow_dims(rope, reach)),
                              setting.strength, reach, dict(notes or {}), setting.profile)


class Steerer:
    """Steered KV of one haystack's full chunks for a setting and marks."""

    def __init__(self, lm: LoadedModel, means: torch.Tensor, reach: int) -> None:
        self.lm = lm
        self.rope: RopeSpec = rope_spec(lm.model)
        self.means = means
        self.reach = reach
        self._cals: dict[Setting, KeyEditCalibration] = {}

    def calibration(self, s: Setting) -> KeyEditCalibration:
        if s not in self._cals:
            self._cals[s] = calibration_of(s, self.lm, self.means, self.reach)
        return self._cals[s]

    def kv(self, s: Setting, base: torch.Tensor, doc: Sequence[int], marks: Sequence[tuple[int, int]]) -> torch.Tensor:
        hit = stored_tokens(self.lm, doc)
        kept = [(a, min(b, hit)) for a, b in marks if a < hit]  # marks past the stored chunks are dropped
        part = base[:, :, :, :hit]
        if not kept:
            return part
        if s.method == "re-read":
            return re_read_from(self.lm.model, part, list(doc[:hit]), kept)
        return apply_key_edit(part, kept, s.strength, self.calibration(s), self.rope)


def marks_for(lm: LoadedModel, hs: Haystack, kind: str, q: Question) -> list[tuple[int, int]]:
    return char_spans_to_tokens(lm.tokenizer, hs.text, mark_chars(hs, kind, q))


# -- stages -----------------------------------------------------------------------------------------


def _done(path: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill: that haystack runs again
                out[int(rec["index"])] = rec
    return out


def _append(path: Path, rec: dict[str, Any]) -> None:
    """One haystack's line, with the 1-minute load average when it was written."""
    rec = {**rec, "load": round(os.getloadavg()[0], 2)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def _cells(scores: Iterable[tuple[Question, Score]]) -> dict[str, list[Any]]:
    return {f"{q.depth:g}": [int(s.right), round(s.logprob, 4), s.said] for q, s in scores}


def _pending(lm: LoadedModel, pool: SourcePool, path: Path, indices: Iterable[int], *, length: int, n_docs: int,
             seed: int) -> Iterator[tuple[int, float, Haystack, Any]]:
    """``(index, start time, haystack, its full KV)`` for each of ``indices`` that ``path`` does not hold yet."""
    done = _done(path)
    for i in indices:
        if i in done:
            continue
        t0 = time.perf_counter()
        hs = make_haystack(pool, length=length, n_docs=n_docs, seed=seed, index=i)
        yield i, t0, hs, full_kv(lm.model, hs.tokens)


def run_deficit(lm: LoadedModel, pool: SourcePool, lengths: Sequence[int], n_docs: int, n: int, seed: int, out: Path,
                log: Callable[[str], None]) -> None:
    """Plain accuracy by depth and length (``<out>/deficit.jsonl``: one line per haystack and length)."""
    for length in lengths:
        path = out / f"deficit-{length}.jsonl"
        for i, t0, hs, base in _pending(lm, pool, path, range(n), length=length, n_docs=n_docs, seed=seed):
            plain_scores = score(lm, base, hs.tokens, hs.questions)
            _append(path, {"index": i, "length": length, "tokens": len(hs.tokens),
                           "plain": _cells(zip(hs.questions, plain_scores)), "seconds": round(time.perf_counter() - t0, 2)})
            log(f"  deficit {length}: haystack {i + 1}/{n} ({len(hs.tokens)} tokens, {time.perf_counter() - t0:.0f} s)")


def run_means(lm: LoadedModel, pool: SourcePool, length: int, n_docs: int, n: int, seed: int, out: Path,
              log: Callable[[str], None]) -> torch.Tensor:
    """Query means from calibration haystacks ``0 .. n-1`` (``<out>/means.json``, reused when present)."""
    path = out / "means.json"
    held = load_means(lm, out, n)
    if held is not None:
        return held
    sums, count = None, 0
    for i in range(n):
        hs = make_haystack(pool, length=length, n_docs=n_docs, seed=seed, index=i)
        base = full_kv(lm.model, hs.tokens)
        s = answer_query_means(lm, base, hs.questions)
        sums = s if sums is None else sums + s
        count += len(hs.questions)
        log(f"  query means: haystack {i + 1}/{n}")
    assert sums is not None
    means = (sums / count).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fingerprint": bytes(lm.fingerprint).hex(), "haystacks": n, "means": means.tolist()}))
    return means


def load_means(lm: LoadedModel, out: Path, n: int) -> torch.Tensor | None:
    """The query means ``run_means`` wrote for this model and haystack count, or None."""
    path = out / "means.json"
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    if d.get("fingerprint") != bytes(lm.fingerprint).hex() or d.get("haystacks") != n:
        return None
    return torch.tensor(d["means"], dtype=torch.float32)


def run_calibration(lm: LoadedModel, pool: SourcePool, steerer: Steerer, settings: Sequence[Setting], *, length: int,
                    n_docs: int, first: int, n: int, seed: int, out: Path, log: Callable[[str], None]) -> None:
    """Every setting with realistic marks on calibration haystacks ``first .. first+n-1``."""
    path = out / "calibration.jsonl"
    for i, t0, hs, base in _pending(lm, pool, path, range(first, first + n), length=length, n_docs=n_docs, seed=seed):
        rec: dict[str, Any] = {"index": i, "tokens": len(hs.tokens),
                               "variants": {"plain": _cells(zip(hs.questions, score(lm, base, hs.tokens, hs.questions)))}}
        marks = marks_for(lm, hs, "realistic", hs.questions[0])
        for s in settings:
            kv = steerer.kv(s, base, hs.tokens, marks)
            rec["variants"][s.name] = _cells(zip(hs.questions, score(lm, kv, hs.tokens, hs.questions)))
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        _append(path, rec)
        log(f"  calibration: haystack {i - first + 1}/{n} ({time.perf_counter() - t0:.0f} s)")


def run_test(lm: LoadedModel, pool: SourcePool, steerer: Steerer, setting: Setting, *, length: int, n_docs: int, n: int,
             seed: int, out: Path, log: Callable[[str], None], kinds: Sequence[str] = TEST_KINDS) -> None:
    """Plain, the ceiling and ``setting`` with every mark kind on test haystacks ``0 .. n-1``."""
    path = out / "test.jsonl"
    for i, t0, hs, base in _pending(lm, pool, path, range(n), length=length, n_docs=n_docs, seed=seed):
        qs = hs.questions
        v: dict[str, Any] = {"plain": _cells(zip(qs, score(lm, base, hs.tokens, qs)))}
        ceiling = []
        for q in qs:
            toks, cq = ceiling_question(lm.tokenizer, hs, q)
            ceiling += score(lm, full_kv(lm.model, toks), toks, [cq])
        v["ceiling"] = _cells(zip(qs, ceiling))
        for kind in kinds:
            if kind in QUESTION_BLIND:
                kv = steerer.kv(setting, base, hs.tokens, marks_for(lm, hs, kind, qs[0]))
                v[kind] = _cells(zip(qs, score(lm, kv, hs.tokens, qs)))
            else:
                per = []
                for q in qs:
                    kv = steerer.kv(setting, base, hs.tokens, marks_for(lm, hs, kind, q))
                    per += score(lm, kv, hs.tokens, [q])
                v[kind] = _cells(zip(qs, per))
        _append(path, {"index": i, "tokens": len(hs.tokens), "setting": setting.name, "variants": v,
                       "seconds": round(time.perf_counter() - t0, 2)})
        log(f"  test: haystack {i + 1}/{n} ({time.perf_counter() - t0:.0f} s)")


# -- summaries --------------------------------------------------------------------------------------


def _depth_keys() -> list[str]:
    return [f"{d:g}" for d in DEPTHS]


def cell(rows: Sequence[dict[str, list[Any]]], depth: str) -> dict[str, Any]:
    right = [int(r[depth][0]) for r in rows]
    k, n = sum(right), len(right)
    return {"accuracy": k / n if n else 0.0, "n": n, "ci95": wilson(k, n),
            "mean_logprob": statistics.fmean(r[depth][1] for r in rows) if rows else 0.0}


def compare(base: Sequence[dict[str, list[Any]]], other: Sequence[dict[str, list[Any]]], depth: str) -> dict[str, Any]:
    a = [bool(r[depth][0]) for r in base]
    b = [bool(r[depth][0]) for r in other]
    d, lo, hi = paired([float(x) for x in a], [float(x) for x in b])
    gained, lost, p = mcnemar_exact(a, b)
    return {"delta": d, "delta_ci95": (lo, hi), "gained": gained, "lost": lost, "p": p,
            "logprob_delta": statistics.fmean(y[depth][1] - x[depth][1] for x, y in zip(base, other)) if base else 0.0}


def variant_table(recs: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per variant and depth: accuracy, and (not for plain) the paired comparison with plain."""
    table: dict[str, dict[str, Any]] = {}
    plain_rows = [r["variants"]["plain"] for r in recs]
    for name in names:
        rows = [r["variants"][name] for r in recs]
        table[name] = {}
        for dk in _depth_keys():
            c = cell(rows, dk)
            if name != "plain":
                c.update(compare(plain_rows, rows, dk))
            table[name][dk] = c
    return table


def weak_depths(plain_row: dict[str, dict[str, Any]], deficit: float = GOAL_DEFICIT) -> list[str]:
    """Depths whose accuracy is at least ``deficit`` below the best depth's."""
    best = max(c["accuracy"] for c in plain_row.values())
    return [d for d, c in plain_row.items() if c["accuracy"] <= best - deficit + 1e-9]


def judge(row: dict[str, dict[str, Any]], weak: Sequence[str]) -> dict[str, Any]:
    """The steering goal for one variant's row: some weak depth gains >= 5 points with p < 0.05,
    and no other depth loses more than 1 point."""
    gains = {d: row[d]["delta"] for d in row}
    best_weak = max(weak, key=lambda d: gains[d], default=None)
    gain_ok = best_weak is not None and gains[best_weak] >= GOAL_GAIN - 1e-9 and row[best_weak]["p"] < ALPHA
    others = {d: g for d, g in gains.items() if d != best_weak}
    loss_ok = all(g >= -GOAL_LOSS - 1e-9 for g in others.values())
    return {"weak_depth": best_weak, "gain": gains.get(best_weak) if best_weak else None,
            "gain_p": row[best_weak]["p"] if best_weak else None, "worst_other": min(others.values(), default=0.0),
            "met": bool(gain_ok and loss_ok), "mean_gain": statistics.fmean(gains.values())}


def choose(table: dict[str, dict[str, Any]], weak: Sequence[str], settings: Sequence[Setting]) -> tuple[Setting, dict[str, Any]]:
    """The calibration's choice (see the module docstring) and why."""
    def rank(s: Setting) -> tuple[Any, ...]:
        row = table[s.name]
        gains = [row[d]["delta"] for d in row]
        j = judge_point(row, weak)
        no_loss = not any(_calibration_loss(row[d]) for d in row)
        lp = statistics.fmean(row[d]["logprob_delta"] for d in row)
        return (j, statistics.fmean(gains) if no_loss else -math.inf, statistics.fmean(gains), lp)

    best = max(settings, key=rank)
    r = rank(best)
    return best, {"met_on_calibration": bool(r[0]), "mean_gain": r[2], "mean_logprob_gain": r[3]}


def _calibration_loss(c: dict[str, Any]) -> bool:
    """Whether one depth's calibration cell shows a loss the goal forbids. The split is small: one
    question of 40 is 2.5 points, so accuracy cannot see a 1-point loss, and it counts only beyond
    one question net; the answer's mean log-probability is the finer instrument for the same loss,
    and a fall of more than :data:`LOGPROB_GUARD` nats counts too."""
    one = 1.0 / c["n"] if c.get("n") else GOAL_LOSS
    return c["delta"] < -max(GOAL_LOSS, one) - 1e-9 or c["logprob_delta"] < -LOGPROB_GUARD - 1e-9


def judge_point(row: dict[str, dict[str, Any]], weak: Sequence[str]) -> bool:
    """The goal on point estimates (the calibration split is small: no test there; a loss as
    :func:`_calibration_loss` sees it)."""
    gains = {d: row[d]["delta"] for d in row}
    for w in weak:
        if gains[w] >= GOAL_GAIN - 1e-9 and not any(_calibration_loss(row[d]) for d in row if d != w):
            return True
    return False


def deficit_table(out: Path, lengths: Sequence[int]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for length in lengths:
        recs = list(_done(out / f"deficit-{length}.jsonl").values())
        if not recs:
            continue
        rows = [r["plain"] for r in recs]
        res[str(length)] = {"haystacks": len(recs), "tokens": statistics.median(r["tokens"] for r in recs),
                            "depths": {dk: cell(rows, dk) for dk in _depth_keys()}}
    return res


# -- the run ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    model: str = DEFAULT_MODEL
    length: int = 2048
    docs: int = 5
    test: int = 200
    calibration: int = 40
    means: int = 8
    deficit_lengths: tuple[int, ...] = (4096, 8192)
    deficit_haystacks: int = 40
    seed: int = 0
    reach: int = DEFAULT_REACH
    chunk_size: int = 256
    stages: tuple[str, ...] = ("deficit", "calibrate", "test")
    settings: tuple[Setting, ...] = ()
    kinds: tuple[str, ...] = TEST_KINDS


STAGES = ("deficit", "calibrate", "test", "summary")  # summary: only tabulate what ``out`` holds


def run(plan: Plan, out: Path, *, log: Callable[[str], None] = lambda s: None, write_cal: bool = True) -> dict[str, Any]:
    """Run (or resume) the stages of ``plan`` into ``out``; the summary of everything recorded there."""
    lm = load_model(plan.model, chunk_size=plan.chunk_size)
    if lm.untrained:
        raise InvalidInput(f"{plan.model} is a random-init model: steering is judged on a trained one "
                           f"(the default, {DEFAULT_MODEL})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(asdict(plan), indent=1) + "\n")
    settings = list(plan.settings) or grid()
    summary: dict[str, Any] = {"model": plan.model, "fingerprint": bytes(lm.fingerprint).hex(), "plan": asdict(plan)}
    test_pool = cal_pool = None
    t0 = time.perf_counter()
    if "deficit" in plan.stages:
        log(f"deficit: plain accuracy at {list(plan.deficit_lengths)} tokens, {plan.deficit_haystacks} test haystacks each")
        test_pool = SourcePool(lm.tokenizer, "test")
        run_deficit(lm, test_pool, plan.deficit_lengths, plan.docs, plan.deficit_haystacks, plan.seed, out, log)
    summary["deficit"] = deficit_table(out, plan.deficit_lengths)
    means = None
    if "calibrate" in plan.stages or "test" in plan.stages:
        cal_pool = SourcePool(lm.tokenizer, "calibration")
        log(f"query means on {plan.means} calibration haystacks")
        means = run_means(lm, cal_pool, plan.length, plan.docs, plan.means, plan.seed, out, log)
    else:
        means = load_means(lm, out, plan.means)
    steerer = Steerer(lm, means, plan.reach) if means is not None else None
    if "calibrate" in plan.stages:
        assert cal_pool is not None and steerer is not None
        log(f"calibration: {len(settings)} settings on {plan.calibration} calibration haystacks")
        run_calibration(lm, cal_pool, steerer, settings, length=plan.length, n_docs=plan.docs, first=plan.means,
                        n=plan.calibration, seed=plan.seed, out=out, log=log)
    cal_recs = [r for i, r in sorted(_done(out / "calibration.jsonl").items())
                if plan.means <= i < plan.means + plan.calibration]
    chosen = None
    if cal_recs:
        names = ["plain"] + [s.name for s in settings if all(s.name in r["variants"] for r in cal_recs)]
        ctab = variant_table(cal_recs, names)
        weak = weak_depths(ctab["plain"])
        usable = [s for s in settings if s.name in names]
        chosen, why = choose(ctab, weak, usable)
        summary["calibration"] = {"haystacks": len(cal_recs), "weak_depths": weak, "table": ctab,
                                  "chosen": asdict(chosen) | {"name": chosen.name}, "why": why}
        (out / "chosen.json").write_text(json.dumps(asdict(chosen)) + "\n")
        if write_cal and chosen.method == "key-edit" and means is not None:
            cal = calibration_of(chosen, lm, means, plan.reach, notes={
                "task": "lookalike notes in stdlib haystacks (kdn.lab.steer_task)", "rule": NOTE_RULE,
                "haystacks": len(cal_recs), "length": plan.length, "documents": plan.docs, "weak_depths": weak,
                "calibration_gain": why["mean_gain"], "met_on_calibration": why["met_on_calibration"]})
            summary["calibration"]["path"] = str(write_calibration(cal))
            summary["calibration"]["digest"] = cal.digest
    if "test" in plan.stages:
        if chosen is None or steerer is None:
            raise InvalidInput("the test stage needs a calibration (run the calibrate stage first)")
        test_pool = test_pool or SourcePool(lm.tokenizer, "test")
        log(f"test: {chosen.name} with every mark kind on {plan.test} test haystacks")
        run_test(lm, test_pool, steerer, chosen, length=plan.length, n_docs=plan.docs, n=plan.test, seed=plan.seed,
                 out=out, log=log, kinds=plan.kinds)
    test_recs = [r for i, r in sorted(_done(out / "test.jsonl").items()) if i < plan.test]
    if test_recs:
        names = ["plain", *MARK_KINDS, "ceiling"]
        ttab = variant_table(test_recs, [n for n in names if all(n in r["variants"] for r in test_recs)])
        weak = summary.get("calibration", {}).get("weak_depths") or weak_depths(ttab["plain"])
        summary["test"] = {"haystacks": len(test_recs), "setting": test_recs[0]["setting"], "weak_depths": weak,
                           "table": ttab, "claims": claims(ttab, weak)}
        if str(plan.length) not in summary["deficit"]:  # the test's plain answers are the deficit at its length
            summary["deficit"][str(plan.length)] = {
                "haystacks": len(test_recs), "tokens": statistics.median(r["tokens"] for r in test_recs),
                "depths": ttab["plain"], "source": "test stage"}
        if write_cal and chosen is not None and chosen.name == test_recs[0]["setting"] and "path" in summary["calibration"]:
            record_effect(Path(summary["calibration"]["path"]), summary["test"])
    loads = [r["load"] for p in out.glob("*.jsonl") for r in _done(p).values() if "load" in r]
    if loads:
        summary["load"] = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
    summary["stage_seconds"] = {p.stem: round(sum(r.get("seconds", 0) for r in _done(p).values()), 1)
                                for p in sorted(out.glob("*.jsonl"))}
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def record_effect(path: Path, test: dict[str, Any]) -> None:
    """Write the measured effect of a calibration into its file's notes (what ``kdn model info``
    shows; notes are not part of the digest, so variant ids do not change)."""
    from kdn.blobstore import write_file_atomic

    data = json.loads(path.read_text())
    t = test["table"]
    data.setdefault("notes", {})["measured"] = {
        "haystacks": test["haystacks"], "weak_depths": test["weak_depths"],
        "by_depth": {kind: {d: {"plain": t["plain"][d]["accuracy"], "steered": c["accuracy"], "delta": c["delta"],
                                "p": c["p"]} for d, c in row.items()}
                     for kind, row in t.items() if kind in ("realistic", "oracle", "wrong", "random")},
        "claims": test["claims"]}
    write_file_atomic(path, (json.dumps(data) + "\n").encode())


def claims(t: dict[str, dict[str, Any]], weak: Sequence[str]) -> dict[str, Any]:
    """Each claim of the module docstring, judged on the test table."""
    out: dict[str, Any] = {}
    plain_row = t["plain"]
    best = max(plain_row.values(), key=lambda c: c["accuracy"])["accuracy"]
    out["deficit"] = {"best_depth_accuracy": best, "weak_depths": list(weak),
                      "met": any(best - plain_row[d]["accuracy"] >= GOAL_DEFICIT - 1e-9 for d in weak)}
    if "realistic" in t:
        out["realistic"] = judge(t["realistic"], weak)
    if "wrong" in t:
        harmed = [d for d, c in t["wrong"].items() if c["delta"] < 0 and c["p"] < ALPHA]
        out["wrong"] = {"harmed_depths": harmed, "met": bool(harmed)}
    if "random" in t:
        hurt = [d for d, c in t["random"].items() if c["delta"] < -GOAL_LOSS and c["p"] < ALPHA]
        out["random"] = {"worst": min(c["delta"] for c in t["random"].values()), "significant_losses": hurt,
                         "met": not hurt}
    return out


# -- report -----------------------------------------------------------------------------------------


def _acc(c: dict[str, Any]) -> str:
    return f"{c['accuracy']:.3f} [{c['ci95'][0]:.2f},{c['ci95'][1]:.2f}]"


def _delta(c: dict[str, Any]) -> str:
    return f"{c['delta'] * 100:+.1f} (+{c['gained']}/-{c['lost']}, p={c['p']:.2g})"


def format_summary(s: dict[str, Any]) -> str:
    lines = []
    dks = _depth_keys()
    if s.get("deficit"):
        lines.append("plain accuracy by depth (95% Wilson CI), test haystacks:")
        lines.append(f"{'length':>8} {'n':>4} " + " ".join(f"{'depth ' + d:>20}" for d in dks))
        for length, row in s["deficit"].items():
            lines.append(f"{row['tokens']:>8.0f} {row['haystacks']:>4} " + " ".join(f"{_acc(row['depths'][d]):>20}" for d in dks))
    if s.get("calibration"):
        c = s["calibration"]
        lines.append(f"calibration ({c['haystacks']} haystacks, realistic marks; weak depths {c['weak_depths']}):")
        for name, row in c["table"].items():
            lines.append(f"  {name:<26} " + " ".join(f"{row[d]['accuracy']:.3f}" + (f" {row[d]['delta'] * 100:+5.1f}" if name != "plain" else "      ")
                                                 for d in dks))
        lines.append(f"  chosen: {c['chosen']['name']} ({c['why']})")
    if s.get("test"):
        t = s["test"]
        lines.append(f"test ({t['haystacks']} haystacks, {t['setting']}; Δ vs plain in points, +gained/-lost, exact McNemar p):")
        for name, row in t["table"].items():
            lines.append(f"  {name:<11} " + " | ".join(_acc(row[d]) + ("" if name == "plain" else " " + _delta(row[d])) for d in dks))
        for k, v in t["claims"].items():
            lines.append(f"  claim {k}: {v}")
    return "\n".join(lines)


def _numbers(flag: str, text: str, kind: Callable[[str], Any]) -> list[Any]:
    """A comma list flag's values, or InvalidInput naming the flag."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInput(f"{flag} must be a comma list of numbers, got {text!r}") from None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kdn eval-steer", description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"a trained model (default {DEFAULT_MODEL})")
    p.add_argument("--out", type=Path, required=True, help="directory for the per-haystack results (a run resumes there)")
    p.add_argument("--stages", default="deficit,calibrate,test",
                   help="comma list of deficit, calibrate, test, summary (only tabulate what --out holds)")
    p.add_argument("--length", type=int, default=2048, help="document tokens of calibration and test haystacks")
    p.add_argument("--docs", type=int, default=5, help="documents (lookalike notes) per haystack (default 5)")
    p.add_argument("--test", type=int, default=200, help="test haystacks: prompts per depth (default 200)")
    p.add_argument("--calibration", type=int, default=40, help="calibration haystacks for choosing a setting (default 40)")
    p.add_argument("--means", type=int, default=8, help="calibration haystacks for the query means (default 8)")
    p.add_argument("--deficit-lengths", default="4096,8192",
                   help="lengths of the deficit stage (comma list; the test length's row comes from the test stage)")
    p.add_argument("--deficit-haystacks", type=int, default=40, help="test haystacks per deficit length (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated haystacks (default 0)")
    p.add_argument("--strengths", default=",".join(f"{s:g}" for s in STRENGTHS), help="key-edit strengths of the grid")
    p.add_argument("--heads", default=",".join(HEAD_SETS), help="key-edit head sets of the grid (comma list of "
                   f"{', '.join(HEAD_SETS)})")
    p.add_argument("--profiles", default=",".join(PROFILES), help="key-edit profiles of the grid (comma list of "
                   f"{', '.join(PROFILES)})")
    p.add_argument("--no-re-read", action="store_true", help="leave re-read out of the grid")
    p.add_argument("--kinds", default=",".join(TEST_KINDS),
                   help=f"mark kinds of the test stage (comma list of {', '.join(MARK_KINDS)})")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--no-calibration", action="store_true", help="do not write the model's key-edit calibration")
    p.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    args = p.parse_args(argv)
    try:
        stages = tuple(x for x in args.stages.split(",") if x)
        if not stages or any(x not in STAGES for x in stages):
            raise InvalidInput(f"--stages: a comma list of {', '.join(STAGES)}")
        if min(args.test, args.calibration, args.means, args.deficit_haystacks) < 1:
            raise InvalidInput("haystack counts must be >= 1")
        if args.threads < 1:
            raise InvalidInput(f"--threads must be >= 1, got {args.threads}")
        if args.out.exists() and not args.out.is_dir():
            raise InvalidInput(f"--out {args.out} is not a directory")
        strengths = _numbers("--strengths", args.strengths, float)
        deficit_lengths = _numbers("--deficit-lengths", args.deficit_lengths, int)
        if any(not 0 < s < math.inf for s in strengths):
            raise InvalidInput(f"--strengths must be positive numbers, got {args.strengths!r}")
        if any(n < 1 for n in (args.length, *deficit_lengths)):
            raise InvalidInput("--length and --deficit-lengths must be >= 1 tokens")
        if not 2 <= args.docs <= len(VAULTS):  # what a haystack holds (steer_task.make_haystack)
            raise InvalidInput(f"--docs must be in 2..{len(VAULTS)}, got {args.docs}")
        short = [n for n in (args.length, *deficit_lengths) if n < 64 * args.docs]
        if short:
            raise InvalidInput(f"{short[0]} tokens is too short for --docs {args.docs} (at least 64 a document)")
        torch.set_num_threads(args.threads)
        heads = [x for x in args.heads.split(",") if x]
        profiles = [x for x in args.profiles.split(",") if x]
        if not heads or any(h not in HEAD_SETS for h in heads):
            raise InvalidInput(f"--heads: a comma list of {', '.join(HEAD_SETS)}")
        if not profiles or any(x not in PROFILES for x in profiles):
            raise InvalidInput(f"--profiles: a comma list of {', '.join(PROFILES)}")
        settings = grid(heads, profiles, strengths, reread=not args.no_re_read)
        plan = Plan(args.model, args.length, args.docs, args.test, args.calibration, args.means,
                    tuple(deficit_lengths), args.deficit_haystacks, args.seed,
                    stages=stages, settings=tuple(settings),
                    kinds=tuple(x for x in args.kinds.split(",") if x))
        if not plan.kinds or any(k not in MARK_KINDS for k in plan.kinds):
            raise InvalidInput(f"--kinds: a comma list of {', '.join(MARK_KINDS)}")
        res = run(plan, args.out, log=(lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True)),
                  write_cal=not args.no_calibration)
    except (KdnError, ValueError, OSError) as exc:  # OSError: an --out that cannot be written
        report_error("eval-steer", exc, as_json=args.json)
        return 2
    print(json.dumps(res, indent=1) if args.json else format_summary(res))
    return 0
