"""The vLLM connector's loader against fake engine tensors: a chunk counts as loaded only when the
artifact's whole geometry (layers, KV heads, tokens, head dim, dtype) is the engine's.

No vLLM here: the connector module imports only vLLM's connector base classes at import time, so
a stand-in for that one module is enough to run the real ``LoadJob`` (the scheduler and worker
sides that need a real engine are tested in ``tests/vllm``). The engine's paged KV is a real
tensor in the ``FLASH_ATTN`` layout the connector knows; the edge is the in-memory transport
behind a real client.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from kdn.artifact import encode_artifact
from kdn.client import AsyncKdnClient, ClientConfig
from kdn.testing import MemoryEdgeTransport
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint, Namespace

L, H, C, D, BLOCK, BLOCKS = 4, 2, 16, 8, 16, 4
FP = ModelFingerprint(b"\x07" * 32)
NS = Namespace("tenant-a")
KEY = ChunkKey(b"\x11" * 32)
OLD = 7.0  # what the blocks hold from the previous request


@pytest.fixture
def vllm_module(monkeypatch):
    """``kdn.integrations.vllm`` (and its modules), imported over a stand-in for vLLM's connector base module
    when vLLM itself is not installed; dropped again afterwards."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or a broken install: the stand-in is enough here
        base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
        base.KVConnectorBase_V1 = type("KVConnectorBase_V1", (), {})
        base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})
        base.KVConnectorRole = SimpleNamespace(SCHEDULER="scheduler", WORKER="worker")
        parts = "vllm.distributed.kv_transfer.kv_connector.v1.base".split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        monkeypatch.setitem(sys.modules, base.__name__, base)
        metrics = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.metrics")

        class KVConnectorStats:  # vLLM's is a dataclass holding one dict
            def __init__(self, data=None):
                self.data = dict(data or {})

        metrics.KVConnectorStats = KVConnectorStats
        monkeypatch.setitem(sys.modules, metrics.__name__, metrics)
    def drop() -> None:
        for name in [n for n in sys.modules if n == "kdn.integrations.vllm" or n.startswith("kdn.integrations.vllm.")]:
            sys.modules.pop(name)

    drop()
    import kdn.integrations.vllm as mod

    yield mod
    drop()


def _engine(mod):
    """A connector's worker side as ``LoadJob`` sees it (a ``LoadContext``): L layers of paged KV
    ``[blocks, H, block, 2*D]`` filled with another request's values, a client on the memory edge."""
    edge = MemoryEdgeTransport()
    caches = [torch.full((BLOCKS, H, BLOCK, 2 * D), OLD) for _ in range(L)]
    paged = mod.PagedCache.of(mod.EngineGeometry(L, H, D, torch.float32, BLOCK, C), caches, "FLASH_ATTN", None)
    counters = {"loaded_chunks": 0, "load_failures": 0}
    client = AsyncKdnClient(ClientConfig(tenant=NS.tenant, fetch_timeout_s=5.0), transport=edge)
    loop = mod.LoopThread("kdn-vllm-test")
    ctx = mod.LoadContext(FP, paged, loop, fetch_timeout_s=5.0, fetch_concurrency=2,
                          client_for=lambda tenant, salt: client, origin_stream=None,
                          count=lambda name: counters.__setitem__(name, counters[name] + 1))
    return SimpleNamespace(ctx=ctx, counters=counters, loop=loop), edge, caches


def _artifact(layers=L, heads=H, tokens=C, head_dim=D, dtype=torch.float32) -> tuple[bytes, torch.Tensor]:
    kv = torch.randn(layers, 2, heads, tokens, head_dim).to(dtype)  # (L, 2, H, T, D)
    return encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="raw", chunk_index=0), kv


def _load(mod, conn, edge, blob: bytes):
    edge.store[(NS.tenant, bytes(KEY))] = blob
    job = mod.LoadJob(conn.ctx, [mod.LoadSpec("req-1", NS.tenant, "", 0, [bytes(KEY)], 0, [0])])
    job.start()
    job.finish()
    return job


def test_an_artifact_of_the_engines_geometry_is_loaded_into_its_blocks(vllm_module):
    conn, edge, caches = _engine(vllm_module)
    try:
        blob, kv = _artifact()
        job = _load(vllm_module, conn, edge, blob)
        assert not job.failed_blocks and conn.counters == {"loaded_chunks": 1, "load_failures": 0}
        for layer in range(L):
            assert torch.equal(caches[layer][0, :, :, :D], kv[layer, 0])  # K: [H, T, D] of block 0
            assert torch.equal(caches[layer][0, :, :, D:], kv[layer, 1])  # V
    finally:
        conn.loop.close()


@pytest.mark.parametrize("what,geometry", [
    ("one layer of four", dict(layers=1)),
    ("more layers than the engine", dict(layers=L + 1)),
    ("another number of KV heads", dict(heads=1)),
    ("fewer tokens", dict(tokens=C // 2)),
    ("another head dim", dict(head_dim=D // 2)),
    ("another dtype", dict(dtype=torch.float16)),
])
def test_an_artifact_of_any_other_geometry_goes_to_the_load_errors_and_writes_nothing(vllm_module, what, geometry):
    """Under the right key and model: a 1-layer artifact passed every check the reader makes, and
    layers 1..L-1 kept the previous request's KV. Now the chunk's blocks are reported for
    recompute and no block was written."""
    conn, edge, caches = _engine(vllm_module)
    try:
        blob, _kv = _artifact(**geometry)
        job = _load(vllm_module, conn, edge, blob)
        assert job.failed_blocks == {0} and job.failed_reqs == {"req-1"}, what
        assert conn.counters == {"loaded_chunks": 0, "load_failures": 1}, what
        assert all(torch.all(kv == OLD) for kv in caches), f"{what}: a block was written"
    finally:
        conn.loop.close()


def test_a_tail_piece_lands_inside_its_block_and_nowhere_else(vllm_module):
    """A whole-document hit: a 32-token tail piece after chunk 0 fills tokens 16..47 of the request,
    i.e. block 1 (all of it) and the first half of block 2, the rest of block 2 untouched."""
    conn, edge, caches = _engine(vllm_module)
    try:
        from kdn.keys import PIECE_TOKENS

        piece = ChunkKey(b"\x22" * 32)
        kv = torch.randn(L, 2, H, PIECE_TOKENS, D)  # (L, 2, H, 32, D)
        edge.store[(NS.tenant, bytes(piece))] = encode_artifact(kv, key=piece, parent_key=KEY, fingerprint=FP,
                                                                codec="raw", chunk_index=1)
        spec = vllm_module.LoadSpec("req-1", NS.tenant, "", 1, [], 16, [0, 1, 2], [bytes(piece)])
        job = vllm_module.LoadJob(conn.ctx, [spec])
        job.start()
        job.finish()
        assert not job.failed_blocks and conn.counters["loaded_chunks"] == 1
        for layer in range(L):
            assert torch.equal(caches[layer][1, :, :, :D], kv[layer, 0, :, :BLOCK])  # K of tokens 16..31
            assert torch.equal(caches[layer][2, :, : PIECE_TOKENS - BLOCK, D:], kv[layer, 1, :, BLOCK:])  # V of 32..47
            assert torch.all(caches[layer][2, :, PIECE_TOKENS - BLOCK :] == OLD)  # tokens 48.. untouched
            assert torch.all(caches[layer][0] == OLD) and torch.all(caches[layer][3] == OLD)
    finally:
        conn.loop.close()
