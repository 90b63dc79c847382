"""KDN's transformers paths under the transformers release vLLM pins (< 5.20 for vLLM 0.32).

That release names a model's KV-cache argument ``past_key_values`` where later ones say ``cache``,
and a model swallows the other name in ``**kwargs``: a cache passed under the wrong name is
ignored without an error, and the "reused" logits are those of the question alone. These checks
run in the vLLM venv (and the main one, under ``-m vllm``), where stored-and-reused KV must still
give the logits and the tokens of a full prefill.
"""

from __future__ import annotations

import pytest
import torch

from kdn.integrations.transformers import generate, prepare
from kdn.kv import forward, output_cache, split_cache
from kdn.prefill import logits_with_chunks

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def lm():
    from kdn.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def km(lm):
    return prepare(lm)


def test_reused_chunks_give_the_logits_of_a_full_prefill(lm) -> None:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(100, 40000, (2 * lm.chunk_size + 40,), generator=g).tolist()
    with torch.inference_mode():
        full = forward(lm.model, input_ids=torch.tensor([tokens]), use_cache=True)
    chunks = split_cache(output_cache(full), lm.chunk_size)
    assert len(chunks) == 2
    reused = logits_with_chunks(lm, chunks, tokens[2 * lm.chunk_size:])
    want = full.logits[0, 2 * lm.chunk_size:]
    # Reused KV is the full prefill's own KV, so only fp32 summation order may differ: the CPU's
    # matmul and attention kernels block by shape (40 query rows here, 552 in the full pass), and
    # 30 layers amplify that rounding to a few 1e-3 on some CPUs (0 on others). A swallowed cache
    # is off by whole logits and whole nats.
    assert (reused - want).abs().max() < 0.05
    assert _kl(want, reused).max() < 1e-3
    # the question alone (what a swallowed cache argument computes) is far from it
    with torch.inference_mode():
        alone = lm.model(input_ids=torch.tensor([tokens[2 * lm.chunk_size:]])).logits[0]
    assert (alone - want).abs().max() > 1.0
    assert _kl(want, alone).max() > 0.1


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in nats."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def test_generate_after_a_written_back_prefix_is_the_full_prefill_answer(km) -> None:
    from kdn.client import ClientConfig, KdnClient
    from kdn.testing import MemoryEdgeTransport

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(100, 40000, (3 * km.chunk_size + 50,), generator=g).tolist()
    plain = generate(km, tokens, max_new_tokens=8)
    with KdnClient(ClientConfig(edge="mem"), transport=MemoryEdgeTransport()) as client:
        first = generate(km, tokens, client=client, max_new_tokens=8)  # computes, writes its chunks back
        client.flush(10)
        hit = generate(km, tokens, client=client, max_new_tokens=8)
    assert hit.reused_tokens >= 3 * km.chunk_size
    assert first.tokens == plain.tokens == hit.tokens
