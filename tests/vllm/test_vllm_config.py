"""The connector's start-up checks and namespace rules, without an engine (needs vLLM importable)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdn.keys import Namespace
from tests.vllm import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_mod():
    require_vllm()
    from kdn.integrations import vllm as kv

    return kv


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kdn.integrations.model_dir import save_builtin

    return save_builtin("tiny", tmp_path_factory.mktemp("m") / "tiny", dtype="bfloat16")


def fake_config(model_dir, *, block=32, chunk=64, policy="recompute"):
    """The fields of vLLM's VllmConfig that the connector reads."""
    from transformers import AutoConfig

    ktc = SimpleNamespace(kv_connector_extra_config={"edge": None, "chunk_size": chunk}, kv_load_failure_policy=policy,
                          is_kv_producer=True)
    return SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=SimpleNamespace(block_size=block, cache_dtype="auto"),
        model_config=SimpleNamespace(dtype=torch.bfloat16, model=str(model_dir),
                                     hf_config=AutoConfig.from_pretrained(model_dir)),
    )


def test_chunk_size_must_be_a_multiple_of_the_block_size(vllm_mod, model_dir):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(ValueError, match="not a multiple of vLLM's block size 128"):
        vllm_mod.KdnConnector(fake_config(model_dir, block=128, chunk=64), KVConnectorRole.SCHEDULER, None)
    conn = vllm_mod.KdnConnector(fake_config(model_dir, block=32, chunk=64), KVConnectorRole.SCHEDULER, None)
    conn.shutdown()


def test_refuses_a_failure_policy_that_would_fail_requests(vllm_mod, model_dir):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(ValueError, match="recompute"):
        vllm_mod.KdnConnector(fake_config(model_dir, policy="fail"), KVConnectorRole.WORKER, None)


def test_engine_fingerprint_is_the_origins(vllm_mod, model_dir):
    from kdn.models import load_model

    fp = vllm_mod.engine_fingerprint(model_dir, torch.bfloat16, 64)
    assert fp == load_model(str(model_dir), dtype="bfloat16", chunk_size=64).fingerprint
    assert fp != vllm_mod.engine_fingerprint(model_dir, torch.float16, 64)
    assert fp != vllm_mod.engine_fingerprint(model_dir, torch.bfloat16, 128)


def test_namespace_comes_from_the_request(vllm_mod):
    ns = vllm_mod.request_namespace
    default = Namespace("default")
    assert ns(None, None, default) == default
    assert ns(None, None, Namespace("team", "pepper")) == Namespace("team", "pepper")
    assert ns("acme", None, default) == Namespace("acme")
    assert ns("acme:s3cret", None, default) == Namespace("acme", "s3cret")
    assert ns("acme", {"kdn_tenant": "beta", "kdn_salt": "x"}, default) == Namespace("beta", "x")
    assert ns("acme", {"kdn": False}, default) is None
    odd = ns("not a tenant/name!", None, default)
    assert odd.tenant.startswith("salt-") and odd != ns("not a tenant/name?", None, default)


def test_cpu_paged_views_follow_the_vec_kernels_block_layout(vllm_mod):
    """Write tokens the way csrc/cpu/cpu_attn_vec.hpp's reshape_and_cache does (per block and head:
    K column-major [D, block], then V row-major [block, D]); the views must read them back."""
    nb, H, kb, D = 3, 2, 4, 8
    kv = torch.zeros(nb, H, kb, 2 * D)
    flat = kv.view(nb, H, 2 * kb * D)
    k = torch.randn(nb, H, kb, D)
    v = torch.randn(nb, H, kb, D)
    for b in range(nb):
        for h in range(H):
            for t in range(kb):
                for i in range(D):
                    flat[b, h, i * kb + t] = k[b, h, t, i]  # key_cache_start_ptr[j], j = i * block_size
                flat[b, h, kb * D + t * D : kb * D + (t + 1) * D] = v[b, h, t]
    paged = vllm_mod.PagedKV.of(kv, "CPU_ATTN", "vec", D)
    assert torch.equal(paged.k, k) and torch.equal(paged.v, v)
    idx = torch.tensor([2, 0])
    paged.k[idx] = k[idx] * 2  # writes land in the engine's tensor
    assert torch.equal(paged.k[idx], k[idx] * 2) and torch.equal(paged.v, v)
    with pytest.raises(ValueError, match="amx"):
        vllm_mod.PagedKV.of(kv, "CPU_ATTN", "amx", D)
    with pytest.raises(ValueError, match="FLASHINFER"):
        vllm_mod.PagedKV.of(kv, "FLASHINFER", None, D)
    cuda_like = vllm_mod.PagedKV.of(kv, "FLASH_ATTN", None, D)
    assert torch.equal(cuda_like.k, kv[..., :D]) and torch.equal(cuda_like.v, kv[..., D:])


