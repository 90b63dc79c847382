"""The retention hints of one store's entries: pins, TTLs and priorities, applied and saved.

:class:`Hints` applies the hints a put or the Hint API passes to resident entries (under the
store's lock), marks the saved copy stale whenever one changes, and saves it to the store's
:class:`~.retention.RetentionFile` (a snapshot taken under the lock, written outside it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from kdn.edge.clock import Clock
from kdn.edge.store.index import Entry, StoreIndex
from kdn.edge.store.retention import RetentionFile
from kdn.edge.store.tiers import EntryId

__all__ = ["Hints"]


class Hints:
    """The hints of a :class:`StoreIndex`'s entries and their retention file (no directory: not saved)."""

    def __init__(self, index: StoreIndex, lock: threading.Lock, clock: Clock, state_dir: Path | None) -> None:
        self._ix = index
        self._lock = lock
        self._clock = clock
        self._file = RetentionFile(state_dir)

    def changed(self) -> None:
        """Mark the saved hints stale (caller holds the lock)."""
        self._file.seq += 1

    def apply(
        self, eid: EntryId, entry: Entry, pin: bool, ttl_s: float | None, priority: int | None, now: float
    ) -> bool:
        """Apply a put's hints; True (and the saved hints marked stale) if there were any."""
        ix = self._ix
        if pin:
            ix.set_pinned(eid, entry, True)
        if ttl_s is not None:
            ix.set_ttl(eid, entry, ttl_s, now)
        if priority is not None:
            ix.set_priority(eid, entry, priority)
        hinted = pin or ttl_s is not None or priority is not None
        if hinted:
            ix.note_hinted(eid, entry)
            self.changed()
        return hinted

    def apply_each(
        self,
        eids: Iterable[EntryId],
        live: Callable[[EntryId, float], Entry | None],
        fn: Callable[[EntryId, Entry, float], None],
    ) -> int:
        """Apply ``fn`` to each of ``eids`` that ``live`` finds resident; how many (caller holds the lock)."""
        n = 0
        now = self._clock.monotonic()
        for eid in eids:
            entry = live(eid, now)
            if entry is not None:
                fn(eid, entry, now)
                n += 1
        if n:
            self.changed()
        return n

    def restore(self, drop: Callable[[EntryId, Entry], None]) -> None:
        """Re-apply the saved hints to resident entries (caller holds the lock; see ``RetentionFile.restore``)."""
        self._file.restore(self._ix, self._clock, drop)

    def save(self) -> None:
        """Save the hints (called without the lock: snapshot under it, write outside)."""
        if self._file.path is None:
            return
        with self._lock:
            seq, records = self._file.snapshot(self._ix, self._clock)
        if not self._file.save(seq, records):
            with self._lock:
                self._ix.count["hint_save_failures"] += 1
