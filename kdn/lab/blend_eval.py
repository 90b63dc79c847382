"""``kdn eval-blend``: is blending good enough for this model? Measured, with baselines beside it.

For held-out prompts ``[prefix][doc_1 … doc_n][question]`` it runs, on the same prompts:

- ``full`` — a full prefill of the whole prompt (the reference);
- ``prefix-only`` — KDN's exact prefix reuse: chunk KV of every earlier prompt is kept (keyed by
  :func:`kdn.keys.chunk_keys`), each prompt reuses its longest cached chunk prefix and computes the
  rest. Exact, but documents in another order after the first difference get nothing;
- ``naive`` — segments re-placed (keys rotated) and concatenated, nothing recomputed;
- ``first-k`` — EPIC-style: the first ``k`` tokens of each segment recomputed;
- ``blend@r`` — CacheBlend's deviation rule at recompute ratios ``r`` (default 5/10/15/30%).

and reports per method: task accuracy (retrieval model: every answer word right), top-1 agreement
with full prefill on the scored tokens, KL(full ‖ method) in nats averaged over them, the share
of document tokens recomputed, the compute share (token×layer), the share of prompt tokens
reused, and the median time to first-token logits. Segments are prefilled once per document
(what the edge would hold) and are not timed.

Prompts: for a retrieval reference model (``kdn model train-reference --task retrieval``) a pool
of 50 held-out documents with disjoint keys; each prompt takes ``--docs`` of them in random order
and asks about a fact in one. For any other model (built-ins, the stdlib reference model, a local
HF dir) documents are held-out stdlib text or seeded random tokens, the question is scored on its
own next-token predictions, and accuracy is not defined (agreement and KL are).

Verdict (:mod:`kdn.blend.verdict`): the smallest ratio at which blend keeps >= 98% of full
accuracy (when defined) and >= 95% top-1 agreement; written for the model's fingerprint unless
``--no-verdict``. The inference host blends only for a model with a passing verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from kdn.blend import Deviation, FirstK, Naive, Policy, blend, place, prefill_segment
from kdn.blend.verdict import MIN_ACCURACY_KEPT, MIN_AGREEMENT, Verdict, write_verdict
from kdn.console import plain, report_error
from kdn.errors import KdnError
from kdn.keys import DEFAULT_NAMESPACE, chunk_keys
from kdn.models import LoadedModel, load_model
from kdn.segments import Segment, segment_key

DEFAULT_RATIOS = (0.05, 0.10, 0.15, 0.30)
POOL_DOCS = 50


@dataclass(frozen=True, slots=True)
class Case:
    """One prompt: ``prefix + docs + question``, then ``answer`` (scored) or, when ``answer`` is
    empty, the question's own next-token predictions are scored."""

    prefix: tuple[int, ...]
    docs: tuple[tuple[int, ...], ...]
    question: tuple[int, ...]
    answer: tuple[int, ...] = ()

    @property
    def tail(self) -> list[int]:
        """What is fed after the documents: the question, then all but the last answer token."""
        return list(self.question) + list(self.answer[:-1])

    @property
    def scored(self) -> int:
        return len(self.answer) if self.answer else len(self.question)


@dataclass(slots=True)
class MethodResult:
    name: str
    accuracy: float | None = None
    agreement: float = 0.0
    kl: float = 0.0
    recomputed: float = 0.0  # share of document tokens recomputed through the last layer
    compute: float = 0.0  # share of (token, layer) pairs of the documents computed
    reused: float = 0.0  # share of prompt tokens whose KV came from the cache
    ttft_ms: float = 0.0  # median
    per_prompt: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("name", "accuracy", "agreement", "kl", "recomputed", "compute", "reused",
                                           "ttft_ms")}
        return d


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


# -- methods --------------------------------------------------------------------------------------


