"""Judge a KV codec by what the model does with the decoded KV, on real documents.

Protocol (``kdn eval-codec``; defaults in :class:`EvalSetup`, the model ``smollm2-135m``):

- **documents**: held-out Python source (:mod:`kdn.lab.docqa`; the *test* part of the held-out
  files unless told otherwise, so nothing a codec was tuned on), each long enough for the largest
  context plus the continuation, placed as a chat's system message (as ``kdn ingest --layout
  system`` stores it; plain text for a model without a chat template);
- **raw KV**: one prefill per document and KV dtype, cut into chunks and stored in that dtype.
  ``float16``: the fp32 model's KV rounded to fp16 (this CPU has no fast fp16 kernels; on a GPU
  an fp16 engine computes it directly). ``bfloat16``: the model itself runs in bf16, so the KV is
  the bf16 engine's own, and every pass on it runs in bf16 too. A context of ``C`` tokens is the
  first ``C`` tokens (whole chunks) of that prefill, so 2k, 4k and 8k share documents;
- **codec path**: every chunk goes through the real container — :func:`kdn.artifact.encode_artifact`,
  then :func:`kdn.artifact.decode_artifact` with the fingerprint and key expected (checksums
  verified) — timed per chunk, best of ``timing_repeats``;
- **next-token agreement and KL**: the ``continuation`` tokens that follow the context in the
  document are teacher-forced on raw KV and on decoded KV; at every position the argmax tokens are
  compared and ``KL(p_raw ‖ p_codec)`` taken; the perplexity of the true next tokens too;
- **questions**: extractive questions about the first ``C`` tokens (:func:`kdn.lab.docqa.questions_for`)
  asked after the document as the chat's user turn and answered greedily, from raw KV and from
  decoded KV; accuracy beside raw's, answers that changed, and an exact McNemar test over the
  paired outcomes (``p >= 0.05``: no measurable change). A lossy codec's answer is taken from one
  teacher-forced pass over raw's answer when every step's argmax is raw's token by a clear logit
  margin (then greedy decoding cannot differ); otherwise it is decoded token by token;
- a lossless codec whose decoded KV is bit-identical to raw KV (checked, never assumed) gets raw's
  outputs without re-running the model.

Sizes: ``size_ratio`` = raw KV bytes of that dtype / artifact bytes (headers and checksums
included); GB/s are raw KV bytes per second through ``encode_artifact`` / ``decode_artifact``, on
the calling thread. The *crossover* bandwidth is where fetching the smaller artifact and decoding
it stops beating fetching raw KV: ``B* = (S - S_c) / t_decode``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
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
from kdn.kv import build_cache, cache_length, forward, output_cache, split_cache
from kdn.lab import docqa
from kdn.models import DTYPES, LoadedModel, load_model
from kdn.pretrained import DEFAULT_MODEL
from kdn.prompts import Tokenizer, document_tokens, request_tokens

DEFAULT_CODECS = ("raw", "lz4", "zstd:1", "zstd:3", "int8", "kvq:q5", "kvq:k6v5", "kvq:k5v5", "kvq:k5v4",
                  "kvq:k4v4")
# the dtype the model runs in to produce (and then read) KV stored in each dtype
COMPUTE_DTYPE = {"float32": "float32", "float16": "float32", "bfloat16": "bfloat16"}
# a teacher-forced answer step counts as greedy's only with at least this logit margin over the runner-up
_MARGIN = {"float32": 0.05, "bfloat16": 1.0}


@dataclass(frozen=True, slots=True)
class EvalSetup:
    """What the harness reads and how (see the module docstring)."""

    contexts: tuple[int, ...] = (2048, 4096, 7936)
    documents: int = 5
    continuation: int = 128
    kv_dtypes: tuple[str, ...] = ("float16", "bfloat16")
    questions: int = 12  # per document and context; 0: agreement and KL only
    answer_tokens: int = 8
    split: str = "test"
    timing_repeats: int = 3

    def __post_init__(self) -> None:
        if not self.contexts or any(c <= 0 for c in self.contexts):
            raise InvalidInput("contexts must be positive token counts")
        if self.documents <= 0 or self.continuation < 2 or self.timing_repeats < 1:
            raise InvalidInput("documents and timing_repeats must be positive, continuation at least 2")
        if self.questions < 0 or self.answer_tokens < 1:
            raise InvalidInput("questions must be >= 0 and answer_tokens >= 1")
        for d in self.kv_dtypes:
            if d not in DTYPES:
                raise InvalidInput(f"unknown kv dtype {d!r}; choose one of {sorted(DTYPES)}")
        if self.split not in docqa.SPLITS:
            raise InvalidInput(f"unknown split {self.split!r}; choose one of {', '.join(docqa.SPLITS)}")

    def chunked(self, chunk_size: int) -> tuple[int, ...]:
        """The contexts rounded down to whole chunks, largest first."""
        out = sorted({c // chunk_size * chunk_size for c in self.contexts}, reverse=True)
        if out[-1] <= 0:
            raise InvalidInput(f"every context must hold at least one chunk of {chunk_size} tokens")
        return tuple(out)


# -- documents ----------------------------------------------------------------------------------


def layout_for(tok: Tokenizer) -> str:
    """``system`` for a model with a chat template (documents as system messages), else ``text``."""
    from kdn.prompts import check_chat_template

    try:
        check_chat_template(tok, "eval-codec")
        return "system"
    except InvalidInput:
        return "text"


def load_documents(lm: LoadedModel, setup: EvalSetup, files: Sequence[Path] | None = None,
                   root: Path | None = None) -> list[docqa.Document]:
    """``setup.documents`` documents long enough for the largest context plus the continuation."""
    need = max(setup.chunked(lm.chunk_size)) + setup.continuation
    if lm.max_positions and need > lm.max_positions:
        raise InvalidInput(f"a context of {need - setup.continuation} tokens plus {setup.continuation} continuation "
                           f"tokens exceeds the model's {lm.max_positions} positions")
    if files is None:
        root, files = docqa.heldout_files(setup.split)
    docs = docqa.build_documents(lm.tokenizer, files, root or Path("/"), min_tokens=need, count=setup.documents,
                                 layout=layout_for(lm.tokenizer))
    if not docs:
        raise InvalidInput(f"the text holds no document of {need} tokens")
    return docs


# -- model passes -------------------------------------------------------------------------------


@dataclass(slots=True)
class Answer:
    tokens: list[int]
    text: str
    correct: bool


@dataclass(slots=True)
class ContextRef:
    """What raw KV gives at one context: the continuation's logits and the answers."""

    context: int
    continuation: torch.Tensor  # (W,) token ids after the context
    logits: torch.Tensor  # (W, V) float32
    questions: list[docqa.Question]
    prompts: list[torch.Tensor]  # per question: (P,) token ids after the context
    answers: list[Answer]


