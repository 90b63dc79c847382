"""A client gets a steered variant only when it names one, and then only that variant (issue 14)."""

from __future__ import annotations

import pytest
import torch

from kdn.artifact import encode_artifact
from kdn.client import ClientConfig, KdnClient
from kdn.testing import MemoryEdgeTransport
from kdn.errors import ConfigError, InvalidInput
from kdn.keys import chunk_keys
from kdn.models import load_model
from kdn.steer import SteerSpec, steer_root
from kdn.steer.methods import full_kv, re_read

CHUNK = 32
DOC = list(range(3, 3 + 3 * CHUNK))
SPEC = SteerSpec("re-read")


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", chunk_size=CHUNK)


def publish(edge, lm, ns, kv, spec, *, root_of=None):
    """Store ``kv``'s full chunks under the keys of ``root_of`` (default: ``spec``'s own chain)."""
    root = steer_root(spec if root_of is None else root_of)
    keys = chunk_keys(DOC, fingerprint=lm.fingerprint, namespace=ns, chunk_size=CHUNK, root=root)
    for i, key in enumerate(keys):
        data = encode_artifact(kv[:, :, :, i * CHUNK : (i + 1) * CHUNK].contiguous(), key=key,
                               parent_key=keys[i - 1] if i else root, fingerprint=lm.fingerprint, chunk_index=i,
                               steer=spec.canonical() if spec else "")
        edge.store[(ns.tenant, bytes(key))] = data
    return keys


def test_plain_and_steered_chains_live_side_by_side_and_each_client_gets_its_own(lm):
    edge = MemoryEdgeTransport()
    plain_cfg = ClientConfig(edge="mem")
    steered_cfg = ClientConfig(edge="mem", steer=SPEC.variant_id)
    plain_kv = full_kv(lm.model, DOC)
    steered = re_read(lm.model, DOC)
    pk = publish(edge, lm, plain_cfg.namespace, plain_kv, None)
    sk = publish(edge, lm, plain_cfg.namespace, steered, SPEC)
    assert not set(pk) & set(sk) and len(edge.store) == 6
    with KdnClient(plain_cfg, transport=edge) as c:
        r = c.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert r.chunks == 3 and torch.equal(r.kv, plain_kv)  # the default is plain
    with KdnClient(steered_cfg, transport=edge) as c:
        r = c.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert r.chunks == 3 and torch.equal(r.kv, steered)
        assert list(r.keys) == sk


def test_a_plain_client_refuses_steered_kv_even_under_a_plain_key(lm):
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem")
    publish(edge, lm, cfg.namespace, re_read(lm.model, DOC), SPEC, root_of=None)
    publish(edge, lm, cfg.namespace, full_kv(lm.model, DOC), None)  # the plain chain ...
    k0 = chunk_keys(DOC, fingerprint=lm.fingerprint, namespace=cfg.namespace, chunk_size=CHUNK)
    bad = encode_artifact(re_read(lm.model, DOC)[:, :, :, :CHUNK].contiguous(), key=k0[0], parent_key=steer_root(None),
                          fingerprint=lm.fingerprint, steer=SPEC.canonical())
    edge.store[(cfg.namespace.tenant, bytes(k0[0]))] = bad  # ... whose first chunk is a steered artifact
    with KdnClient(cfg, transport=edge) as c:
        r = c.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
    assert r.chunks == 0 and r.kv is None and "steered variant" in (r.warning or "")


def test_a_steered_client_refuses_other_kv_and_never_writes_back(lm):
    edge = MemoryEdgeTransport()
    cfg = ClientConfig(edge="mem", steer=SPEC.variant_id)
    kv = full_kv(lm.model, DOC)
    publish(edge, lm, cfg.namespace, kv, None, root_of=SPEC)  # plain KV under the variant's keys
    with KdnClient(cfg, transport=edge) as c:
        r = c.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert r.chunks == 0 and "plain KV" in (r.warning or "")
        other = SteerSpec("re-read", ((0, 5),))
        edge.store.clear()
        publish(edge, lm, cfg.namespace, kv, other, root_of=SPEC)  # another variant's header
        r = c.reuse(DOC, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert r.chunks == 0 and "is not steered variant" in (r.warning or "")
        layers = [(kv[l, 0].unsqueeze(0), kv[l, 1].unsqueeze(0)) for l in range(kv.shape[0])]
        keys = c.keys_for(DOC, lm.fingerprint, CHUNK)
        assert not c.schedule_write_back(layers, keys, fingerprint=lm.fingerprint, chunk_size=CHUNK, start=0)
    assert edge.calls.get("put", 0) == 0


def test_variant_ids_are_checked_and_normalised():
    assert ClientConfig(edge="mem", steer="plain").steer == ""
    assert ClientConfig(edge="mem", steer=SPEC.variant_id.upper()).steer == SPEC.variant_id
    with pytest.raises((ConfigError, InvalidInput, ValueError)):
        ClientConfig(edge="mem", steer="zz")
