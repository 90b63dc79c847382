"""Prefill into chunks: the one way origin workers and inference hosts turn tokens into chunk KV.

Both sides must agree on three things or their keys and KV differ: how text becomes tokens
(:func:`document_tokens`: the engine's own tokens for a request that starts with the document, in
its :mod:`kdn.prompts` layout), which chunks exist (:func:`plan_chunks`), and the forward pass that
produces their KV (:func:`prefill_chunks`).

Documents longer than the model window: a chunk's KV depends on every token before it, and a
model cannot attend past ``max_position_embeddings`` positions, so only the chunks that end
within the window exist. Chunks beyond ``max_positions // chunk_size`` are **not produced**;
:class:`ChunkPlan` reports how many tokens that drops, and the origin's ingest summary says so.
The trailing partial chunk (fewer than ``chunk_size`` tokens) is stored in pieces of
:data:`kdn.keys.PIECE_TOKENS` tokens (:func:`prefill_document`); what is left after the last full
piece has no key and is recomputed.

Bounded tokenization: since nothing past the window is ever used, :func:`window_tokens` tokenizes
growing prefixes of a text and stops once it holds more than the window plus a margin, so a 200 MB
document costs the tokenizer a few hundred KB, not gigabytes. Tokenizers are local (pre-tokenizing
BPE, bytes): a token at least :data:`CUT_MARGIN` tokens before a cut is the same token the whole
text would give, so only the tokens before that margin are kept from a cut text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kdn import prompts
from kdn.errors import InvalidInput
from kdn.keys import PIECE_TOKENS, pieces_enabled
from kdn.kv import forward, layers_to_chunk, output_cache
from kdn.models import LoadedModel

__all__ = [
    "document_tokens", "greedy_tail", "logits_with_chunks", "plan_chunks", "prefill_chunks",
    "prefill_document", "window_tokens",
]


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Which full chunks of a token sequence can be produced by a model."""

    n_tokens: int
    chunk_size: int
    max_positions: int
    n_chunks: int  # full chunks that fit within the window
    tail_tokens: int  # tokens after the last full chunk, within the window (recomputed, never stored)
    beyond_window_tokens: int  # tokens past the window: no KV is produced for them

    @property
    def covered_tokens(self) -> int:
        return self.n_chunks * self.chunk_size

    @property
    def truncated(self) -> bool:
        return self.beyond_window_tokens > 0


def plan_chunks(n_tokens: int, chunk_size: int, max_positions: int) -> ChunkPlan:
    """Full chunks of ``n_tokens`` that end within ``max_positions`` (0 = unbounded)."""
    if chunk_size <= 0:
        raise InvalidInput(f"chunk_size must be positive, got {chunk_size}")
    window = n_tokens if max_positions <= 0 else min(n_tokens, max_positions)
    n_chunks = window // chunk_size
    return ChunkPlan(
        n_tokens=n_tokens,
        chunk_size=chunk_size,
        max_positions=max_positions,
        n_chunks=n_chunks,
        tail_tokens=window - n_chunks * chunk_size,
        beyond_window_tokens=n_tokens - window,
    )


def document_tokens(lm: LoadedModel, text: str, layout: str = "text") -> list[int]:
    """Tokens of a document as both origin and inference host compute them: the first tokens of
    every request that carries ``text`` in ``layout`` (:func:`kdn.prompts.document_tokens`)."""
    return prompts.document_tokens(lm.tokenizer, text, layout)


CUT_MARGIN = 64  # tokens dropped before a cut in the text: they might differ from the whole text's


@dataclass(frozen=True, slots=True)
class WindowTokens:
    """The tokens of a text that a model window can use. ``complete``: ``tokens`` are all of the
    text's tokens (the text was tokenized whole); otherwise the text holds more than ``counted``
    tokens (a lower bound) and ``tokens`` is the stable prefix of at most ``limit`` tokens."""

    tokens: list[int]
    counted: int
    complete: bool


def window_tokens(
    lm: LoadedModel, text: str, limit: int | None = None, *, text_complete: bool = True, layout: str = "text"
) -> WindowTokens:
    """The first tokens of ``text`` up to ``limit`` (default: the model window; 0 = no bound),
    tokenizing growing prefixes so the tokenizer never sees much more than the window needs.

    ``text_complete=False``: ``text`` is itself a prefix of a longer document (the caller read
    only part of it), so its last :data:`CUT_MARGIN` tokens are not trusted either.
    """
    limit = lm.max_positions if limit is None else limit
    if limit <= 0:
        toks = document_tokens(lm, text, layout)
        return WindowTokens(toks, len(toks), text_complete) if text_complete else _cut(toks, len(toks))
    want = limit + CUT_MARGIN
    n = min(len(text), 4 * want + 1024)
    while True:
        toks = document_tokens(lm, text[:n], layout)
        if n >= len(text):
            if text_complete:
                return WindowTokens(toks, len(toks), True)
            return _cut(toks, limit)
        if len(toks) > want:
            return _cut(toks, limit)
        n = min(len(text), 2 * n)


