"""Documents reused anywhere in the prompt, on the inference host (``generate(..., documents=[...])``).

One request, laid out ``[prefix][document_1] … [document_n][question]``::

    each document ─► segment key (kdn.segments) ─► Fetch from the edge, all at once
       hit  ─► verified segment KV, computed after the model's lead (kdn.segments)
       miss ─► prefill that document after the lead here, Put it as a segment (background), use it
    kdn.blend.place  ─► keys rotated to where each document now sits (naive concatenation);
                        the prefix and the question are glue (no cached KV)
    kdn.blend.blend_and_predict ─► one pass: the prefix and the question at every layer, the share
                        of document tokens the model's verdict names; the question's next-token
                        logits come off it; greedy decoding
    (a model whose own forward the pass does not reproduce, kdn.blend.predicts_in_pass: the
    prefix is prefilled first and the question over the blended KV, as a cache)

Why here: the host has the weights, the prefix and every other segment of this prompt, and the
blended KV is specific to it. An engine that only loads KV (vLLM) gets the same blend from the
store instead (:mod:`kdn.origin.blend`, :mod:`kdn.integrations.vllm_blend`).

Invariants:
- blended KV is never written back: only segments (each document's own KV, computed after the lead) are
  Put, so 200 prompts over 50 documents store 50 segments, not 200 contexts;
- blending needs a passing verdict for the model (``kdn eval-blend``, :mod:`kdn.blend.verdict`):
  without one the request falls back to prefix reuse of the concatenated prompt and says so in
  :attr:`Result.warnings`; a model whose RoPE variant cannot be moved by a rotation is refused
  the same way (:class:`~kdn.errors.UnsupportedModel`), never blended wrong;
- a cache failure (edge down, corrupt or wrong-model segment) never changes the answer: the
  request is recomputed in full locally, exactly as without KDN, with one warning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kdn.blend import (
    Deviation, FirstK, Glue, Naive, Policy, Random, blend, blend_and_predict, check_model, place, predicts_in_pass,
    prefill_document, prefill_segment,
)
from kdn.blend.verdict import read_verdict
from kdn.client import LOG, KdnClient
from kdn.errors import InvalidInput, KdnError, NotFound
from kdn.integrations.records import KdnModel, Result, Timings, token_ids
from kdn.kv import forward, output_cache
from kdn.prefill import greedy_tail
from kdn.segments import Segment, encode_segment, segment_key



@dataclass(frozen=True, slots=True)
class BlendOptions:
    """How documents are blended. ``policy=None``: the model's verdict decides (and must pass);
    a policy given here skips the verdict (for evaluation and experiments)."""

    policy: Policy | None = None
    verdict_root: Path | None = None
    put_segments: bool = True

    def __post_init__(self) -> None:
        if self.policy is not None and not isinstance(self.policy, (Naive, FirstK, Deviation, Random)):
            raise InvalidInput(f"BlendOptions.policy must be a kdn.blend policy (Naive, FirstK, Deviation, Random) "
                               f"or None, got {self.policy!r}")


def _tokens(km: "KdnModel", text: str | Sequence[int], what: str = "a document") -> list[int]:
    """Text (encoded) or token ids, each an integer id of the model's vocabulary."""
    if isinstance(text, str):
        if km.tokenizer is None:
            raise InvalidInput("text documents need a tokenizer")
        return list(km.tokenizer.encode(text))
    return token_ids(text, int(km.config.vocab_size), what)


def _policy(km: "KdnModel", options: BlendOptions) -> tuple[Policy | None, str | None]:
    """The policy to blend with, or ``(None, why not)``."""
    try:
        check_model(km.model)
    except KdnError as exc:
        return None, f"blending refused: {exc}"
    if options.policy is not None:
        return options.policy, None
    try:
        v = read_verdict(km.fingerprint, options.verdict_root)
    except KdnError as exc:
        return None, f"blend verdict unreadable ({exc})"
    if v is None:
        return None, ("no blend verdict for this model (run `kdn eval-blend --model DIR`); "
                      "reusing documents as an exact prefix only")
    if not v.passed:
        return None, f"this model failed the blend quality gate ({v.reason}); reusing documents as an exact prefix only"
    return Deviation(v.ratio, v.check_layer), None


