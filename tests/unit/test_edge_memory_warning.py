"""An edge whose memory tier is too small for the model it serves says so, once per model."""

from __future__ import annotations

import asyncio
import logging

from kdn.testing import InProcessEdge, make_chain


def _put_all(edge: InProcessEdge, chain) -> None:
    async def main() -> None:
        for key, blob in zip(chain.keys, chain.blobs):
            await edge.node.put(blob, namespace=chain.namespace, fingerprint=chain.fingerprint, key=key)

    asyncio.run(main())


def test_a_memory_tier_holding_few_documents_of_a_model_warns_once(caplog) -> None:
    # (L, H, T, D) = (30, 3, 8, 64) in fp16: 23 KB of KV per token, SmolLM2-135M's shape
    chain = make_chain(3, shape=(30, 3, 8, 64))
    edge = InProcessEdge(memory_bytes=64 << 20)
    with caplog.at_level(logging.WARNING, logger="kdn.edge.sources"):
        _put_all(edge, chain)
    warned = [r.getMessage() for r in caplog.records if "memory tier" in r.getMessage()]
    assert len(warned) == 1, warned  # once for the model, not per artifact
    assert "about 2912 tokens" in warned[0] and "fewer than 4 documents of 8192 tokens" in warned[0]


def test_a_memory_tier_large_enough_says_nothing(caplog) -> None:
    chain = make_chain(2, shape=(2, 2, 8, 8))  # 128 bytes per token: 1 GiB holds millions of tokens
    edge = InProcessEdge(memory_bytes=1 << 30)
    with caplog.at_level(logging.WARNING, logger="kdn.edge.sources"):
        _put_all(edge, chain)
    assert not [r for r in caplog.records if "memory tier" in r.getMessage()]
