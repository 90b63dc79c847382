"""Same-host fast path: artifacts handed over through shared memory instead of the gRPC stream.

Edge side, :class:`ShmPool`: on a Fetch with ``shm=True`` the edge writes the artifact once into a
file under ``/dev/shm`` (tmpfs: RAM, no disk) and answers with its reference (file name, inode,
owner: :func:`kdn.wire.shm.segment_ref`) in ``FetchChunk.shm_name``; later fetches of the same
artifact reuse the segment. Segments are bounded in count and bytes; the least recently
handed-out one is unlinked first. Unlinking is safe while a client still has the segment mapped
(its mapping stays valid until it closes), so the edge never waits for clients. Segments of a dead
edge process are swept when a new pool opens; all of a pool's segments are unlinked on close.

A segment is created exclusively (never through a link), mode 0400: once written, nobody but
root can open it for writing without changing its mode first. Before a segment is handed out
again, the edge checks that its file is still the one it wrote: the same inode, size, owner and
mode, and the same modification and change times (a write, a truncation or a change of mode moves
the change time, and nothing short of the clock sets it back); the pool holds an ``O_PATH``
descriptor of each segment, so its inode number cannot pass to another file meanwhile. A segment
that changed is dropped and the artifact written afresh; a file in its place that the pool did
not make is left where it is. The sweep removes only regular files with a segment's name,
owned by this process's uid, of edge processes that no longer run: never another user's file,
never a link.

The reading side (hosts, the admin client, benchmarks) is :mod:`kdn.wire.shm`: one reader that
checks names, sizes and checksums. ``open_segment``, ``SegmentCache`` and ``ShmArtifact`` are
re-exported here for the edge's own tests and benchmarks.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kdn.errors import Unavailable
from kdn.keys import ChunkKey
from kdn.procs import pid_alive
from kdn.wire.shm import DEFAULT_SHM_DIR, SEGMENT_NAME, SegmentCache, ShmArtifact, open_segment, segment_ref

__all__ = ["DEFAULT_SHM_DIR", "SegmentCache", "ShmArtifact", "ShmPool", "open_segment"]
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_CREATE = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What must not change while a segment is handed out (see the module docstring)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_uid, st.st_mode, st.st_nlink, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(slots=True)
class _Segment:
    name: str
    size: int
    ref: str
    identity: tuple[int, ...]
    pin: int  # an O_PATH descriptor of the file: its inode number cannot go to another file meanwhile


class ShmPool:
    """The edge's bounded set of shared-memory segments, one per (tenant, key)."""

    def __init__(self, node_id: str, *, directory: str, max_segments: int, max_bytes: int) -> None:
        """Segments under ``directory``, at most ``max_segments`` of them and ``max_bytes`` together
        (``EdgeConfig.shm_dir``, ``shm_max_segments``, ``shm_max_bytes``)."""
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
        self.changed = 0  # segments found changed when about to be handed out again
        self.unlinked = 0
        self.swept = self._sweep_dead()

    def _sweep_dead(self) -> int:
        """Unlink segments that edge processes of this uid left and that no longer run."""
        swept = 0
        uid = os.geteuid()
        for path in self.dir.glob("kdn-*"):
            m = SEGMENT_NAME.match(path.name)
            if not m:
                continue
            pid = int(m.group(1))
            if pid == os.getpid() or pid_alive(pid):
                continue
            try:
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                    continue  # a link, or another user's file: not ours to remove
                path.unlink()
                swept += 1
            except OSError:
                pass
        return swept

    def _unchanged(self, seg: _Segment) -> bool:
        try:
            return _identity((self.dir / seg.name).lstat()) == seg.identity
        except OSError:
            return False

    def publish(self, tenant: str, key: ChunkKey, data: bytes | memoryview) -> str:
        """Reference of a segment holding ``data`` (created once per key, then reused while its
        file is unchanged). Concurrent first calls for one key may each write a file, but all get
        the reference of the one that landed first: a reference handed out is never unlinked by
        another publication of its key."""
        ident = (tenant, bytes(key))
        with self._lock:
            seg = self._segments.get(ident)
            if seg is not None and seg.size == len(data):
                if self._unchanged(seg):
                    self._segments.move_to_end(ident)
                    self.reused += 1
                    return seg.ref
                # rewritten, replaced or gone: dropped now, so a concurrent publication of this key
                # neither counts it again nor hands it out, and written afresh below
                del self._segments[ident]
                self._drop(seg)
                self.changed += 1
        if len(data) > self._max_bytes:
            raise Unavailable(f"artifact of {len(data)} bytes exceeds the shm budget {self._max_bytes}")
        name = f"kdn-{self._node}-{os.getpid()}-{secrets.token_hex(8)}"
        path = self.dir / name
        try:
            fd = os.open(path, _CREATE, 0o400)  # the creating descriptor writes; nobody opens it to write after
        except OSError as exc:
            raise Unavailable(f"cannot create shared-memory segment: {exc.strerror or exc}") from exc
        try:
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
            made = os.fstat(fd)
            pin = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            os.close(fd)
            _unlink(path)
            raise Unavailable(f"cannot write shared-memory segment: {exc.strerror or exc}") from exc
        os.close(fd)
        with self._lock:
            old = self._segments.get(ident)
            if old is not None and old.size == len(data) and self._unchanged(old):
                # a concurrent first fetch of this key published while we wrote: its reference may
                # be in a client's hands already, so it stays and ours goes
                os.close(pin)
                _unlink(path)
                self._segments.move_to_end(ident)
                self.reused += 1
                return old.ref
            if old is not None:
                del self._segments[ident]
                self._drop(old)
            ref = segment_ref(name, made)
            self._segments[ident] = _Segment(name, len(data), ref, _identity(made), pin)
            self._bytes += len(data)
            self.created += 1
            while len(self._segments) > self._max_segments or (self._bytes > self._max_bytes and len(self._segments) > 1):
                _, victim = self._segments.popitem(last=False)
                self._drop(victim)
        return ref

    def forget(self, tenant: str, key: ChunkKey) -> None:
        with self._lock:
            seg = self._segments.pop((tenant, bytes(key)), None)
            if seg is not None:
                self._drop(seg)

    def _drop(self, seg: _Segment) -> None:
        self._bytes -= seg.size
        self.unlinked += 1
        path = self.dir / seg.name
        try:
            st = path.lstat()
            if (st.st_dev, st.st_ino) == seg.identity[:2]:  # the inode is pinned: it is the file we made
                _unlink(path)
        except OSError:
            pass  # gone already
        finally:
            os.close(seg.pin)

    def __len__(self) -> int:
        return len(self._segments)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    @property
    def bounds(self) -> tuple[int, int]:
        """(segments, bytes) this pool keeps live at most: what a same-host client sizes its mappings to."""
        return self._max_segments, self._max_bytes

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
