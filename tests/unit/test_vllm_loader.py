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


@pytest.fixture(params=[False, True], ids=["streamed", "whole"])
def whole(request) -> bool:
    """How the edge answers: in pieces (a remote edge), or the whole container at once as same-host
    shared memory does (then read layer by layer across the step's chunks)."""
    return request.param


def _engine(mod, whole: bool = False):
    """A connector's worker side as ``LoadJob`` sees it (a ``LoadContext``): L layers of paged KV
    ``[blocks, H, block, 2*D]`` filled with another request's values, a client on the memory edge
    (``whole``: answering as same-host shared memory does)."""
    edge = MemoryEdgeTransport(whole=whole)
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


def test_an_artifact_of_the_engines_geometry_is_loaded_into_its_blocks(vllm_module, whole):
    conn, edge, caches = _engine(vllm_module, whole)
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
def test_an_artifact_of_any_other_geometry_goes_to_the_load_errors_and_writes_nothing(vllm_module, what, geometry,
                                                                                     whole):
    """Under the right key and model: a 1-layer artifact passed every check the reader makes, and
    layers 1..L-1 kept the previous request's KV. Now the chunk's blocks are reported for
    recompute and no block was written."""
    conn, edge, caches = _engine(vllm_module, whole)
    try:
        blob, _kv = _artifact(**geometry)
        job = _load(vllm_module, conn, edge, blob)
        assert job.failed_blocks == {0} and job.failed_reqs == {"req-1"}, what
        assert conn.counters == {"loaded_chunks": 0, "load_failures": 1}, what
        assert all(torch.all(kv == OLD) for kv in caches), f"{what}: a block was written"
    finally:
        conn.loop.close()


def test_a_tail_piece_lands_inside_its_block_and_nowhere_else(vllm_module, whole):
    """A whole-document hit: a 32-token tail piece after chunk 0 fills tokens 16..47 of the request,
    i.e. block 1 (all of it) and the first half of block 2, the rest of block 2 untouched."""
    conn, edge, caches = _engine(vllm_module, whole)
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


def _chain(n: int) -> list[tuple[ChunkKey, bytes, torch.Tensor]]:
    """``n`` chained chunks (key, container, KV)."""
    out, parent = [], ROOT_KEY
    for c in range(n):
        key = ChunkKey(bytes([0x30 + c]) * 32)
        kv = torch.randn(L, 2, H, C, D)
        out.append((key, encode_artifact(kv, key=key, parent_key=parent, fingerprint=FP, codec="raw",
                                         chunk_index=c), kv))
        parent = key
    return out


