"""``kdn eval-blend``: is blending good enough for this model? Measured, with baselines beside it.

For held-out prompts ``[prefix][doc_1 … doc_n][question]`` it runs, on the same prompts (paired):

- ``full`` — a full prefill of the whole prompt (the reference);
- ``prefix-only`` — KDN's exact prefix reuse over the stream of prompts: each prompt reuses the
  longest chunk prefix an earlier prompt computed (keys of :func:`kdn.keys.chunk_keys`) and
  computes the rest. Exact; its reuse share is measured on every prompt, its logits (a prefill in
  two parts: the hit, then the rest over it) on the first ``--prefix-prompts``;
- ``naive`` — each document prefilled alone (nothing before it: what a store of independently
  computed chunks holds, as in LMCache's CacheBlend and EPIC), re-placed (keys rotated) and
  concatenated, nothing recomputed;
- ``first-k`` — EPIC-style: the first ``k`` tokens of each alone-prefilled document recomputed;
- ``naive+lead`` — KDN's segments (each document prefilled after the model's lead token,
  :func:`kdn.segments.segment_lead`) concatenated, nothing recomputed;
- ``blend@r`` — CacheBlend's deviation rule at recompute ratios ``r`` over KDN's segments (default
  5/15/30/50/70%: the verdict's ladder);
- ``random@0.15`` — the control: as many tokens as blend@15%, the same segments and passes,
  chosen at random;
- ``blend@1`` — every token recomputed: must equal full prefill (a correctness check, on the
  first ``--check-prompts``; its largest logit difference to full is reported).

Per method: task accuracy with its Wilson 95% interval (when the task has answers: the judged
answer tokens all top-1 — the first for ``needle``, every one for ``retrieval``), the share of
prompts whose every answer token is top-1 (``exact``), top-1
agreement with full prefill on the scored tokens, KL(full ‖ method) in nats (mean over prompts of
the mean over scored tokens, with a 95% interval), the share of document tokens recomputed, the
compute share (token×layer), the share of prompt tokens reused, the median seconds to the scored
logits, exact McNemar tests against full prefill and against blend@15%, and an exact sign test of
the per-prompt KL against blend@15%'s (:mod:`kdn.lab.paired`): the random control is judged worse
than the deviation rule by that test, at what blending is for (reproducing full prefill), since
on a task where most of the naive gap closes without recompute the two rarely differ in answers.
Segments are prefilled once per document (what the store holds) and are not timed.

Tasks (``--task``): ``needle`` (the default for a model with a subword tokenizer:
:mod:`kdn.lab.blend_tasks`, excerpts of held-out stdlib files, a line of one of them continued
after all of them); ``retrieval`` (a retrieval reference model, ``kdn model train-reference
--task retrieval``); ``generic`` (held-out text or seeded random tokens, the question scored on
its own next-token predictions: no accuracy, only agreement and KL).

Work is cached under ``--cache`` (default ``$KDN_CACHE/blend-eval/<fingerprint>/<task digest>``):
segment KV and full-prefill logits as safetensors, one JSON line per (prompt, method) result.
A run stops between prompts after ``--budget-s`` seconds; the next run with the same arguments
resumes where it stopped, and the summary covers every prompt with results.

Verdict (:mod:`kdn.blend.verdict`): the smallest ratio at which blend keeps >= 98% of full
accuracy (when defined) and >= 95% top-1 agreement; written for the model's fingerprint unless
``--no-verdict``. Blending (on the inference host and in the store) runs only for a model with a
passing verdict.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kdn.blend import Deviation, FirstK, Naive, Policy, Random, blend, place, prefill_document, prefill_segment
from kdn.blend.verdict import MIN_ACCURACY_KEPT, MIN_AGREEMENT, Verdict, write_verdict
from kdn.console import plain, report_error
from kdn.errors import InvalidInput, KdnError
from kdn.keys import DEFAULT_NAMESPACE, chunk_keys
from kdn.kv import forward, output_cache
from kdn.lab.paired import mcnemar, mean_ci, sign_test, wilson
from kdn.models import LoadedModel, load_model
from kdn.segments import Segment, segment_key

# the verdict's ladder: it names the smallest ratio that keeps the model's answers (kdn.blend.verdict);
# a model that needs more than 30% still blends, at what it needs, rather than not at all
DEFAULT_RATIOS = (0.05, 0.15, 0.30, 0.50, 0.70)
CONTROL_RATIO = 0.15
POOL_DOCS = 50
TASKS = ("needle", "retrieval", "generic")

# what the task must show (needle/retrieval: tasks with answers)
GOAL_FULL_ACCURACY = 0.70
GOAL_NAIVE_GAP = 0.05
GOAL_KEPT = 0.98
GOAL_RECOVERED = 0.80
GOAL_KL_SHARE = 0.20
GOAL_CHECK_LOGITS = 1e-3
GOAL_CONTROL_P = 0.05


@dataclass(frozen=True, slots=True)
class Case:
    """One prompt: ``prefix + docs + question``, then ``answer`` (scored) or, when ``answer`` is
    empty, the question's own next-token predictions are scored."""

    prefix: tuple[int, ...]
    docs: tuple[tuple[int, ...], ...]
    question: tuple[int, ...]
    answer: tuple[int, ...] = ()
    judged: int = 0  # leading answer tokens that must all be right for the prompt to count (0: all)

    @property
    def tail(self) -> list[int]:
        """What is fed after the documents: the question, then all but the last answer token."""
        return list(self.question) + list(self.answer[:-1])

    @property
    def scored(self) -> int:
        return len(self.answer) if self.answer else len(self.question)

    @property
    def tokens(self) -> list[int]:
        return list(self.prefix) + [t for d in self.docs for t in d] + self.tail

    @property
    def judged_tokens(self) -> int:
        return self.judged or len(self.answer)

    @property
    def id(self) -> str:
        """A digest of every token: equal ids, equal prompts."""
        h = hashlib.blake2b(digest_size=12)
        for part in (self.prefix, *self.docs, self.question, self.answer):
            h.update(len(part).to_bytes(4, "little"))
            h.update(b"".join(int(t).to_bytes(4, "little") for t in part))
        return h.hexdigest()


