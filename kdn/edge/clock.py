"""Injectable clocks: the edge's store and hint scheduler read time only through a :class:`Clock`.

Two readings, for two jobs:

* ``monotonic()`` — seconds on a clock that never goes backwards; TTL deadlines use it, so a wall
  clock step (NTP, an operator) never expires or revives entries.
* ``now()`` — an aware UTC ``datetime``; cron schedules fire at wall-clock times and use it.

:class:`MonotonicClock` is the real one. :class:`FakeClock` only moves when told to
(:meth:`FakeClock.advance`), so tests (and a discrete-event simulator) can run hours of TTLs and
schedules in microseconds. Neither holds process-global state: each store/scheduler gets its own.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Protocol, runtime_checkable

from kdn.errors import InvalidInput

__all__ = ["Clock", "FakeClock", "MonotonicClock"]


@runtime_checkable
class Clock(Protocol):
    """What the edge needs to know about time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (origin arbitrary)."""
        ...

    def now(self) -> datetime:
        """The current wall-clock time, timezone-aware, in UTC."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and ``datetime.now(UTC)``. Stateless."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    def __repr__(self) -> str:
        return "MonotonicClock()"


class FakeClock:
    """A clock that stands still until :meth:`advance` or :meth:`set` moves it. Thread-safe.

    Both readings move together: ``advance(60)`` adds 60 s to ``monotonic()`` and one minute to
    ``now()``. :meth:`set` jumps the wall clock only (as an NTP step would); ``monotonic()`` does not
    go backwards.
    """

    def __init__(self, start: datetime | None = None, *, monotonic_start: float = 1000.0) -> None:
        start = start or datetime(2026, 1, 1, tzinfo=timezone.utc)
        self._wall = _as_utc(start)
        self._mono = float(monotonic_start)
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def now(self) -> datetime:
        with self._lock:
            return self._wall

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise InvalidInput(f"a clock cannot advance by a negative amount ({seconds} s)")
        with self._lock:
            self._mono += seconds
            self._wall += timedelta(seconds=seconds)

    def set(self, when: datetime) -> None:
        """Step the wall clock to ``when`` (either direction); the monotonic reading is unchanged."""
        with self._lock:
            self._wall = _as_utc(when)

    def __repr__(self) -> str:
        return f"FakeClock(now={self._wall.isoformat()}, monotonic={self._mono})"


def _as_utc(when: datetime) -> datetime:
    """Naive datetimes are taken as UTC; aware ones are converted."""
    if when.tzinfo is None:
        return when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc)