@dataclass(slots=True)
class DocRun:
    """One document in one KV dtype: its raw KV chunks and what the model does with them."""

    document: str
    kv_dtype: str
    lm: LoadedModel
    chunks: list[torch.Tensor]  # each (L, 2, H, T, D), kv_dtype
    refs: list[ContextRef]  # largest context first


def _model_dtype(lm: LoadedModel) -> torch.dtype:
    return next(lm.model.parameters()).dtype


def _eos(lm: LoadedModel) -> set[int]:
    eos = getattr(lm.config, "eos_token_id", None)
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if isinstance(eos, int) else set())


def _cache(lm: LoadedModel, chunks: Sequence[torch.Tensor]) -> Any:
    dtype = _model_dtype(lm)
    return build_cache([c.to(dtype) for c in chunks], lm.config)


def _crop(cache: Any, length: int) -> None:
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)


@torch.no_grad()
def _forward(lm: LoadedModel, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``(N, V)`` float32 of ``ids`` ``(N,)`` on top of ``cache`` (which grows by N)."""
    return forward(lm.model, input_ids=ids.unsqueeze(0), cache=cache, use_cache=True).logits[0].float()


@torch.no_grad()
def _greedy(lm: LoadedModel, cache: Any, prompt: torch.Tensor, limit: int) -> list[int]:
    base, eos, out = cache_length(cache), _eos(lm), []
    x = prompt
    try:
        for _ in range(limit):
            t = int(_forward(lm, cache, x)[-1].argmax())
            out.append(t)
            if t in eos:
                break
            x = torch.tensor([t])
    finally:
        _crop(cache, base)
    return out


@torch.no_grad()
def _answer_like(lm: LoadedModel, cache: Any, prompt: torch.Tensor, ref: list[int], limit: int) -> list[int]:
    """Greedy answer on ``cache``; one teacher-forced pass over ``ref`` first, which stands for the
    greedy decode when every step picks ``ref``'s token by a clear margin."""
    base = cache_length(cache)
    try:
        logits = _forward(lm, cache, torch.cat([prompt, torch.tensor(ref[:-1], dtype=torch.long)]))
    finally:
        _crop(cache, base)
    steps = logits[prompt.numel() - 1:]  # (len(ref), V): step i predicts ref[i]
    top = steps.topk(2, dim=-1)
    margin = _MARGIN["bfloat16" if _model_dtype(lm) == torch.bfloat16 else "float32"]
    if bool((top.indices[:, 0] == torch.tensor(ref)).all()) and bool((top.values[:, 0] - top.values[:, 1] > margin).all()):
        return list(ref)
    return _greedy(lm, cache, prompt, limit)


def _suffix(tok: Tokenizer, question: str, layout: str) -> list[int]:
    """The tokens a request adds after its document: the rest of the document's message, the question."""
    stand_in = "x"
    return request_tokens(tok, stand_in, question, layout)[len(document_tokens(tok, stand_in, layout)):]


def _store(chunk: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    return chunk.to(DTYPES[kv_dtype]).contiguous()


@torch.no_grad()
def reference_run(lm: LoadedModel, doc: docqa.Document, kv_dtype: str, setup: EvalSetup) -> DocRun:
    """Prefill ``doc`` once, store its KV as ``kv_dtype`` and record what raw KV gives at every context."""
    layout = layout_for(lm.tokenizer)
    ids = torch.tensor(document_tokens(lm.tokenizer, doc.text, layout), dtype=torch.long)  # (N,)
    contexts = setup.chunked(lm.chunk_size)
    top = contexts[0]
    if ids.numel() < top + setup.continuation:
        raise InvalidInput(f"document {doc.name} has {ids.numel()} tokens, needs {top + setup.continuation}")
    out = lm.model(input_ids=ids[:top].unsqueeze(0), use_cache=True)
    prefilled = output_cache(out)
    chunks = [_store(c, kv_dtype) for c in split_cache(prefilled, lm.chunk_size)]  # each (L, 2, H, T, D)
    del out, prefilled
    cache = _cache(lm, chunks)
    refs = []
    for ctx in contexts:
        _crop(cache, ctx)
        cont = ids[ctx: ctx + setup.continuation]
        logits = _forward(lm, cache, cont)
        _crop(cache, ctx)
        qs = docqa.questions_for(lm.tokenizer, doc, ctx, setup.questions, layout) if setup.questions else []
        prompts = [torch.tensor(_suffix(lm.tokenizer, q.question, layout) + lm.tokenizer.encode(q.lead), dtype=torch.long)
                   for q in qs]
        answers = []
        for q, p in zip(qs, prompts):
            toks = _greedy(lm, cache, p, setup.answer_tokens)
            text = lm.tokenizer.decode(toks)
            answers.append(Answer(toks, text, docqa.is_correct(text, q.answer)))
        refs.append(ContextRef(ctx, cont, logits, qs, prompts, answers))
    return DocRun(doc.name, kv_dtype, lm, chunks, refs)


# -- one codec ----------------------------------------------------------------------------------


def _chain_keys(n: int) -> list[tuple[ChunkKey, ChunkKey]]:
    """Placeholder keys for the harness's artifacts (they never leave the process)."""
    keys = [ROOT_KEY]
    for i in range(n):
        keys.append(ChunkKey(hashlib.blake2b(keys[-1] + i.to_bytes(4, "little"), digest_size=32).digest()))
    return [(keys[i + 1], keys[i]) for i in range(n)]


@dataclass(slots=True)
class _Tally:
    """One codec at one (dtype, context), summed over documents."""

    documents: int = 0
    predictions: int = 0
    agree: float = 0.0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    nll_raw: float = 0.0
    nll_codec: float = 0.0
    n_nll: int = 0
    raw_bytes: int = 0
    enc_bytes: int = 0
    t_enc: float = 0.0
    t_dec: float = 0.0
    identical: bool = True
    questions: int = 0
    raw_right: int = 0
    codec_right: int = 0
    raw_only: int = 0
    codec_only: int = 0
    changed: int = 0
    doc_ratio: list[float] = field(default_factory=list)
    doc_agreement: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CodecQuality:
    codec: str
    lossy: bool
    kv_dtype: str
    context: int
    documents: int
    predictions: int
    top1_agreement: float
    mean_kl: float
    max_kl: float
    ppl_raw: float
    ppl_codec: float
    ppl_change: float  # ppl_codec / ppl_raw - 1
    raw_bytes: int
    encoded_bytes: int
    size_ratio: float  # raw KV bytes (kv_dtype) / artifact bytes
    bits_per_value: float
    encode_gbps: float
    decode_gbps: float
    crossover_gbps: float  # below this link bandwidth, fetch + decode beats fetching raw KV (inf: always)
    identical: bool  # decoded KV was bit-identical to raw KV in every chunk
    questions: int
    accuracy_raw: float
    accuracy: float
    raw_only: int  # questions right from raw KV only
    codec_only: int  # right from decoded KV only
    changed: int  # answers whose tokens differ from raw's
    mcnemar_p: float
    doc_ratio: tuple[float, ...]
    doc_agreement: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed_round_trip(lm: LoadedModel, chunks: Sequence[torch.Tensor], codec: Codec,
                      repeats: int) -> tuple[list[bytes], list[torch.Tensor], list[float], list[float]]:
    """Blobs, decoded chunks, and per-chunk encode and decode seconds (best of ``repeats``)."""
    keys = _chain_keys(len(chunks))
    blobs, decoded, t_enc, t_dec = [], [], [], []
    for i, (x, (k, p)) in enumerate(zip(chunks, keys)):
        te = td = math.inf
        for r in range(repeats):
            t0 = time.perf_counter()
            blob = encode_artifact(x, key=k, parent_key=p, fingerprint=lm.fingerprint, codec=codec, chunk_index=i)
            t1 = time.perf_counter()
            art = decode_artifact(blob, expect_fingerprint=lm.fingerprint, expect_key=k)
            t2 = time.perf_counter()
            te, td = min(te, t1 - t0), min(td, t2 - t1)
        blobs.append(blob)
        decoded.append(art.kv)
        t_enc.append(te)
        t_dec.append(td)
    return blobs, decoded, t_enc, t_dec


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@torch.no_grad()
def run_codec(run: DocRun, codec: Codec, setup: EvalSetup, tallies: dict[int, _Tally], *,
              questions: bool = True) -> None:
    """Send ``run``'s chunks through ``codec`` and add what the model does with them to ``tallies``
    (one per context)."""
    lm = run.lm
    n_max = run.refs[0].context // lm.chunk_size
    blobs, decoded, t_enc, t_dec = _timed_round_trip(lm, run.chunks[:n_max], codec, setup.timing_repeats)
    same = [_same_bits(a, b) for a, b in zip(decoded, run.chunks)]
    cache = None if all(same) else _cache(lm, decoded)
    chunk_bytes = run.chunks[0].numel() * run.chunks[0].element_size()
    for ref in run.refs:
        n = ref.context // lm.chunk_size
        t = tallies.setdefault(ref.context, _Tally())
        t.documents += 1
        t.raw_bytes += n * chunk_bytes
        t.enc_bytes += sum(len(b) for b in blobs[:n])
        t.t_enc += sum(t_enc[:n])
        t.t_dec += sum(t_dec[:n])
        t.doc_ratio.append(n * chunk_bytes / sum(len(b) for b in blobs[:n]))
        identical = all(same[:n])
        t.identical &= identical
        w = ref.continuation.numel()
        lp_ref = torch.log_softmax(ref.logits, -1)  # (W, V)
        target = ref.continuation[1:]  # (W-1,)
        nll_ref = -float(lp_ref[:-1].gather(-1, target[:, None]).sum())
        t.predictions += w
        t.nll_raw += nll_ref
        t.n_nll += target.numel()
        t.questions += len(ref.questions)
        t.raw_right += sum(a.correct for a in ref.answers)
        if identical:
            t.agree += w
            t.nll_codec += nll_ref
            t.codec_right += sum(a.correct for a in ref.answers)
            t.doc_agreement.append(1.0)
            continue
        _crop(cache, ref.context)
        logits = _forward(lm, cache, ref.continuation)  # (W, V)
        _crop(cache, ref.context)
        lp = torch.log_softmax(logits, -1)  # (W, V)
        kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0.0)  # (W,)
        agree = float((logits.argmax(-1) == ref.logits.argmax(-1)).sum())
        t.agree += agree
        t.doc_agreement.append(agree / w)
        t.kl_sum += float(kl.sum())
        t.kl_max = max(t.kl_max, float(kl.max()))
        t.nll_codec -= float(lp[:-1].gather(-1, target[:, None]).sum())
        for q, prompt, raw in zip(ref.questions, ref.prompts, ref.answers):
            if not questions:
                break
            toks = _answer_like(lm, cache, prompt, raw.tokens, setup.answer_tokens)
            right = raw.correct if toks == raw.tokens else docqa.is_correct(lm.tokenizer.decode(toks), q.answer)
            t.codec_right += right
            t.raw_only += raw.correct and not right
            t.codec_only += right and not raw.correct
            t.changed += toks != raw.tokens


def _finish(codec: Codec, label: str, kv_dtype: str, context: int, t: _Tally) -> CodecQuality:
    ppl_r = math.exp(t.nll_raw / t.n_nll) if t.n_nll else float("nan")
    ppl_c = math.exp(t.nll_codec / t.n_nll) if t.n_nll else float("nan")
    crossover = math.inf if t.t_dec <= 0 else (t.raw_bytes - t.enc_bytes) / t.t_dec / 1e9
    itemsize = DTYPES[kv_dtype].itemsize
    return CodecQuality(
        codec=label, lossy=codec.lossy, kv_dtype=kv_dtype, context=context, documents=t.documents,
        predictions=t.predictions, top1_agreement=t.agree / t.predictions, mean_kl=t.kl_sum / t.predictions,
        max_kl=t.kl_max, ppl_raw=ppl_r, ppl_codec=ppl_c, ppl_change=ppl_c / ppl_r - 1,
        raw_bytes=t.raw_bytes, encoded_bytes=t.enc_bytes, size_ratio=t.raw_bytes / t.enc_bytes,
        bits_per_value=8 * t.enc_bytes / (t.raw_bytes / itemsize),
        encode_gbps=t.raw_bytes / t.t_enc / 1e9, decode_gbps=t.raw_bytes / t.t_dec / 1e9,
        crossover_gbps=max(0.0, crossover), identical=t.identical, questions=t.questions,
        accuracy_raw=t.raw_right / t.questions if t.questions else float("nan"),
        accuracy=t.codec_right / t.questions if t.questions else float("nan"),
        raw_only=t.raw_only, codec_only=t.codec_only, changed=t.changed,
        mcnemar_p=docqa.mcnemar_p(t.raw_only, t.codec_only),
        doc_ratio=tuple(t.doc_ratio), doc_agreement=tuple(t.doc_agreement),
    )


# -- the whole evaluation -----------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    model: str
    setup: EvalSetup
    documents: list[str] = field(default_factory=list)
    questions: dict[str, dict[str, int]] = field(default_factory=dict)  # per context: count by kind
    results: list[CodecQuality] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "setup": asdict(self.setup), "documents": self.documents,
                "questions": self.questions, "seconds": self.seconds, "results": [r.as_dict() for r in self.results]}

    def get(self, codec: str, kv_dtype: str, context: int) -> CodecQuality:
        for r in self.results:
            if (r.codec, r.kv_dtype, r.context) == (codec, kv_dtype, context):
                return r
        raise KeyError((codec, kv_dtype, context))