# -- prompts --------------------------------------------------------------------------------------


def retrieval_cases(model_dir: Path, lm: LoadedModel, n: int, n_docs: int, seed: int) -> list[Case]:
    """Held-out prompts over a pool of documents with disjoint keys, in random subsets and orders."""
    from kdn.lab.retrieval import HELDOUT_SEED_OFFSET, PREFIX_TEXT, _document, load_task

    cfg, _ = load_task(model_dir)
    task = cfg.task
    gen = torch.Generator().manual_seed(seed + HELDOUT_SEED_OFFSET + 7)
    pool_n = min(POOL_DOCS, task.num_keys // task.facts_per_doc)
    keys = torch.randperm(task.num_keys, generator=gen)[: pool_n * task.facts_per_doc].tolist()
    pool = []
    for d in range(pool_n):
        words, facts = _document(task, keys[d * task.facts_per_doc : (d + 1) * task.facts_per_doc], gen)
        pool.append((words, facts))
    enc = lambda words: tuple(lm.tokenizer.encode(" ".join(words)))  # noqa: E731
    prefix = enc(PREFIX_TEXT.split())
    docs_tok = [enc(w) for w, _ in pool]
    cases = []
    for _ in range(n):
        pick = torch.randperm(pool_n, generator=gen)[:n_docs].tolist()  # random subset, random order
        target = pick[int(torch.randint(0, len(pick), (1,), generator=gen))]
        facts = pool[target][1]
        key = list(facts)[int(torch.randint(0, len(facts), (1,), generator=gen))]
        v = facts[key]
        cases.append(Case(prefix, tuple(docs_tok[i] for i in pick), enc(["?", f"k{key}"]), enc([f"v{x}" for x in v])))
    return cases


def generic_cases(lm: LoadedModel, n: int, n_docs: int, doc_tokens: int, seed: int, question_tokens: int = 16,
                  *, text: bool = True) -> list[Case]:
    """Documents from held-out stdlib text (``text``, when its tokens are diverse) or seeded random
    tokens; a pool of documents reused in random subsets and orders."""
    gen = torch.Generator().manual_seed(seed + 99)
    vocab = int(lm.config.vocab_size)
    stream: list[int] = []
    try:
        if not text:
            raise OSError("random tokens asked for")
        from kdn.lab.reference import heldout_texts

        for text in heldout_texts(max_files=40):
            stream += lm.tokenizer.encode(text)
            if len(stream) > (POOL_DOCS + n) * (doc_tokens + question_tokens):
                break
    except (KdnError, OSError):
        stream = []
    need = (POOL_DOCS * doc_tokens) + n * question_tokens
    if len(stream) < need or len(set(stream[:need])) < 64:  # too short, or a tokenizer that knows no code
        stream = torch.randint(3, vocab, (need,), generator=gen).tolist()
    pool = [tuple(stream[i * doc_tokens : (i + 1) * doc_tokens]) for i in range(POOL_DOCS)]
    qbase = POOL_DOCS * doc_tokens
    cases = []
    for j in range(n):
        pick = torch.randperm(POOL_DOCS, generator=gen)[:n_docs].tolist()
        q = tuple(stream[qbase + j * question_tokens : qbase + (j + 1) * question_tokens])
        cases.append(Case((), tuple(pool[i] for i in pick), q))
    return cases


def needle_cases(lm: LoadedModel, n: int, n_docs: int, doc_tokens: int, seed: int, *, split: str = "heldout",
                 answer_tokens: int = 4) -> tuple[list[Case], dict[str, Any]]:
    """Needle prompts (:mod:`kdn.lab.blend_tasks`) over excerpts of the ``split`` files."""
    from kdn.lab import blend_tasks
    from kdn.lab.reference import corpus_split

    cs = corpus_split()
    files = cs.heldout if split == "heldout" else cs.train[::8]  # train: every 8th file is plenty to tune on
    spec = blend_tasks.NeedleSpec(n_docs=n_docs, doc_tokens=doc_tokens, answer_tokens=answer_tokens)
    pool = blend_tasks.document_pool(lm.tokenizer, files, cs.root, doc_tokens=doc_tokens, per_file=spec.per_file)
    raw = blend_tasks.needle_cases(lm.tokenizer, pool, n, spec, seed)
    cases = [Case(tuple(c["prefix"]), tuple(tuple(d) for d in c["docs"]), tuple(c["question"]), tuple(c["answer"]),
                  judged=1) for c in raw]
    info = {"split": split, "files": len({d.name for d in pool}), "pool_documents": len(pool),
            "cue_tokens": spec.cue_tokens, "answer_tokens": spec.answer_tokens,
            "needle_positions": [c["needle"] for c in raw]}
    return cases, info


# -- methods --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Method:
    """One way of answering a prompt. ``policy``: how segments are blended (None: ``full`` or
    ``prefix-only``); ``subset``: which prompts it runs on (``all``, ``check``, ``prefix``);
    ``alone``: over documents prefilled alone instead of KDN's segments (after the lead)."""

    name: str
    policy: Callable[[Case], Policy] | None = None
    subset: str = "all"
    alone: bool = False  # blend segments prefilled with nothing before them (the baselines' segments)


def methods(ratios: Sequence[float] = DEFAULT_RATIOS, *, first_k: int = 16, check_layer: int = 1) -> list[Method]:
    out = [Method("full"), Method("prefix-only", subset="prefix"), Method("naive", lambda c: Naive(), alone=True),
           Method(f"first-{first_k}", lambda c: FirstK(first_k), alone=True),
           Method("naive+lead", lambda c: Naive())]
    out += [Method(f"blend@{r:g}", lambda c, r=r: Deviation(r, check_layer)) for r in ratios]
    out.append(Method(f"random@{CONTROL_RATIO:g}",
                      lambda c: Random(CONTROL_RATIO, check_layer, seed=int(c.id[:8], 16))))
    out.append(Method("blend@1", lambda c: Deviation(1.0, check_layer), subset="check"))
    return out


class EvalStore:
    """Segments, full-prefill logits and per-(prompt, method) results; on disk under ``root``
    (safetensors and JSON lines, no pickle), or in memory only when ``root`` is None."""

    def __init__(self, lm: LoadedModel, root: Path | None, results: str = "results.jsonl") -> None:
        self.lm = lm
        self.root = root
        self.results = results
        self._segs: dict[tuple[int, ...], Segment] = {}
        self.rows: dict[tuple[str, str], dict[str, Any]] = {}
        if root is not None:
            (root / "segments").mkdir(parents=True, exist_ok=True)
            (root / "full").mkdir(parents=True, exist_ok=True)
            path = root / results
            if path.is_file():
                for line in path.read_text().splitlines():
                    try:
                        row = json.loads(line)
                        self.rows[(row["case"], row["method"])] = row
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut by a killed run: that result is computed again

    def segment(self, doc: tuple[int, ...], *, alone: bool = False) -> Segment:
        """KDN's segment of ``doc`` (after the model's lead), or with ``alone`` the document
        prefilled with nothing before it (the baselines')."""
        seg = self._segs.get((doc, alone))
        if seg is not None:
            return seg
        key = segment_key(doc, fingerprint=self.lm.fingerprint, namespace=DEFAULT_NAMESPACE)
        name = f"{'alone-' if alone else ''}{bytes(key).hex()}.safetensors"
        path = self.root / "segments" / name if self.root is not None else None
        kv = start = None
        if path is not None and path.is_file():
            from safetensors.torch import load_file

            got = load_file(str(path))
            kv, start = got.get("kv"), got.get("start")
        if kv is None or start is None or tuple(kv.shape[3:4]) != (len(doc),):
            if alone:
                kv, s0 = prefill_segment(self.lm.model, doc), 0  # (L, 2, H, n, D) at positions 0..n-1
            else:
                kv, s0 = prefill_document(self.lm.model, doc)  # (L, 2, H, n, D) after the lead
            start = torch.tensor(s0)
            if path is not None:
                _save_tensors(path, {"kv": kv, "start": start})
        seg = self._segs[(doc, alone)] = Segment(key, doc, kv, int(start))
        return seg

    def full(self, case: Case) -> tuple[torch.Tensor, float]:
        """Full-prefill logits ``(tail, V)`` of ``case`` and the seconds they took."""
        path = self.root / "full" / f"{case.id}.safetensors" if self.root is not None else None
        if path is not None and path.is_file():
            from safetensors.torch import load_file

            d = load_file(str(path))
            return d["logits"], float(d["seconds"])
        t0 = time.perf_counter()
        out = self.lm.model(input_ids=torch.tensor([case.tokens]), logits_to_keep=len(case.tail))
        secs = time.perf_counter() - t0
        logits = out.logits[0].float().contiguous()
        if path is not None:
            _save_tensors(path, {"logits": logits, "seconds": torch.tensor(secs, dtype=torch.float64)})
        return logits, secs

    def add(self, row: dict[str, Any]) -> None:
        self.rows[(row["case"], row["method"])] = row
        if self.root is not None:
            with open(self.root / self.results, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    def has(self, case: Case, method: str) -> bool:
        return (case.id, method) in self.rows


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


def _blended(lm: LoadedModel, case: Case, store: EvalStore, policy: Policy, *, alone: bool = False
             ) -> tuple[torch.Tensor, Any, float]:
    segments = [store.segment(d, alone=alone) for d in case.docs]
    pre = list(case.prefix)
    pkv = prefill_segment(lm.model, pre) if pre else None  # position 0: exact (a prefix hit in practice)
    t0 = time.perf_counter()
    layout = place(lm.model, segments, prefix_tokens=pre, prefix_kv=pkv)
    cache, stats = blend(lm.model, layout, policy)
    out = forward(lm.model, input_ids=torch.tensor([case.tail]), cache=cache, use_cache=True, logits_to_keep=len(case.tail))
    return out.logits[0], stats, time.perf_counter() - t0


def prefix_hits(lm: LoadedModel, cases: Sequence[Case]) -> list[int]:
    """Per prompt, the tokens exact prefix reuse finds: the longest run of leading chunk keys an
    earlier prompt of the stream holds (each prompt's chunks are kept once computed), never the
    scored tail."""
    C = lm.chunk_size
    seen: set[bytes] = set()
    hits = []
    for case in cases:
        toks = case.tokens
        keys = chunk_keys(toks, fingerprint=lm.fingerprint, namespace=DEFAULT_NAMESPACE, chunk_size=C)
        limit = (len(toks) - len(case.tail)) // C
        h = 0
        while h < min(limit, len(keys)) and bytes(keys[h]) in seen:
            h += 1
        hits.append(h * C)
        seen.update(bytes(k) for k in keys)
    return hits


def _prefix_only(lm: LoadedModel, case: Case, hit: int) -> tuple[torch.Tensor, float]:
    """Logits of a prefill in two parts: the ``hit`` tokens (what reuse loads), then the rest over them."""
    toks = case.tokens
    cache = None
    if hit:
        cache = output_cache(lm.model(input_ids=torch.tensor([toks[:hit]]), use_cache=True, logits_to_keep=1))
    t0 = time.perf_counter()
    out = forward(lm.model, input_ids=torch.tensor([toks[hit:]]), cache=cache, use_cache=True, logits_to_keep=len(case.tail))
    return out.logits[0], time.perf_counter() - t0


def _score(logits: torch.Tensor, ref: torch.Tensor, case: Case) -> tuple[bool | None, bool | None, float, float]:
    """(right: the judged answer tokens are top-1, exact: every answer token is, top-1 agreement
    with ref, mean KL(ref ‖ logits)) over the scored positions."""
    k = case.scored
    lo, rf = logits[-k:].float(), ref[-k:].float()  # (k, V)
    agree = float((lo.argmax(-1) == rf.argmax(-1)).float().mean())
    kl = float(torch.nn.functional.kl_div(lo.log_softmax(-1), rf.log_softmax(-1), log_target=True,
                                          reduction="batchmean"))
    if not case.answer:
        return None, None, agree, max(0.0, kl)
    pred = lo.argmax(-1).tolist()
    j = case.judged_tokens
    return pred[:j] == list(case.answer[:j]), pred == list(case.answer), agree, max(0.0, kl)


@torch.inference_mode()
def evaluate(lm: LoadedModel, cases: Sequence[Case], *, store: EvalStore | None = None,
             method_list: Sequence[Method] | None = None, check_prompts: int = 30, prefix_prompts: int = 40,
             budget_s: float | None = None, progress: bool = False) -> int:
    """Run every method on every prompt it covers that has no result yet; returns prompts done.
    Stops between prompts once ``budget_s`` seconds have passed (after at least one prompt)."""
    store = store or EvalStore(lm, None)
    method_list = list(method_list or methods())
    hits = prefix_hits(lm, cases)
    t_start = time.monotonic()
    done = ran = 0
    for i, case in enumerate(cases):
        todo = [m for m in method_list if not store.has(case, m.name)
                and (m.subset == "all" or (m.subset == "check" and i < check_prompts)
                     or (m.subset == "prefix" and i < prefix_prompts))]
        if not todo:
            done += 1
            continue
        if budget_s is not None and ran and time.monotonic() - t_start > budget_s:
            break
        ran += 1
        ref, t_full = store.full(case)
        doc_tokens = sum(len(d) for d in case.docs)
        prompt_tokens = len(case.tokens)
        for m in todo:
            extra: dict[str, Any] = {}
            if m.name == "full":
                logits, secs, rec, cmp_, reu = ref, t_full, 1.0, 1.0, 0.0
            elif m.name == "prefix-only":
                logits, secs = _prefix_only(lm, case, hits[i])
                rec = cmp_ = (doc_tokens - max(0, hits[i] - len(case.prefix))) / doc_tokens
                reu = hits[i] / prompt_tokens
            else:
                assert m.policy is not None
                logits, stats, secs = _blended(lm, case, store, m.policy(case), alone=m.alone)
                rec, cmp_ = stats.recompute_fraction, stats.layer_token_fraction
                reu = (doc_tokens - stats.selected) / prompt_tokens
            right, exact, agree, kl = _score(logits, ref, case)
            if m.name in ("prefix-only", "blend@1"):
                extra["max_logit_diff"] = float((logits.float() - ref.float()).abs().max())
            store.add({"case": case.id, "index": i, "method": m.name, "right": right, "exact": exact, "agree": agree,
                       "kl": kl,
                       "recomputed": rec, "compute": cmp_, "reused": reu, "seconds": secs, **extra})
        done += 1
        if progress and done % 10 == 0:
            print(f"  {done}/{len(cases)} prompts ({time.monotonic() - t_start:.0f} s)", file=sys.stderr, flush=True)
    return done


def summarize(cases: Sequence[Case], store: EvalStore, method_list: Sequence[Method],
              hits: Sequence[int] | None = None) -> dict[str, Any]:
    """Per-method figures over the prompts each method has results for, paired tests, and the
    task's claims (when it has answers)."""
    ids = [c.id for c in cases]
    out: dict[str, Any] = {}
    for m in method_list:
        rows = [store.rows[(cid, m.name)] for cid in ids if (cid, m.name) in store.rows]
        if not rows:
            continue
        rights = [r["right"] for r in rows if r["right"] is not None]
        acc = statistics.fmean(rights) if rights else None
        lo, hi = wilson(sum(rights), len(rights)) if rights else (None, None)
        exacts = [r["exact"] for r in rows if r.get("exact") is not None]
        kl, kl_lo, kl_hi = mean_ci([r["kl"] for r in rows])
        kl_lo = max(0.0, kl_lo)  # a KL is never negative
        d: dict[str, Any] = {
            "name": m.name, "prompts": len(rows), "accuracy": acc, "accuracy_ci": [lo, hi],
            "exact": statistics.fmean(exacts) if exacts else None,
            "agreement": statistics.fmean(r["agree"] for r in rows), "kl": kl, "kl_ci": [kl_lo, kl_hi],
            "recomputed": statistics.fmean(r["recomputed"] for r in rows),
            "compute": statistics.fmean(r["compute"] for r in rows),
            "reused": statistics.fmean(r["reused"] for r in rows),
            "seconds_median": statistics.median(r["seconds"] for r in rows),
        }
        if any("max_logit_diff" in r for r in rows):
            d["max_logit_diff"] = max(r.get("max_logit_diff", 0.0) for r in rows)
        if m.name == "prefix-only" and hits is not None:
            d["reused_all_prompts"] = statistics.fmean(h / len(c.tokens) for h, c in zip(hits, cases))
        out[m.name] = d
    for name, d in out.items():
        for other in ("full", f"blend@{CONTROL_RATIO:g}"):
            if other == name or other not in out:
                continue
            both = [(store.rows[(cid, name)], store.rows[(cid, other)]) for cid in ids
                    if (cid, name) in store.rows and (cid, other) in store.rows]
            pairs = [(a["right"], b["right"]) for a, b in both if a["right"] is not None and b["right"] is not None]
            if pairs:
                t = mcnemar([a for a, _ in pairs], [b for _, b in pairs])
                d[f"vs_{other}"] = {"prompts": t.n, "only_this": t.a_only, "only_other": t.b_only, "p": t.p_value}
            if both and other != "full":  # against full every KL would be compared with 0
                t = sign_test([a["kl"] for a, _ in both], [b["kl"] for _, b in both])
                d[f"kl_vs_{other}"] = {"prompts": t.n, "lower_this": t.a_only, "lower_other": t.b_only, "p": t.p_value}
    return {"methods": out, "claims": claims(out)}


def claims(m: dict[str, Any]) -> list[dict[str, Any]]:
    """What the issue asks the task to show, each with the measured value and whether it holds."""
    full, naive = m.get("full"), m.get("naive")
    b15, r15, check = m.get(f"blend@{CONTROL_RATIO:g}"), m.get(f"random@{CONTROL_RATIO:g}"), m.get("blend@1")
    if not full or full["accuracy"] is None:
        return []
    out = []

    def claim(what: str, value: float | None, goal: str, ok: bool) -> None:
        out.append({"what": what, "value": value, "goal": goal, "met": bool(ok)})

    fa = full["accuracy"]
    claim("full-prefill accuracy", fa, f">= {GOAL_FULL_ACCURACY:.2f}", fa >= GOAL_FULL_ACCURACY)
    if naive and naive["accuracy"] is not None:
        gap = fa - naive["accuracy"]
        claim("naive concatenation below full prefill (points)", 100 * gap, f">= {100 * GOAL_NAIVE_GAP:.0f}",
              gap >= GOAL_NAIVE_GAP)
    if b15 and b15["accuracy"] is not None:
        claim("blend@15%: share of full-prefill accuracy", b15["accuracy"] / fa if fa else None,
              f">= {GOAL_KEPT:.2f}", fa > 0 and b15["accuracy"] / fa >= GOAL_KEPT)
        if naive and naive["accuracy"] is not None and fa > naive["accuracy"]:
            rec = (b15["accuracy"] - naive["accuracy"]) / (fa - naive["accuracy"])
            claim("blend@15%: share of the naive gap recovered", rec, f">= {GOAL_RECOVERED:.2f}", rec >= GOAL_RECOVERED)
        if naive:
            share = b15["kl"] / naive["kl"] if naive["kl"] > 0 else None
            claim("blend@15%: KL to full prefill over naive's", share, f"<= {GOAL_KL_SHARE:.2f}",
                  share is not None and share <= GOAL_KL_SHARE)
        if r15:
            # worse at what blending is for, reproducing full prefill: per prompt, whose KL to full
            # prefill is higher (accuracy differences are in the table, with their McNemar p)
            t = r15.get(f"kl_vs_blend@{CONTROL_RATIO:g}", {})
            worse = t.get("lower_other", 0) > t.get("lower_this", 0) and t.get("p", 1.0) < GOAL_CONTROL_P
            claim("random@15% further from full prefill than blend@15% (per-prompt KL, exact sign test p)",
                  t.get("p"), f"< {GOAL_CONTROL_P}, higher KL in more prompts", worse)
    if check:
        diff = check.get("max_logit_diff", float("inf"))
        claim("blend@100% equals full prefill (largest logit difference)", diff, f"<= {GOAL_CHECK_LOGITS:g}",
              diff <= GOAL_CHECK_LOGITS)
    return out


def verdict_for(lm: LoadedModel, summary: dict[str, Any], ratios: Sequence[float], check_layer: int) -> Verdict:
    res = summary["methods"]
    if "full" not in res:
        return Verdict(bytes(lm.fingerprint).hex(), False, max(ratios), check_layer, reason="no prompt evaluated")
    full = res["full"]
    reasons = []
    for r in sorted(ratios):
        b = res.get(f"blend@{r:g}")
        if b is None:
            continue
        kept = None if full["accuracy"] is None else (b["accuracy"] or 0.0) / max(full["accuracy"], 1e-9)
        ok = b["agreement"] >= MIN_AGREEMENT and (kept is None or kept >= MIN_ACCURACY_KEPT)
        reasons.append(f"blend@{r:g}: agreement {b['agreement']:.3f}" + ("" if kept is None else f", accuracy kept {kept:.3f}"))
        if ok:
            return Verdict(bytes(lm.fingerprint).hex(), True, r, check_layer, reason=reasons[-1], metrics=res)
    return Verdict(bytes(lm.fingerprint).hex(), False, max(ratios), check_layer,
                   reason="no ratio passed (" + "; ".join(reasons) + f"; need agreement >= {MIN_AGREEMENT}"
                   + ("" if full["accuracy"] is None else f" and accuracy kept >= {MIN_ACCURACY_KEPT}") + ")",
                   metrics=res)


def _fmt_p(p: float | None) -> str:
    return "—" if p is None else (f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}")


def format_table(summary: dict[str, Any]) -> str:
    head = (f"{'method':<12} {'n':>4} {'accuracy [95% CI]':>20} {'exact':>6} {'agree':>6} {'KL [95% CI]':>24} {'recomp':>7} "
            f"{'compute':>8} {'reused':>7} {'s (med)':>8} {'McNemar p vs full / vs blend@.15':>34}")
    lines = [head, "-" * len(head)]
    for r in summary["methods"].values():
        acc = "—" if r["accuracy"] is None else f"{r['accuracy']:.3f} [{r['accuracy_ci'][0]:.2f},{r['accuracy_ci'][1]:.2f}]"
        kl = f"{r['kl']:.4f} [{r['kl_ci'][0]:.4f},{r['kl_ci'][1]:.4f}]"
        ps = f"{_fmt_p(r.get('vs_full', {}).get('p'))} / {_fmt_p(r.get(f'vs_blend@{CONTROL_RATIO:g}', {}).get('p'))}"
        ex = "—" if r.get("exact") is None else f"{r['exact']:.3f}"
        lines.append(f"{r['name']:<12} {r['prompts']:>4} {acc:>20} {ex:>6} {r['agreement']:>6.3f} {kl:>24} {r['recomputed']:>7.1%} "
                     f"{r['compute']:>8.1%} {r['reused']:>7.1%} {r['seconds_median']:>8.2f} {ps:>34}")
    for c in summary.get("claims", []):
        v = c["value"]
        lines.append(f"  {'MET ' if c['met'] else 'NOT '} {c['what']}: {'—' if v is None else f'{v:.4g}'} (goal {c['goal']})")
    return "\n".join(lines)


def build_cases(lm: LoadedModel, model: str, task: str, *, prompts: int, docs: int, doc_tokens: int, seed: int,
                split: str = "heldout", answer_tokens: int = 4) -> tuple[list[Case], dict[str, Any]]:
    if task == "retrieval":
        return retrieval_cases(Path(model), lm, prompts, docs, seed), {}
    if task == "needle":
        return needle_cases(lm, prompts, docs, doc_tokens, seed, split=split, answer_tokens=answer_tokens)
    return generic_cases(lm, prompts, docs, doc_tokens, seed), {}


def default_task(model: str, lm: LoadedModel) -> str:
    if Path(model).is_dir():
        meta = Path(model) / "kdn_reference.json"
        if meta.is_file() and json.loads(meta.read_text()).get("task") == "retrieval":
            return "retrieval"
    from kdn.models import HFTokenizer

    return "needle" if isinstance(lm.tokenizer, HFTokenizer) and int(lm.config.vocab_size) > 4096 else "generic"


def run(model: str, *, prompts: int, docs: int, doc_tokens: int, ratios: Sequence[float], first_k: int, seed: int,
        check_layer: int = 1, progress: bool = False, task: str | None = None, cache: Path | None | bool = None,
        budget_s: float | None = None, check_prompts: int = 30, prefix_prompts: int = 40, split: str = "heldout",
        answer_tokens: int = 4) -> tuple[LoadedModel, dict[str, Any], dict[str, Any]]:
    """Build the prompts, evaluate (resuming from ``cache``; ``False``: memory only), summarize."""
    lm = load_model(model)
    task = task or default_task(model, lm)
    if task not in TASKS:
        raise InvalidInput(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if not 0 <= check_layer < lm.kv_shape.num_layers:
        raise InvalidInput(f"--check-layer must be in 0..{lm.kv_shape.num_layers - 1} ({model} has "
                           f"{lm.kv_shape.num_layers} layers), got {check_layer}")
    cases, task_info = build_cases(lm, model, task, prompts=prompts, docs=docs, doc_tokens=doc_tokens, seed=seed,
                                   split=split, answer_tokens=answer_tokens)
    mlist = methods(ratios, first_k=first_k, check_layer=check_layer)
    if cache is None:
        from kdn.config import cache_root

        # prompts are generated in sequence: a run of more prompts starts with a shorter run's
        digest = hashlib.blake2b(json.dumps([task, docs, doc_tokens, seed, split, answer_tokens]).encode(),
                                 digest_size=6).hexdigest()
        cache = cache_root() / "blend-eval" / bytes(lm.fingerprint).hex()[:16] / f"{task}-{digest}"
    # segments and full-prefill logits do not depend on the blend settings; results do, and on
    # how segments are prefilled (seg2: after the model's lead token)
    store = EvalStore(lm, cache if isinstance(cache, Path) else None,
                      results=f"results-seg2-cl{check_layer}-k{first_k}.jsonl")
    t0 = time.perf_counter()
    done = evaluate(lm, cases, store=store, method_list=mlist, check_prompts=check_prompts,
                    prefix_prompts=prefix_prompts, budget_s=budget_s, progress=progress)
    summary = summarize(cases, store, mlist, prefix_hits(lm, cases))
    info = {
        "model": model, "fingerprint": bytes(lm.fingerprint).hex(), "task": task, **task_info,
        "prompts": len(cases), "prompts_done": done, "documents": docs,
        "document_tokens": [len(d) for d in cases[0].docs] if cases else [],
        "context_tokens": (len(cases[0].prefix) + sum(len(d) for d in cases[0].docs)) if cases else 0,
        "layers": lm.kv_shape.num_layers, "check_layer": check_layer, "seconds": time.perf_counter() - t0,
        "cache": str(cache) if isinstance(cache, Path) else None, "threads": torch.get_num_threads(),
    }
    return lm, info, summary


def _ratios(text: str) -> list[float]:
    """``--ratios``: a comma list of recompute ratios in [0, 1] that includes the control's."""
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInput(f"--ratios must be a comma list of numbers in [0, 1], got {text!r}") from None
    bad = [r for r in ratios if not 0.0 <= r <= 1.0]  # NaN fails the comparison too
    if bad:
        raise InvalidInput(f"--ratios must be in [0, 1], got {bad[0]:g}")
    if CONTROL_RATIO not in ratios:
        raise InvalidInput(f"--ratios must include {CONTROL_RATIO:g}: the random control is matched to it")
    return ratios


def main(argv: list[str]) -> int:
    from kdn.pretrained import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="kdn eval-blend", description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"built-in name or model dir (default {DEFAULT_MODEL})")
    p.add_argument("--task", choices=TASKS, default=None,
                   help="needle (models with a subword tokenizer), retrieval (a retrieval reference model), generic")
    p.add_argument("--prompts", type=int, default=240, help="prompts evaluated (default 240)")
    p.add_argument("--docs", type=int, default=8, help="documents per prompt")
    p.add_argument("--doc-tokens", type=int, default=128, help="tokens per document (needle and generic prompts)")
    p.add_argument("--answer-tokens", type=int, default=4, help="needle: answer tokens scored (the first judges the prompt)")
    p.add_argument("--split", choices=("heldout", "train"), default="heldout",
                   help="needle: the files documents come from (train: for choosing settings)")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in DEFAULT_RATIOS), help="blend recompute ratios")
    p.add_argument("--first-k", type=int, default=16,
                   help="the EPIC-style baseline recomputes each document's first K tokens (default 16)")
    p.add_argument("--check-layer", type=int, default=1,
                   help="layer whose KV deviation picks the tokens the blend recomputes (default 1)")
    p.add_argument("--check-prompts", type=int, default=30, help="prompts of the 100%% recompute check (default 30)")
    p.add_argument("--prefix-prompts", type=int, default=40, help="prompts whose prefix-only logits are computed")
    p.add_argument("--seed", type=int, default=0, help="random seed of the generated prompts (default 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--cache", type=Path, default=None, help="where work is cached (default under $KDN_CACHE)")
    p.add_argument("--no-cache", action="store_true", help="keep nothing on disk")
    p.add_argument("--budget-s", type=float, default=None, help="stop between prompts after this many seconds")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    p.add_argument("--no-verdict", action="store_true", help="do not write the model's verdict")
    p.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    args = p.parse_args(argv)
    try:
        # every flag is checked before the model loads, so a bad one costs nothing and writes nothing
        # (no cache directory, no verdict)
        ratios = _ratios(args.ratios)
        for flag, value, least in (("--prompts", args.prompts, 1), ("--docs", args.docs, 1),
                                   ("--doc-tokens", args.doc_tokens, 1), ("--answer-tokens", args.answer_tokens, 1),
                                   ("--first-k", args.first_k, 0), ("--check-layer", args.check_layer, 0),
                                   ("--check-prompts", args.check_prompts, 0),
                                   ("--prefix-prompts", args.prefix_prompts, 0), ("--threads", args.threads, 1)):
            if value < least:
                raise InvalidInput(f"{flag} must be >= {least}, got {value}")
        if args.budget_s is not None and not args.budget_s >= 0:
            raise InvalidInput(f"--budget-s must be >= 0, got {args.budget_s}")
        if args.out is not None:
            if args.out.is_dir():
                raise InvalidInput(f"--out {args.out} is a directory; name the JSON file to write")
            args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(args.threads)
        lm, info, summary = run(args.model, prompts=args.prompts, docs=args.docs, doc_tokens=args.doc_tokens,
                                ratios=ratios, first_k=args.first_k, seed=args.seed, check_layer=args.check_layer,
                                progress=not args.json, task=args.task, cache=False if args.no_cache else args.cache,
                                budget_s=args.budget_s, check_prompts=args.check_prompts,
                                prefix_prompts=args.prefix_prompts, split=args.split, answer_tokens=args.answer_tokens)
        complete = info["prompts_done"] == info["prompts"]
        verdict = verdict_for(lm, summary, ratios, args.check_layer)
        path = None if args.no_verdict or not complete else write_verdict(verdict)
    except (KdnError, ValueError, OSError) as exc:  # OSError: a --cache or --out that cannot be written
        report_error("eval-blend", exc, as_json=args.json)
        return 2
    out = {**info, **summary, "verdict": {"passed": verdict.passed, "ratio": verdict.ratio, "reason": verdict.reason,
                                          "path": str(path) if path else None}}
    if args.out is not None:
        try:
            args.out.write_text(json.dumps(out, indent=2) + "\n")
        except OSError as exc:  # the results stay in the cache: the same command prints them again
            report_error("eval-blend", exc, as_json=args.json)
            return 2
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{info['model']}: {info['prompts_done']} of {info['prompts']} prompts, task {info['task']}, "
              f"{info['documents']} documents ({info['context_tokens']} context tokens)")
        print(format_table(summary))
        print(f"verdict: {'PASS' if verdict.passed else 'FAIL'} — {verdict.reason}"
              + (f" (written to {path})" if path else "" if complete else " (not written: the run is incomplete)"))
    return 0
