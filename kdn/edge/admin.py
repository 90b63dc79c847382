"""A small admin-oriented client for one edge: fetch, put, lookup, prefetch, hints, stats.

Inference hosts use :mod:`kdn.client` (fallbacks, pipelining, integrations); this one is for
operators, ``kdn edge pin ...``, ``kdn stats`` and tests. Both flavours are thin adapters over
:mod:`kdn.wire`: requests from :mod:`kdn.wire.convert`, errors turned into :mod:`kdn.errors` by
:func:`kdn.wire.errors.rpc_errors`, shared-memory answers read by :mod:`kdn.wire.shm`::

    async with AsyncEdgeClient("127.0.0.1:50061", token="s3cret") as c:
        data = await c.fetch(key, fingerprint=fp, namespace=Namespace("acme"))
        await c.pin([key], fingerprint=fp, namespace=Namespace("acme"))

    with EdgeClient("127.0.0.1:50061") as c:
        print(c.stats())
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import grpc

from kdn.errors import ArtifactCorrupt, MessageTooLarge, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.wire.calls import collect_fetch, fetch_method
from kdn.wire.channel import DEFAULT_DEADLINE_S, MAX_MESSAGE, STREAM_PIECE, aio_channel, auth_metadata, sync_channel
from kdn.wire import health
from kdn.wire.convert import (
    HintAction,
    NodeStats,
    fetch_request,
    hint_request,
    lookup_request,
    parse_stats,
    prefetch_request,
    put_messages,
    stats_request,
)
from kdn.wire.errors import rpc_errors
from kdn.wire.service import service_stub
from kdn.wire.frames import decode_chunk
from kdn.wire.shm import DEFAULT_SHM_DIR, SegmentCache, ShmArtifact
from kdn.wire.tls import TlsFiles

__all__ = ["Action", "AsyncEdgeClient", "EdgeClient", "EdgeStats", "fetch_request", "hint_request"]

Action = HintAction


EdgeStats = NodeStats
"""A ``Stats`` answer (node id, counters, details), as :mod:`kdn.wire.convert` parses it."""


class AsyncEdgeClient:
    """grpc.aio client for one edge; every call has a deadline."""

    def __init__(
        self, address: str, *, token: str | None = None, tls: TlsFiles | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S, max_message: int = MAX_MESSAGE, shm_dir: str = DEFAULT_SHM_DIR,
        channel: Any = None,
    ) -> None:
        """``channel`` replaces the socket to ``address`` (:mod:`kdn.wire.inproc` in unit tests)."""
        self.address = address
        self._md = auth_metadata(token)
        self._deadline = deadline_s
        self._channel = channel if channel is not None else aio_channel(address, tls=tls, max_message=max_message)
        self._stub = service_stub(self._channel, "EdgeService")
        self._fetch = fetch_method(self._channel)
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
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        last: Exception | None = None
        while loop.time() < end:
            try:
                if await health.check(self._channel, timeout=1.0):
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
        with rpc_errors(self.address):
            got = await collect_fetch(self._fetch(req, timeout=self._deadline, metadata=self._md), peer=self.address)
        if len(got.data) != got.total_size:
            raise ArtifactCorrupt(f"edge announced {got.total_size} bytes and sent {len(got.data)}")
        return got.data, got.source

    async def fetch_shm(self, key: ChunkKey, *, fingerprint: ModelFingerprint, namespace: Namespace,
                        verify: bool = True) -> ShmArtifact:
        """Same-host path: the edge hands over a shared-memory segment; mapped and verified here."""
        req = fetch_request(key, fingerprint=fingerprint, namespace=namespace, shm=True)
        with rpc_errors(self.address):
            chunks = [decode_chunk(c) async for c in self._fetch(req, timeout=self._deadline, metadata=self._md)]
        first = chunks[0]
        if not first.shm_name:
            raise Unavailable("edge did not offer shared memory")
        return self.segments.open(first.shm_name, size=first.total_size, expect_key=key,
                                  expect_fingerprint=fingerprint, verify=verify)

    async def _call(self, method: Any, request: Any) -> Any:
        with rpc_errors(self.address):
            return await method(request, timeout=self._deadline, metadata=self._md)

    async def put(self, data: bytes, *, key: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace,
                  piece: int = STREAM_PIECE) -> bool:
        messages = put_messages(data, key=key, fingerprint=fingerprint, namespace=namespace, piece=piece)
        return (await self._call(self._stub.Put, messages)).stored

    async def lookup(self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace,
                     local_only: bool = False) -> Any:
        req = lookup_request(keys, fingerprint=fingerprint, namespace=namespace, local_only=local_only)
        return await self._call(self._stub.Lookup, req)

    async def prefetch(self, keys: Sequence[ChunkKey] = (), *, fingerprint: ModelFingerprint, namespace: Namespace,
                       document: str = "") -> int:
        req = prefetch_request(keys, fingerprint=fingerprint, namespace=namespace, document=document)
        return (await self._call(self._stub.Prefetch, req)).queued

    async def hint(self, request: Any) -> Any:
        return await self._call(self._stub.Hint, request)

    async def stats(self) -> EdgeStats:
        return parse_stats(await self._call(self._stub.Stats, stats_request()))


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
        self._stub = service_stub(self._channel, "EdgeService")
        self._fetch = fetch_method(self._channel)

    def __enter__(self) -> "EdgeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        with rpc_errors(self.address):
            return method(request, timeout=self._deadline, metadata=self._md)

    def fetch(self, key: ChunkKey, *, fingerprint: ModelFingerprint, namespace: Namespace,
              max_bytes: int = 1 << 30) -> bytes:
        req = fetch_request(key, fingerprint=fingerprint, namespace=namespace)
        pieces: list[memoryview] = []
        size = 0
        with rpc_errors(self.address):
            for raw in self._fetch(req, timeout=self._deadline, metadata=self._md):
                chunk = decode_chunk(raw)
                size += len(chunk.data)
                if size > max_bytes:
                    raise MessageTooLarge(f"edge sent more than {max_bytes} bytes")
                pieces.append(chunk.data)
        return b"".join(pieces)

    def put(self, data: bytes, *, key: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace) -> bool:
        return self._call(self._stub.Put, put_messages(data, key=key, fingerprint=fingerprint, namespace=namespace)).stored

    def lookup(self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace) -> Any:
        return self._call(self._stub.Lookup, lookup_request(keys, fingerprint=fingerprint, namespace=namespace))

    def prefetch(self, keys: Sequence[ChunkKey] = (), *, fingerprint: ModelFingerprint, namespace: Namespace,
                 document: str = "") -> int:
        req = prefetch_request(keys, fingerprint=fingerprint, namespace=namespace, document=document)
        return self._call(self._stub.Prefetch, req).queued

    def hint(self, request: Any) -> Any:
        return self._call(self._stub.Hint, request)

    def stats(self) -> EdgeStats:
        return parse_stats(self._call(self._stub.Stats, stats_request()))

    def origin_stats(self) -> EdgeStats:
        """The same address asked as an origin (``OriginService.Stats``): ``kdn stats`` of an origin."""
        return parse_stats(self._call(service_stub(self._channel, "OriginService").Stats, stats_request()))
