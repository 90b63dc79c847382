"""Same-host fast path: artifacts handed over through shared memory instead of the gRPC stream.

Edge side, :class:`ShmPool`: on a Fetch with ``shm=True`` the edge writes the artifact once into a
file under ``/dev/shm`` (tmpfs: RAM, no disk) and answers with its name in
``FetchChunk.shm_name``; later fetches of the same artifact reuse the segment. Segments are
bounded in count and bytes; the least recently handed-out one is unlinked first. Unlinking is safe
while a client still has the segment mapped (its mapping stays valid until it closes), so the edge
never waits for clients. Segments of a dead edge process are swept when a new pool opens; all of a
pool's segments are unlinked on close.

The reading side (hosts, the admin client, benchmarks) is :mod:`kdn.wire.shm`: one reader that
checks names, sizes and checksums. ``open_segment``, ``SegmentCache`` and ``ShmArtifact`` are
re-exported here for the edge's own tests and benchmarks.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kdn.errors import Unavailable
from kdn.keys import ChunkKey
from kdn.procs import pid_alive
from kdn.wire.shm import DEFAULT_SHM_DIR, SEGMENT_NAME, SegmentCache, ShmArtifact, open_segment

__all__ = ["DEFAULT_SHM_DIR", "SegmentCache", "ShmArtifact", "ShmPool", "open_segment"]
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


@dataclass(slots=True)
class _Segment:
    name: str
    size: int


class ShmPool:
    """The edge's bounded set of shared-memory segments, one per (tenant, key)."""

    def __init__(
        self, node_id: str, *, directory: str = DEFAULT_SHM_DIR, max_segments: int = 64, max_bytes: int = 1 << 30
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._node = _SAFE.sub("_", node_id)[:64] or "edge"
        self._max_segments = max_segments
        self._max_bytes = max_bytes
        self._segments: OrderedDict[tuple[str, bytes], _Segment] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.created = 0
        self.reused = 0
        self.unlinked = 0
        self.swept = self._sweep_dead()

    def _sweep_dead(self) -> int:
        """Unlink segments left by edge processes that no longer exist."""
        swept = 0
        for path in self.dir.glob("kdn-*"):
            m = SEGMENT_NAME.match(path.name)
            if not m:
                continue
            pid = int(m.group(1))
            if pid == os.getpid() or pid_alive(pid):
                continue
            try:
                path.unlink()
                swept += 1
            except OSError:
                pass
        return swept

    def publish(self, tenant: str, key: ChunkKey, data: bytes | memoryview) -> str:
        """Name of a segment holding ``data`` (created once per key, then reused)."""
        ident = (tenant, bytes(key))
        with self._lock:
            seg = self._segments.get(ident)
            if seg is not None and seg.size == len(data) and (self.dir / seg.name).exists():
                self._segments.move_to_end(ident)
                self.reused += 1
                return seg.name
        if len(data) > self._max_bytes:
            raise Unavailable(f"artifact of {len(data)} bytes exceeds the shm budget {self._max_bytes}")
        name = f"kdn-{self._node}-{os.getpid()}-{secrets.token_hex(8)}"
        path = self.dir / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        except OSError as exc:
            os.close(fd)
            _unlink(path)
            raise Unavailable(f"cannot write shared-memory segment: {exc.strerror or exc}") from exc
        os.close(fd)
        with self._lock:
            old = self._segments.pop(ident, None)
            if old is not None:
                self._drop(old)
            self._segments[ident] = _Segment(name, len(data))
            self._bytes += len(data)
            self.created += 1
            while len(self._segments) > self._max_segments or (self._bytes > self._max_bytes and len(self._segments) > 1):
                _, victim = self._segments.popitem(last=False)
                self._drop(victim)
        return name

    def forget(self, tenant: str, key: ChunkKey) -> None:
        with self._lock:
            seg = self._segments.pop((tenant, bytes(key)), None)
            if seg is not None:
                self._drop(seg)

    def _drop(self, seg: _Segment) -> None:
        self._bytes -= seg.size
        self.unlinked += 1
        _unlink(self.dir / seg.name)

    def __len__(self) -> int:
        return len(self._segments)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def close(self) -> None:
        with self._lock:
            while self._segments:
                _, seg = self._segments.popitem(last=False)
                self._drop(seg)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
