"""kdn.prefill: which chunks exist, and that their KV is what the model computes."""

from __future__ import annotations

import pytest
import torch

from kdn.prefill import document_tokens, logits_with_chunks, plan_chunks, prefill_chunks


@pytest.mark.parametrize(
    "n, size, window, chunks, tail, beyond",
    [
        (0, 256, 8192, 0, 0, 0),
        (255, 256, 8192, 0, 255, 0),
        (256, 256, 8192, 1, 0, 0),
        (1000, 256, 8192, 3, 232, 0),
        (20000, 256, 8192, 32, 0, 11808),
        (1000, 256, 600, 2, 88, 400),  # window not a multiple of the chunk size
        (1000, 256, 0, 3, 232, 0),  # 0 = unbounded window
    ],
)
def test_plan_chunks(n, size, window, chunks, tail, beyond):
    p = plan_chunks(n, size, window)
    assert (p.n_chunks, p.tail_tokens, p.beyond_window_tokens) == (chunks, tail, beyond)
    assert p.truncated == (beyond > 0)
    assert p.covered_tokens + p.tail_tokens + p.beyond_window_tokens == n


def test_prefill_chunks_shapes_and_max_chunks(tiny_model):
    lm = tiny_model
    toks = document_tokens(lm, "The quick brown fox. " * 40)  # 840 tokens -> 3 chunks
    chunks = prefill_chunks(lm, toks)
    s = lm.kv_shape
    assert len(chunks) == 3
    assert all(c.shape == (s.num_layers, 2, s.num_kv_heads, lm.chunk_size, s.head_dim) for c in chunks)
    first = prefill_chunks(lm, toks, max_chunks=1)
    assert len(first) == 1
    # causal: chunk 0 does not depend on what follows it
    torch.testing.assert_close(first[0], chunks[0], rtol=1e-5, atol=1e-5)


def test_stored_chunks_give_the_logits_of_a_fresh_prefill(tiny_model):
    lm = tiny_model
    toks = document_tokens(lm, "def f(x):\n    return x * 2\n" * 30)
    chunks = prefill_chunks(lm, toks)
    n = len(chunks) * lm.chunk_size
    rest = toks[n : n + 20]
    reused = logits_with_chunks(lm, chunks, rest)  # (R, V)
    with torch.inference_mode():
        fresh = lm.model(input_ids=torch.tensor([toks[: n + len(rest)]])).logits[0, n:]
    torch.testing.assert_close(reused, fresh, rtol=1e-4, atol=1e-4)
    assert torch.equal(reused.argmax(-1), fresh.argmax(-1))


def test_long_document_stops_at_the_window(tiny_model):
    lm = tiny_model
    toks = [5] * (lm.max_positions + 3 * lm.chunk_size + 7)
    p = plan_chunks(len(toks), lm.chunk_size, lm.max_positions)
    assert p.n_chunks == lm.max_positions // lm.chunk_size
    assert p.beyond_window_tokens == 3 * lm.chunk_size + 7