def _on_place(conn, hook) -> None:
    """Wrap the engine's placer: ``hook(layer, chunk)`` runs on the placing thread before each
    section is placed."""
    placer = conn.ctx.paged.placer

    def wrapped(block_ids, write_from, lo, hi, after=None):
        put = placer(block_ids, write_from, lo, hi, after)

        def place(section):
            hook(section.layer, lo // C)
            return put(section)

        return place

    conn.ctx.paged.placer = wrapped


def _chain_job(mod, conn, chain):
    """A job loading ``chain`` into blocks 0, 1, ... of one request."""
    spec = mod.LoadSpec("req-1", NS.tenant, "", 0, [bytes(k) for k, _, _ in chain], 0, list(range(len(chain))))
    return mod.LoadJob(conn.ctx, [spec])


@pytest.mark.parametrize("threads", [1, 2])
def test_whole_containers_are_placed_layer_by_layer_across_chunks(vllm_module, threads):
    """Same-host answers: each reader thread places every one of its chunks' layer 0 before any
    of their layer 1 (one thread: every chunk's), so the forward's first layer does not wait for most of
    the load (streamed, chunk 3's layer 0 came after chunks 0..1 were whole). The KV in the
    blocks is each chunk's own."""
    import threading

    conn, edge, caches = _engine(vllm_module, whole=True)
    conn.loop.read_threads = threads
    try:
        chain = _chain(BLOCKS)
        for key, blob, _kv in chain:
            edge.store[(NS.tenant, bytes(key))] = blob
        order: list[tuple[int, int, int]] = []  # (thread, layer, chunk)
        _on_place(conn, lambda layer, chunk: order.append((threading.get_ident(), layer, chunk)))
        job = _chain_job(vllm_module, conn, chain)
        job.start()
        job.wait_layer(0)
        job.finish()
        assert not job.failed_blocks and conn.counters == {"loaded_chunks": BLOCKS, "load_failures": 0}
        for k in range(threads):  # the chunks are dealt out: reader k reads chunks k, k + threads, ...
            share = [(t, layer) for t, layer, chunk in order if chunk % threads == k]
            assert len({t for t, _ in share}) == 1, f"one reader per share: {order}"
            layers = [layer for _, layer in share]
            assert layers == sorted(layers), f"placed out of layer order: {order}"
        assert {chunk for _t, layer, chunk in order if layer == 0} == set(range(BLOCKS))
        for c, (_key, _blob, kv) in enumerate(chain):
            for layer in range(L):
                assert torch.equal(caches[layer][c, :, :, :D], kv[layer, 0])
                assert torch.equal(caches[layer][c, :, :, D:], kv[layer, 1])
    finally:
        conn.loop.close()


@pytest.mark.parametrize("where", ["layer 0", "last layer", "trailer"])
def test_a_corrupt_whole_container_fails_from_its_chunk_on_and_the_earlier_chunks_load(vllm_module, where):
    """A flipped bit in chunk 1 of 4, read layer by layer: chunk 0 is loaded, chunk 1's blocks and
    every later chunk's are reported for recompute (vLLM recomputes from the first failed block),
    and nothing unverified reaches chunk 1's blocks beyond the section that failed."""
    conn, edge, caches = _engine(vllm_module, whole=True)
    try:
        chain = _chain(BLOCKS)
        for c, (key, blob, _kv) in enumerate(chain):
            if c == 1:
                at = {"layer 0": 200, "last layer": len(blob) - 100, "trailer": len(blob) - 3}[where]
                bad = bytearray(blob)
                bad[at] ^= 0x10
                blob = bytes(bad)
            edge.store[(NS.tenant, bytes(key))] = blob
        job = _chain_job(vllm_module, conn, chain)
        job.start()
        job.finish()
        assert job.failed_blocks == {1, 2, 3} and job.failed_reqs == {"req-1"}, where
        assert conn.counters["load_failures"] == 1, where
        for layer in range(L):
            assert torch.equal(caches[layer][0, :, :, :D], chain[0][2][layer, 0])
    finally:
        conn.loop.close()


def _section(kind: str, x: torch.Tensor, lent: bool):
    """A section as a decoder makes it (a tensor), or as the reader lends raw bytes (an array)."""
    from kdn.artifact import Section
    from kdn.codecs import same_width_array

    return Section(0, kind, array=same_width_array(x.contiguous()), dtype=x.dtype) if lent else Section(0, kind, x)


@pytest.mark.parametrize("lent", [False, True], ids=["tensor", "lent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_ids", [[1, 2], [3, 1], [2, 0]], ids=["consecutive", "descending", "gapped"])
@pytest.mark.parametrize("backend,isa", [("FLASH_ATTN", None), ("CPU_ATTN", "vec")])
def test_a_chunk_lands_in_its_own_blocks_whatever_their_ids(vllm_module, block_ids, backend, isa, dtype, lent):
    """A 16-token chunk over two 8-token blocks: consecutive ids take one strided copy, any other
    ids an indexed write; either way each block gets its tokens, bit for bit (bfloat16 goes
    through numpy as int16), and the others keep theirs. The same whether the section is a
    tensor or raw bytes the reader lent (as numpy, copied without a tensor being made)."""
    bs = 8
    caches = [torch.full((4, H, bs, 2 * D), OLD, dtype=dtype)]
    paged = vllm_module.PagedCache.of(vllm_module.EngineGeometry(1, H, D, dtype, bs, C), caches, backend, isa)
    kv = torch.randn(2, H, C, D).to(dtype)  # K, V of one layer
    for s, kind in enumerate("kv"):
        paged.placer(block_ids, 0, 0, C)(_section(kind, kv[s], lent))
    got = paged.gather(block_ids)  # (1, 2, H, C, D), read back through the backend's layout
    assert torch.equal(got[0], kv)
    for b in set(range(4)) - set(block_ids):
        assert torch.all(caches[0][b] == OLD)


@pytest.mark.parametrize("lent", [False, True], ids=["tensor", "lent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend,isa", [("FLASH_ATTN", None), ("CPU_ATTN", "vec")])
def test_tokens_inside_blocks_land_in_their_slots_and_nowhere_else(vllm_module, backend, isa, dtype, lent):
    """Tokens 4..11 of a request whose blocks are [2, 0] (8 tokens each), the engine holding tokens
    before 6: tokens 6, 7 go to the end of block 2 and 8..11 to the start of block 0; every other
    slot keeps what it held."""
    bs, lo, hi, write_from = 8, 4, 12, 6
    caches = [torch.full((3, H, bs, 2 * D), OLD, dtype=dtype)]
    paged = vllm_module.PagedCache.of(vllm_module.EngineGeometry(1, H, D, dtype, bs, C), caches, backend, isa)
    kv = torch.randn(2, H, hi - lo, D).to(dtype)
    put = paged.placer([2, 0], write_from, lo, hi)
    for s, kind in enumerate("kv"):
        put(_section(kind, kv[s], lent))
    got = paged.gather([2, 0], 0, 2 * bs)[0]  # (2, H, 16, D): tokens 0..15 of the request
    assert torch.equal(got[:, :, write_from:hi], kv[:, :, write_from - lo:])
    assert torch.all(got[:, :, :write_from] == OLD) and torch.all(got[:, :, hi:] == OLD)
    assert torch.all(caches[0][1] == OLD)


def test_a_cancelled_load_writes_nothing_once_the_cancel_returned(vllm_module):
    """Past the deadline the job is cancelled while reader threads are mid-load: the cancel returns
    only once every reader has stopped, nothing is placed after that, and every chunk that had not
    finished is reported for recompute."""
    import threading
    import time

    conn, edge, caches = _engine(vllm_module, whole=True)
    conn.loop.read_threads = 2
    try:
        chain = _chain(BLOCKS)
        for key, blob, _kv in chain:
            edge.store[(NS.tenant, bytes(key))] = blob
        writes: list[tuple[int, int]] = []
        entered, release = threading.Event(), threading.Event()

        def slow(layer: int, chunk: int) -> None:
            if (layer, chunk) == (1, 0):
                entered.set()
                release.wait(5)  # the reader of chunk 0 is busy when the cancel comes
            writes.append((layer, chunk))

        _on_place(conn, slow)
        job = _chain_job(vllm_module, conn, chain)
        job.start()
        assert entered.wait(5)
        cancel = threading.Thread(target=job._cancel)
        cancel.start()
        time.sleep(0.2)
        assert cancel.is_alive(), "the cancel returned while a reader was still placing"
        release.set()
        cancel.join(10)
        assert not cancel.is_alive()
        n = len(writes)
        time.sleep(0.2)
        assert len(writes) == n, "placed after the cancel returned"
        job.finish()
        assert job.failed_blocks == set(range(BLOCKS)) and job.failed_reqs == {"req-1"}
    finally:
        release.set()
        conn.loop.close()


def _pairs_kernel(drop: bool = False, shift_block_1: bool = False, swizzle: bool = False):
    """A stand-in for a packing CPU kernel (like ``amx``): per block and head, K's tokens are
    interleaved two by two along the head dim (``[block/2, D, 2]``), V is row-major. Writes K, V
    ``(T, H, D)`` of tokens 0..T-1 into slots 0..T-1 of ``[blocks, H, block, 2*D]``. ``drop``:
    loses token 0's K (not a permutation); ``shift_block_1``: block 1 laid out unlike block 0;
    ``swizzle``: K's dims XOR-swizzled by token (a permutation, but no strided view)."""

    def write(key, value, cache):
        nb, H, kb, w = cache.shape
        D = w // 2
        flat = cache.view(nb, H, 2, kb * D)
        for t in range(key.shape[0]):
            b, o = divmod(t, kb)
            for h in range(H):
                if not (drop and t == 0):
                    k_at = (o // 2) * 2 * D + torch.arange(D) * 2 + o % 2
                    if swizzle:
                        k_at = o * D + (torch.arange(D) ^ (o % D))
                    if shift_block_1 and b == 1:
                        k_at = (k_at + 1) % (kb * D)
                    flat[b, h, 0, k_at] = key[t, h]
                flat[b, h, 1, o * D : (o + 1) * D] = value[t, h]

    return write


@pytest.mark.parametrize("blocks", [[3, 1], [1, 2]], ids=["blocks 3, 1", "blocks 1, 2"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["strided", "by position"])
def test_a_learned_layout_places_what_the_engines_kernel_would(vllm_module, swizzle, blocks):
    """A CPU kernel KDN has no map for: its layout is learned by writing coded values through it,
    and a chunk placed into blocks 3, 1 (whole blocks) and a piece inside blocks land exactly where
    the kernel would have written those tokens; reading the blocks back gives the chunk. A layout
    that is a sum of strides over the bits of token and dim is copied as a strided view, any
    other through each value's place."""
    from kdn.artifact import Section

    mod = vllm_module
    nb, H, kb, D, C = 4, 2, 4, 8, 8
    write = _pairs_kernel(swizzle=swizzle)
    ours = torch.zeros(nb, H, kb, 2 * D)
    paged = mod.PagedCache.of(mod.EngineGeometry(1, H, D, torch.float32, kb, C), [ours], "CPU_ATTN", "pairs", 0, write)
    assert isinstance(paged.layers[0].k, mod.paged.PermutedView)
    assert (paged.layers[0].k.bits is None) == swizzle and paged.layers[0].v.bits is not None
    kv = torch.randn(2, H, C, D)  # one chunk's K, V
    for s, kind in enumerate("kv"):
        paged.placer(blocks, 0, 0, C)(Section(0, kind, kv[s]))  # whole blocks
        paged.placer([*blocks, 0], 0, C, C + 2)(Section(0, kind, kv[s, :, :2]))  # tokens 8, 9: block 0, offsets 0, 1
    # the kernel writing the same tokens into the same slots: slot = block * kb + offset
    slots = {blocks[0] * kb + t: t for t in range(kb)} | {blocks[1] * kb + t: kb + t for t in range(kb)} | {0: 0, 1: 1}
    key, value = torch.zeros(nb * kb, H, D), torch.zeros(nb * kb, H, D)
    for slot, t in slots.items():
        key[slot], value[slot] = kv[0, :, t], kv[1, :, t]
    ref = torch.zeros_like(ours)
    write(key, value, ref)
    assert torch.equal(ours, ref)
    assert torch.equal(paged.gather(blocks)[0], kv)


@pytest.mark.parametrize("kernel,why", [(_pairs_kernel(drop=True), "wrote"), (_pairs_kernel(shift_block_1=True),
                                        "laid out differently")], ids=["loses a value", "block-dependent"])
def test_a_kernel_whose_layout_cannot_be_learned_is_refused_at_start(vllm_module, kernel, why):
    """Learned only if every value lands once, the same way in every block: otherwise the
    connector refuses to start rather than mix up KV; with no kernel to learn from, too."""
    mod = vllm_module
    geometry = mod.EngineGeometry(1, 2, 8, torch.float32, 4, 8)
    with pytest.raises(ValueError, match=why):
        mod.PagedCache.of(geometry, [torch.zeros(4, 2, 4, 16)], "CPU_ATTN", "pairs", 0, kernel)
    with pytest.raises(ValueError, match="'pairs'"):
        mod.PagedCache.of(geometry, [torch.zeros(4, 2, 4, 16)], "CPU_ATTN", "pairs", 0, None)


def test_a_finished_prompt_writes_back_only_the_tail_pieces_the_edge_lacks(vllm_module):
    """A whole-document hit loaded its chunk and the edge's tail pieces, up to one that ends inside
    a vLLM block. Once the prompt is computed, only the pieces after those the edge holds are written
    back (a hit puts nothing the edge has)."""
    import numpy as np

    from kdn.integrations.vllm.plan import ReqState, saves_of
    from kdn.keys import PIECE_TOKENS, chunk_keys, piece_keys

    C32, bs = 4 * PIECE_TOKENS, 2 * PIECE_TOKENS  # chunks of 4 pieces, vLLM blocks of 2
    tokens = np.arange(C32 + 3 * PIECE_TOKENS + 5, dtype=np.int64)  # one chunk, 3 whole pieces, 5 tokens
    keys = chunk_keys(tokens, fingerprint=FP, namespace=NS, chunk_size=C32)
    pkeys = piece_keys(tokens[C32 : len(tokens) - 1], after=keys[0], fingerprint=FP, namespace=NS, chunk_size=C32)
    assert len(pkeys) == 3

    def state(held: int) -> ReqState:
        st = ReqState(NS, keys, len(tokens), on_edge=1, saved=1, first_saved=1, tokens=tokens)
        st.pieces = pkeys[:held]
        st.block_ids = list(range(-(-len(tokens) // bs)))
        return st

    for held, saved in ((0, pkeys), (2, pkeys[2:]), (3, [])):
        specs = saves_of("r", state(held), len(tokens), chunk_size=C32, block_size=bs, fingerprint=FP)
        assert [ChunkKey(s.key) for s in specs] == list(saved), held


@pytest.mark.parametrize("backend,isa", [("FLASH_ATTN", None), ("CPU_ATTN", "vec")])
def test_lent_bytes_of_another_dtype_of_the_same_width_are_refused(vllm_module, backend, isa):
    """float16 bytes lent to a bfloat16 engine are both int16 to numpy: the section's dtype, not
    the array's, decides, and nothing is written."""
    from kdn.errors import FingerprintMismatch

    bs = 8
    caches = [torch.full((2, H, bs, 2 * D), OLD, dtype=torch.bfloat16)]
    paged = vllm_module.PagedCache.of(vllm_module.EngineGeometry(1, H, D, torch.bfloat16, bs, C), caches, backend, isa)
    with pytest.raises(FingerprintMismatch):
        paged.placer([0, 1], 0, 0, C)(_section("k", torch.randn(H, C, D).to(torch.float16), True))
    assert torch.all(caches[0] == OLD)


@pytest.mark.parametrize("other", [dict(dtype=torch.float16), dict(blocks=3)], ids=["dtype", "shape"])
def test_a_layer_cache_unlike_layer_0s_is_refused_at_start(vllm_module, other):
    """Only layer 0's cache was checked against the model; a later layer of another dtype would
    have been cast into by numpy's copy, not refused."""
    bs = 8
    caches = [torch.zeros(4, H, bs, 2 * D), torch.zeros(other.get("blocks", 4), H, bs, 2 * D,
                                                        dtype=other.get("dtype", torch.float32))]
    with pytest.raises(ValueError, match="layer 1"):
        vllm_module.PagedCache.of(vllm_module.EngineGeometry(2, H, D, torch.float32, bs, C), caches, "CPU_ATTN", "vec")