class SegmentCache:
    """Segments prefilled once per document (what the edge holds); not part of any timing."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self._by_doc: dict[tuple[int, ...], Segment] = {}

    def get(self, doc: tuple[int, ...]) -> Segment:
        seg = self._by_doc.get(doc)
        if seg is None:
            key = segment_key(doc, fingerprint=self.lm.fingerprint, namespace=DEFAULT_NAMESPACE)
            seg = self._by_doc[doc] = Segment(key, doc, prefill_segment(self.lm.model, doc))
        return seg

    @property
    def stored_bytes(self) -> int:
        return sum(s.kv.numel() * s.kv.element_size() for s in self._by_doc.values())


class PrefixCache:
    """KDN's exact prefix reuse over a stream of prompts: full chunks' KV by chain key."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.chunks: dict[bytes, torch.Tensor] = {}  # key -> (L, 2, H, C, D)

    def run(self, tokens: list[int], tail_len: int) -> tuple[torch.Tensor, int, float]:
        """Logits of the last ``tail_len`` positions, tokens reused, seconds to those logits."""
        from kdn.kv import build_cache, split_cache

        C = self.lm.chunk_size
        keys = chunk_keys(tokens, fingerprint=self.lm.fingerprint, namespace=DEFAULT_NAMESPACE, chunk_size=C)
        limit = len(tokens) - tail_len  # the tail is always computed
        hit = 0
        while hit < len(keys) and (hit + 1) * C <= limit and bytes(keys[hit]) in self.chunks:
            hit += 1
        t0 = time.perf_counter()
        cache = build_cache([self.chunks[bytes(k)] for k in keys[:hit]], self.lm.config)
        ids = torch.tensor([tokens[hit * C :]], dtype=torch.long)
        out = self.lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=tail_len)
        seconds = time.perf_counter() - t0
        for i, c in enumerate(split_cache(out.cache, C, start=hit), start=hit):  # "write back" what was computed
            if i < len(keys):
                self.chunks[bytes(keys[i])] = c
        return out.logits[0], hit * C, seconds


def _full(lm: LoadedModel, case: Case) -> tuple[torch.Tensor, float]:
    ids = list(case.prefix) + [t for d in case.docs for t in d] + case.tail
    t0 = time.perf_counter()
    out = lm.model(input_ids=torch.tensor([ids]), logits_to_keep=len(case.tail))
    return out.logits[0], time.perf_counter() - t0


def _blended(lm: LoadedModel, case: Case, segs: SegmentCache, policy: Policy) -> tuple[torch.Tensor, Any, float]:
    segments = [segs.get(d) for d in case.docs]
    pre = list(case.prefix)
    pkv = prefill_segment(lm.model, pre) if pre else None  # position 0: exact (a prefix hit in practice)
    t0 = time.perf_counter()
    layout = place(lm.model, segments, prefix_tokens=pre, prefix_kv=pkv)
    cache, stats = blend(lm.model, layout, policy)
    out = lm.model(input_ids=torch.tensor([case.tail]), cache=cache, use_cache=True, logits_to_keep=len(case.tail))
    return out.logits[0], stats, time.perf_counter() - t0


def _score(logits: torch.Tensor, ref: torch.Tensor, case: Case) -> tuple[bool | None, float, float]:
    """(answer right?, top-1 agreement with ref, mean KL(ref ‖ logits)) over the scored positions."""
    k = case.scored
    lo, rf = logits[-k:].float(), ref[-k:].float()  # (k, V)
    agree = float((lo.argmax(-1) == rf.argmax(-1)).float().mean())
    kl = float(torch.nn.functional.kl_div(lo.log_softmax(-1), rf.log_softmax(-1), log_target=True,
                                          reduction="batchmean"))
    right = None if not case.answer else bool(lo.argmax(-1).tolist() == list(case.answer))
    return right, agree, max(0.0, kl)


