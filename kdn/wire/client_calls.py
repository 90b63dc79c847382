"""``EdgeService`` as a host client calls it: requests built by :mod:`kdn.wire.convert`, answers
parsed into KDN types, every gRPC status converted by :func:`kdn.wire.errors.rpc_errors`.

One :class:`EdgeCalls` per channel. The Fetch is the exception to "parsed here": it returns the
raw call, whose frames the caller reads zero-copy with :func:`kdn.wire.frames.decode_chunk` inside
``rpc_errors`` (the caller owns the call: it cancels it when it stops reading).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pb_grpc
from kdn.wire.calls import fetch_method
from kdn.wire.channel import STREAM_PIECE, auth_metadata
from kdn.wire.convert import (
    BulkOffer, FetchSpec, NodeStats, lookup_request, parse_bulk_offer, parse_locations, parse_stats, put_messages,
)
from kdn.wire.errors import rpc_errors

__all__ = ["EdgeCalls"]


class EdgeCalls:
    """The client side of ``EdgeService`` on one channel. ``token``: the bearer token every call
    carries unless a call names another."""

    def __init__(self, channel: Any, address: str, *, token: str | None = None) -> None:
        self.address = address
        self.metadata = auth_metadata(token)
        self._stub = pb_grpc.EdgeServiceStub(channel)
        self._fetch = fetch_method(channel)

    def _meta(self, token: str | None) -> tuple[tuple[str, str], ...]:
        return self.metadata if token is None else auth_metadata(token)

    async def _lookup(self, keys: Sequence[ChunkKey], fingerprint: ModelFingerprint, namespace: Namespace, *,
                      probe: bool, timeout: float, token: str | None) -> Any:
        req = lookup_request(keys, fingerprint=fingerprint, namespace=namespace, probe=probe)
        with rpc_errors(self.address):
            return await self._stub.Lookup(req, timeout=timeout, metadata=self._meta(token))

    async def lookup(self, keys: Sequence[ChunkKey], fingerprint: ModelFingerprint, namespace: Namespace, *,
                     timeout: float, probe: bool = False, token: str | None = None) -> int:
        """How many leading keys of the chain ``keys`` the edge can serve (at most ``len(keys)``)."""
        resp = await self._lookup(keys, fingerprint, namespace, probe=probe, timeout=timeout, token=token)
        return min(int(resp.available), len(keys))

    async def locate(self, keys: Sequence[ChunkKey], fingerprint: ModelFingerprint, namespace: Namespace, *,
                     timeout: float, token: str | None = None) -> tuple[int, list[str]]:
        """``(available, tiers)``: :meth:`lookup`'s count and the tier the edge names for each of
        those keys (as many as it names)."""
        resp = await self._lookup(keys, fingerprint, namespace, probe=False, timeout=timeout, token=token)
        n = min(int(resp.available), len(keys))
        return n, parse_locations(resp, n)

    def fetch(self, spec: FetchSpec, next_keys: Sequence[ChunkKey] = (), *, shm: bool, timeout: float) -> Any:
        """The raw Fetch call of ``spec`` (iterate it for ``FetchChunk`` bytes; cancel it when done)."""
        return self._fetch(spec.to_proto(next_keys, shm=shm), timeout=timeout, metadata=self.metadata)

    async def put(self, data: bytes, *, key: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace,
                  timeout: float) -> bool:
        """Stream one container; True when the edge kept it."""
        messages: Iterable[pb.PutChunk] = put_messages(data, key=key, fingerprint=fingerprint, namespace=namespace,
                                                       piece=STREAM_PIECE)
        with rpc_errors(self.address):
            resp = await self._stub.Put(messages, timeout=timeout, metadata=self.metadata)
        return bool(resp.stored)

    async def open_bulk(self, *, timeout: float) -> BulkOffer:
        """A ticket for the edge's bulk byte path (port 0: not offered)."""
        with rpc_errors(self.address):
            return parse_bulk_offer(await self._stub.OpenBulk(pb.BulkRequest(), timeout=timeout, metadata=self.metadata))

    async def stats(self, *, timeout: float) -> NodeStats:
        with rpc_errors(self.address):
            return parse_stats(await self._stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=self.metadata))