def test_connector_config_is_a_client_config_per_namespace(vllm_mod):
    cfg = vllm_mod.KdnConnectorConfig.build({"edge": "127.0.0.1:7070", "fetch_timeout_s": 3.5, "token": "t0",
                                             "tokens": {"acme": "t1"}, "write_back": False, "require_lossless": False})
    acme = cfg.client_config(Namespace("acme", "s"))
    other = cfg.client_config(Namespace("beta"))
    assert (acme.edge, acme.fetch_timeout_s, acme.write_back) == ("127.0.0.1:7070", 3.5, False)
    assert (acme.tenant, acme.salt, acme.token) == ("acme", "s", "t1")
    assert (other.tenant, other.token) == ("beta", "t0")
    assert acme.require_lossless and other.require_lossless  # loads into vLLM's blocks are always lossless
    assert cfg.lookup_timeout_s == 1.0 and acme.lookup_timeout_s == 1.0
    with pytest.raises(Exception, match="flux"):
        vllm_mod.KdnConnectorConfig.build({"flux": 1})


@pytest.mark.parametrize("isa,dtype", [("vec", torch.float32), ("vec", torch.bfloat16), ("vec16", torch.float32),
                                       ("amx", torch.bfloat16)], ids=str)
def test_the_connectors_writes_are_the_cpu_kernels_own(vllm_mod, isa, dtype):
    """Whatever the CPU kernel (its layout mapped by hand, ``vec``/``vec16``, or learned from the
    kernel at start, ``amx``): K and V placed by the connector, whole blocks and single tokens
    inside a block, are bit for bit what vLLM's own ``cpu_attn_reshape_and_cache`` writes, and
    read back as written."""
    from kdn.artifact import Section
    from kdn.integrations.vllm.connector import _cpu_write_kernel

    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM never picks the amx kernel here")
    write = _cpu_write_kernel(isa)
    nb, H, bs, D, C = 4, 2, 32, 64, 64
    key, value = torch.randn(nb * bs, H, D).to(dtype), torch.randn(nb * bs, H, D).to(dtype)  # (T, H, D)
    key[:16], value[:16] = 0, 0  # tokens the engine already holds: not written by the load below
    ref = torch.zeros(nb, H, bs, 2 * D, dtype=dtype)
    write(key, value, ref)
    ours = torch.zeros_like(ref)
    paged = vllm_mod.PagedCache.of(vllm_mod.EngineGeometry(1, H, D, dtype, bs, C), [ours], "CPU_ATTN", isa, 0, write)
    for c in range(nb * bs // C):  # chunk 0 from token 16 on (single tokens), chunk 1 whole blocks
        for kind, x in (("k", key), ("v", value)):
            paged.placer(list(range(nb)), 16, c * C, (c + 1) * C)(Section(0, kind, x[c * C : (c + 1) * C].transpose(0, 1)))
    assert torch.equal(ours.view(torch.int16) if dtype == torch.bfloat16 else ours,
                       ref.view(torch.int16) if dtype == torch.bfloat16 else ref)
    back = paged.gather(list(range(nb)), 0, nb * bs)  # (1, 2, H, T, D)
    assert torch.equal(back[0, 0], key.transpose(0, 1)) and torch.equal(back[0, 1], value.transpose(0, 1))
