"""How a vLLM request names a steered variant (kdn.integrations.vllm_steer); no engine needed."""

from __future__ import annotations

import pytest

from kdn.artifact import decode_artifact, encode_artifact
from kdn.errors import ArtifactCorrupt, InvalidInput
from kdn.integrations.vllm_steer import check_variant_header, requested_variant, variant_namespace
from kdn.keys import DEFAULT_NAMESPACE, Namespace, chunk_keys
from kdn.steer import SteerSpec, steer_root

SPEC = SteerSpec("re-read", ((0, 4),))
VID = SPEC.variant_id


def test_a_request_names_a_variant_only_with_a_salt_that_keeps_vllms_cache_apart() -> None:
    assert requested_variant(None, None) is None and requested_variant("t", {}) is None
    assert requested_variant(None, {"kdn_steer": ""}) is None and requested_variant(None, {"kdn_steer": "plain"}) is None
    assert requested_variant(f"kdn-steer-{VID}", {"kdn_steer": VID}) == steer_root(SPEC)
    assert requested_variant(f"kdn-steer-{VID}", {"kdn_steer": VID.upper()}) == steer_root(SPEC)
    assert requested_variant(f"kdn-steer-{VID}", {"kdn_steer": VID, "kdn": False}) is None  # opted out of KDN
    with pytest.raises(InvalidInput, match="cache_salt that contains the variant id"):
        requested_variant(None, {"kdn_steer": VID})  # blocks would enter vLLM's cache under plain hashes
    with pytest.raises(InvalidInput, match="cache_salt that contains the variant id"):
        requested_variant("tenant-a", {"kdn_steer": VID})
    with pytest.raises(InvalidInput, match="variant id"):
        requested_variant("x", {"kdn_steer": "not-hex"})
    with pytest.raises(InvalidInput, match="variant id"):
        requested_variant("x", {"kdn_steer": 7})


def test_a_steered_requests_namespace_never_comes_from_its_salt() -> None:
    default = Namespace("default")
    assert variant_namespace({"kdn_steer": VID}, default) == default
    assert variant_namespace({"kdn_steer": VID, "kdn_tenant": "acme", "kdn_salt": "s"}, default) == Namespace("acme", "s")


def test_only_an_artifact_of_the_requested_variant_passes() -> None:
    import torch

    kv = torch.zeros(1, 2, 1, 4, 2)
    root = steer_root(SPEC)
    key = chunk_keys([1, 2, 3, 4], fingerprint=bytes(32), namespace=DEFAULT_NAMESPACE, chunk_size=4, root=root)[0]
    steered = decode_artifact(encode_artifact(kv, key=key, parent_key=root, fingerprint=bytes(32), steer=SPEC.canonical()))
    check_variant_header(steered.header, bytes(root))
    plain = decode_artifact(encode_artifact(kv, key=key, parent_key=root, fingerprint=bytes(32)))
    with pytest.raises(ArtifactCorrupt, match="plain KV"):
        check_variant_header(plain.header, bytes(root))
    other = SteerSpec("re-read", ((0, 3),))
    with pytest.raises(ArtifactCorrupt, match="another steered variant"):
        check_variant_header(steered.header, bytes(steer_root(other)))