def _cut(toks: list[int], limit: int) -> WindowTokens:
    keep = max(0, min(limit, len(toks) - CUT_MARGIN)) if limit > 0 else max(0, len(toks) - CUT_MARGIN)
    return WindowTokens(toks[:keep], len(toks), False)


def prefill_chunks(
    lm: LoadedModel, tokens: Sequence[int] | np.ndarray, *, max_chunks: int | None = None
) -> list[torch.Tensor]:
    """KV of every full chunk of ``tokens`` that fits the model window, each ``(L, 2, H, C, D)``.

    One forward pass over the covered tokens (``n_chunks * chunk_size``), so chunk ``i``'s KV is
    exactly what a model that read tokens ``0 .. (i+1)·C`` holds. ``max_chunks`` caps the count
    further (e.g. a client that only needs the first few). Chunks past the window are not
    produced (see the module docstring); use :func:`plan_chunks` to learn how many were dropped.
    """
    return prefill_document(lm, tokens, max_chunks=max_chunks, pieces=False)[0]


def prefill_document(
    lm: LoadedModel, tokens: Sequence[int] | np.ndarray, *, max_chunks: int | None = None, pieces: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """KV of the full chunks of ``tokens`` (as :func:`prefill_chunks`) and, with ``pieces`` and no
    cap on the chunks, of the full tail pieces after them (:func:`kdn.keys.piece_keys`), each
    ``(L, 2, H, PIECE_TOKENS, D)``: one forward pass over both."""
    C = lm.chunk_size
    plan = plan_chunks(len(tokens), C, lm.max_positions)
    n = plan.n_chunks if max_chunks is None else min(plan.n_chunks, max_chunks)
    n_pieces = 0
    if pieces and n == plan.n_chunks and pieces_enabled(C):
        n_pieces = min(plan.tail_tokens // PIECE_TOKENS, C // PIECE_TOKENS - 1)
    total = n * C + n_pieces * PIECE_TOKENS
    if total == 0:
        return [], []
    ids = torch.as_tensor(np.asarray(tokens[:total], dtype=np.int64)).unsqueeze(0)  # (1, N)
    with torch.inference_mode():
        # logits_to_keep=1: prefill needs the cache, not a (N, vocab) logits tensor
        out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=1)
    # transformers < 5.20 (the release vLLM 0.32 pins) names the output cache past_key_values
    cache = output_cache(out)
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    chunks = [layers_to_chunk(layers, c * C, (c + 1) * C) for c in range(n)]  # n × (L, 2, H, C, D)
    base = n * C
    tail = [layers_to_chunk(layers, base + j * PIECE_TOKENS, base + (j + 1) * PIECE_TOKENS) for j in range(n_pieces)]
    return chunks, tail


def logits_with_chunks(lm: LoadedModel, chunks: Sequence[torch.Tensor], rest: Sequence[int]) -> torch.Tensor:
    """Logits for ``rest`` read after a cache rebuilt from ``chunks``: ``(len(rest), vocab)``.

    The check that stored KV is what the model would compute: these logits must equal those of a
    fresh prefill of the whole sequence at the same positions.
    """
    from kdn.kv import build_cache

    if not rest:
        raise InvalidInput("need at least one token after the cached chunks")
    cache = build_cache(list(chunks), lm.config)
    ids = torch.as_tensor(list(rest), dtype=torch.long).unsqueeze(0)  # (1, R)
    with torch.inference_mode():
        out = forward(lm.model, input_ids=ids, cache=cache, use_cache=True)
    return out.logits[0]  # (R, V)


def greedy_tail(model: Any, cache: Any, first: int, *, max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Greedy generation after the first token: ``[first, ...]`` until ``max_new_tokens`` tokens
    or an EOS id, each step one token over (and extending) ``cache``."""
    generated = [first]
    nxt = first
    while len(generated) < max_new_tokens and nxt not in eos_ids:
        out = forward(model, input_ids=torch.tensor([[nxt]], dtype=torch.long), cache=cache, use_cache=True, logits_to_keep=1)
        cache = output_cache(out)
        nxt = int(torch.argmax(out.logits[0, -1]).item())
        generated.append(nxt)
    return generated
