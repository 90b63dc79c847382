"""How an inference host talks to its edge: one small interface, a gRPC and an in-memory transport.

:class:`EdgeTransport` is the client's only view of an edge: ``lookup`` (how many leading keys of a
chain are available), ``fetch`` (the bytes of one artifact container named by a
:class:`kdn.wire.convert.FetchSpec`, as an async stream of pieces so decoding can start before the
last byte arrived) and ``put`` (store a container). Every method
takes a deadline and raises only :mod:`kdn.errors` exceptions: gRPC statuses are converted by
:func:`kdn.wire.errors.rpc_errors` (the one place they map), timeouts become ``Unavailable``.
``fetch`` yields ``(piece, via)``: how the bytes travelled is the transport's business, so another
byte path (a bulk socket negotiated over gRPC, say) slots in as one more ``via`` behind the same
three methods, with the same checksums verified by the client. ``fetch_into`` hands the bytes to
an :class:`kdn.artifact.ArtifactReader` instead (what :mod:`kdn.client` uses): by default it feeds
``fetch``'s pieces; over the bulk path raw KV is received straight into the reader's destination.

- :class:`GrpcEdgeTransport` speaks ``EdgeService`` over gRPC, a thin adapter over :mod:`kdn.wire`
  (requests from :mod:`kdn.wire.convert`, Fetch frames read zero-copy by :mod:`kdn.wire.frames`);
  on the same host it asks for the shared-memory answer (``FetchRequest.shm``) and maps the
  segment read-only with :func:`kdn.wire.shm.map_segment` instead of streaming the bytes through
  the socket. It never unlinks a segment: the edge owns their lifetime.
- :class:`FailoverEdgeTransport` puts several edges in preference order: a call whose edge is
  unavailable moves on to the next one, and that edge sits out a backoff before it is tried again.
- :class:`MemoryEdgeTransport` keeps artifacts in a dict: the transport for unit tests (no sockets),
  with fault injection (down, corrupt, slow).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from kdn.artifact import ArtifactReader
from kdn.errors import FingerprintMismatch, InvalidInput, KdnError, NotFound, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pb_grpc
from kdn.wire.calls import fetch_method
from kdn.wire.channel import STREAM_PIECE, aio_channel, auth_metadata, split_pieces
from kdn.wire.convert import FetchSpec, lookup_request, put_header, put_messages
from kdn.wire.errors import rpc_errors
from kdn.wire.frames import decode_chunk
from kdn.wire.bulk import LAND_MIN_BYTES, BufferPool, BulkClient, BulkProtocolError
from kdn.wire.shm import SegmentCache
from kdn.wire.tls import TlsFiles

log = logging.getLogger(__name__)
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
_SEGMENT_GUESSES = 4096  # specs whose last segment name a shared-memory client remembers


@contextlib.asynccontextmanager
async def _deadline(timeout: float, what: str) -> AsyncIterator[None]:
    """``asyncio.timeout(timeout)`` whose expiry is ``Unavailable("<what>: deadline ... exceeded")``."""
    try:
        async with asyncio.timeout(timeout):
            yield
    except TimeoutError as exc:
        raise Unavailable(f"{what}: deadline of {timeout}s exceeded") from exc


class EdgeTransport(ABC):
    """The client's view of one edge. Raises only KdnError subclasses."""

    name: str = "edge"

    @abstractmethod
    async def lookup(
        self, fingerprint: ModelFingerprint, namespace: Namespace, keys: Sequence[ChunkKey], *, timeout: float,
        probe: bool = False,
    ) -> int:
        """How many leading keys of the chain ``keys`` the edge can serve (``probe``: a tokenization
        probe, which the edge counts when it hits; see :meth:`kdn.client.AsyncKdnClient.reuse`)."""

    @abstractmethod
    def fetch(
        self, spec: FetchSpec, *, timeout: float, next_keys: Sequence[ChunkKey] = ()
    ) -> AsyncIterator[tuple[bytes | memoryview, str]]:
        """Yield ``(piece, via)`` for consecutive pieces of ``spec``'s container; ``next_keys`` are
        the chain's following keys (a hint the edge may prefetch)."""

    @abstractmethod
    async def put(
        self, fingerprint: ModelFingerprint, namespace: Namespace, key: ChunkKey, data: bytes, *, timeout: float
    ) -> bool:
        """Store one container; True when the edge kept it."""

    async def fetch_into(
        self, spec: FetchSpec, reader: ArtifactReader, *, timeout: float, next_keys: Sequence[ChunkKey] = ()
    ) -> FetchStats:
        """Fetch ``spec``'s container into ``reader`` (which verifies and decodes it); the caller
        calls ``reader.finish()``. This default feeds the pieces of :meth:`fetch` as they arrive;
        a transport that can receive in place lands the bytes where the reader wants them."""
        stats = FetchStats()
        stream = self.fetch(spec, timeout=timeout, next_keys=next_keys)
        async with aclosing(stream):  # a refused artifact ends its call now, not at garbage collection
            async for piece, via in stream:
                t0 = time.perf_counter()
                reader.feed(piece)
                stats.decode_s += time.perf_counter() - t0
                stats.bytes += len(piece)
                stats.via = via
        return stats

    async def close(self) -> None:
        return None


