"""Adversarial probes of the inference client: whatever the edge does, the caller gets the plain
prefill's tokens, one warning and a counter, never an exception and never wrong KV.

Each probe publishes a document through a real write-back, breaks the edge one way (the in-memory
transport plus a few faults it lacks), and compares ``generate`` with a plain recompute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
import torch

from kdn.client import AsyncKdnClient, ClientConfig, KdnClient
from kdn.errors import ConfigError, InvalidInput, Unavailable
from kdn.integrations.transformers import generate
from kdn.models import load_model
from kdn.prefill import prefill_chunks
from kdn.testing import MemoryEdgeTransport, reseal
from kdn.transport import FailoverEdgeTransport

CHUNK = 32
DOC = [3 + (i * 7) % 90 for i in range(5 * CHUNK)]  # 5 full chunks
PROMPT = DOC + [100, 101, 102, 103]
NEW = 6


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", chunk_size=CHUNK)


@pytest.fixture(scope="module")
def plain(lm):
    return generate(lm, PROMPT, max_new_tokens=NEW, eos_token_id=-1).tokens


class Faulty(MemoryEdgeTransport):
    """The in-memory edge plus faults it lacks: a Lookup that claims ``claim`` chunks, Fetches of
    some keys that hang, fail mid-stream or raise a non-KdnError, and an edge that dies right
    after answering a Lookup."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.claim: Any = None
        self.hang_lookup = False
        self.die_after_lookup = False
        self.faults: dict[bytes, str] = {}

    async def lookup(self, fingerprint, namespace, keys, *, timeout, probe=False):
        if self.hang_lookup:
            await asyncio.Event().wait()  # ignores its deadline
        n = await super().lookup(fingerprint, namespace, keys, timeout=timeout, probe=probe)
        if self.die_after_lookup:
            self.down = True
        return n if self.claim is None or probe else self.claim

    async def fetch(self, spec, *, timeout, next_keys=()):
        fault = self.faults.get(bytes(spec.key))
        if fault == "hang":
            await asyncio.Event().wait()
        if fault == "bug":
            raise RuntimeError("transport bug")
        sent = 0
        async for piece in super().fetch(spec, timeout=timeout, next_keys=next_keys):
            if fault == "cut" and sent:
                raise Unavailable("edge killed mid-stream")
            sent += 1
            yield piece


def cached_edge(lm, cfg: ClientConfig, **kw: Any) -> tuple[Faulty, list]:
    """An edge holding DOC's 5 chunks (written back by a real request) and their keys."""
    edge = Faulty(piece=512, **kw)
    with KdnClient(cfg, transport=edge) as client:
        generate(lm, DOC, client=client, max_new_tokens=1)
        client.flush(10)
        keys = client.keys_for(DOC, lm.fingerprint, CHUNK)
    assert all((cfg.namespace.tenant, bytes(k)) in edge.store for k in keys)
    edge.calls.update(lookup=0, fetch=0, put=0)
    return edge, keys


@pytest.fixture(scope="module")
def doc_kv(lm):
    """(L, 2, H, 5*CHUNK, D): the KV a prefill of DOC produced (what the edge was given)."""
    return torch.cat(prefill_chunks(lm, DOC), dim=3)


def run_generate(lm, cfg: ClientConfig, transport, caplog, doc_kv) -> tuple[Any, dict[str, float], list[str]]:
    """``generate`` of PROMPT through ``transport``; the KV it reused must be the prefill's, bit for bit
    (the tiny model's greedy tokens alone barely depend on the context)."""
    caplog.clear()
    seen = []
    with caplog.at_level(logging.WARNING, logger="kdn.client"), KdnClient(cfg, transport=transport) as client:
        reuse, settle = client.reuse, client.settle
        client.reuse = lambda *a, **kw: seen.append(reuse(*a, **kw)) or seen[-1]  # type: ignore[method-assign]
        client.settle = lambda r: seen.append(settle(r)) or seen[-1]  # type: ignore[method-assign]
        got = generate(lm, PROMPT, client=client, max_new_tokens=NEW, eos_token_id=-1, write_back=False)
        counters = dict(client.counters)
    # a layered fetch is settled once (kdn.layered): what it gave is the settled Reuse
    assert len(seen) == (2 if seen[0].gate is not None else 1) and seen[-1].gate is None
    if seen[0].tokens and cfg.layered is not None:  # a fetch was started: layered exactly when asked
        assert (seen[0].gate is not None) == cfg.layered
    r = seen[-1]
    assert r.tokens == got.reused_tokens and 0 <= r.chunks <= r.available <= len(r.keys) and r.pieces >= 0
    assert (r.kv is None) == (r.tokens == 0)
    if r.kv is not None:
        assert r.kv.shape[3] == r.tokens and torch.equal(r.kv, doc_kv[:, :, :, : r.tokens])
    return got, counters, [rec.getMessage() for rec in caplog.records if rec.name == "kdn.client"]


