"""The same-host shared-memory path: segments written once, verified by the reader, bounded, swept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kdn.edge.shm import ShmPool, open_segment
from kdn.edge.testing import make_chain
from kdn.errors import ArtifactCorrupt, FingerprintMismatch, InvalidInput, Unavailable


def test_publish_open_verify_and_reuse(tmp_path: Path) -> None:
    chain = make_chain(2)
    pool = ShmPool("e0", directory=str(tmp_path), max_segments=4)
    name = pool.publish("default", chain.keys[0], chain.blobs[0])
    assert pool.publish("default", chain.keys[0], chain.blobs[0]) == name  # reused, not rewritten
    assert pool.created == 1 and pool.reused == 1
    with open_segment(name, size=len(chain.blobs[0]), directory=str(tmp_path), expect_key=chain.keys[0],
                      expect_fingerprint=chain.fingerprint) as art:
        assert bytes(art.data) == chain.blobs[0]
        assert art.header.key == bytes(chain.keys[0])
    assert oct((tmp_path / name).stat().st_mode & 0o777) == "0o600"
    pool.close()
    assert list(tmp_path.iterdir()) == []


def test_reader_detects_corruption_and_wrong_model(tmp_path: Path) -> None:
    chain = make_chain(1)
    pool = ShmPool("e0", directory=str(tmp_path))
    name = pool.publish("default", chain.keys[0], chain.blobs[0])
    with pytest.raises(FingerprintMismatch):
        open_segment(name, directory=str(tmp_path), expect_fingerprint=bytes(32))  # type: ignore[arg-type]
    path = tmp_path / name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ArtifactCorrupt):
        open_segment(name, directory=str(tmp_path))
    with pytest.raises(ArtifactCorrupt):
        open_segment(name, size=3, directory=str(tmp_path))
    pool.close()


def test_bounded_count_and_gone_segment(tmp_path: Path) -> None:
    chain = make_chain(5)
    pool = ShmPool("e0", directory=str(tmp_path), max_segments=2)
    names = [pool.publish("default", k, b) for k, b in zip(chain.keys, chain.blobs)]
    assert len(pool) == 2 and len(list(tmp_path.iterdir())) == 2
    with pytest.raises(Unavailable):
        open_segment(names[0], directory=str(tmp_path))  # recycled: the client fetches again
    # a mapping stays valid after the edge unlinks the segment
    art = open_segment(names[-1], directory=str(tmp_path))
    pool.close()
    assert bytes(art.data) == chain.blobs[-1]
    art.close()


def test_names_cannot_escape_and_dead_writers_are_swept(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput):
        open_segment("../../etc/passwd", directory=str(tmp_path))
    dead_pid = 2**22 + 12345  # above pid_max on common kernels
    stale = tmp_path / f"kdn-e0-{dead_pid}-0123456789abcdef"
    stale.write_bytes(b"x")
    live = tmp_path / f"kdn-e0-{os.getpid()}-0123456789abcdef"
    live.write_bytes(b"y")
    pool = ShmPool("e1", directory=str(tmp_path))
    assert pool.swept == 1 and not stale.exists() and live.exists()


def test_segment_cache_maps_once_and_still_verifies(tmp_path: Path) -> None:
    from kdn.edge.shm import SegmentCache

    chain = make_chain(3)
    pool = ShmPool("e0", directory=str(tmp_path))
    cache = SegmentCache(str(tmp_path), max_maps=2)
    names = [pool.publish("default", k, b) for k, b in zip(chain.keys, chain.blobs)]
    for _ in range(3):
        with cache.open(names[0], expect_key=chain.keys[0]) as art:
            assert bytes(art.data) == chain.blobs[0]
    assert len(cache) == 1
    for n in names:
        cache.open(n).close()
    assert len(cache) == 2  # bounded
    with pytest.raises(ArtifactCorrupt):
        cache.open(names[1], expect_key=chain.keys[2])  # verification still runs on a cached map
    assert len(cache) == 1  # and a map that failed it is dropped
    cache.close()
    pool.close()


def test_segment_cache_bounds_the_bytes_it_keeps_mapped(tmp_path: Path) -> None:
    """A cached mapping keeps a segment's memory alive after the edge unlinked it: the cache
    bounds the bytes it holds, not only the count."""
    from kdn.edge.shm import SegmentCache

    chain = make_chain(4, shape=(2, 2, 64, 64))
    size = len(chain.blobs[0])
    pool = ShmPool("e0", directory=str(tmp_path))
    cache = SegmentCache(str(tmp_path), max_maps=32, max_bytes=2 * size + size // 2)
    for k, b in zip(chain.keys, chain.blobs):
        cache.open(pool.publish("default", k, b)).close()
    assert len(cache) == 2
    cache.close()
    pool.close()
