"""``OriginService``'s messages, both sides: what the origin parses and answers, and the ``Blend``
call a host makes to it.

The origin's side follows :mod:`kdn.wire.convert`'s edge side: each parser names the tenant first
and calls ``authorize(namespace)`` before any other field is read. What differs from the edge, by
contract:

- a Lookup's fingerprint is not read (the origin answers for its own store);
- a Fetch or a Document may name no model (an empty fingerprint): ``fingerprint`` is ``None``,
  and the origin serves what is stored (Fetch) or looks in its default model's documents;
- Compute and Blend carry the prompt's tokens, bounded by the origin's ``max_tokens``
  (``MessageTooLarge`` before they are converted); Blend's document spans stay the flat wire form
  (``[s0, e0, s1, e1, ...]``) for the origin to check.

The Fetch answer is framed by :mod:`kdn.wire.frames`, as at the edge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from kdn.errors import MessageTooLarge
from kdn.keys import ChunkKey, ModelFingerprint, Namespace, parse_fingerprint, parse_key
from kdn.proto import kdn_pb2 as pb
from kdn.wire.channel import auth_metadata
from kdn.wire.convert import key_bytes, lookup_response, namespace_msg, parse_keys, parse_namespace
from kdn.wire.errors import rpc_errors
from kdn.wire.service import service_stub

__all__ = [
    "BlendAnswer", "BlendAsk", "BlendResponse", "ComputeAsk", "DocumentAsk", "OriginCalls", "OriginFetch",
    "OriginLookup", "StatsResponse", "blend_refusal", "blend_request", "blend_response", "compute_response",
    "document_response", "origin_lookup_response", "origin_stats_response", "parse_blend", "parse_blend_answer",
    "parse_compute", "parse_document", "parse_origin_fetch", "parse_origin_lookup",
]  # fmt: skip

BlendResponse = pb.BlendResponse
"""A Blend answer's message type, for annotations outside :mod:`kdn.wire`."""
StatsResponse = pb.StatsResponse
"""A Stats answer's message type, for annotations outside :mod:`kdn.wire`."""

Authorize = Callable[[Namespace], None]


def _authorized(request: Any, authorize: Authorize) -> Namespace:
    ns = parse_namespace(request.namespace)
    authorize(ns)
    return ns


def _optional_fingerprint(raw: bytes) -> ModelFingerprint | None:
    return parse_fingerprint(raw) if raw else None


def _tokens(raw: Sequence[int], *, limit: int, what: str) -> np.ndarray:
    """A prompt's tokens, ``(N,)`` int64; more than ``limit`` is ``MessageTooLarge``."""
    if len(raw) > limit:
        raise MessageTooLarge(f"{what} of {len(raw)} tokens (limit {limit})")
    return np.asarray(raw, dtype=np.int64)


# -- the origin's side: requests -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OriginLookup:
    keys: list[ChunkKey]
    namespace: Namespace


def parse_origin_lookup(request: Any, *, limit: int, authorize: Authorize) -> OriginLookup:
    ns = _authorized(request, authorize)
    return OriginLookup(parse_keys(request.keys, limit=limit), ns)


@dataclass(frozen=True, slots=True)
class OriginFetch:
    key: ChunkKey
    namespace: Namespace
    fingerprint: ModelFingerprint | None
    codec: str = ""
    require_lossless: bool = False


def parse_origin_fetch(request: Any, *, authorize: Authorize) -> OriginFetch:
    ns = _authorized(request, authorize)
    key = parse_key(request.key)
    return OriginFetch(key, ns, _optional_fingerprint(request.fingerprint), request.codec, request.require_lossless)


@dataclass(frozen=True, slots=True)
class ComputeAsk:
    fingerprint: ModelFingerprint
    namespace: Namespace
    tokens: np.ndarray  # (N,) int64
    codec: str = ""


def parse_compute(request: Any, *, max_tokens: int, authorize: Authorize) -> ComputeAsk:
    ns = _authorized(request, authorize)
    fp = parse_fingerprint(request.fingerprint)
    return ComputeAsk(fp, ns, _tokens(request.tokens, limit=max_tokens, what="compute"), request.codec)


@dataclass(frozen=True, slots=True)
class DocumentAsk:
    """``fingerprint`` ``None``: the request names no model. ``emphasis``: the steered variant
    asked for (JSON, :class:`kdn.steer.Emphasis`), empty for the plain document."""

    document: str
    fingerprint: ModelFingerprint | None
    namespace: Namespace
    emphasis: str = ""


def parse_document(request: Any, *, authorize: Authorize) -> DocumentAsk:
    ns = _authorized(request, authorize)
    return DocumentAsk(request.document, _optional_fingerprint(request.fingerprint), ns, request.emphasis)