@dataclass(slots=True)
class FetchStats:
    """How one :meth:`EdgeTransport.fetch_into` went: the path, the bytes, the seconds spent in
    the reader (verifying and decoding; for bytes received in place, hashing them where they landed)."""

    via: str = ""
    bytes: int = 0
    decode_s: float = 0.0


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host in _LOOPBACK_HOSTS or host.startswith("127.") or address.startswith("unix:")


class GrpcEdgeTransport(EdgeTransport):
    """``EdgeService`` over gRPC (``grpc.aio``): a thin adapter over :mod:`kdn.wire`. Create and use
    it inside one event loop. ``channel`` replaces the socket (an in-process channel in tests).

    Payload bytes take the fastest path the edge offers: shared memory on the same host (``shm``:
    the segment is named over the bulk socket when the edge offers it, else in the gRPC answer;
    the mapping is cached by segment name, and the caller's reader verifies while it copies into
    its destination), else the bulk byte path (``bulk``, :mod:`kdn.wire.bulk`: received into a
    reused buffer from :attr:`buffers`), else the gRPC stream. An edge that does not offer the bulk
    path (TLS, switched off, an older edge) is asked once; a bulk connection that fails before its
    first byte falls back to gRPC for that call and rests ``bulk_backoff_s``, and so does one whose
    hello the edge refuses (a full listener, or a ticket it forgot and refused again after one
    renewal: :class:`kdn.wire.bulk.HelloRefused`)."""

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
    ) -> None:
        self.name = address
        self.address = address
        self.shm = shm
        self.bulk = bulk and tls is None and channel is None
        self.buffers = buffers or BufferPool()
        self._metadata = auth_metadata(token)
        self._channel = channel if channel is not None else aio_channel(address, tls=tls)
        self._stub = pb_grpc.EdgeServiceStub(self._channel)
        self._fetch = fetch_method(self._channel)
        self._maps = SegmentCache(max_maps=32) if shm else None
        self._bulk: BulkClient | None = None
        self._bulk_expires = 0.0
        self._bulk_rest_until = 0.0
        self._bulk_backoff_s = bulk_backoff_s
        self._bulk_shm = True  # the edge names segments over the bulk socket (False: over gRPC)
        # the segment each recent spec was last answered with: the next fetch of it reads that
        # mapping while the edge confirms (see _fetch_shm_ahead)
        self._segment_of: OrderedDict[FetchSpec, str] = OrderedDict()
        self.read_ahead = 0  # shared-memory fetches read while the edge answered
        self.land_min_bytes = LAND_MIN_BYTES  # bulk answers this large are received in place

    async def lookup(
        self, fingerprint: ModelFingerprint, namespace: Namespace, keys: Sequence[ChunkKey], *, timeout: float,
        probe: bool = False,
    ) -> int:
        req = lookup_request(keys, fingerprint=fingerprint, namespace=namespace, probe=probe)
        with rpc_errors(self.address):
            resp = await self._stub.Lookup(req, timeout=timeout, metadata=self._metadata)
        return min(int(resp.available), len(keys))

    async def _bulk_client(self, timeout: float) -> BulkClient | None:
        """The bulk connections, negotiated on first use and renewed before the ticket expires;
        None while the path is not offered or rests after a failure."""
        if not self.bulk or time.monotonic() < self._bulk_rest_until:
            return None
        if self._bulk is not None and time.monotonic() < self._bulk_expires:
            return self._bulk
        try:
            with rpc_errors(self.address):
                offer = await self._stub.OpenBulk(pb.BulkRequest(), timeout=timeout, metadata=self._metadata)
        except Unavailable:
            raise
        except KdnError as exc:  # an edge without the RPC (UNIMPLEMENTED) or that refuses it
            log.debug("%s: no bulk path (%s); streaming over gRPC", self.address, exc)
            self.bulk = False
            return None
        if not offer.port:
            self.bulk = False
            return None
        if self._bulk is not None:
            self._bulk.close()
        host = self.address.rsplit(":", 1)[0] if not self.address.startswith("unix:") else "127.0.0.1"

        async def renew() -> bytes:
            """A fresh ticket when the edge forgot ours: once, then the call falls back to gRPC."""
            with rpc_errors(self.address):
                again = await self._stub.OpenBulk(pb.BulkRequest(), timeout=timeout, metadata=self._metadata)
            if again.port != offer.port:
                raise Unavailable(f"{self.address}: the bulk listener moved")
            self._bulk_expires = time.monotonic() + max(0.0, again.ttl_s - 30.0)
            return again.ticket

        self._bulk = BulkClient(host, offer.port, offer.ticket, peer=self.address, renew=renew)
        self._bulk_expires = time.monotonic() + max(0.0, offer.ttl_s - 30.0)
        return self._bulk

    def _bulk_broke(self, exc: BaseException) -> None:
        log.info("%s: bulk byte path failed (%s); gRPC for %.0f s", self.address, exc, self._bulk_backoff_s)
        self._bulk_rest_until = time.monotonic() + self._bulk_backoff_s
        if self._bulk is not None:
            self._bulk.close()
            self._bulk = None

    def _bulk_refused_shm(self, exc: BaseException) -> None:
        """An edge from before the SHM request refuses it (and hangs up): segments are named over
        gRPC from now on, bytes still take the bulk path."""
        log.info("%s: no shared memory over the bulk path (%s); asking over gRPC", self.address, exc)
        self._bulk_shm = False
        self._bulk_broke(exc)

    async def fetch(
        self, spec: FetchSpec, *, timeout: float, next_keys: Sequence[ChunkKey] = ()
    ) -> AsyncIterator[tuple[bytes | memoryview, str]]:
        use_shm = self.shm
        bulk = await self._bulk_client(timeout) if self._bulk_shm or not use_shm else None
        if bulk is not None:
            request = spec.to_proto(next_keys, shm=use_shm).SerializeToString()
            try:
                async with _deadline(timeout, f"Fetch from {self.address}"):
                    buf, size, text = await bulk.fetch(request, self.buffers, shm=use_shm)
            except (OSError, BulkProtocolError) as exc:
                self._bulk_broke(exc)  # nothing was yielded yet: this call goes over gRPC
            except InvalidInput as exc:
                if not use_shm:
                    raise
                self._bulk_refused_shm(exc)
            else:
                if buf is None:  # a shared-memory segment on this host, named over the bulk socket
                    assert self._maps is not None
                    try:
                        art = self._maps.open(text, size=size, verify=False)  # cached by name
                    except (OSError, KdnError) as exc:
                        # recycled between the answer and the mapping: ask gRPC (which retries once)
                        log.debug("%s: segment %r not mapped (%s); asking again", self.address, text, exc)
                    else:
                        self._remember_segment(spec, text)
                        try:
                            # the consumer verifies while it copies what it needs, before the next piece
                            yield art.data, "shm"
                        finally:
                            art.close()
                        return
                else:
                    view = memoryview(buf)[:size]
                    try:
                        yield view, "bulk"  # the consumer reads it before asking for more
                    finally:
                        view.release()
                        self.buffers.give(buf)
                    return
        for attempt in range(2):
            req = spec.to_proto(next_keys, shm=use_shm)
            call = self._fetch(req, timeout=timeout, metadata=self._metadata)
            yielded = False
            try:
                with rpc_errors(self.address):
                    total = 0
                    async for raw in call:
                        msg = decode_chunk(raw)  # msg.data: a view into the received message, no copy
                        if msg.total_size:
                            total = msg.total_size
                        if msg.shm_name:
                            assert self._maps is not None
                            try:
                                # a cached mapping: a published segment never changes
                                art = self._maps.open(msg.shm_name, size=total or None, verify=False)
                            except (OSError, KdnError):
                                if attempt == 0 and not yielded:
                                    call.cancel()
                                    break  # the segment is gone: ask again for the bytes themselves
                                raise Unavailable(f"shared-memory segment {msg.shm_name!r} vanished ({self.address})")
                            self._remember_segment(spec, msg.shm_name)
                            yielded = True
                            try:
                                # the consumer verifies while it copies what it needs, before the next piece
                                yield art.data, "shm"
                            finally:
                                art.close()
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
        """Over the bulk path, the container is received in place (:meth:`BulkClient.fetch_into`):
        raw KV straight into the reader's destination. Shared memory and gRPC feed the reader
        (the shared-memory path already reads the bytes where they lie)."""
        if self.shm:
            stats = await self._fetch_shm_ahead(spec, reader, timeout=timeout, next_keys=next_keys)
            if stats is not None:
                return stats
        bulk = None if self.shm else await self._bulk_client(timeout)
        if bulk is None:
            return await super().fetch_into(spec, reader, timeout=timeout, next_keys=next_keys)
        request = spec.to_proto(next_keys, shm=False).SerializeToString()
        before = reader.received
        try:
            async with _deadline(timeout, f"Fetch from {self.address}"):
                size, _source, reader_s = await bulk.fetch_into(request, reader, self.buffers, self.land_min_bytes)
        except (OSError, BulkProtocolError) as exc:
            self._bulk_broke(exc)
            if reader.received != before:
                # part of the container is in the reader: it cannot start over on another path
                raise Unavailable(f"Fetch from {self.address}: bulk connection broke mid-answer ({exc})") from exc
            return await super().fetch_into(spec, reader, timeout=timeout, next_keys=next_keys)  # over gRPC
        return FetchStats("bulk", size, reader_s)

    def _remember_segment(self, spec: FetchSpec, name: str) -> None:
        self._segment_of[spec] = name
        self._segment_of.move_to_end(spec)
        while len(self._segment_of) > _SEGMENT_GUESSES:
            self._segment_of.popitem(last=False)

    async def _fetch_shm_ahead(
        self, spec: FetchSpec, reader: ArtifactReader, *, timeout: float, next_keys: Sequence[ChunkKey]
    ) -> FetchStats | None:
        """Read the segment this spec was last answered with while the edge answers this fetch.

        The control round trip (~0.35 ms here) was a tenth of a verified 32 MiB shared-memory
        fetch. A published segment never changes (the edge writes a new, randomly named one for
        every publication), so when its mapping is still open the reader verifies and copies it
        while the request is on its way, and the fetch counts only once the edge has answered:
        the edge still authorizes every fetch, counts it, sees ``next_keys``, and its refusal
        (auth, not found) is the fetch's error; the reader's destination then holds bytes the
        caller never uses. Any answer that grants the artifact confirms what was read, whatever
        segment it names: the reader has checked the key, the fingerprint, losslessness if asked,
        and every checksum. None when there is nothing to read ahead (the caller fetches as usual)."""
        name = self._segment_of.get(spec)
        if name is None or self._maps is None or not self._bulk_shm:
            return None
        bulk = await self._bulk_client(timeout)
        view = self._maps.peek(name) if bulk is not None else None
        if view is None:
            self._segment_of.pop(spec, None)
            return None
        assert bulk is not None
        n, spent, fed = len(view), 0.0, False
        refused: BaseException | None = None  # what the reader raised: the fetch's error as it is

        def read() -> None:
            nonlocal spent, fed, refused
            t0 = time.perf_counter()
            try:
                reader.feed(view)
            except BaseException as exc:
                refused = exc
                raise
            finally:
                view.release()
            spent, fed = time.perf_counter() - t0, True

        request = spec.to_proto(next_keys, shm=True).SerializeToString()
        try:
            try:
                async with _deadline(timeout, f"Fetch from {self.address}"):
                    buf, _size, text = await bulk.fetch_shm_ahead(request, self.buffers, read)
            except (OSError, BulkProtocolError, InvalidInput) as exc:
                if exc is refused:
                    raise
                if isinstance(exc, InvalidInput):
                    self._bulk_refused_shm(exc)
                else:
                    self._bulk_broke(exc)
                if not fed:
                    view.release()
                    return None  # nothing read yet: the usual path asks over gRPC
                await self._confirm(spec, timeout=timeout, next_keys=next_keys)
                self.read_ahead += 1
                return FetchStats("shm", n, spent)
        except BaseException:
            view.release()
            self._segment_of.pop(spec, None)
            raise
        if buf is not None:  # the edge sent the bytes this time: they are not needed
            self.buffers.give(buf)
            self._segment_of.pop(spec, None)
        else:
            self._remember_segment(spec, text)
        self.read_ahead += 1
        return FetchStats("shm", n, spent)

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
        bulk = await self._bulk_client(timeout)
        if bulk is not None:
            header = put_header(data, key=key, fingerprint=fingerprint, namespace=namespace)
            try:
                async with _deadline(timeout, f"Put to {self.address}"):
                    await bulk.put(header.SerializeToString(), data)
                return True
            except (OSError, BulkProtocolError) as exc:
                self._bulk_broke(exc)  # the Put did not land: send it over gRPC
        messages = put_messages(data, key=key, fingerprint=fingerprint, namespace=namespace, piece=STREAM_PIECE)
        with rpc_errors(self.address):
            resp = await self._stub.Put(messages, timeout=timeout, metadata=self._metadata)
        return bool(resp.stored)

    async def close(self) -> None:
        if self._bulk is not None:
            self._bulk.close()
            self._bulk = None
        if self._maps is not None:
            self._maps.close()
        await self._channel.close(grace=None)