@torch.inference_mode()
def evaluate(lm: LoadedModel, cases: Sequence[Case], *, ratios: Sequence[float] = DEFAULT_RATIOS, first_k: int = 16,
             check_layer: int = 1, progress: bool = False) -> dict[str, MethodResult]:
    methods: list[tuple[str, Policy | None]] = [("full", None), ("prefix-only", None), ("naive", Naive()),
                                                (f"first-{first_k}", FirstK(first_k))]
    methods += [(f"blend@{r:g}", Deviation(r, check_layer)) for r in ratios]
    results = {name: MethodResult(name) for name, _ in methods}
    acc: dict[str, list[float]] = {name: [] for name, _ in methods}
    times: dict[str, list[float]] = {name: [] for name, _ in methods}
    sums: dict[str, dict[str, float]] = {name: {"agree": 0.0, "kl": 0.0, "rec": 0.0, "cmp": 0.0, "reu": 0.0}
                                         for name, _ in methods}
    segs, prefix_cache = SegmentCache(lm), PrefixCache(lm)
    for i, case in enumerate(cases):
        ref, t_full = _full(lm, case)
        doc_tokens = sum(len(d) for d in case.docs)
        prompt_tokens = len(case.prefix) + doc_tokens + len(case.tail)
        for name, policy in methods:
            if name == "full":
                logits, secs, rec, cmp_, reu = ref, t_full, 1.0, 1.0, 0.0
            elif name == "prefix-only":
                ids = list(case.prefix) + [t for d in case.docs for t in d] + case.tail
                logits, hit, secs = prefix_cache.run(ids, len(case.tail))
                rec = cmp_ = (doc_tokens - max(0, hit - len(case.prefix))) / doc_tokens
                reu = hit / prompt_tokens
            else:
                assert policy is not None
                logits, stats, secs = _blended(lm, case, segs, policy)
                rec, cmp_ = stats.recompute_fraction, stats.layer_token_fraction
                reu = (doc_tokens - stats.selected) / prompt_tokens
            right, agree, kl = _score(logits, ref, case)
            if right is not None:
                acc[name].append(float(right))
            s = sums[name]
            s["agree"] += agree
            s["kl"] += kl
            s["rec"] += rec
            s["cmp"] += cmp_
            s["reu"] += reu
            times[name].append(secs)
        if progress and (i + 1) % 25 == 0:
            print(f"  {i + 1}/{len(cases)} prompts", file=sys.stderr)
    n = max(1, len(cases))
    for name, r in results.items():
        s = sums[name]
        r.accuracy = statistics.fmean(acc[name]) if acc[name] else None
        r.agreement, r.kl = s["agree"] / n, s["kl"] / n
        r.recomputed, r.compute, r.reused = s["rec"] / n, s["cmp"] / n, s["reu"] / n
        r.ttft_ms = statistics.median(times[name]) * 1e3 if times[name] else 0.0
    return results


def verdict_for(lm: LoadedModel, results: dict[str, MethodResult], ratios: Sequence[float], check_layer: int) -> Verdict:
    full = results["full"]
    metrics = {name: r.as_dict() for name, r in results.items()}
    reasons = []
    for r in sorted(ratios):
        b = results[f"blend@{r:g}"]
        kept = None if full.accuracy is None else (b.accuracy or 0.0) / max(full.accuracy, 1e-9)
        ok = b.agreement >= MIN_AGREEMENT and (kept is None or kept >= MIN_ACCURACY_KEPT)
        reasons.append(f"blend@{r:g}: agreement {b.agreement:.3f}" + ("" if kept is None else f", accuracy kept {kept:.3f}"))
        if ok:
            return Verdict(bytes(lm.fingerprint).hex(), True, r, check_layer, reason=reasons[-1], metrics=metrics)
    return Verdict(bytes(lm.fingerprint).hex(), False, max(ratios), check_layer,
                   reason="no ratio passed (" + "; ".join(reasons) + f"; need agreement >= {MIN_AGREEMENT}"
                   + ("" if full.accuracy is None else f" and accuracy kept >= {MIN_ACCURACY_KEPT}") + ")",
                   metrics=metrics)


