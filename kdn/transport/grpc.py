"""``EdgeService`` over gRPC: the control transport, and the byte path each fetch takes.

:class:`GrpcEdgeTransport` is a thin adapter over :mod:`kdn.wire` (calls by
:class:`kdn.wire.client_calls.EdgeCalls`, Fetch frames read zero-copy by :mod:`kdn.wire.frames`).
Lookup always goes over gRPC; payload bytes take the fastest path the edge offers: shared memory
on the same host (:mod:`kdn.transport.shm`: the segment is named over the bulk socket, or in the
gRPC answer while the bulk path is not usable), else the bulk byte path
(:mod:`kdn.transport.bulk`), else the gRPC stream. Each byte path keeps its own state and back-off.
"""

from __future__ import annotations

from contextlib import aclosing, closing
from typing import Any, AsyncIterator, Sequence

from kdn.artifact import ArtifactReader
from kdn.errors import InvalidInput, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.transport.base import EdgeTransport, FetchStats, reader_pool
from kdn.transport.bulk import BulkPath
from kdn.transport.shm import ShmPath
from kdn.wire.bulk import BufferPool
from kdn.wire.channel import aio_channel
from kdn.wire.client_calls import EdgeCalls
from kdn.wire.convert import FetchSpec
from kdn.wire.errors import rpc_errors
from kdn.wire.frames import decode_chunk
from kdn.wire.tls import TlsFiles


class GrpcEdgeTransport(EdgeTransport):
    """``EdgeService`` over gRPC (``grpc.aio``). Create and use it inside one event loop.
    ``channel`` replaces the socket (an in-process channel in tests; no bulk path then).

    ``shm``: ask for shared-memory answers (:attr:`shm_path`); ``bulk``: use the edge's bulk byte
    path when it offers one (:attr:`bulk_path`, never with TLS), received into reused buffers
    from ``buffers``; a failed bulk connection rests that path ``bulk_backoff_s``. ``bulk_local``:
    to an edge on this host (a loopback address), connect over its same-host socket when it
    offers one (False: over TCP, as from another host)."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        shm: bool = False,
        bulk: bool = True,
        tls: TlsFiles | None = None,
        channel: Any = None,
        buffers: BufferPool | None = None,
        bulk_backoff_s: float = 5.0,
        bulk_local: bool = True,
    ) -> None:
        self.name = address
        self.address = address
        self.shm = shm
        self._channel = channel if channel is not None else aio_channel(address, tls=tls)
        self.calls = EdgeCalls(self._channel, address, token=token)
        self.shm_path = ShmPath(address) if shm else None
        self.bulk_path = (BulkPath(address, self.calls.open_bulk, buffers=buffers, backoff_s=bulk_backoff_s,
                                   on_offer=self.shm_path.fit if self.shm_path is not None else None,
                                   local=bulk_local)
                          if bulk and tls is None and channel is None else None)
        self.pool = reader_pool()

    async def lookup(
        self, fingerprint: ModelFingerprint, namespace: Namespace, keys: Sequence[ChunkKey], *, timeout: float,
        probe: bool = False,
    ) -> int:
        return await self.calls.lookup(keys, fingerprint, namespace, timeout=timeout, probe=probe)

    async def fetch(
        self, spec: FetchSpec, *, timeout: float, next_keys: Sequence[ChunkKey] = ()
    ) -> AsyncIterator[tuple[bytes | memoryview, str]]:
        use_shm = self.shm
        got = await self.bulk_path.fetch(spec, next_keys, shm=use_shm, timeout=timeout) if self.bulk_path else None
        if got is not None:
            buf, size, text = got
            if buf is not None:
                assert self.bulk_path is not None
                with self.bulk_path.lent(buf, size) as view:
                    yield view, "bulk"  # the consumer reads it before asking for more
                return
            assert self.shm_path is not None  # a segment on this host, named over the bulk socket
            art = self.shm_path.map(spec, text, size)
            if art is not None:  # else recycled between the answer and the mapping: ask gRPC (which retries once)
                with closing(art):
                    yield art.data, "shm"  # the consumer verifies while it copies, before the next piece
                return
        for attempt in range(2):
            call = self.calls.fetch(spec, next_keys, shm=use_shm, timeout=timeout)
            yielded = False
            try:
                with rpc_errors(self.address):
                    total = 0
                    async for raw in call:
                        msg = decode_chunk(raw)  # msg.data: a view into the received message, no copy
                        if msg.total_size:
                            total = msg.total_size
                        if msg.shm_name:
                            if not use_shm or self.shm_path is None:  # an edge's answer is input: refuse, never assert
                                raise InvalidInput(f"{self.address} answered with shared memory although it was not "
                                                   "asked for it")
                            art = self.shm_path.map(spec, msg.shm_name, total or None)
                            if art is None:
                                if attempt == 0 and not yielded:
                                    call.cancel()
                                    break  # the segment is gone: ask again for the bytes themselves
                                raise Unavailable(f"shared-memory segment {msg.shm_name!r} vanished ({self.address})")
                            yielded = True
                            with closing(art):
                                yield art.data, "shm"  # the consumer verifies while it copies, before the next piece
                        elif len(msg.data):
                            yielded = True
                            yield msg.data, "grpc"
                    else:
                        return
            finally:
                if not call.done():
                    call.cancel()
            use_shm = False

    async def fetch_into(
        self, spec: FetchSpec, reader: ArtifactReader, *, timeout: float, next_keys: Sequence[ChunkKey] = ()
    ) -> FetchStats:
        """Shared memory reads ahead when it can (:meth:`ShmPath.fetch_ahead`); over the bulk path
        the container is received in place (:meth:`BulkPath.fetch_into`): raw KV straight into
        the reader's destination. Otherwise :meth:`fetch`'s pieces feed the reader (the
        shared-memory path already reads the bytes where they lie)."""
        if self.shm_path is not None:
            stats = await self.shm_path.fetch_ahead(
                spec, reader, self.bulk_path, timeout=timeout, next_keys=next_keys,
                confirm=lambda: self._confirm(spec, timeout=timeout, next_keys=next_keys),
            )
            if stats is not None:
                return stats
        elif self.bulk_path is not None:
            stats = await self.bulk_path.fetch_into(spec, reader, next_keys, timeout=timeout)
            if stats is not None:
                return stats
        return await super().fetch_into(spec, reader, timeout=timeout, next_keys=next_keys)

    async def _confirm(self, spec: FetchSpec, *, timeout: float, next_keys: Sequence[ChunkKey]) -> None:
        """Ask for ``spec`` over gRPC and drop the answer: the bulk socket broke before the edge
        said yes to a fetch whose bytes were already read ahead."""
        stream = self.fetch(spec, timeout=timeout, next_keys=next_keys)
        async with aclosing(stream):
            async for _piece, _via in stream:
                pass

    async def put(
        self, fingerprint: ModelFingerprint, namespace: Namespace, key: ChunkKey, data: bytes, *, timeout: float
    ) -> bool:
        bulk = self.bulk_path
        if bulk is not None and await bulk.put(data, key=key, fingerprint=fingerprint, namespace=namespace,
                                               timeout=timeout):
            return True  # else the Put did not land over the bulk path: it goes over gRPC
        return await self.calls.put(data, key=key, fingerprint=fingerprint, namespace=namespace, timeout=timeout)

    async def close(self) -> None:
        if self.bulk_path is not None:
            self.bulk_path.close()
        if self.shm_path is not None:
            self.shm_path.close()
        await self._channel.close(grace=None)
        await super().close()
