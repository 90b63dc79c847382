"""Steered variants in vLLM: a request that names one loads that variant's chain from the edge.

    llm.generate({"prompt_token_ids": ids, "cache_salt": f"kdn-steer-{VARIANT}"},
                 SamplingParams(..., extra_args={"kv_transfer_params": {"kdn_steer": VARIANT, "kdn_tenant": T}}))

``VARIANT`` is the id ``kdn ingest --emphasize`` prints (:attr:`kdn.steer.SteerSpec.variant_id`,
64 hex digits). Such a request's chunk keys start from the variant's root
(:func:`kdn.steer.parse_variant`) in the namespace of ``kdn_tenant``/``kdn_salt`` (else the
connector's default namespace) — never from the ``cache_salt``, which for these requests only keeps
vLLM's own prefix cache apart: the engine hashes the salt into its blocks, so KV computed on top
of a variant is never found by a request that does not carry the same salt.

Invariants:
- a request gets steered KV only when it names the variant *and* its ``cache_salt`` contains the
  variant id; one that names a malformed id, or a variant without such a salt, is refused with a
  warning and runs without the connector (plain recompute): a steered block never enters vLLM's
  prefix cache under a salt that plain requests share;
- every loaded artifact must be a steered one whose header's spec has the requested variant's
  root (besides the key check every load makes); a plain artifact, or another variant's, fails
  the load and vLLM recomputes;
- a steered request writes nothing back and runs no tokenization probe; it loads the variant's
  tail pieces (stored by the origin, read on top of the steered chunks) like a plain request's;
- a variant the edge does not hold in the request's namespace (another tenant's, or never stored)
  is a plain recompute, logged as a warning and counted (``steer_misses``): the answer is the
  model's plain one, and the log says so.
"""

from __future__ import annotations

from typing import Any

from kdn.errors import ArtifactCorrupt, InvalidInput
from kdn.keys import ROOT_KEY, ChunkKey, Namespace
from kdn.steer import SteerSpec, parse_variant, steer_root

__all__ = ["requested_variant", "variant_namespace", "check_variant_header"]


def requested_variant(cache_salt: str | None, params: dict[str, Any] | None) -> ChunkKey | None:
    """The chain root of the variant a request names (``kv_transfer_params.kdn_steer``), or None
    for a plain request; :class:`InvalidInput` for a malformed id or a ``cache_salt`` that does not
    contain it."""
    params = params or {}
    if not isinstance(params, dict):  # any JSON reaches here from an API request
        raise InvalidInput(f"kv_transfer_params must be an object, got {type(params).__name__}")
    value = params.get("kdn_steer")
    if params.get("kdn") is False or value in (None, "", "plain"):
        return None
    if not isinstance(value, str):
        raise InvalidInput(f"kdn_steer must be a variant id (64 hex digits), got {type(value).__name__}")
    root = parse_variant(value)
    if root == ROOT_KEY:
        return None
    if bytes(root).hex() not in (cache_salt or "").lower():
        raise InvalidInput(f"a request naming steered variant {value[:16]}... needs a cache_salt that contains the "
                           "variant id (e.g. 'kdn-steer-<id>'), so that vLLM's own prefix cache keeps its blocks apart "
                           "from plain ones")
    return root


def variant_namespace(params: dict[str, Any] | None, default: Namespace) -> Namespace:
    """A steered request's namespace: ``kdn_tenant``/``kdn_salt``, else the connector's default."""
    params = params or {}
    if params.get("kdn_tenant"):
        return Namespace(str(params["kdn_tenant"]), str(params.get("kdn_salt", "")))
    return default


def check_variant_header(header: Any, root: bytes) -> None:
    """:class:`ArtifactCorrupt` unless the artifact header names a spec whose root is ``root``."""
    spec = getattr(header, "steer", "")
    if not spec:
        raise ArtifactCorrupt(f"artifact is plain KV, expected steered variant {root.hex()[:16]}...")
    try:
        got = steer_root(SteerSpec.from_canonical(spec))
    except InvalidInput as exc:
        raise ArtifactCorrupt(f"artifact names a malformed steer spec ({exc}), expected {root.hex()[:16]}...") from exc
    if bytes(got) != bytes(root):
        raise ArtifactCorrupt(f"artifact is another steered variant ({spec[:120]!r}), expected {root.hex()[:16]}...")