def load_models(spec: str, kv_dtypes: Sequence[str], chunk_size: int) -> dict[str, LoadedModel]:
    """One loaded model per compute dtype the KV dtypes need, keyed by KV dtype."""
    by_compute: dict[str, LoadedModel] = {}
    out = {}
    for d in kv_dtypes:
        c = COMPUTE_DTYPE[d]
        if c not in by_compute:
            by_compute[c] = load_model(spec, dtype=c, chunk_size=chunk_size)
        out[d] = by_compute[c]
    return out


def evaluate(models: dict[str, LoadedModel], codecs: Sequence[Codec | str], setup: EvalSetup,
             docs: Sequence[docqa.Document], *, labels: Sequence[str] | None = None,
             progress: Any = None) -> Report:
    """One reference run per (document, KV dtype), then every codec against it."""
    t0 = time.perf_counter()
    objs = [get_codec(c) if isinstance(c, str) else c for c in codecs]  # a bad spec fails before any model work
    names = list(labels) if labels else [c.spec for c in objs]
    any_lm = next(iter(models.values()))
    report = Report(any_lm.spec, setup, [d.name for d in docs])
    tallies: dict[tuple[str, str], dict[int, _Tally]] = {}
    for kv_dtype in setup.kv_dtypes:
        lm = models[kv_dtype]
        for doc in docs:
            run = reference_run(lm, doc, kv_dtype, setup)
            if progress:
                progress(f"{kv_dtype} {doc.name[:60]}: raw KV and its answers ready")
            if kv_dtype == setup.kv_dtypes[0]:
                for ref in run.refs:
                    counts = report.questions.setdefault(str(ref.context), {})
                    for q in ref.questions:
                        counts[q.kind] = counts.get(q.kind, 0) + 1
            for codec, name in zip(objs, names):
                run_codec(run, codec, setup, tallies.setdefault((name, kv_dtype), {}))
                if progress:
                    progress(f"{kv_dtype} {doc.name[:60]}: {name} judged")
            del run
    for kv_dtype in setup.kv_dtypes:
        for codec, name in zip(objs, names):
            for ctx, t in sorted(tallies[(name, kv_dtype)].items()):
                report.results.append(_finish(codec, name, kv_dtype, ctx, t))
    report.seconds = time.perf_counter() - t0
    return report


