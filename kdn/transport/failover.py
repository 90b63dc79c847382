"""Several edges in preference order: a call whose edge is unavailable moves on to the next one."""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from kdn.artifact import ArtifactReader
from kdn.errors import Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.transport.base import Backoff, EdgeTransport, FetchStats, reader_pool
from kdn.wire.convert import FetchSpec

T = TypeVar("T")


class FailoverEdgeTransport(EdgeTransport):
    """Edges in preference order (the local edge first). Only ``Unavailable`` moves a call on: a
    refused or missing artifact is an answer from a live edge, not a reason to ask another. An
    edge that was unavailable sits out a backoff before it is tried again. A fetch that fails
    after its first piece arrived is not retried elsewhere (the reader already holds part of one
    container); the client then reuses what it verified and recomputes the rest."""

    def __init__(self, transports: Sequence[EdgeTransport], *, backoff_s: float = 5.0) -> None:
        if not transports:
            raise ValueError("FailoverEdgeTransport needs at least one edge")
        self.transports = list(transports)
        self.name = ",".join(getattr(t, "name", "?") for t in self.transports)
        self.shm = any(getattr(t, "shm", False) for t in self.transports)
        self._down = [Backoff(backoff_s) for _ in self.transports]
        self.failovers = 0
        self.pool = reader_pool()

    def _order(self) -> list[int]:
        up = [i for i, b in enumerate(self._down) if not b.resting()]
        down = sorted((i for i in range(len(self.transports)) if i not in up), key=lambda i: self._down[i].until)
        return up + down  # when every edge sits out a backoff, still try them, soonest-back first

    def _failed(self, i: int) -> None:
        self._down[i].rest()
        self.failovers += 1

    async def _each(self, call: Callable[[EdgeTransport], Awaitable[T]],
                    restartable: Callable[[], bool] = lambda: True) -> T:
        """``call`` on each edge in order until one answers; an ``Unavailable`` after which the
        call is not ``restartable()`` is raised as it is."""
        last: Unavailable | None = None
        for i in self._order():
            try:
                result = await call(self.transports[i])
            except Unavailable as exc:
                self._failed(i)
                if not restartable():
                    raise
                last = exc
                continue
            self._down[i].clear()
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
                self._down[i].clear()
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
        before = reader.received
        return await self._each(  # once the reader holds part of this container it is not restarted elsewhere
            lambda t: t.fetch_into(spec, reader, timeout=timeout, next_keys=next_keys),
            restartable=lambda: reader.received == before,
        )

    async def put(
        self, fingerprint: ModelFingerprint, namespace: Namespace, key: ChunkKey, data: bytes, *, timeout: float
    ) -> bool:
        return await self._each(lambda t: t.put(fingerprint, namespace, key, data, timeout=timeout))

    async def close(self) -> None:
        for t in self.transports:
            await t.close()
        await super().close()