def generate_with_documents(
    km: "KdnModel",
    question: str | Sequence[int],
    documents: Sequence[str | Sequence[int]],
    *,
    prefix: str | Sequence[int] = (),
    client: KdnClient | None,
    max_new_tokens: int,
    eos_ids: set[int],
    options: BlendOptions,
    t_start: float,
    generate: Callable[..., Result],
) -> Result:
    """``generate``: the prefix-reuse generation (:func:`kdn.integrations.transformers.generate`),
    used for the fallbacks."""
    from dataclasses import replace

    pre = _tokens(km, prefix, "the prefix") if prefix else []
    docs = [_tokens(km, d, f"document {i}") for i, d in enumerate(documents)]
    q = _tokens(km, question, "the question")
    if not q:
        raise InvalidInput("the question (the text after the documents) must hold at least one token")
    if any(not d for d in docs):
        raise InvalidInput("empty document")
    flat = pre + [t for d in docs for t in d] + q

    def fallback(why: str, *, use_client: bool) -> Result:
        LOG.warning(why)
        r = generate(km, flat, client=client if use_client else None, max_new_tokens=max_new_tokens,
                     eos_token_id=min(eos_ids) if eos_ids else None)
        return replace(r, warnings=(why, *r.warnings), via=r.via or ("prefix" if use_client else "recompute"))

    if client is None or not docs:
        return generate(km, flat, client=None, max_new_tokens=max_new_tokens)
    policy, why = _policy(km, options)
    if policy is None:
        return fallback(str(why), use_client=True)

    shape = km.kv_shape
    t0 = time.perf_counter()
    keys = [segment_key(d, fingerprint=km.fingerprint, namespace=client.config.namespace) for d in docs]
    results = client.fetch_segments(km.fingerprint, [(k, len(d)) for k, d in zip(keys, docs)], shape)
    t1 = time.perf_counter()
    segments: list[Segment] = []
    fetched = missed = 0
    n_bytes = 0
    written = False
    with torch.inference_mode():
        for key, d, r in zip(keys, docs, results):
            if isinstance(r, NotFound):
                kv, start = prefill_document(km.model, d)  # (L, 2, H, n, D) after the model's lead
                seg = Segment(key, tuple(d), kv.to(shape.dtype), start)
                missed += 1
                if options.put_segments:
                    written |= client.schedule_put(km.fingerprint, key, encode_segment(seg, fingerprint=km.fingerprint,
                                                                                       codec=client.config.put_codec))
            elif isinstance(r, Exception):
                return fallback(f"KDN segment fetch failed ({type(r).__name__}: {r}); recomputing the whole prompt "
                                "locally", use_client=False)
            else:
                seg = Segment(key, tuple(d), r[0], r[2])
                fetched += 1
                n_bytes += r[1]
            segments.append(seg)
        t2 = time.perf_counter()
        if predicts_in_pass(km.model):
            # the prefix and the question are glue: computed in the blend's pass at every layer, so
            # the question's logits come out of it, with no second pass over the weights for either
            parts: list[Segment | Glue] = [Glue(tuple(pre)), *segments, Glue(tuple(q))]
            # room after the prompt for the tokens decoding feeds back (the last new one is not)
            layout = place(km.model, parts, room=max_new_tokens - 1)
            cache, stats, logits = blend_and_predict(km.model, layout, policy)
            t3 = t4 = time.perf_counter()
        else:
            prefix_kv = prefill_segment(km.model, pre).to(shape.dtype) if pre else None  # (L, 2, H, P, D), exact
            layout = place(km.model, segments, prefix_tokens=pre, prefix_kv=prefix_kv)
            cache, stats = blend(km.model, layout, policy)
            t3 = time.perf_counter()
            out = forward(km.model, input_ids=torch.tensor([q], dtype=torch.long), cache=cache, use_cache=True,
                          logits_to_keep=1)
            cache, logits = output_cache(out), out.logits[0, -1]
            t4 = time.perf_counter()
        nxt = int(torch.argmax(logits).item())
        t_first = time.perf_counter()
        generated = greedy_tail(km.model, cache, nxt, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    t_end = time.perf_counter()
    doc_tokens = sum(len(d) for d in docs)
    reused = sum(len(s.tokens) for s, r in zip(segments, results) if not isinstance(r, Exception)) - \
        sum(1 for p in stats.selected_positions if _from_fetched(p, layout.spans, results))
    timings = Timings(ttft_s=t_first - t_start, fetch_s=t1 - t0, build_s=(t2 - t1) + (t3 - t2), prefill_s=t4 - t3,
                      first_token_s=t_first - t4, total_s=t_end - t_start, blend_s=stats.seconds)
    warnings: tuple[str, ...] = ()
    if missed:
        warnings = (f"{missed} of {len(docs)} documents were not cached as segments: computed here"
                    + (" and stored" if options.put_segments else ""),)
    text = km.tokenizer.decode(generated) if km.tokenizer is not None else None
    return Result(tokens=generated, text=text, timings=timings, prompt_tokens=len(flat), reused_tokens=max(0, reused),
                  computed_tokens=len(flat) - max(0, reused), fetched_bytes=n_bytes, via=f"blend:{stats.policy}",
                  written_back=written, warnings=warnings, blend=stats, documents_tokens=doc_tokens)


def _from_fetched(pos: int, spans: Sequence[tuple[int, int]], results: Sequence[Any]) -> bool:
    for (s, e), r in zip(spans, results):
        if s <= pos < e:
            return not isinstance(r, Exception)
    return False