@dataclass(frozen=True, slots=True)
class BlendAsk:
    fingerprint: ModelFingerprint
    namespace: Namespace
    tokens: np.ndarray  # (N,) int64
    documents: list[int]  # flat [start, end) pairs, unchecked
    codec: str = ""


def parse_blend(request: Any, *, max_tokens: int, authorize: Authorize) -> BlendAsk:
    ns = _authorized(request, authorize)
    fp = parse_fingerprint(request.fingerprint)
    tokens = _tokens(request.tokens, limit=max_tokens, what="blend")
    return BlendAsk(fp, ns, tokens, list(request.documents), request.codec)


# -- the origin's side: answers ------------------------------------------------------------------


class _Stored(NamedTuple):
    tier: str
    node_id: str
    address: str


def origin_lookup_response(available: int, *, node_id: str, address: str) -> Any:
    """``available`` leading keys, each located in this origin's store (tier ``origin``)."""
    return lookup_response([_Stored("origin", node_id, address)] * available, node_id=node_id)


def compute_response(keys: Sequence[ChunkKey], *, computed: int, already_stored: int) -> Any:
    return pb.ComputeResponse(keys=key_bytes(keys), computed=computed, already_stored=already_stored)


def document_response(keys: Sequence[ChunkKey], steer_variant: str = "") -> Any:
    """A document's chunk keys; ``steer_variant``: the id of the steered variant they are of."""
    return pb.DocumentResponse(keys=key_bytes(keys), steer_variant=steer_variant)


def blend_response(
    keys: Sequence[ChunkKey], *, covered_tokens: int, variant: str, documents: int, document_tokens: int,
    recomputed_tokens: int, ratio: float, cached: bool,
) -> BlendResponse:
    return pb.BlendResponse(
        keys=key_bytes(keys), covered_tokens=covered_tokens, variant=variant, documents=documents,
        document_tokens=document_tokens, recomputed_tokens=recomputed_tokens, ratio=ratio, cached=cached,
    )


def blend_refusal(code: str, reason: str) -> BlendResponse:
    """A Blend that blended nothing: a short code and the same in words."""
    return pb.BlendResponse(refused=code, reason=reason)


def origin_stats_response(node_id: str, counters: dict[str, float], details: dict[str, Any]) -> StatsResponse:
    return pb.StatsResponse(node_id=node_id, role="origin", counters=counters, json=json.dumps(details))


# -- a host's side: Blend ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlendAnswer:
    """The origin's answer: the variant's chunk keys (covering ``covered`` prompt tokens), or
    ``refused`` (a short code) and ``reason`` when it blended nothing."""

    keys: tuple[ChunkKey, ...]
    covered: int
    variant: str = ""
    documents: int = 0
    document_tokens: int = 0
    recomputed: int = 0
    ratio: float = 0.0
    cached: bool = False
    refused: str = ""
    reason: str = ""


def blend_request(fingerprint: ModelFingerprint, namespace: Namespace, tokens: Sequence[int],
                  documents: Sequence[tuple[int, int]] = ()) -> Any:
    """``documents``: the prompt's document spans, ``[start, end)`` each (none: found by content)."""
    return pb.BlendRequest(fingerprint=bytes(fingerprint), namespace=namespace_msg(namespace),
                           tokens=[int(t) for t in tokens], documents=[int(x) for s in documents for x in s])


def parse_blend_answer(r: Any) -> BlendAnswer:
    return BlendAnswer(tuple(ChunkKey(bytes(k)) for k in r.keys), int(r.covered_tokens), r.variant, int(r.documents),
                       int(r.document_tokens), int(r.recomputed_tokens), float(r.ratio), bool(r.cached), r.refused,
                       r.reason)


class OriginCalls:
    """``OriginService`` as a host calls it on one channel (Blend), every gRPC status converted
    by :func:`kdn.wire.errors.rpc_errors` naming ``peer``."""

    def __init__(self, channel: Any, peer: str, *, token: str | None = None) -> None:
        self._stub = service_stub(channel, "OriginService")
        self._metadata = auth_metadata(token)
        self._peer = peer

    async def blend(self, fingerprint: ModelFingerprint, namespace: Namespace, tokens: Sequence[int],
                    documents: Sequence[tuple[int, int]] = (), *, timeout: float) -> BlendAnswer:
        req = blend_request(fingerprint, namespace, tokens, documents)
        with rpc_errors(self._peer):
            r = await self._stub.Blend(req, timeout=timeout, metadata=self._metadata)
        return parse_blend_answer(r)