class FailoverEdgeTransport(EdgeTransport):
    """Edges in preference order (the local edge first). Only ``Unavailable`` moves a call on: a
    refused or missing artifact is an answer from a live edge, not a reason to ask another. A fetch
    that fails after its first piece arrived is not retried elsewhere (the reader already holds
    part of one container); the client then reuses what it verified and recomputes the rest."""

    def __init__(self, transports: Sequence[EdgeTransport], *, backoff_s: float = 5.0) -> None:
        if not transports:
            raise ValueError("FailoverEdgeTransport needs at least one edge")
        self.transports = list(transports)
        self.name = ",".join(getattr(t, "name", "?") for t in self.transports)
        self.shm = any(getattr(t, "shm", False) for t in self.transports)
        self._backoff_s = backoff_s
        self._down_until: dict[int, float] = {}
        self.failovers = 0

    def _order(self) -> list[int]:
        now = time.monotonic()
        up = [i for i in range(len(self.transports)) if self._down_until.get(i, 0.0) <= now]
        down = sorted((i for i in range(len(self.transports)) if i not in up), key=lambda i: self._down_until[i])
        return up + down  # when every edge sits out a backoff, still try them, soonest-back first

    def _failed(self, i: int) -> None:
        self._down_until[i] = time.monotonic() + self._backoff_s
        self.failovers += 1

    async def _each(self, call):
        last: Unavailable | None = None
        for i in self._order():
            try:
                result = await call(self.transports[i])
            except Unavailable as exc:
                self._failed(i)
                last = exc
                continue
            self._down_until.pop(i, None)
            return result
        assert last is not None
        raise last

    async def lookup(
        self, fingerprint: ModelFingerprint, namespace: Namespace, keys: Sequence[ChunkKey], *, timeout: float,
        probe: bool = False,
    ) -> int:
        return await self._each(lambda t: t.lookup(fingerprint, namespace, keys, timeout=timeout, probe=probe))

    async def fetch(
        self, spec: FetchSpec, *, timeout: float, next_keys: Sequence[ChunkKey] = ()
    ) -> AsyncIterator[tuple[bytes | memoryview, str]]:
        last: Unavailable | None = None
        for i in self._order():
            started = False
            try:
                async for piece in self.transports[i].fetch(spec, timeout=timeout, next_keys=next_keys):
                    started = True
                    yield piece
                self._down_until.pop(i, None)
                return
            except Unavailable as exc:
                self._failed(i)
                if started:
                    raise
                last = exc
        assert last is not None
        raise last

    async def fetch_into(
        self, spec: FetchSpec, reader: ArtifactReader, *, timeout: float, next_keys: Sequence[ChunkKey] = ()
    ) -> FetchStats:
        last: Unavailable | None = None
        for i in self._order():
            before = reader.received
            try:
                stats = await self.transports[i].fetch_into(spec, reader, timeout=timeout, next_keys=next_keys)
            except Unavailable as exc:
                self._failed(i)
                if reader.received != before:
                    raise  # the reader holds part of this container: not restarted elsewhere
                last = exc
                continue
            self._down_until.pop(i, None)
            return stats
        assert last is not None
        raise last

    async def put(
        self, fingerprint: ModelFingerprint, namespace: Namespace, key: ChunkKey, data: bytes, *, timeout: float
    ) -> bool:
        return await self._each(lambda t: t.put(fingerprint, namespace, key, data, timeout=timeout))

    async def close(self) -> None:
        for t in self.transports:
            await t.close()