# -- calibration --------------------------------------------------------------------------------


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


def mean_kl(runs: Sequence[DocRun], codec: Codec, setup: EvalSetup) -> float:
    """Mean KL over every run's largest context (no questions, one timing pass)."""
    quick = EvalSetup(setup.contexts, setup.documents, setup.continuation, setup.kv_dtypes, 0, 1, setup.split, 1)
    kl = n = 0.0
    for run in runs:
        tallies: dict[int, _Tally] = {}
        top = DocRun(run.document, run.kv_dtype, run.lm, run.chunks, run.refs[:1])
        run_codec(top, codec, quick, tallies, questions=False)
        t = tallies[top.refs[0].context]
        kl += t.kl_sum
        n += t.predictions
    return kl / n


def calibrate_kvq(runs: Sequence[DocRun], level: str, setup: EvalSetup) -> Calibration:
    """Which layers' K and V hurt most when coarse, and a plan that spends bits there.

    Every (layer, K|V) slot is probed alone at ``probe_bits`` (the level's bits minus one) with
    everything else at 8 bits; the slots whose probe moves the next-token distribution most (KL)
    one more bit (the level's early-layer bonus, if it has one) — as many slots as that rule gives
    (a quarter of the layers, K and V), spent where this model needs it; in format 2, which has no
    such rule, as many of the least sensitive slots give one bit up, so the size stays about the
    level's. Run it on calibration documents only.
    """
    from kdn.codecs.kvq import LEVELS, BitPlan, KvqCodec

    if level not in LEVELS:
        raise InvalidInput(f"unknown kvq level {level!r}; choose one of {', '.join(LEVELS)}")
    from dataclasses import replace

    k_bits, v_bits = LEVELS[level]
    rule = BitPlan.for_level(level)
    n = runs[0].lm.kv_shape.num_layers
    probe = max(2, min(k_bits, v_bits) - 1)
    kl = []
    for layer in range(n):
        row = []
        for slot in (0, 1):
            table = [(8, 8)] * n
            table[layer] = (probe, 8) if slot == 0 else (8, probe)
            row.append(mean_kl(runs, KvqCodec(level, replace(rule, table=tuple(table))), setup))
        kl.append((row[0], row[1]))
    bonus_slots = 2 * math.ceil(rule.early_frac * n)
    bonus = rule.early_bonus or 1
    ranked = sorted(((kl[l][s], l, s) for l in range(n) for s in (0, 1)), reverse=True)
    table = [[k_bits, v_bits] for _ in range(n)]
    for _, layer, slot in ranked[:bonus_slots]:
        table[layer][slot] = min(8, table[layer][slot] + bonus)
    if rule.format == 2:  # no shape rule to match: the least sensitive slots pay for the bonus
        for _, layer, slot in ranked[::-1][:bonus_slots]:
            if (kl[layer][slot], layer, slot) not in ranked[:bonus_slots]:
                table[layer][slot] = max(2, table[layer][slot] - bonus)
    plan = replace(rule, table=tuple((k, v) for k, v in table))
    return Calibration(level, probe, tuple(kl), plan)


