"""A small admin-oriented client for one edge: fetch, put, lookup, prefetch, hints, stats.

Inference hosts use :mod:`kdn.client` (fallbacks, pipelining, integrations); this one is for
operators, ``kdn edge pin ...``, ``kdn stats`` and tests. Both flavours share the request
builders; errors are :mod:`kdn.errors` (converted once, by ``from_rpc_error``)::

    async with AsyncEdgeClient("127.0.0.1:50061", token="s3cret") as c:
        data = await c.fetch(key, fingerprint=fp, namespace=Namespace("acme"))
        await c.pin([key], fingerprint=fp, namespace=Namespace("acme"))

    with EdgeClient("127.0.0.1:50061") as c:
        print(c.stats())
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kdn.edge.shm import DEFAULT_SHM_DIR, SegmentCache, ShmArtifact
from kdn.wire.frames import decode_chunk, identity
from kdn.errors import ArtifactCorrupt, MessageTooLarge, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pbg
from kdn.wire.channel import (
    DEFAULT_DEADLINE_S,
    MAX_MESSAGE,
    STREAM_PIECE,
    TlsFiles,
    aio_channel,
    auth_metadata,
    split_pieces,
    sync_channel,
)
from kdn.wire.errors import from_rpc_error

Action = pb.HintRequest.Action


@dataclass(frozen=True, slots=True)
class EdgeStats:
    node_id: str
    counters: dict[str, float]
    details: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "counters": self.counters, "details": self.details}


def _ns(namespace: Namespace) -> pb.Namespace:
    return pb.Namespace(tenant=namespace.tenant, salt=namespace.salt)


def fetch_request(
    key: ChunkKey, *, fingerprint: ModelFingerprint, namespace: Namespace, next_keys: Sequence[ChunkKey] = (),
    shm: bool = False, require_lossless: bool = False, codec: str = "",
) -> pb.FetchRequest:
    return pb.FetchRequest(
        fingerprint=bytes(fingerprint), namespace=_ns(namespace), key=bytes(key), next_keys=[bytes(k) for k in next_keys],
        shm=shm, require_lossless=require_lossless, codec=codec,
    )


def hint_request(
    action: int, *, fingerprint: ModelFingerprint, namespace: Namespace, keys: Sequence[ChunkKey] = (),
    document: str = "", ttl_s: float = 0.0, priority: int = 0, cron: str = "", schedule_id: str = "",
) -> pb.HintRequest:
    return pb.HintRequest(
        action=action, fingerprint=bytes(fingerprint), namespace=_ns(namespace), keys=[bytes(k) for k in keys],
        document=document, ttl_s=ttl_s, priority=priority, cron=cron, schedule_id=schedule_id,
    )


def _put_messages(data: bytes, key: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace, piece: int):
    header = pb.PutHeader(fingerprint=bytes(fingerprint), namespace=_ns(namespace), key=bytes(key), total_size=len(data))
    first = True
    for view in split_pieces(data, piece) if data else [b""]:
        yield pb.PutChunk(header=header, data=bytes(view)) if first else pb.PutChunk(data=bytes(view))
        first = False


def _stats(resp: pb.StatsResponse) -> EdgeStats:
    return EdgeStats(resp.node_id, dict(resp.counters), json.loads(resp.json) if resp.json else {})


class AsyncEdgeClient:
    """grpc.aio client for one edge; every call has a deadline."""

    def __init__(
        self, address: str, *, token: str | None = None, tls: TlsFiles | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S, max_message: int = MAX_MESSAGE, shm_dir: str = DEFAULT_SHM_DIR,
    ) -> None:
        self.address = address
        self._md = auth_metadata(token)
        self._deadline = deadline_s
        self._channel = aio_channel(address, tls=tls, max_message=max_message)
        self._stub = pbg.EdgeServiceStub(self._channel)
        self._fetch = self._channel.unary_stream(
            "/kdn.v1.EdgeService/Fetch", request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=identity,
        )
        self.segments = SegmentCache(shm_dir)

    async def __aenter__(self) -> "AsyncEdgeClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self.segments.close()
        await self._channel.close(grace=None)

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Poll the standard health service until SERVING (or raise Unavailable)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        last: Exception | None = None
        while loop.time() < end:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last = exc
            await asyncio.sleep(0.05)
        raise Unavailable(f"edge {self.address} not ready after {timeout}s ({last})")

    async def fetch(self, key: ChunkKey, *, fingerprint: ModelFingerprint, namespace: Namespace,
                    next_keys: Sequence[ChunkKey] = (), require_lossless: bool = False) -> bytes:
        data, _ = await self.fetch_with_source(
            key, fingerprint=fingerprint, namespace=namespace, next_keys=next_keys, require_lossless=require_lossless
        )
        return data

    async def fetch_with_source(self, key: ChunkKey, *, fingerprint: ModelFingerprint, namespace: Namespace,
                                next_keys: Sequence[ChunkKey] = (), require_lossless: bool = False) -> tuple[bytes, str]:
        """Container bytes (not verified here: the caller decodes with ArtifactReader) and the source tier."""
        req = fetch_request(key, fingerprint=fingerprint, namespace=namespace, next_keys=next_keys,
                            require_lossless=require_lossless)
        pieces: list[memoryview] = []
        source, total = "", 0
        try:
            async for raw in self._fetch(req, timeout=self._deadline, metadata=self._md):
                chunk = decode_chunk(raw)
                if not pieces:
                    source, total = chunk.source, chunk.total_size
                pieces.append(chunk.data)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc
        data = b"".join(pieces)  # the one copy: views of the received messages into one buffer
        if len(data) != total:
            raise ArtifactCorrupt(f"edge announced {total} bytes and sent {len(data)}")
        return data, source

    async def fetch_shm(self, key: ChunkKey, *, fingerprint: ModelFingerprint, namespace: Namespace,
                        verify: bool = True) -> ShmArtifact:
        """Same-host path: the edge hands over a shared-memory segment; mapped and verified here."""
        req = fetch_request(key, fingerprint=fingerprint, namespace=namespace, shm=True)
        try:
            chunks = [decode_chunk(c) async for c in self._fetch(req, timeout=self._deadline, metadata=self._md)]
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc
        first = chunks[0]
        if not first.shm_name:
            raise Unavailable("edge did not offer shared memory")
        return self.segments.open(first.shm_name, size=first.total_size, expect_key=key,
                                  expect_fingerprint=fingerprint, verify=verify)

    async def put(self, data: bytes, *, key: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace,
                  piece: int = STREAM_PIECE) -> bool:
        try:
            resp = await self._stub.Put(_put_messages(data, key, fingerprint, namespace, piece),
                                        timeout=self._deadline, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc
        return resp.stored

    async def lookup(self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace,
                     local_only: bool = False) -> pb.LookupResponse:
        req = pb.LookupRequest(fingerprint=bytes(fingerprint), namespace=_ns(namespace),
                               keys=[bytes(k) for k in keys], local_only=local_only)
        try:
            return await self._stub.Lookup(req, timeout=self._deadline, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc

    async def prefetch(self, keys: Sequence[ChunkKey] = (), *, fingerprint: ModelFingerprint, namespace: Namespace,
                       document: str = "") -> int:
        req = pb.PrefetchRequest(fingerprint=bytes(fingerprint), namespace=_ns(namespace),
                                 keys=[bytes(k) for k in keys], document=document)
        try:
            return (await self._stub.Prefetch(req, timeout=self._deadline, metadata=self._md)).queued
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc

    async def hint(self, request: pb.HintRequest) -> pb.HintResponse:
        try:
            return await self._stub.Hint(request, timeout=self._deadline, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc

    async def stats(self) -> EdgeStats:
        try:
            return _stats(await self._stub.Stats(pb.StatsRequest(), timeout=self._deadline, metadata=self._md))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc


class EdgeClient:
    """Blocking twin of :class:`AsyncEdgeClient` for the CLI and scripts."""

    def __init__(
        self, address: str, *, token: str | None = None, tls: TlsFiles | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S, max_message: int = MAX_MESSAGE,
    ) -> None:
        self.address = address
        self._md = auth_metadata(token)
        self._deadline = deadline_s
        self._channel = sync_channel(address, tls=tls, max_message=max_message)
        self._stub = pbg.EdgeServiceStub(self._channel)

    def __enter__(self) -> "EdgeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self._deadline, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc

    def fetch(self, key: ChunkKey, *, fingerprint: ModelFingerprint, namespace: Namespace,
              max_bytes: int = 1 << 30) -> bytes:
        req = fetch_request(key, fingerprint=fingerprint, namespace=namespace)
        pieces: list[bytes] = []
        size = 0
        try:
            for chunk in self._stub.Fetch(req, timeout=self._deadline, metadata=self._md):
                size += len(chunk.data)
                if size > max_bytes:
                    raise MessageTooLarge(f"edge sent more than {max_bytes} bytes")
                pieces.append(chunk.data)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc
        return b"".join(pieces)

    def put(self, data: bytes, *, key: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace) -> bool:
        try:
            resp = self._stub.Put(_put_messages(data, key, fingerprint, namespace, STREAM_PIECE),
                                  timeout=self._deadline, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer=self.address) from exc
        return resp.stored

    def lookup(self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace) -> pb.LookupResponse:
        req = pb.LookupRequest(fingerprint=bytes(fingerprint), namespace=_ns(namespace), keys=[bytes(k) for k in keys])
        return self._call(self._stub.Lookup, req)

    def prefetch(self, keys: Sequence[ChunkKey] = (), *, fingerprint: ModelFingerprint, namespace: Namespace,
                 document: str = "") -> int:
        req = pb.PrefetchRequest(fingerprint=bytes(fingerprint), namespace=_ns(namespace),
                                 keys=[bytes(k) for k in keys], document=document)
        return self._call(self._stub.Prefetch, req).queued

    def hint(self, request: pb.HintRequest) -> pb.HintResponse:
        return self._call(self._stub.Hint, request)

    def stats(self) -> EdgeStats:
        return _stats(self._call(self._stub.Stats, pb.StatsRequest()))
