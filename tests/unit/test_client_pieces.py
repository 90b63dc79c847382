"""Whole-document hits: a document's tail after its last full chunk is stored in pieces, reused by
a request that carries the whole document, bit-exactly, and only where the tokens are the same."""

from __future__ import annotations

import torch
import pytest

from kdn.client import ClientConfig, KdnClient
from kdn.testing import MemoryEdgeTransport
from kdn.integrations.transformers import generate
from kdn.keys import PIECE_TOKENS, ROOT_KEY, Namespace, chunk_keys, piece_keys
from kdn.models import load_model
from kdn.origin.config import OriginConfig
from kdn.origin.worker import DocumentTask, PrefillWorker

CHUNK = 128  # four pieces of 32 per chunk
DOC = [3 + 32 + (i * 7) % 90 for i in range(2 * CHUNK + 3 * PIECE_TOKENS + 5)]  # ASCII bytes: 2 chunks, 3 pieces, 5 more
QUESTION = [200, 201, 202, 203, 204, 205]


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", chunk_size=CHUNK)


def full_kv(lm, tokens):
    from transformers import DynamicCache

    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([tokens]), cache=DynamicCache(config=lm.config), use_cache=True)
    return torch.stack([torch.stack((l.keys[0], l.values[0])) for l in out.cache.layers])  # (L, 2, H, N, D)


def test_keys_of_pieces_are_exact_and_distinct_from_chunk_keys(lm) -> None:
    ns = Namespace("acme")
    keys = chunk_keys(DOC, fingerprint=lm.fingerprint, namespace=ns, chunk_size=CHUNK)
    pk = piece_keys(DOC[2 * CHUNK:], after=keys[-1], fingerprint=lm.fingerprint, namespace=ns, chunk_size=CHUNK)
    assert len(pk) == 3 and not set(pk) & set(keys)
    other = DOC[: 2 * CHUNK + PIECE_TOKENS] + [9] + DOC[2 * CHUNK + PIECE_TOKENS + 1:]  # piece 2 differs in one token
    pk2 = piece_keys(other[2 * CHUNK:], after=keys[-1], fingerprint=lm.fingerprint, namespace=ns, chunk_size=CHUNK)
    assert pk2[0] == pk[0] and pk2[1] != pk[1] and pk2[2] != pk[2]  # chained: a change carries forward
    assert piece_keys(DOC[2 * CHUNK:], after=ROOT_KEY, fingerprint=lm.fingerprint, namespace=ns, chunk_size=CHUNK)[0] != pk[0]
    assert piece_keys(DOC, after=ROOT_KEY, fingerprint=lm.fingerprint, namespace=ns, chunk_size=32) == []  # no pieces


def test_an_ingested_document_is_reused_whole_and_bit_exactly(lm, tmp_path) -> None:
    cfg = OriginConfig(store_dir=str(tmp_path / "origin"), models=["tiny"], codecs=["raw"], chunk_size=CHUNK,
                       fsync=False, verify_on_start="none")
    worker = PrefillWorker(cfg, lm=lm)
    res = worker.process(DocumentTask("d", bytes(t - 3 for t in DOC).decode("ascii"), "h", "acme").to_dict())
    worker.close()
    assert len(res["keys"]) == 2 and len(res["piece_keys"]) == 3
    # the origin's artifacts, served by an in-memory edge
    from kdn.origin.store import OriginStore

    store = OriginStore(cfg.store_path, verify="none")
    edge = MemoryEdgeTransport()
    for k in (*res["keys"], *res["piece_keys"]):
        edge.store[("acme", bytes.fromhex(k))] = store.get(bytes.fromhex(k), "raw", tenant="acme")
    store.close()
    tokens = lm.tokenizer.encode(bytes(t - 3 for t in DOC).decode("ascii")) + QUESTION
    with KdnClient(ClientConfig(edge="mem", tenant="acme", write_back=False), transport=edge) as client:
        r = client.reuse(tokens, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK,
                         max_tokens=len(tokens) - 1)
        assert (r.chunks, r.pieces, r.tokens) == (2, 3, 2 * CHUNK + 3 * PIECE_TOKENS) and r.warning is None
        assert torch.equal(r.kv, full_kv(lm, tokens[: r.tokens]))  # every bit of what the origin computed
        base = generate(lm, tokens, max_new_tokens=6)
        hit = generate(lm, tokens, client=client, max_new_tokens=6)
    assert hit.tokens == base.tokens and hit.reused_tokens == r.tokens
    assert hit.computed_tokens == 5 + len(QUESTION)  # the loose tail tokens and the question


def test_a_request_whose_tail_differs_reuses_only_the_pieces_before_the_difference(lm) -> None:
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem", tenant="acme")
    with KdnClient(cfg, transport=edge) as client:
        first = generate(lm, DOC + QUESTION, client=client, max_new_tokens=2)  # computes, writes chunks and pieces back
        client.flush(10)
        assert client.counters["written_back"] == 2 and client.counters["written_back_pieces"] == 3
        again = generate(lm, DOC + QUESTION, client=client, max_new_tokens=2)
        assert again.reused_tokens == 2 * CHUNK + 3 * PIECE_TOKENS and again.tokens == first.tokens
        changed = DOC[: 2 * CHUNK + PIECE_TOKENS + 3] + [7] + DOC[2 * CHUNK + PIECE_TOKENS + 4:] + QUESTION
        r = generate(lm, changed, client=client, max_new_tokens=2, write_back=False)
        assert r.reused_tokens == 2 * CHUNK + PIECE_TOKENS  # piece 2 holds the changed token: neither it nor piece 3
        assert r.tokens == generate(lm, changed, max_new_tokens=2).tokens