# -- output -------------------------------------------------------------------------------------

_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _acc(r: CodecQuality) -> str:
    if not r.questions:
        return "-"
    if r.identical:
        return f"{100 * r.accuracy:.1f}% (same KV)"
    return f"{100 * r.accuracy:.1f}% ({r.changed} changed, p={r.mcnemar_p:.2f})"


def format_table(results: Sequence[CodecQuality]) -> str:
    head = (f"{'codec':<12} {'kv':<4} {'context':>7} {'ratio':>7} {'top-1':>8} {'mean KL':>9} "
            f"{'accuracy (raw)':>16} {'accuracy':>28} {'dec GB/s':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        raw_acc = f"{100 * r.accuracy_raw:.1f}% of {r.questions}" if r.questions else "-"
        lines.append(
            f"{r.codec:<12} {_SHORT.get(r.kv_dtype, r.kv_dtype):<4} {r.context:>7} {r.size_ratio:>6.2f}x "
            f"{100 * r.top1_agreement:>7.2f}% {r.mean_kl:>9.5f} {raw_acc:>16} {_acc(r):>28} {r.decode_gbps:>8.2f}"
        )
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def main(argv: list[str]) -> int:
    defaults = EvalSetup()
    parser = argparse.ArgumentParser(prog="kdn eval-codec", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"built-in name or HF model dir (default {DEFAULT_MODEL})")
    parser.add_argument("--codec", action="append", default=None,
                        help=f"NAME[:LEVEL]; repeat or comma-separate (default: {','.join(DEFAULT_CODECS)})")
    parser.add_argument("--contexts", type=_ints, default=defaults.contexts,
                        help=f"context lengths in tokens, rounded down to whole chunks (default "
                             f"{','.join(map(str, defaults.contexts))})")
    parser.add_argument("--documents", type=int, default=defaults.documents,
                        help=f"documents judged (default {defaults.documents})")
    parser.add_argument("--continuation", type=int, default=defaults.continuation,
                        help=f"teacher-forced tokens after the context, where predictions are compared "
                             f"(default {defaults.continuation})")
    parser.add_argument("--questions", type=int, default=defaults.questions,
                        help=f"questions per document and context; 0 for none (default {defaults.questions})")
    parser.add_argument("--kv-dtype", type=_names, default=defaults.kv_dtypes,
                        help=f"KV dtypes, comma-separated (default {','.join(defaults.kv_dtypes)})")
    parser.add_argument("--split", default=defaults.split, choices=docqa.SPLITS,
                        help="which held-out files: calibration (for tuning), test (for figures) or all "
                             f"(default {defaults.split})")
    parser.add_argument("--text", type=Path, action="append",
                        help="read these files instead of the held-out stdlib (questions come from Python files)")
    parser.add_argument("--answer-tokens", type=int, default=defaults.answer_tokens,
                        help=f"longest answer decoded per question (default {defaults.answer_tokens})")
    parser.add_argument("--timing-repeats", type=int, default=defaults.timing_repeats,
                        help=f"encode/decode passes per chunk, the fastest kept (default {defaults.timing_repeats})")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default 256)")
    parser.add_argument("--calibrate", metavar="LEVEL", default=None,
                        help="also run a kvq calibration at LEVEL on these documents and judge its bit plan")
    parser.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    args = parser.parse_args(argv)
    codecs = [c for spec in (args.codec or [",".join(DEFAULT_CODECS)]) for c in spec.split(",") if c]
    calibration = None
    try:
        setup = EvalSetup(contexts=args.contexts, documents=args.documents, continuation=args.continuation,
                          kv_dtypes=args.kv_dtype, questions=args.questions, answer_tokens=args.answer_tokens,
                          split=args.split, timing_repeats=args.timing_repeats)
        objs = [get_codec(c) for c in codecs]
        models = load_models(args.model, setup.kv_dtypes, args.chunk_size)
        lm = next(iter(models.values()))
        if args.text:
            for p in args.text:
                if not p.is_file():
                    raise InvalidInput(f"no such file: {p}")
            docs = load_documents(lm, setup, [p.resolve() for p in args.text], Path("/"))
        else:
            docs = load_documents(lm, setup)
        def say(msg: str) -> None:
            print(f"eval-codec: {msg}", file=sys.stderr, flush=True)

        report = evaluate(models, objs, setup, docs, progress=say)
        if args.calibrate:
            from kdn.codecs.kvq import KvqCodec

            runs = [reference_run(models[setup.kv_dtypes[0]], d, setup.kv_dtypes[0],
                                  EvalSetup(setup.contexts, setup.documents, setup.continuation, setup.kv_dtypes, 0))
                    for d in docs]
            calibration = calibrate_kvq(runs, args.calibrate, setup)
            extra = evaluate(models, [KvqCodec(args.calibrate, calibration.plan)], setup, docs,
                             labels=[f"kvq:{args.calibrate}+cal"])
            report.results += extra.results
    except (KdnError, OSError) as exc:
        report_error("eval-codec", exc, as_json=args.json)
        return 2
    if args.json:
        out = report.as_dict()
        out["load"] = os.getloadavg()[0]
        if calibration is not None:
            out["calibration"] = calibration.as_dict()
        print(json.dumps(out, indent=2, default=str))
        return 0
    if calibration is not None:
        print(f"calibration at {calibration.level} (probe {calibration.probe_bits} bits), mean KL per layer (K, V):")
        for layer, ((kk, vv), bits) in enumerate(zip(calibration.kl, calibration.plan.table)):
            print(f"  layer {layer:>2}: K {kk:.5f}  V {vv:.5f}  -> bits K {bits[0]} V {bits[1]}")
    print(f"model {report.model}: {len(docs)} documents ({setup.split} split), contexts "
          f"{', '.join(map(str, setup.chunked(lm.chunk_size)[::-1]))} tokens, {setup.continuation} continuation "
          f"tokens each; questions per context: "
          + ", ".join(f"{c}: {sum(k.values())}" for c, k in sorted(report.questions.items(), key=lambda x: int(x[0])))
          + f"; {report.seconds:.0f}s")
    print(format_table(report.results))
    return 0
