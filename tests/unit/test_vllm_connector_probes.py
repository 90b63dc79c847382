"""Probes of what reaches the vLLM connector from outside, without vLLM: the operator's
``kv_connector_extra_config``, an API caller's ``kv_transfer_params``/``cache_salt``/prompt, and
what the edge sends back.

The rules probed: nothing raises into vLLM's scheduler or worker; a bad request parameter is a
warning, a count and the plain path (nothing looked up, loaded or saved); bad bytes from the edge
never reach the blocks as if valid (the blocks of the failed chunk and every later one are
reported); a request of one tenant never reads or writes another's namespace.

The connector is the real ``KdnConnector`` over stand-ins for vLLM's connector base module (its
config a ``SimpleNamespace``), its clients on the in-memory edge; the worker side gets a real
paged cache in the ``FLASH_ATTN`` layout.
"""

from __future__ import annotations

import asyncio
import sys
import time
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kdn.artifact import encode_artifact
from kdn.config import ConfigError
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, chunk_keys
from kdn.testing import MemoryEdgeTransport

L, H, D, BLOCK, C, BLOCKS = 2, 2, 8, 16, 32, 16
FP = ModelFingerprint(b"\x07" * 32)
OLD = 7.0  # what the blocks hold before a load


@pytest.fixture
def mod(monkeypatch, tmp_path):
    """``kdn.integrations.vllm`` over stand-ins for vLLM's connector base and metrics modules
    (always, so that the connector can be built from a plain namespace), dropped afterwards."""
    monkeypatch.setenv("KDN_CACHE", str(tmp_path))
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")

    class KVConnectorBase_V1:  # what the connector uses of vLLM's base class
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config = vllm_config
            self._connector_metadata = None

    base.KVConnectorBase_V1 = KVConnectorBase_V1
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})
    base.KVConnectorRole = SimpleNamespace(SCHEDULER=SimpleNamespace(name="SCHEDULER"),
                                           WORKER=SimpleNamespace(name="WORKER"))
    metrics = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    metrics.KVConnectorStats = type("KVConnectorStats", (), {"__init__": lambda self, data=None: setattr(
        self, "data", dict(data or {}))})
    parts = base.__name__.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setitem(sys.modules, metrics.__name__, metrics)

    def drop() -> None:
        for name in [n for n in sys.modules if n == "kdn.integrations.vllm" or n.startswith("kdn.integrations.vllm.")]:
            sys.modules.pop(name)

    drop()
    import kdn.integrations.vllm as m

    monkeypatch.setattr(m.connector, "engine_fingerprint", lambda *a: FP)
    yield m
    drop()


def _vllm_config(extra: dict, block: int = BLOCK) -> SimpleNamespace:
    hf = SimpleNamespace(num_hidden_layers=L, num_key_value_heads=H, head_dim=D, hidden_size=H * D,
                         num_attention_heads=H, bos_token_id=None)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_load_failure_policy="recompute"),
        cache_config=SimpleNamespace(block_size=block, cache_dtype="auto"),
        model_config=SimpleNamespace(dtype=torch.float32, model="/nonexistent", hf_config=hf),
    )


