"""The client's one view of an edge, and what its transports share.

:class:`EdgeTransport` is the client's only view of an edge: ``lookup`` (how many leading keys of a
chain are available), ``fetch`` (the bytes of one artifact container named by a
:class:`kdn.wire.convert.FetchSpec`, as an async stream of pieces so decoding can start before the
last byte arrived) and ``put`` (store a container). Every method takes a deadline and raises only
:mod:`kdn.errors` exceptions: gRPC statuses are converted by :func:`kdn.wire.errors.rpc_errors`
(the one place they map), timeouts become ``Unavailable``. ``fetch`` yields ``(piece, via)``: how
the bytes travelled is the transport's business, so a byte path slots in as one more ``via``
behind the same three methods, with the same checksums verified by the client. ``fetch_into``
hands the bytes to an :class:`kdn.artifact.ArtifactReader` instead (what :mod:`kdn.client` uses):
by default it feeds ``fetch``'s pieces; a transport that can receive in place lands them.

Every transport owns :attr:`EdgeTransport.pool`, a one-thread executor for the readers of its
fetches, created with the transport and shut down by its ``close()``.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from kdn.artifact import ArtifactReader
from kdn.errors import Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.wire.convert import FetchSpec

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


class deadline:
    """``async with deadline(timeout, what)``: ``asyncio.timeout(timeout)`` whose expiry is
    ``Unavailable("<what>: deadline ... exceeded")``. A class, not a generator-based context
    manager: it wraps every fetch, and a 1 MiB fetch costs a few hundred microseconds in all."""

    __slots__ = ("_timeout", "_what", "_inner")

    def __init__(self, timeout: float, what: str) -> None:
        self._timeout = timeout
        self._what = what
        self._inner: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        self._inner = asyncio.timeout(self._timeout)
        await self._inner.__aenter__()

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool | None:
        assert self._inner is not None
        try:
            return await self._inner.__aexit__(et, exc, tb)
        except TimeoutError as expired:
            raise Unavailable(f"{self._what}: deadline of {self._timeout}s exceeded") from expired


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host in _LOOPBACK_HOSTS or host.startswith("127.") or address.startswith("unix:")


def reader_pool() -> ThreadPoolExecutor:
    """The small executor a transport owns for its readers' helper work."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdn-verify")


class Backoff:
    """Something that failed (a byte path, an edge) sits out ``seconds`` before it is tried again."""

    __slots__ = ("seconds", "until")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.until = 0.0  # time.monotonic() at which it may be tried again

    def resting(self) -> bool:
        return time.monotonic() < self.until

    def rest(self) -> None:
        self.until = time.monotonic() + self.seconds

    def clear(self) -> None:
        self.until = 0.0


@dataclass(slots=True)
class FetchStats:
    """How one :meth:`EdgeTransport.fetch_into` went: the path, the bytes, the seconds spent in
    the reader (verifying and decoding; for bytes received in place, hashing them where they landed)."""

    via: str = ""
    bytes: int = 0
    decode_s: float = 0.0


class EdgeTransport(ABC):
    """The client's view of one edge. Raises only KdnError subclasses."""

    name: str = "edge"
    pool: ThreadPoolExecutor  # the readers' helper thread, owned: shut down by close()

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
        self.pool.shutdown(wait=False)
