"""kdn.client against the in-memory edge transport: reuse, pipelined fetch, fallback, write-back."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest
import torch

from kdn.artifact import encode_artifact
from kdn.client import AsyncKdnClient, ClientConfig, KdnClient
from kdn.testing import MemoryEdgeTransport
from kdn.errors import ConfigError
from kdn.keys import ROOT_KEY, ChunkKey, Namespace, chunk_keys
from kdn.kv import split_cache
from kdn.models import load_model

CHUNK = 32


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", chunk_size=CHUNK)


def prefill_kv(lm, tokens):
    """(L, 2, H, N, D) KV of a plain prefill, and its full chunks."""
    from transformers import DynamicCache

    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([tokens]), cache=DynamicCache(config=lm.config), use_cache=True)
    return split_cache(out.cache, CHUNK)


def publish(edge: MemoryEdgeTransport, lm, tokens, namespace: Namespace, codec: str = "raw", fingerprint=None):
    """Do what the origin does: prefill, cut into chunks, encode, store under the chained keys."""
    keys = chunk_keys(tokens, fingerprint=lm.fingerprint, namespace=namespace, chunk_size=CHUNK)
    chunks = prefill_kv(lm, tokens)
    for i, (key, kv) in enumerate(zip(keys, chunks)):
        data = encode_artifact(kv, key=key, parent_key=keys[i - 1] if i else ROOT_KEY,
                               fingerprint=fingerprint or lm.fingerprint, codec=codec, chunk_index=i)
        edge.store[(namespace.tenant, bytes(key))] = data
    return keys, chunks


DOC = list(range(3, 3 + 5 * CHUNK))  # 5 full chunks


def test_reuse_fetches_the_longest_available_prefix_bit_exactly(lm):
    edge = MemoryEdgeTransport(piece=4096)  # many pieces per container: sections complete mid-stream
    cfg = ClientConfig(edge="mem", tenant="acme")
    keys, chunks = publish(edge, lm, DOC[: 3 * CHUNK], cfg.namespace)
    with KdnClient(cfg, transport=edge) as client:
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
    assert (r.available, r.chunks, r.tokens) == (3, 3, 3 * CHUNK)
    assert r.warning is None and r.via == "memory" and r.bytes == sum(len(v) for v in edge.store.values())
    assert torch.equal(r.kv, torch.cat(chunks, dim=3))  # (L, 2, H, 3*T, D), every bit
    assert len(r.keys) == 5 and list(r.keys[:3]) == keys


def test_max_tokens_cuts_inside_a_chunk(lm):
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem")
    _, chunks = publish(edge, lm, DOC[: 2 * CHUNK], cfg.namespace)
    with KdnClient(cfg, transport=edge) as client:
        r = client.reuse(DOC[: 2 * CHUNK], fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK,
                         max_tokens=2 * CHUNK - 1)
    assert r.tokens == 2 * CHUNK - 1 and r.chunks == 2
    assert torch.equal(r.kv, torch.cat(chunks, dim=3)[:, :, :, : 2 * CHUNK - 1])


def test_a_corrupt_middle_chunk_keeps_the_verified_prefix_and_warns_once(lm, caplog):
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem")
    keys, chunks = publish(edge, lm, DOC, cfg.namespace)
    edge.corrupt.add(bytes(keys[2]))
    with caplog.at_level(logging.WARNING, logger="kdn.client"), KdnClient(cfg, transport=edge) as client:
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
    assert r.chunks == 2 and r.tokens == 2 * CHUNK and r.available == 5
    assert torch.equal(r.kv, torch.cat(chunks[:2], dim=3))
    assert "ArtifactCorrupt" in r.warning and "chunk 2" in r.warning
    assert len([rec for rec in caplog.records if rec.name == "kdn.client"]) == 1


@pytest.mark.parametrize("fault", ["down", "slow", "foreign-fingerprint", "lossy", "wrong-geometry"])
def test_faults_fall_back_to_recompute_with_one_warning(lm, fault, caplog):
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem", lookup_timeout_s=0.2, fetch_timeout_s=0.2)
    if fault == "foreign-fingerprint":
        publish(edge, lm, DOC, cfg.namespace, fingerprint=bytes(32))  # right keys, another model's artifacts
    elif fault == "lossy":
        publish(edge, lm, DOC, cfg.namespace, codec="int8")
    elif fault == "wrong-geometry":
        other = load_model("tiny-mha", chunk_size=CHUNK)
        keys = chunk_keys(DOC, fingerprint=lm.fingerprint, namespace=cfg.namespace, chunk_size=CHUNK)
        for i, kv in enumerate(prefill_kv(other, DOC)):
            edge.store[(cfg.namespace.tenant, bytes(keys[i]))] = encode_artifact(
                kv, key=keys[i], parent_key=keys[i - 1] if i else ROOT_KEY, fingerprint=lm.fingerprint)
    else:
        publish(edge, lm, DOC, cfg.namespace)
        edge.down = fault == "down"
        edge.delay_s = 1.0 if fault == "slow" else 0.0
    with caplog.at_level(logging.WARNING, logger="kdn.client"), KdnClient(cfg, transport=edge) as client:
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
    assert r.kv is None and r.tokens == 0 and r.warning
    expected = {"down": "Unavailable", "slow": "Unavailable", "foreign-fingerprint": "FingerprintMismatch",
                "lossy": "LossyRefused", "wrong-geometry": "FingerprintMismatch"}[fault]
    assert expected in r.warning
    assert len([rec for rec in caplog.records if rec.name == "kdn.client"]) == 1


def test_lossy_artifacts_are_used_when_allowed(lm):
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem", require_lossless=False)
    _, chunks = publish(edge, lm, DOC, cfg.namespace, codec="int8")
    with KdnClient(cfg, transport=edge) as client:
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
    assert r.chunks == 5 and r.warning is None
    exact = torch.cat(chunks, dim=3)
    assert not torch.equal(r.kv, exact) and torch.allclose(r.kv, exact, atol=0.1 * exact.abs().max().item())


class _Recording(MemoryEdgeTransport):
    asked: list[bytes]

    async def lookup(self, fingerprint, namespace, keys, *, timeout):
        self.asked.extend(bytes(k) for k in keys)
        return await super().lookup(fingerprint, namespace, keys, timeout=timeout)


def test_a_second_tenant_never_names_or_reuses_the_first_tenants_chunks(lm):
    edge = _Recording()
    edge.asked = []
    a, b = ClientConfig(edge="mem", tenant="alice"), ClientConfig(edge="mem", tenant="bob")
    keys_a, _ = publish(edge, lm, DOC, a.namespace)
    # an edge that ignored tenants would still not help bob: his keys are other keys
    for (tenant, key), data in list(edge.store.items()):
        edge.store[("bob", key)] = data
    with KdnClient(b, transport=edge) as client:
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
    assert r.tokens == 0 and r.warning is None
    assert not set(edge.asked) & {bytes(k) for k in keys_a}


def test_write_back_stores_new_full_chunks_that_the_next_request_reuses(lm):
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem", put_codec="lz4")
    _, chunks = publish(edge, lm, DOC[: 2 * CHUNK], cfg.namespace)
    from transformers import DynamicCache

    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([DOC]), cache=DynamicCache(config=lm.config), use_cache=True)
    layers = [(l.keys, l.values) for l in out.cache.layers]
    with KdnClient(cfg, transport=edge) as client:
        keys = client.keys_for(DOC, lm.fingerprint, CHUNK)
        assert client.schedule_write_back(layers, keys, fingerprint=lm.fingerprint, chunk_size=CHUNK, start=2)
        client.flush(10)
        assert edge.calls["put"] == 3 and client.counters["written_back"] == 3
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
    assert r.chunks == 5
    assert torch.equal(r.kv[:, :, :, : 2 * CHUNK], torch.cat(chunks[:2], dim=3))


def test_write_back_to_a_dead_edge_is_quiet_and_bounded(lm):
    edge = MemoryEdgeTransport(down=True)
    cfg = ClientConfig(edge="mem")
    layers = [(torch.zeros(1, lm.kv_shape.num_kv_heads, 2 * CHUNK, lm.kv_shape.head_dim),) * 2
              for _ in range(lm.kv_shape.num_layers)]
    with KdnClient(cfg, transport=edge) as client:
        keys = client.keys_for(DOC[: 2 * CHUNK], lm.fingerprint, CHUNK)
        assert client.write_back(layers, keys, fingerprint=lm.fingerprint, chunk_size=CHUNK, start=0) == 0
        assert edge.calls["put"] == 1  # gave up after the first failure
        assert client.counters["write_back_errors"] == 1


def test_no_edge_configured_means_plain_recompute(lm):
    with KdnClient(ClientConfig()) as client:
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
    assert r.kv is None and r.warning is None and not r.edge_usable


def test_async_client_directly(lm):
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem", fetch_concurrency=2)
    _, chunks = publish(edge, lm, DOC, cfg.namespace)

    async def go():
        async with AsyncKdnClient(cfg, transport=edge) as client:
            return await client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)

    r = asyncio.run(go())
    assert torch.equal(r.kv, torch.cat(chunks, dim=3))


def test_config_validation():
    with pytest.raises(ConfigError):
        ClientConfig.build({"tenant": "no spaces allowed"})
    with pytest.raises(ConfigError):
        ClientConfig.build({"fetch_concurrency": 0})
    with pytest.raises(ConfigError):
        ClientConfig.build({"unknown_field": 1})
    assert ClientConfig(edge="127.0.0.1:1").use_shm() and not ClientConfig(edge="10.0.0.2:1").use_shm()
    assert not ClientConfig(edge="127.0.0.1:1", shm="off").use_shm()


def test_failover_moves_to_the_next_edge_and_back(lm):
    from kdn.transport import FailoverEdgeTransport

    local, other = MemoryEdgeTransport(name="local"), MemoryEdgeTransport(name="other")
    cfg = ClientConfig(edge="mem", tenant="acme")
    _, chunks = publish(local, lm, DOC[: 3 * CHUNK], cfg.namespace)
    publish(other, lm, DOC[: 3 * CHUNK], cfg.namespace)
    both = FailoverEdgeTransport([local, other], backoff_s=3600)
    with KdnClient(cfg, transport=both) as client:
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert r.chunks == 3 and r.via == "memory" and other.calls["lookup"] == 0  # local edge first
        local.down = True  # the local edge dies: the same request is answered by the next edge
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert r.warning is None and r.chunks == 3 and torch.equal(r.kv, torch.cat(chunks, dim=3))
        assert other.calls["fetch"] == 3 and both.failovers == 1
        before = local.calls["lookup"]
        client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert local.calls["lookup"] == before  # still sitting out its backoff: not asked again
        local.down = other.down = True  # nobody answers: the cache failed, the caller recomputes
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert r.chunks == 0 and r.warning


def test_failover_does_not_hide_answers_of_a_live_edge(lm):
    from kdn.transport import FailoverEdgeTransport

    local, other = MemoryEdgeTransport(name="local"), MemoryEdgeTransport(name="other")
    cfg = ClientConfig(edge="mem")
    publish(other, lm, DOC[: 2 * CHUNK], cfg.namespace)  # only the second edge holds the chunks
    with KdnClient(cfg, transport=FailoverEdgeTransport([local, other])) as client:
        r = client.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
    assert r.chunks == 0 and other.calls["lookup"] == 0  # "0 available" is an answer, not an outage


@pytest.mark.parametrize("shape", [(2, 2, 4, 8, 16), (12, 2, 4, 4096, 64)])  # below and above the prefault size
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefix_destination_is_a_writable_tensor_that_outlives_its_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from kdn.kv import empty_prefaulted

    out = empty_prefaulted(shape, dtype)
    assert tuple(out.shape) == shape and out.dtype == dtype and out.is_contiguous()
    view = out[:, 1, :, -3:]  # what the client decodes into and the cache keeps
    del out
    gc.collect()
    view.fill_(2.5)
    assert float(view.float().sum()) == 2.5 * view.numel()


def test_failover_fetch_into_restarts_only_before_the_first_byte(lm):
    """An edge that fails before sending anything is replaced by the next; one that fails after
    part of the container reached the reader is not (the reader cannot start over)."""
    import asyncio

    from kdn.artifact import ArtifactReader
    from kdn.transport import FailoverEdgeTransport
    from kdn.errors import Unavailable
    from kdn.wire.convert import FetchSpec

    class HalfEdge(MemoryEdgeTransport):
        async def fetch(self, spec, *, timeout, next_keys=()):  # noqa: ANN001
            async for piece in MemoryEdgeTransport.fetch(self, spec, timeout=timeout, next_keys=next_keys):
                yield piece
                raise Unavailable("connection lost mid-answer")

    cfg = ClientConfig(edge="mem")
    good, half, down = MemoryEdgeTransport(name="good", piece=64), HalfEdge(name="half", piece=64), \
        MemoryEdgeTransport(name="down", down=True)
    _, chunks = publish(good, lm, DOC[:CHUNK], cfg.namespace)
    half.store = dict(good.store)
    key = next(iter(good.store))[1]
    spec = FetchSpec(ChunkKey(key), lm.fingerprint, cfg.namespace)

    async def main() -> None:
        r = ArtifactReader(expect_fingerprint=lm.fingerprint, assemble=True)
        stats = await FailoverEdgeTransport([down, good]).fetch_into(spec, r, timeout=5)
        r.finish()
        assert stats.via == "memory" and stats.bytes == r.received and torch.equal(r.kv, chunks[0])
        r = ArtifactReader(expect_fingerprint=lm.fingerprint, assemble=True)
        both = FailoverEdgeTransport([half, good])
        with pytest.raises(Unavailable, match="mid-answer"):
            await both.fetch_into(spec, r, timeout=5)
        assert 0 < r.received and good.calls["fetch"] == 1 and both.failovers == 1

    asyncio.run(main())


def test_destination_pool_reuses_a_buffer_only_once_nothing_refers_to_it() -> None:
    """A prefix destination is handed out again only when every tensor, view and storage made from
    it is gone (a reused buffer under a live cache would corrupt that cache); idle ones are bounded."""
    from kdn.kv import PREFAULT_MIN_BYTES, DestinationPool

    shape = (2, 2, 4, PREFAULT_MIN_BYTES // 64, 4)  # fp16: 2 * PREFAULT_MIN_BYTES bytes
    pool = DestinationPool(max_idle_bytes=4 * PREFAULT_MIN_BYTES)
    a = pool.empty(shape, torch.float16)
    a.fill_(1.5)
    cache_view = a[:, 1, :, -3:]  # what a cache keeps after the request returns
    del a
    b = pool.empty(shape, torch.float16)
    assert pool.mapped == 2 and pool.reused == 0  # a's pages are still in use through its view
    b.fill_(2.5)
    assert bool((cache_view == 1.5).all())
    storage = cache_view.untyped_storage()
    del cache_view
    c = pool.empty(shape, torch.float16)
    assert pool.mapped == 3 and pool.reused == 0  # a bare storage still counts
    del storage
    d = pool.empty(shape, torch.float16)
    assert pool.reused == 1 and bool((d == 1.5).all())  # a's pages, contents and all: the caller overwrites
    del b, c, d
    for _ in range(3):
        pool.empty(shape, torch.float16)  # each request's buffer dies at once: one region serves them all
    assert pool.reused == 4 and pool.idle_bytes <= 4 * PREFAULT_MIN_BYTES + 2 * PREFAULT_MIN_BYTES
    off = DestinationPool(max_idle_bytes=0)
    x = off.empty(shape, torch.float16)
    del x
    off.empty(shape, torch.float16)
    assert off.reused == 0  # switched off: a fresh mapping every time
    small = pool.empty((2, 2, 2, 4, 4), torch.float16)
    assert small.shape == (2, 2, 2, 4, 4)  # small destinations come from the allocator


def test_fetch_into_streams_verified_sections_into_a_sink_after_the_header_check(lm):
    """The public call an integration loads with: every (layer, K/V) section, verified, in order,
    handed to the caller's sink; ``check`` sees the header first and its refusal is the fetch's
    error, before any section reached the sink."""
    edge = MemoryEdgeTransport(piece=4096)
    cfg = ClientConfig(edge="mem", tenant="acme")
    keys, chunks = publish(edge, lm, DOC[:CHUNK], cfg.namespace)
    got: list[tuple[int, str, torch.Tensor]] = []
    headers = []
    with KdnClient(cfg, transport=edge) as client:
        stats = client.fetch_into(lm.fingerprint, keys[0], lambda s: got.append((s.layer, s.kind, s.tensor.clone())),
                                  check=headers.append)
        assert stats.via == "memory" and stats.bytes == len(edge.store[("acme", bytes(keys[0]))])
        assert len(headers) == 1 and headers[0].token_count == CHUNK
        L = chunks[0].shape[0]
        assert [(layer, kind) for layer, kind, _ in got] == [(l, k) for l in range(L) for k in ("k", "v")]
        for layer, kind, t in got:
            assert torch.equal(t, chunks[0][layer, 0 if kind == "k" else 1])  # (H, T, D), every bit
        got.clear()

        def refuse(header) -> None:
            raise ConfigError("not this one")

        with pytest.raises(ConfigError):
            client.fetch_into(lm.fingerprint, keys[0], lambda s: got.append(s), check=refuse)
        assert got == []
