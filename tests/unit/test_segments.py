"""Segment keys and containers: position-free names, domain-separated from chain keys, verified."""

from __future__ import annotations

import pytest
import torch

from kdn.errors import ArtifactCorrupt, FingerprintMismatch, InvalidInput
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, chunk_keys
from kdn.artifact import encode_artifact
from kdn.segments import Segment, decode_segment, encode_segment, segment_key

FP = ModelFingerprint(bytes(range(32)))
FP2 = ModelFingerprint(bytes(range(1, 33)))
NS = Namespace("tenant-a")
TOKENS = list(range(10, 42))


def test_segment_key_names_content_model_and_namespace_only() -> None:
    k = segment_key(TOKENS, fingerprint=FP, namespace=NS)
    assert k == segment_key(list(TOKENS), fingerprint=FP, namespace=NS)  # seedless, deterministic
    assert len(k) == 32
    assert k != segment_key(TOKENS[:-1] + [99], fingerprint=FP, namespace=NS)
    assert k != segment_key(TOKENS, fingerprint=FP2, namespace=NS)
    assert k != segment_key(TOKENS, fingerprint=FP, namespace=Namespace("tenant-b"))
    assert k != segment_key(TOKENS, fingerprint=FP, namespace=Namespace("tenant-a", "salt"))


def test_segment_keys_never_equal_chain_keys_of_the_same_tokens() -> None:
    seg = segment_key(TOKENS, fingerprint=FP, namespace=NS)
    chain = chunk_keys(TOKENS, fingerprint=FP, namespace=NS, chunk_size=len(TOKENS))
    assert chain and seg != chain[0] and seg != ROOT_KEY


def test_segment_key_refuses_empty_and_bad_input() -> None:
    with pytest.raises(InvalidInput):
        segment_key([], fingerprint=FP, namespace=NS)
    with pytest.raises(InvalidInput):
        segment_key([-1, 2], fingerprint=FP, namespace=NS)
    with pytest.raises(InvalidInput):
        segment_key(TOKENS, fingerprint=ModelFingerprint(b"short"), namespace=NS)


def _segment(n: int = 8) -> Segment:
    toks = TOKENS[:n]
    kv = torch.randn(2, 2, 2, n, 4, generator=torch.Generator().manual_seed(0))  # (L, 2, H, n, D)
    return Segment(segment_key(toks, fingerprint=FP, namespace=NS), tuple(toks), kv)


def test_segment_container_round_trips_bit_exact() -> None:
    seg = _segment()
    back = decode_segment(encode_segment(seg, fingerprint=FP), seg.tokens, key=seg.key, fingerprint=FP)
    assert torch.equal(back.kv, seg.kv) and back.start == 0 and back.tokens == seg.tokens


def test_corrupt_wrong_model_wrong_length_and_chain_chunks_are_refused() -> None:
    seg = _segment()
    data = bytearray(encode_segment(seg, fingerprint=FP))
    data[len(data) // 2] ^= 0x01
    with pytest.raises(ArtifactCorrupt):
        decode_segment(bytes(data), seg.tokens, key=seg.key, fingerprint=FP)
    with pytest.raises(FingerprintMismatch):
        decode_segment(encode_segment(seg, fingerprint=FP2), seg.tokens, key=seg.key, fingerprint=FP)
    with pytest.raises(ArtifactCorrupt):
        decode_segment(encode_segment(seg, fingerprint=FP), seg.tokens[:-1], key=seg.key, fingerprint=FP)
    chain_chunk = encode_artifact(seg.kv, key=ChunkKey(seg.key), parent_key=ROOT_KEY, fingerprint=FP)
    with pytest.raises(ArtifactCorrupt, match="not a segment"):
        decode_segment(chain_chunk, seg.tokens, key=seg.key, fingerprint=FP)


def test_origin_ingests_a_segment_once_and_an_edge_store_serves_and_pins_it(tiny_model, tmp_path) -> None:
    from kdn.blend import prefill_document
    from kdn.edge.config import EdgeConfig
    from kdn.edge.store import MemoryTier, TieredStore
    from kdn.origin.segments import ingest_segments
    from kdn.origin.store import OriginStore
    from kdn.prefill import document_tokens

    text = "A policy manual paragraph that many prompts will quote, in any order."
    with OriginStore(tmp_path / "origin", fsync=False) as store:
        first = ingest_segments(tiny_model, store, [("manual", text)], namespace=NS)
        again = ingest_segments(tiny_model, store, [("manual", text)], namespace=NS)
        assert first[0].computed and not again[0].computed and first[0].key == again[0].key
        data = store.get(first[0].key, "raw", tenant=NS.tenant)
        assert store.document(NS.tenant, tiny_model.fingerprint, "manual#segment").keys == (first[0].key,)
    toks = document_tokens(tiny_model, text)
    seg = decode_segment(data, toks, key=first[0].key, fingerprint=tiny_model.fingerprint)
    kv, start = prefill_document(tiny_model.model, toks)
    assert torch.equal(seg.kv, kv) and seg.start == start == 1  # after the model's lead token
    edge = TieredStore([MemoryTier(len(data) * 4)], policy=EdgeConfig.default("policy"))
    edge.put(data, tenant=NS.tenant)
    assert edge.pin([ChunkKey(first[0].key)], tenant=NS.tenant) == 1
    assert edge.get(ChunkKey(first[0].key), tenant=NS.tenant)[0] == data