class Rig:
    """A scheduler-side and a worker-side connector on one memory edge."""

    def __init__(self, mod, monkeypatch, edge: MemoryEdgeTransport | None = None, **extra) -> None:
        from kdn.client import AsyncKdnClient

        self.mod = mod
        self.edge = edge or MemoryEdgeTransport()
        monkeypatch.setattr(mod.load, "AsyncKdnClient", lambda cfg: AsyncKdnClient(cfg, transport=self.edge))
        cfg = _vllm_config({"edge": "127.0.0.1:7070", "chunk_size": C, "fetch_timeout_s": 5.0, **extra})
        self.sched = mod.KdnConnector(cfg, SimpleNamespace(name="SCHEDULER"))
        self.worker = mod.KdnConnector(cfg, SimpleNamespace(name="WORKER"))
        self.caches = [torch.full((BLOCKS, H, BLOCK, 2 * D), OLD) for _ in range(L)]
        self.worker._paged = mod.PagedCache.of(self.worker.geometry, self.caches, "FLASH_ATTN", None)
        self.worker._layer_of = {f"layers.{i}": i for i in range(L)}

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()

    def store(self, tokens, ns: Namespace, chunks: int, *, blob=None) -> list[torch.Tensor]:
        """The first ``chunks`` chunks of ``tokens`` on the edge under ``ns`` (``blob(c, key, parent, kv)``:
        the bytes to store instead), their KV returned."""
        keys = chunk_keys(np.asarray(tokens), fingerprint=FP, namespace=ns, chunk_size=C)
        out = []
        for c in range(chunks):
            kv = torch.randn(L, 2, H, C, D)
            parent = keys[c - 1] if c else ROOT_KEY
            data = (blob(c, keys[c], parent, kv) if blob else None) or encode_artifact(
                kv, key=keys[c], parent_key=parent, fingerprint=FP, codec="raw", chunk_index=c)
            self.edge.store[(ns.tenant, bytes(keys[c]))] = data
            out.append(kv)
        return out

    def step(self, req, blocks: list[int]):
        """One scheduler step of a new request (``blocks`` allocated), then the worker's step:
        ``(matched tokens, failed block ids)``."""
        n, asynchronous = self.sched.get_num_new_matched_tokens(req, 0)
        assert asynchronous is False
        if n:
            self.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), n)
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=n)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                  num_computed_tokens=[]),
            num_scheduled_tokens={req.request_id: len(req.prompt_token_ids or ()) - n},
        )
        self.worker._connector_metadata = self.sched.build_connector_meta(out)
        self.worker.start_load_kv(None)
        for name in self.worker._layer_of:
            self.worker.wait_for_layer_load(name)
        self.worker.wait_for_save()
        self.worker.flush(5)
        return n, self.worker.get_block_ids_with_load_errors()


def _req(rid="r1", n=3 * C + 5, salt=None, params=None, tokens=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(100, 100 + n)) if tokens is None else tokens,
                           cache_salt=salt, kv_transfer_params=params)


@pytest.fixture
def rig(mod, monkeypatch):
    r = Rig(mod, monkeypatch)
    yield r
    r.close()


# -- kv_connector_extra_config: refused at start, with the field named ---------------------------


@pytest.mark.parametrize("extra,field", [
    ({"chunk_sise": 256}, "chunk_sise"),  # unknown key
    ({"chunk_size": "many"}, "chunk_size"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"lookup_timeout_s": -1}, "lookup_timeout_s"),
    ({"fetch_timeout_s": 0}, "fetch_timeout_s"),
    ({"tokens": ["acme"]}, "tokens"),
    ({"tenant": "not a tenant!"}, "tenant"),
    ({"fetch_concurrency": 0}, "fetch_concurrency"),
    ({"fetch_timeout_s": float("inf")}, "fetch_timeout_s"),
    ({"fetch_timeout_s": 1e10}, "fetch_timeout_s"),  # past what a thread can wait for
    ({"lookup_timeout_s": float("inf")}, "lookup_timeout_s"),
    ({"put_codec": "nope"}, "put_codec"),
    ({"put_codec": "int8"}, "put_codec"),  # lossy: the connector's own loads would refuse what it saved
])
def test_a_bad_extra_config_is_refused_at_start_naming_the_field(mod, extra, field):
    with pytest.raises(ConfigError, match=field):
        mod.KdnConnectorConfig.build({"edge": "127.0.0.1:7070", **extra}, source="kv_connector_extra_config")


def test_a_chunk_size_that_is_no_multiple_of_the_block_size_is_refused_at_start(mod):
    with pytest.raises(ValueError, match="multiple of 16"):
        mod.KdnConnector(_vllm_config({"edge": "127.0.0.1:7070", "chunk_size": 40}), SimpleNamespace(name="SCHEDULER"))


@pytest.mark.parametrize("edge", ["no such host:http", "no-such-host.invalid:7070"])
def test_an_edge_address_that_is_garbage_is_refused_at_start_or_means_recompute_counted(mod, edge):
    """No memory edge here: the real gRPC client, on an address it refuses (then the connector
    does not start) or that resolves nowhere (then every request is recomputed, counted)."""
    cfg = _vllm_config({"edge": edge, "chunk_size": C, "lookup_timeout_s": 0.5})
    try:
        conn = mod.KdnConnector(cfg, SimpleNamespace(name="SCHEDULER"))
    except ConfigError:
        return
    try:
        assert conn.get_num_new_matched_tokens(_req(), 0) == (0, False)
        assert conn.counters["lookup_errors"] == 1
    finally:
        conn.shutdown()


# -- kv_transfer_params and cache_salt: a bad one is a warning, a count and the plain path ------