def _resealed(blob: bytes, **fields: Any) -> bytes:
    def edit(h: Any) -> None:
        for k, v in fields.items():
            setattr(h, k, v)

    return reseal(blob, header=edit)


# fault -> (break the edge, chunks still reused, counter that must move)
def _break(fault: str, lm, edge: Faulty, keys: list, cfg: ClientConfig) -> None:
    t, k2 = cfg.namespace.tenant, bytes(keys[2])
    if fault == "truncated":
        edge.store[(t, k2)] = edge.store[(t, k2)][: len(edge.store[(t, k2)]) // 2]
    elif fault == "truncated-by-one":
        edge.store[(t, k2)] = edge.store[(t, k2)][:-1]
    elif fault == "trailing-bytes":
        edge.store[(t, k2)] = edge.store[(t, k2)] + b"\0" * 16
    elif fault == "bit-flipped":
        edge.corrupt.add(k2)
    elif fault == "another-model":
        edge.store[(t, k2)] = _resealed(edge.store[(t, k2)], fingerprint=bytes(32))
    elif fault == "another-chunk":  # chunk 3's bytes served under chunk 2's key
        edge.store[(t, k2)] = edge.store[(t, bytes(keys[3]))]
    elif fault == "another-tenant":  # bob's chunk 2 under alice's key: a sealed, valid artifact of bob's
        bob = ClientConfig(edge="mem", tenant="bob")
        other, bob_keys = cached_edge(lm, bob)
        edge.store[(t, k2)] = other.store[("bob", bytes(bob_keys[2]))]
    elif fault == "steered-on-plain":
        edge.store[(t, k2)] = _resealed(edge.store[(t, k2)], steer='{"kind":"x"}')
    elif fault == "over-claimed":  # Lookup says 5, the edge then has only 2
        for k in keys[2:]:
            del edge.store[(t, bytes(k))]
        edge.claim = 5
    elif fault == "cut-mid-stream":
        edge.faults[k2] = "cut"
    elif fault == "transport-bug":
        edge.faults[k2] = "bug"
    elif fault == "hangs-past-deadline":
        edge.faults[k2] = "hang"
    else:
        raise AssertionError(fault)


CHUNK_FAULTS = ["truncated", "truncated-by-one", "trailing-bytes", "bit-flipped", "another-model", "another-chunk",
                "another-tenant", "steered-on-plain", "over-claimed", "cut-mid-stream", "transport-bug",
                "hangs-past-deadline"]


@pytest.mark.parametrize("layered", [False, True], ids=["fetched-whole", "layered"])
@pytest.mark.parametrize("fault", CHUNK_FAULTS)
def test_a_fault_at_chunk_2_reuses_chunks_0_1_and_answers_as_plain_prefill(lm, plain, doc_kv, fault, layered, caplog):
    cfg = ClientConfig(edge="mem", tenant="alice", fetch_timeout_s=0.3, lookup_timeout_s=0.3, layered=layered)
    edge, keys = cached_edge(lm, cfg)
    _break(fault, lm, edge, keys, cfg)
    t0 = time.perf_counter()
    got, counters, logged = run_generate(lm, cfg, edge, caplog, doc_kv)
    assert time.perf_counter() - t0 < 5
    assert got.tokens == plain
    assert got.reused_tokens == 2 * CHUNK  # recompute from the first chunk that failed
    assert len(got.warnings) == 1 and logged == list(got.warnings)
    assert counters["fetch_errors"] == 1 and counters["reused_chunks"] == 2


@pytest.mark.parametrize("fault", ["down", "lookup-hangs", "lookup-negative", "lookup-not-an-int",
                                   "every-edge-down", "dies-after-lookup-fallback-has-2"])
def test_an_edge_fault_before_any_chunk_answers_as_plain_prefill(lm, plain, doc_kv, fault, caplog):
    cfg = ClientConfig(edge="mem", tenant="alice", fetch_timeout_s=0.3, lookup_timeout_s=0.3, edge_backoff_s=60)
    edge, keys = cached_edge(lm, cfg)
    transport: Any = edge
    reused, counter = 0, "edge_errors"
    if fault == "down":
        edge.down = True
    elif fault == "lookup-hangs":
        edge.hang_lookup = True
    elif fault == "lookup-negative":
        edge.claim = -1
    elif fault == "lookup-not-an-int":
        edge.claim = "2"  # a transport bug: not a count at all
    elif fault == "every-edge-down":
        other, _ = cached_edge(lm, cfg)
        edge.down = other.down = True
        transport = FailoverEdgeTransport([edge, other], backoff_s=60)
    elif fault == "dies-after-lookup-fallback-has-2":
        other, _ = cached_edge(lm, cfg)
        for k in keys[2:]:
            del other.store[("alice", bytes(k))]
        edge.die_after_lookup = True
        transport = FailoverEdgeTransport([edge, other], backoff_s=60)
        reused, counter = 2 * CHUNK, "fetch_errors"
    t0 = time.perf_counter()
    got, counters, logged = run_generate(lm, cfg, transport, caplog, doc_kv)
    assert time.perf_counter() - t0 < 5
    assert got.tokens == plain and got.reused_tokens == reused
    assert len(got.warnings) == 1 and logged == list(got.warnings)
    assert counters[counter] == 1


def test_a_lookup_that_claims_more_chunks_than_were_asked_is_held_to_the_chain(lm, plain, caplog):
    cfg = ClientConfig(edge="mem", tenant="alice")
    edge, keys = cached_edge(lm, cfg)
    edge.claim = 1000
    with KdnClient(cfg, transport=edge) as client:
        r = client.reuse(PROMPT, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK,
                         max_tokens=len(PROMPT) - 1)
        assert r.available <= len(r.keys) and r.chunks == 5 and r.tokens == 5 * CHUNK
        got = generate(lm, PROMPT, client=client, max_new_tokens=NEW, eos_token_id=-1)
        client.flush(10)
    assert got.tokens == plain and got.reused_tokens == 5 * CHUNK


def test_failover_mid_stream_keeps_the_verified_prefix(lm, plain, doc_kv, caplog):
    cfg = ClientConfig(edge="mem", tenant="alice", edge_backoff_s=60)
    local, keys = cached_edge(lm, cfg)
    other, _ = cached_edge(lm, cfg)
    local.faults[bytes(keys[3])] = "cut"  # dies while chunk 3 streams: not restarted on the other edge
    got, counters, logged = run_generate(lm, cfg, FailoverEdgeTransport([local, other], backoff_s=60), caplog, doc_kv)
    assert got.tokens == plain and got.reused_tokens == 3 * CHUNK
    assert len(got.warnings) == 1 and counters["fetch_errors"] == 1


def test_a_broken_chunk_is_healed_by_the_write_back_of_the_recompute(lm, plain):
    cfg = ClientConfig(edge="mem", tenant="alice")
    edge, keys = cached_edge(lm, cfg)
    edge.store[("alice", bytes(keys[2]))] = edge.store[("alice", bytes(keys[2]))][:100]
    with KdnClient(cfg, transport=edge) as client:
        first = generate(lm, PROMPT, client=client, max_new_tokens=NEW, eos_token_id=-1)
        client.flush(10)
        second = generate(lm, PROMPT, client=client, max_new_tokens=NEW, eos_token_id=-1)
    assert first.tokens == second.tokens == plain
    assert (first.reused_tokens, second.reused_tokens) == (2 * CHUNK, 5 * CHUNK) and not second.warnings


def test_a_tail_piece_fault_keeps_the_chunks(caplog):
    lm = load_model("tiny", chunk_size=128)
    doc = [3 + (i * 5) % 90 for i in range(128 + 3 * 32)]  # one chunk, three pieces
    prompt = doc + [100, 101]
    base = generate(lm, prompt, max_new_tokens=NEW, eos_token_id=-1).tokens
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem")
    with KdnClient(cfg, transport=edge) as client:
        generate(lm, doc + [7], client=client, max_new_tokens=1)
        client.flush(10)
        assert client.counters["written_back_pieces"] == 3
    piece_keys = [k for (_, k) in edge.store if k not in {bytes(x) for x in client.keys_for(doc, lm.fingerprint, 128)}]
    edge.corrupt.update(piece_keys)
    with KdnClient(cfg, transport=edge) as client:
        got = generate(lm, prompt, client=client, max_new_tokens=NEW, eos_token_id=-1, write_back=False)
        assert client.counters["fetch_errors"] == 1
    assert got.tokens == base and got.reused_tokens == 128 and len(got.warnings) == 1


@pytest.mark.parametrize("bad", [
    {"lookup_timeout_s": -1}, {"fetch_timeout_s": 0}, {"put_timeout_s": -0.5}, {"edge_backoff_s": -1},
    {"fetch_concurrency": 0}, {"max_pending_puts": 0},
    {"fetch_timeout_s": float("inf")}, {"lookup_timeout_s": float("nan")}, {"put_timeout_s": 1e10},
    {"edge_backoff_s": float("inf")},
    {"fallback_edges": ["127.0.0.1:2"]},  # fallback edges but no edge: silently never reused
    {"edge": ""},  # an empty address is not "no edge" (that is None)
    {"edge": "127.0.0.1:1", "fallback_edges": [""]},
    {"codec": "no-such-codec"}, {"put_codec": "no-such-codec"}, {"put_codec": ""}, {"codec": "zstd:many"},
    {"codec": "int8"},  # lossy, while lossless is required: every fetch would be refused
    {"put_codec": "int8"},  # lossy, while lossless is required: what is written back is never reused
])
def test_bad_config_values_are_one_clear_error_at_construction(bad):
    with pytest.raises(ConfigError) as info:
        ClientConfig.build(bad)
    assert next(iter(bad)) in str(info.value)


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000", ":50051"])
@pytest.mark.parametrize("where", ["edge", "fallback"])
def test_a_malformed_edge_address_is_refused_when_the_client_is_built(address, where):
    cfg = ClientConfig(edge=address) if where == "edge" else ClientConfig(edge="127.0.0.1:1", fallback_edges=[address])
    with pytest.raises(ConfigError, match="host:port"):
        KdnClient(cfg).close()


def test_well_formed_settings_still_build_a_client():
    for address in ("127.0.0.1:50051", "[::1]:50051", "edge-0.kdn.svc:7000", "unix:/tmp/kdn.sock"):
        KdnClient(ClientConfig(edge=address, fallback_edges=["127.0.0.1:2"])).close()
    ClientConfig(codec="zstd:3", put_codec="lz4")
    ClientConfig(codec="int8", put_codec="int8", require_lossless=False)
    KdnClient(ClientConfig()).close()  # no edge: recompute only


def test_chunk_size_zero_is_a_clear_error():
    with pytest.raises(InvalidInput, match="chunk_size"):
        asyncio.run(_reuse_with(chunk_size=0))


async def _reuse_with(**kw: Any) -> Any:
    from kdn.testing import DEFAULT_FP

    async with AsyncKdnClient(ClientConfig(edge="mem"), transport=MemoryEdgeTransport()) as client:
        from kdn.kv import KVShape

        return await client.reuse([1, 2, 3], fingerprint=DEFAULT_FP, kv_shape=KVShape(2, 2, 8, torch.float16), **kw)
