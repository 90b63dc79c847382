"""Same-host fast path: artifacts handed over through shared memory instead of the gRPC stream.

Edge side, :class:`ShmPool`: on a Fetch with ``shm=True`` the edge writes the artifact once into a
file under ``/dev/shm`` (tmpfs: RAM, no disk) and answers with its name in
``FetchChunk.shm_name``; later fetches of the same artifact reuse the segment. Segments are
bounded in count and bytes; the least recently handed-out one is unlinked first. Unlinking is safe
while a client still has the segment mapped (its mapping stays valid until it closes), so the edge
never waits for clients. Segments of a dead edge process are swept when a new pool opens; all of a
pool's segments are unlinked on close.

Client side, :func:`open_segment`: maps the segment read-only, verifies every checksum (and the
expected key/fingerprint) and returns a :class:`ShmArtifact` whose ``data`` is a zero-copy
memoryview; ``close()`` releases the mapping. Names are checked so that an edge cannot make the
client open an arbitrary path.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kdn.artifact import read_header, verify_artifact
from kdn.errors import ArtifactCorrupt, InvalidInput, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint
from kdn.procs import pid_alive
from kdn.proto import kdn_pb2 as pb

DEFAULT_SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^kdn-[A-Za-z0-9_.\-]{1,64}-(\d+)-[0-9a-f]{16}$")
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
            m = _NAME.match(path.name)
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


class ShmArtifact:
    """A verified artifact mapped from shared memory. ``data`` is valid until ``close()``."""

    def __init__(self, mm: mmap.mmap, header: pb.ArtifactHeader, *, owns_map: bool = True) -> None:
        self._mm = mm
        self._owns = owns_map
        self.header = header
        self.data = memoryview(mm)

    def __enter__(self) -> "ShmArtifact":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.data)

    def close(self) -> None:
        self.data.release()
        if self._owns:
            self._mm.close()


def _map(name: str, size: int | None, directory: str) -> mmap.mmap:
    if not _NAME.match(name):
        raise InvalidInput(f"not a KDN shared-memory segment name: {name[:80]!r}")
    path = Path(directory) / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise Unavailable(f"shared-memory segment {name} is gone (edge recycled it); fetch again") from exc
    try:
        actual = os.fstat(fd).st_size
        if size is not None and actual != size:
            raise ArtifactCorrupt(f"shared-memory segment holds {actual} bytes, edge announced {size}")
        if actual == 0:
            raise ArtifactCorrupt("shared-memory segment is empty")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, actual, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _check(
    mm: mmap.mmap, *, verify: bool, expect_key: ChunkKey | None, expect_fingerprint: ModelFingerprint | None,
    require_lossless: bool,
) -> pb.ArtifactHeader:
    view = memoryview(mm)
    try:
        if verify:
            return verify_artifact(
                view, expect_key=expect_key, expect_fingerprint=expect_fingerprint, require_lossless=require_lossless
            )
        return read_header(view)
    finally:
        view.release()


def open_segment(
    name: str,
    *,
    size: int | None = None,
    directory: str = DEFAULT_SHM_DIR,
    expect_key: ChunkKey | None = None,
    expect_fingerprint: ModelFingerprint | None = None,
    require_lossless: bool = False,
    verify: bool = True,
) -> ShmArtifact:
    """Map and verify a segment the edge named. Raises Unavailable if it is already gone."""
    mm = _map(name, size, directory)
    try:
        header = _check(mm, verify=verify, expect_key=expect_key, expect_fingerprint=expect_fingerprint,
                        require_lossless=require_lossless)
    except BaseException:
        mm.close()
        raise
    return ShmArtifact(mm, header)


class SegmentCache:
    """Client side: keeps up to ``max_maps`` segment mappings open, by name.

    A published segment's bytes never change (the edge writes a new, randomly named file for every
    publication and only ever unlinks old ones; a mapping outlives the unlink), so a hot artifact
    is mapped once instead of once per fetch. Checksums are still verified on every fetch unless
    the caller asks otherwise.
    """

    def __init__(self, directory: str = DEFAULT_SHM_DIR, max_maps: int = 32) -> None:
        self.directory = directory
        self._max = max_maps
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()

    def open(
        self,
        name: str,
        *,
        size: int | None = None,
        expect_key: ChunkKey | None = None,
        expect_fingerprint: ModelFingerprint | None = None,
        require_lossless: bool = False,
        verify: bool = True,
    ) -> ShmArtifact:
        with self._lock:
            mm = self._maps.get(name)
            if mm is not None:
                self._maps.move_to_end(name)
        if mm is None or (size is not None and len(mm) != size):
            mm = _map(name, size, self.directory)
            with self._lock:
                self._maps[name] = mm
                while len(self._maps) > self._max:
                    _, old = self._maps.popitem(last=False)
                    _close_quietly(old)
        try:
            header = _check(mm, verify=verify, expect_key=expect_key, expect_fingerprint=expect_fingerprint,
                            require_lossless=require_lossless)
        except BaseException:
            with self._lock:
                if self._maps.get(name) is mm:
                    del self._maps[name]
            _close_quietly(mm)
            raise
        return ShmArtifact(mm, header, owns_map=False)

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), OrderedDict()
        for mm in maps:
            _close_quietly(mm)


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a caller still holds a view: the mapping goes when that view does
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
