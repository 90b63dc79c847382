"""The bound on bytes that in-flight Puts hold, across gRPC and the bulk socket (:class:`PutBudget`)."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from kdn.errors import StorageFull


class PutBudget:
    """Bytes held by in-flight Puts, bounded across all of them (``EdgeConfig.put_buffer_bytes``).

    Each Put takes a lease; every piece it buffers is reserved first, and a reservation that would
    pass the bound refuses that Put with ``StorageFull`` (RESOURCE_EXHAUSTED) and frees what it
    held. Runs on the event loop only (no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._trim: asyncio.TimerHandle | None = None

    def refused(self) -> None:
        """A Put was refused: gRPC frees what it buffered for the stream when the call is torn
        down, just after this; give that heap back to the OS then (once per burst of refusals)."""
        if self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(0.25, self._trim_when_idle)

    def _trim_when_idle(self) -> None:
        self._trim = None
        if self.used == 0:
            _trim_heap()
        else:
            self.refused()  # Puts in flight hold the heap now: try again a little later

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes, or refuse with ``StorageFull``."""
        if self.used + n > self.limit:
            raise StorageFull(
                f"in-flight Puts hold {self.used} bytes; {n} more would pass the {self.limit}-byte budget"
            )
        self.used += n
        self.peak = max(self.peak, self.used)

    def give(self, n: int) -> None:
        """Give back ``n`` bytes a finished (or refused) Put held."""
        self.used -= n
        if n >= _TRIM_AFTER and self.used == 0:
            _trim_heap()

    @contextmanager
    def lease(self) -> Iterator[Callable[[int], None]]:
        held = 0

        def reserve(n: int) -> None:
            nonlocal held
            self.take(n)
            held += n

        try:
            yield reserve
        finally:
            self.give(held)


_TRIM_AFTER = 64 << 20  # a Put that held this much: give the freed heap back once no Put holds any


def _trim_heap() -> None:
    """Return freed heap to the OS (glibc ``malloc_trim``). A big Put's pieces (and gRPC's buffers
    for them) are freed when it ends, but glibc keeps freed arena memory mapped: without this, a
    flood of large refused Puts leaves the edge's RSS at its peak. A no-op where there is no glibc."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None
