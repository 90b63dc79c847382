"""Retention hints on disk: the pins, priorities and TTLs of resident entries, across restarts.

Saved as JSON (:data:`RETENTION_FILE`, ``{"version": 1, "entries": [...]}``) in the state
directory of the first tier that has one — the disk tier's root — whenever they change, with the
tree's one atomic writer (:func:`kdn.blobstore.write_json_atomic`: temp file, fsync, rename, fsync
the directory). A TTL is saved as a wall-clock deadline (``expires_unix``). On restart the hints
are re-applied to the entries the disk brought back, and an entry whose TTL ran out while the edge
was down is dropped. Hints of memory-only entries die with them.

A save never raises (hints are advice): a failure is logged and counted (``hint_save_failures``).
Saves may race: each carries the sequence number of its snapshot, and one older than a snapshot
already written is skipped.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kdn.blobstore import sweep_file_tmp, write_json_atomic
from kdn.edge.clock import Clock
from kdn.edge.store.index import Entry, StoreIndex, check_priority
from kdn.edge.store.tiers import EntryId
from kdn.errors import KdnError
from kdn.keys import ChunkKey

__all__ = ["RETENTION_FILE", "RetentionFile"]

log = logging.getLogger(__name__)

RETENTION_FILE = ".entry-retention.json"
"""Where pins, priorities and TTLs are saved: in the first tier with a state directory (the disk)."""


class RetentionFile:
    """Saves and restores the ``hinted`` entries of a :class:`StoreIndex` (no file: does nothing)."""

    def __init__(self, state_dir: Path | None) -> None:
        self.path = None if state_dir is None else state_dir / RETENTION_FILE
        self.seq = 0  # bumped (under the store's lock) whenever a hint changes
        self._written = 0
        self._write_lock = threading.Lock()

    def snapshot(self, index: StoreIndex, clock: Clock) -> tuple[int, list[dict[str, Any]]]:
        """The records to save and their sequence number (caller holds the store's lock)."""
        now_mono, now_wall = clock.monotonic(), clock.now().timestamp()
        records = [
            {
                "tenant": eid.tenant,
                "key": bytes(eid.key).hex(),
                "pinned": e.pinned,
                "priority": e.priority,
                "expires_unix": None if e.expires_at is None else now_wall + (e.expires_at - now_mono),
            }
            for eid in index.hinted
            for e in (index.entries[eid],)
        ]
        return self.seq, records

    def save(self, seq: int, records: list[dict[str, Any]]) -> bool:
        """Write a snapshot unless a newer one is already written (caller does NOT hold the lock).
        False when the write failed."""
        if self.path is None:
            return True
        with self._write_lock:
            if seq <= self._written:
                return True
            try:
                write_json_atomic(self.path, {"version": 1, "entries": records})
            except OSError as exc:
                log.warning("could not save entry hints to %s: %s", self.path, exc)
                return False
            self._written = seq
            return True

    def restore(self, index: StoreIndex, clock: Clock, drop: Callable[[EntryId, Entry], None]) -> None:
        """Re-apply saved hints to resident entries (caller holds the store's lock); ``drop``
        removes an entry whose saved TTL has run out."""
        records = self._read()
        if not records:
            return
        now_mono, now_wall = clock.monotonic(), clock.now().timestamp()
        for rec in records:
            try:
                eid = EntryId(str(rec["tenant"]), ChunkKey(bytes.fromhex(rec["key"])))
                entry = index.entries.get(eid)
                if entry is None:
                    continue
                expires = rec.get("expires_unix")
                if expires is not None and float(expires) <= now_wall:
                    drop(eid, entry)
                    index.count["expired"] += 1
                    continue
                priority = int(rec.get("priority", 0))
                check_priority(priority)
                index.set_priority(eid, entry, priority)
                index.set_pinned(eid, entry, bool(rec.get("pinned", False)))
                if expires is not None:
                    index.set_ttl(eid, entry, float(expires) - now_wall, now_mono)
            except (KdnError, ValueError, KeyError, TypeError):
                continue

    def _read(self) -> list[Any] | None:
        path = self.path
        if path is None:
            return None
        sweep_file_tmp(path)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            records = doc["entries"]
            if not isinstance(records, list):
                raise ValueError("'entries' is not a list")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable entry hints %s: %s", path, exc)
            return None
        return records