@dataclass(slots=True)
class MemoryEdgeTransport(EdgeTransport):
    """An edge in a dict, for unit tests. Tenants are isolated; faults can be switched on.

    ``down``: every call raises Unavailable. ``corrupt``: keys whose served bytes get one bit
    flipped. ``delay_s``: added to every call (to exercise deadlines).
    """

    fingerprint: ModelFingerprint | None = None
    piece: int = 64 * 1024
    down: bool = False
    delay_s: float = 0.0
    corrupt: set[bytes] = field(default_factory=set)
    store: dict[tuple[str, bytes], bytes] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=lambda: {"lookup": 0, "fetch": 0, "put": 0})
    name: str = "memory"

    async def _enter(self, op: str, fingerprint: ModelFingerprint, timeout: float) -> None:
        self.calls[op] += 1
        if self.delay_s:
            if self.delay_s >= timeout:
                await asyncio.sleep(timeout)
                raise Unavailable(f"memory edge: deadline of {timeout}s exceeded")
            await asyncio.sleep(self.delay_s)
        if self.down:
            raise Unavailable("memory edge is down")
        if self.fingerprint is not None and bytes(fingerprint) != bytes(self.fingerprint):
            raise FingerprintMismatch("memory edge serves another model")

    async def lookup(
        self, fingerprint: ModelFingerprint, namespace: Namespace, keys: Sequence[ChunkKey], *, timeout: float,
        probe: bool = False,
    ) -> int:
        await self._enter("lookup", fingerprint, timeout)
        n = 0
        for k in keys:
            if (namespace.tenant, bytes(k)) not in self.store:
                break
            n += 1
        return n

    async def fetch(
        self, spec: FetchSpec, *, timeout: float, next_keys: Sequence[ChunkKey] = ()
    ) -> AsyncIterator[tuple[bytes | memoryview, str]]:
        await self._enter("fetch", spec.fingerprint, timeout)
        key = bytes(spec.key)
        data = self.store.get((spec.namespace.tenant, key))
        if data is None:
            raise NotFound(f"memory edge has no {key.hex()[:16]}…")
        if key in self.corrupt:
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x10
            data = bytes(flipped)
        for piece in split_pieces(data, self.piece):
            yield bytes(piece), "memory"
            await asyncio.sleep(0)

    async def put(
        self, fingerprint: ModelFingerprint, namespace: Namespace, key: ChunkKey, data: bytes, *, timeout: float
    ) -> bool:
        await self._enter("put", fingerprint, timeout)
        self.store[(namespace.tenant, bytes(key))] = bytes(data)
        return True
