"""An edge in a dict: the transport for unit tests (no sockets), with fault injection."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from kdn.errors import FingerprintMismatch, NotFound, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.transport.base import EdgeTransport, reader_pool
from kdn.wire.channel import split_pieces
from kdn.wire.convert import FetchSpec


@dataclass(slots=True)
class MemoryEdgeTransport(EdgeTransport):
    """An edge in a dict, for unit tests. Tenants are isolated; faults can be switched on.

    ``down``: every call raises Unavailable. ``corrupt``: keys whose served bytes get one bit
    flipped. ``delay_s``: added to every call (to exercise deadlines). ``whole``: answer as an
    edge on the same host does, the whole container in one piece via ``"shm"``.
    """

    fingerprint: ModelFingerprint | None = None
    piece: int = 64 * 1024
    down: bool = False
    delay_s: float = 0.0
    corrupt: set[bytes] = field(default_factory=set)
    store: dict[tuple[str, bytes], bytes] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=lambda: {"lookup": 0, "fetch": 0, "put": 0})
    name: str = "memory"
    whole: bool = False
    pool: ThreadPoolExecutor = field(default_factory=reader_pool, repr=False, compare=False)

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
        if self.whole:
            yield memoryview(data), "shm"
            return
        for piece in split_pieces(data, self.piece):
            yield bytes(piece), "memory"
            await asyncio.sleep(0)

    async def put(
        self, fingerprint: ModelFingerprint, namespace: Namespace, key: ChunkKey, data: bytes, *, timeout: float
    ) -> bool:
        await self._enter("put", fingerprint, timeout)
        self.store[(namespace.tenant, bytes(key))] = bytes(data)
        return True