@pytest.mark.parametrize("salt,params", [
    (None, ["kdn_tenant", "acme"]),  # not an object (the offline API passes anything)
    (None, "acme"),
    (None, {"kdn": "false"}),  # a string, not false
    (None, {"kdn": 0}),
    (None, {"kdn_tenant": 123}),  # would be tenant "123"
    (None, {"kdn_tenant": True}),  # would be tenant "True"
    (None, {"kdn_tenant": ["acme"]}),
    (None, {"kdn_tenant": "bad tenant!"}),
    (None, {"kdn_tenant": "a" * 129}),
    ("acme", {"kdn_tenant": "acme", "kdn_salt": 5}),  # would be salt "5"
    ("acme", {"kdn_tenant": "acme", "kdn_salt": {"s": 1}}),
    ("acme", {"kdn_tenant": "acme", "kdn_salt": "s" * 257}),
    ("acme", {"kdn_salt": "secret"}),  # a salt for no tenant: would be dropped, the request unsalted
    (12345, None),  # a cache_salt that is no string
])
def test_a_bad_request_parameter_is_the_plain_path_counted(rig, salt, params):
    tokens = list(range(100, 100 + 3 * C + 5))
    for ns in (Namespace("default"), Namespace("acme"), Namespace("123"), Namespace("True")):
        rig.store(tokens, ns, 3)
    req = _req(salt=salt, params=params, tokens=tokens)
    n, failed = rig.step(req, list(range(7)))
    assert (n, failed) == (0, set())
    assert rig.sched.counters["bad_requests"] == 1
    assert rig.sched.counters["lookups"] == 0 and rig.edge.calls == {"lookup": 0, "fetch": 0, "put": 0}
    assert all(torch.all(kv == OLD) for kv in rig.caches)
    rig.sched.request_finished(req, [])


@pytest.mark.parametrize("params", [None, {}, {"kdn": True}, {"kdn_tenant": None}, {"kdn_tenant": ""},
                                    {"kdn_salt": None}, {"kdn_salt": ""}])
def test_absent_or_empty_parameters_are_the_default_namespace(rig, params):
    tokens = list(range(100, 100 + 3 * C + 5))
    rig.store(tokens, Namespace("default"), 3)
    n, failed = rig.step(_req(params=params, tokens=tokens), list(range(7)))
    assert (n, failed) == (3 * C, set()) and not rig.sched.counters.get("bad_requests")


def test_kdn_false_skips_kdn_without_a_count(rig):
    tokens = list(range(100, 100 + 3 * C + 5))
    rig.store(tokens, Namespace("default"), 3)
    assert rig.step(_req(params={"kdn": False}, tokens=tokens), list(range(7))) == (0, set())
    assert rig.edge.calls == {"lookup": 0, "fetch": 0, "put": 0} and not rig.sched.counters.get("bad_requests")


@pytest.mark.parametrize("salt", ["a b/c", "ünïcødé", "x" * 10_000, "acme:" + "s" * 300, ":salt", "acme:b:c"])
def test_a_cache_salt_with_odd_characters_is_a_namespace_of_its_own(mod, salt):
    ns = mod.request_namespace(salt, None, Namespace("default"))
    assert ns != Namespace("acme") and ns != Namespace("default")
    assert ns != mod.request_namespace(salt + "!", None, Namespace("default"))