def format_table(results: dict[str, MethodResult]) -> str:
    head = f"{'method':<12} {'accuracy':>8} {'agree':>6} {'KL':>8} {'recomp':>7} {'compute':>8} {'reused':>7} {'TTFT ms':>8}"
    lines = [head, "-" * len(head)]
    for r in results.values():
        acc = "—" if r.accuracy is None else f"{r.accuracy:.3f}"
        lines.append(f"{r.name:<12} {acc:>8} {r.agreement:>6.3f} {r.kl:>8.4f} {r.recomputed:>7.1%} {r.compute:>8.1%} "
                     f"{r.reused:>7.1%} {r.ttft_ms:>8.1f}")
    return "\n".join(lines)


def run(model: str, *, prompts: int, docs: int, doc_tokens: int, ratios: Sequence[float], first_k: int, seed: int,
        check_layer: int = 1, progress: bool = False) -> tuple[LoadedModel, dict[str, Any], dict[str, MethodResult]]:
    lm = load_model(model)
    is_retrieval = False
    if Path(model).is_dir():
        meta = Path(model) / "kdn_reference.json"
        is_retrieval = meta.is_file() and json.loads(meta.read_text()).get("task") == "retrieval"
    cases = (retrieval_cases(Path(model), lm, prompts, docs, seed) if is_retrieval
             else generic_cases(lm, prompts, docs, doc_tokens, seed))
    t0 = time.perf_counter()
    results = evaluate(lm, cases, ratios=ratios, first_k=first_k, check_layer=check_layer, progress=progress)
    info = {
        "model": model, "fingerprint": bytes(lm.fingerprint).hex(), "task": "retrieval" if is_retrieval else "generic",
        "prompts": len(cases), "documents": docs, "document_tokens": [len(d) for d in cases[0].docs] if cases else [],
        "context_tokens": (len(cases[0].prefix) + sum(len(d) for d in cases[0].docs)) if cases else 0,
        "layers": lm.kv_shape.num_layers, "check_layer": check_layer, "seconds": time.perf_counter() - t0,
    }
    return lm, info, results


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kdn eval-blend", description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("--model", required=True, help="model dir (a retrieval reference model for accuracy) or built-in spec")
    p.add_argument("--prompts", type=int, default=200, help="prompts evaluated (default 200)")
    p.add_argument("--docs", type=int, default=8, help="documents per prompt")
    p.add_argument("--doc-tokens", type=int, default=128, help="tokens per document (generic prompts)")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in DEFAULT_RATIOS), help="blend recompute ratios")
    p.add_argument("--first-k", type=int, default=16,
                   help="the EPIC-style baseline recomputes each document's first K tokens (default 16)")
    p.add_argument("--check-layer", type=int, default=1,
                   help="layer whose KV deviation picks the tokens the blend recomputes (default 1)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the generated prompts (default 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--no-verdict", action="store_true", help="do not write the model's verdict")
    p.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        ratios = [float(x) for x in args.ratios.split(",") if x]
        lm, info, results = run(args.model, prompts=args.prompts, docs=args.docs, doc_tokens=args.doc_tokens,
                                ratios=ratios, first_k=args.first_k, seed=args.seed, check_layer=args.check_layer,
                                progress=not args.json)
        verdict = verdict_for(lm, results, ratios, args.check_layer)
        path = None if args.no_verdict else write_verdict(verdict)
    except (KdnError, ValueError) as exc:
        report_error("eval-blend", exc, as_json=args.json)
        return 2
    out = {**info, "methods": {k: r.as_dict() for k, r in results.items()},
           "verdict": {"passed": verdict.passed, "ratio": verdict.ratio, "reason": verdict.reason,
                       "path": str(path) if path else None}}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{info['model']}: {info['prompts']} held-out prompts, {info['documents']} documents "
              f"({info['context_tokens']} context tokens), task {info['task']}")
        print(format_table(results))
        print(f"verdict: {'PASS' if verdict.passed else 'FAIL'} — {verdict.reason}"
              + (f" (written to {path})" if path else ""))
    return 0
