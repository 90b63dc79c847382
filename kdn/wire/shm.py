"""Reading a shared-memory segment an edge published: the one reader, for hosts, admin and benches.

An edge (:class:`kdn.edge.shm.ShmPool`) writes an artifact once into a file under ``/dev/shm``
(tmpfs: RAM, no disk) and names it in ``FetchChunk.shm_name`` with a *segment reference*
``<file>:<inode>:<uid>``: the file name, and the inode and owner the edge created it with. The
reader:

- :func:`map_segment` maps it read-only after checking the reference (an edge cannot make a
  reader open an arbitrary path: only ``kdn-<node>-<pid>-<16 hex>`` in the segment directory),
  opening the file without following a symbolic link or waiting on a FIFO, and checking that it
  is a regular file with the inode and owner the edge named, writable by nobody but its owner,
  of the size the edge announced. In a directory anyone may create files in (``/dev/shm`` is
  1777), a file made under a recycled name by someone else is thereby refused, not mapped. A
  segment already recycled, or another file in its place, is ``Unavailable`` (fetch again); a
  link in its place, or a size that disagrees, is ``ArtifactCorrupt``. The host client (:mod:`kdn.transport`) maps with this and verifies
  with its own ``ArtifactReader``.
- :func:`open_segment` also verifies every checksum (and the expected key/fingerprint) and returns a
  :class:`ShmArtifact` whose ``data`` is a zero-copy memoryview; ``close()`` releases the mapping.
- :class:`SegmentCache` keeps hot mappings open by name (a published segment never changes).

Never unlinks: the edge owns segments' lifetime (a mapping outlives an unlink).

Trust (``docs/security.md``): segments are the edge's uid's files, mode 0400; processes of other
uids can open none of them. Processes running as the edge's uid are inside the edge's trust
boundary (they could read the edge's memory itself): a tenant that must be kept from the others
runs its clients under another uid, and gets its bytes over the bulk socket or gRPC.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from collections import OrderedDict
from pathlib import Path

from kdn.artifact import read_header, verify_artifact
from kdn.errors import ArtifactCorrupt, InvalidInput, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint
from kdn.proto import kdn_pb2 as pb

DEFAULT_SHM_DIR = "/dev/shm"
SEGMENT_NAME = re.compile(r"^kdn-[A-Za-z0-9_.\-]{1,64}-(\d+)-[0-9a-f]{16}$")
"""What an edge's segment is called: ``kdn-<node>-<pid>-<16 hex>`` (the pid lets a new edge sweep a dead one's)."""
_REF = re.compile(r"^(kdn-[A-Za-z0-9_.\-]{1,64}-\d+-[0-9a-f]{16}):(\d{1,20}):(\d{1,10})$")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def segment_ref(name: str, st: os.stat_result) -> str:
    """The reference an edge hands out for segment file ``name`` as created (``st``)."""
    return f"{name}:{st.st_ino}:{st.st_uid}"


def parse_ref(ref: str) -> tuple[str, int, int]:
    """``(file name, inode, owner uid)`` of a segment reference; ``InvalidInput`` otherwise."""
    m = _REF.match(ref)
    if not m:
        raise InvalidInput(f"not a KDN shared-memory segment reference: {ref[:100]!r}")
    return m.group(1), int(m.group(2)), int(m.group(3))


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


def map_segment(name: str, size: int | None = None, directory: str = DEFAULT_SHM_DIR) -> mmap.mmap:
    """Map the segment a reference ``name`` names, read-only, once the file is the one the edge
    made (see the module docstring); ``size`` (when announced) must match it exactly."""
    file, ino, uid = parse_ref(name)
    path = Path(directory) / file
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError as exc:
        raise Unavailable(f"shared-memory segment {file} is gone (edge recycled it); fetch again") from exc
    except OSError as exc:  # ELOOP: a symbolic link in its place
        raise ArtifactCorrupt(f"shared-memory segment {file} is not the edge's file ({exc.strerror})") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != ino or st.st_uid != uid:
            raise Unavailable(f"shared-memory segment {file} is not the file the edge made (recycled, and "
                              f"made again by someone else); fetch again")
        if st.st_mode & 0o022:
            raise ArtifactCorrupt(f"shared-memory segment {file} is writable by others")
        actual = st.st_size
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
    mm = map_segment(name, size, directory)
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

    def __init__(self, directory: str = DEFAULT_SHM_DIR, max_maps: int = 32, max_bytes: int = 1 << 30) -> None:
        self.directory = directory
        self._max = max_maps
        self._max_bytes = max_bytes  # a mapping keeps an unlinked segment's memory alive: bound it
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()

    def fit(self, max_maps: int, max_bytes: int) -> None:
        """Keep at least ``max_maps`` mappings and ``max_bytes`` mapped (never fewer than now):
        the edge's own bounds, so that every segment it keeps live stays mapped here."""
        with self._lock:
            self._max = max(self._max, max_maps)
            self._max_bytes = max(self._max_bytes, max_bytes)

    @property
    def bounds(self) -> tuple[int, int]:
        """(mappings, bytes) kept at most."""
        return self._max, self._max_bytes

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
            mm = map_segment(name, size, self.directory)
            with self._lock:
                self._maps[name] = mm
                while len(self._maps) > 1 and (
                    len(self._maps) > self._max or sum(len(m) for m in self._maps.values()) > self._max_bytes
                ):
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

    def peek(self, name: str) -> memoryview | None:
        """The segment's bytes if it is mapped already (no system call, nothing parsed); None
        otherwise. Not verified: the caller's reader checks every byte it uses, and releases
        the view."""
        with self._lock:
            mm = self._maps.get(name)
            if mm is None:
                return None
            self._maps.move_to_end(name)
            return memoryview(mm)

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