@pytest.mark.parametrize("n", [0, 1, 2, C - 1, C, C + 1])
def test_short_prompts_match_nothing_and_raise_nothing(rig, n):
    """vLLM computes the last prompt token: a prompt of at most one chunk (plus nothing) matches 0;
    C + 1 tokens match the one chunk."""
    tokens = list(range(100, 100 + n))
    rig.store(list(range(100, 100 + C + 1)), Namespace("default"), 1)
    got, failed = rig.step(_req(n=n, tokens=tokens), list(range(max(1, -(-n // BLOCK)))))
    assert (got, failed) == ((C if n == C + 1 else 0), set())


@pytest.mark.parametrize("tokens", [None, [-1] * (C + 5), [2 ** 40] * (C + 5)])
def test_a_prompt_kdn_cannot_key_is_the_plain_path(rig, tokens):
    """No prompt token ids (prompt embeddings), or ids outside uint32: nothing raised."""
    req = _req(tokens=tokens)
    req.prompt_token_ids = tokens
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_one_tenants_request_never_reads_or_writes_anothers_namespace(rig):
    """Tenant a's chunks are on the edge; the same prompt for tenant b (kv_transfer_params, then
    cache_salt) matches nothing, and its write-backs land under b."""
    tokens = list(range(100, 100 + 3 * C + 5))
    rig.store(tokens, Namespace("tenant-a"), 3)
    assert rig.step(_req("a", salt="tenant-a", tokens=tokens), list(range(7)))[0] == 3 * C
    before = set(rig.edge.store)
    n, _ = rig.step(_req("b", params={"kdn_tenant": "tenant-b"}, salt="tenant-a", tokens=tokens), list(range(7, 14)))
    assert n == 0
    written = set(rig.edge.store) - before
    assert written and {t for t, _ in written} == {"tenant-b"}
    assert rig.step(_req("c", salt="tenant-b:pepper", tokens=tokens), list(range(7)))[0] == 0


# -- what the edge sends back --------------------------------------------------------------------


def test_a_hit_loads_every_chunk_into_its_blocks(rig):
    tokens = list(range(100, 100 + 3 * C + 5))
    kvs = rig.store(tokens, Namespace("default"), 3)
    blocks = [5, 4, 0, 1, 2, 3, 6]
    assert rig.step(_req(tokens=tokens), blocks) == (3 * C, set())
    got = rig.worker._paged.gather(blocks[:6], 0, 3 * C)  # (L, 2, H, 3C, D)
    assert torch.equal(got, torch.cat(kvs, dim=3))


def _other_key(c, key, parent, kv):
    return encode_artifact(kv, key=ChunkKey(b"\x55" * 32), parent_key=parent, fingerprint=FP, codec="raw", chunk_index=c)


def _other_model(c, key, parent, kv):
    return encode_artifact(kv, key=key, parent_key=parent, fingerprint=ModelFingerprint(b"\x08" * 32), codec="raw",
                           chunk_index=c)


def _steered(c, key, parent, kv):
    from kdn.steer import SteerSpec

    return encode_artifact(kv, key=key, parent_key=parent, fingerprint=FP, codec="raw", chunk_index=c,
                           steer=SteerSpec("re-read", ((0, 4),)).canonical())


def _lossy(c, key, parent, kv):
    return encode_artifact(kv, key=key, parent_key=parent, fingerprint=FP, codec="int8", chunk_index=c)


def _layers(n):
    def make(c, key, parent, kv):
        return encode_artifact(torch.randn(n, 2, H, C, D), key=key, parent_key=parent, fingerprint=FP, codec="raw",
                               chunk_index=c)
    return make


def _truncated(c, key, parent, kv):
    blob = encode_artifact(kv, key=key, parent_key=parent, fingerprint=FP, codec="raw", chunk_index=c)
    return blob[: len(blob) * 2 // 3]


def _flipped(c, key, parent, kv):
    blob = bytearray(encode_artifact(kv, key=key, parent_key=parent, fingerprint=FP, codec="raw", chunk_index=c))
    blob[len(blob) // 2] ^= 0x01
    return bytes(blob)


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "whole"])
@pytest.mark.parametrize("bad", [_other_key, _other_model, _steered, _lossy, _layers(L + 1), _layers(1), _truncated,
                                 _flipped], ids=lambda f: f.__name__)
def test_bad_bytes_for_chunk_1_fail_it_and_every_later_chunk(mod, monkeypatch, bad, whole):
    """Chunk 0 loads; chunk 1's artifact is wrong: its blocks and chunk 2's are reported (vLLM
    recomputes from there), nothing is counted loaded past chunk 0, and chunk 1's blocks hold no
    value that is not chunk 1's own."""
    rig = Rig(mod, monkeypatch, MemoryEdgeTransport(whole=whole, piece=4096))
    try:
        tokens = list(range(100, 100 + 3 * C + 5))
        kvs = rig.store(tokens, Namespace("default"), 3, blob=lambda c, *a: bad(c, *a) if c == 1 else None)
        n, failed = rig.step(_req(tokens=tokens), list(range(7)))
        assert n == 3 * C and failed == {2, 3, 4, 5}
        assert rig.worker.counters["load_failures"] >= 1 and rig.worker.counters["loaded_chunks"] <= 2
        got = rig.worker._paged.gather([0, 1, 2, 3], 0, 2 * C)
        assert torch.equal(got[..., :C, :], kvs[0])
        chunk1 = got[..., C:, :]
        assert torch.all((chunk1 == OLD) | (chunk1 == kvs[1])), "a value that is not chunk 1's reached its blocks"
        assert not rig.worker.counters.get("saved_chunks")  # a failed load saves nothing
    finally:
        rig.close()


class StallingEdge(MemoryEdgeTransport):
    """Sends the first piece of ``stall_key``'s container, then nothing."""

    stall_key: bytes = b""

    async def fetch(self, spec, *, timeout, next_keys=()):
        n = 0
        async for piece in super().fetch(spec, timeout=timeout, next_keys=next_keys):
            if bytes(spec.key) == self.stall_key and n == 1:
                await asyncio.Event().wait()
            n += 1
            yield piece


def test_an_edge_that_stalls_mid_load_fails_from_that_chunk_on_within_the_deadline(mod, monkeypatch):
    import time

    edge = StallingEdge(piece=2048)
    rig = Rig(mod, monkeypatch, edge, fetch_timeout_s=0.3)
    try:
        tokens = list(range(100, 100 + 3 * C + 5))
        keys = chunk_keys(np.asarray(tokens), fingerprint=FP, namespace=Namespace("default"), chunk_size=C)
        edge.stall_key = bytes(keys[1])
        kvs = rig.store(tokens, Namespace("default"), 3)
        t = time.monotonic()
        n, failed = rig.step(_req(tokens=tokens), list(range(7)))
        assert time.monotonic() - t < 4
        assert n == 3 * C and failed == {2, 3, 4, 5}
        assert torch.equal(rig.worker._paged.gather([0, 1]), kvs[0])
    finally:
        rig.close()


def test_a_load_errs_only_into_the_load_errors_never_into_the_worker(rig, monkeypatch):
    """The placer itself raising (a bug, or a device error) fails the chunk; the worker's calls
    return, reporting the loaded blocks (block 4 holds only the prompt's last tokens, vLLM's to compute)."""
    tokens = list(range(100, 100 + 2 * C + 5))
    rig.store(tokens, Namespace("default"), 2)

    def broken(*a, **k):
        def put(section):
            raise RuntimeError("device lost")
        return put

    monkeypatch.setattr(rig.worker._paged, "placer", broken)
    assert rig.step(_req(tokens=tokens), list(range(5))) == (2 * C, {0, 1, 2, 3})


def test_distinct_cache_salts_do_not_grow_the_connectors_clients_without_bound(rig):
    for i in range(300):
        rig.sched.get_num_new_matched_tokens(_req(f"r{i}", salt=f"user {i}"), 0)
    assert len(rig.sched._clients._clients) <= 256


def test_an_evicted_client_is_closed_after_its_deadlines_and_rebuilt_on_demand(rig):  # rig: vLLM's stand-ins
    from kdn.client import ClientConfig
    from kdn.integrations.vllm.load import Clients, LoopThread

    closed: list[str] = []
    loop = LoopThread("probe-clients")
    try:
        def config_for(ns):
            return ClientConfig(tenant=ns.tenant, salt=ns.salt, fetch_timeout_s=0.05, put_timeout_s=0.05)

        clients = Clients(loop, config_for, max_clients=2)
        made = [clients.get(Namespace(t)) for t in ("a", "b")]
        for c in made:
            real = c.close

            async def close(*, flush_timeout: float = 5.0, c=c, real=real) -> None:
                closed.append(c.config.tenant)
                await real(flush_timeout=flush_timeout)

            c.close = close  # type: ignore[method-assign]
        assert clients.get(Namespace("a")) is made[0]  # "a" used last: "b" goes first
        clients.get(Namespace("c"))
        assert set(clients._clients) == {Namespace("a"), Namespace("c")} and closed == []
        deadline = time.monotonic() + 5
        while not closed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert closed == ["b"] and not clients._closing
        assert clients.get(Namespace("b")) is not made[1]  # a fresh one for the namespace
        loop.submit(clients.close()).result(10)
    finally:
        loop.close()


def test_a_write_back_whose_client_cannot_be_made_is_counted_not_lost(rig, monkeypatch):
    """A miss is written back on the loop thread; the namespace's client failing to build is a
    counted save error (it was an exception left in a future nobody reads)."""
    def broken(tenant, salt):
        raise RuntimeError("no client")

    monkeypatch.setattr(rig.worker._clients, "on_loop", broken)
    assert rig.step(_req(tokens=list(range(100, 100 + 2 * C + 5))), list(range(5))) == (0, set())
    assert rig.worker.counters["save_errors"] == 2 and not rig.worker.counters["saved_chunks"]
