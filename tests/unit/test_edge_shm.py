"""The same-host shared-memory path: segments written once, verified by the reader, bounded, swept;
a segment changed after it was written is never handed out again, and a file someone else put
under a segment's name is never mapped."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kdn.edge.config import EdgeConfig
from kdn.edge.shm import ShmPool, open_segment
from kdn.testing import make_chain
from kdn.errors import ArtifactCorrupt, FingerprintMismatch, InvalidInput, KdnError, Unavailable
from kdn.keys import ChunkKey
from tests.reframe import frame, split


def _pool(tmp_path: Path, node_id: str, **bounds: int) -> ShmPool:
    """A pool under ``tmp_path`` with the config's bounds, except those given."""
    c = EdgeConfig()
    return ShmPool(node_id, directory=str(tmp_path),
                   **{"max_segments": c.shm_max_segments, "max_bytes": c.shm_max_bytes, **bounds})


def _file(tmp_path: Path, ref: str) -> Path:
    """The file a segment reference (``<file>:<inode>:<uid>``) names."""
    return tmp_path / ref.split(":", 1)[0]


def _forgery(blob: bytes) -> bytes:
    """``blob`` with its KV changed and every checksum recomputed: what a hostile process of the
    edge's uid could write (checksums are not keyed)."""
    (version, flags), header, payloads = split(blob)
    payloads[0] = bytes(b ^ 0x5A for b in payloads[0])
    return frame(header, payloads, version=version, flags=flags)


def test_publish_open_verify_and_reuse(tmp_path: Path) -> None:
    chain = make_chain(2)
    pool = _pool(tmp_path, "e0", max_segments=4)
    name = pool.publish("default", chain.keys[0], chain.blobs[0])
    assert pool.publish("default", chain.keys[0], chain.blobs[0]) == name  # reused, not rewritten
    assert pool.created == 1 and pool.reused == 1
    with open_segment(name, size=len(chain.blobs[0]), directory=str(tmp_path), expect_key=chain.keys[0],
                      expect_fingerprint=chain.fingerprint) as art:
        assert bytes(art.data) == chain.blobs[0]
        assert art.header.key == bytes(chain.keys[0])
    assert oct(_file(tmp_path, name).stat().st_mode & 0o777) == "0o400"  # nobody opens it to write
    pool.close()
    assert list(tmp_path.iterdir()) == []


def test_reader_detects_corruption_and_wrong_model(tmp_path: Path) -> None:
    chain = make_chain(1)
    pool = _pool(tmp_path, "e0")
    name = pool.publish("default", chain.keys[0], chain.blobs[0])
    with pytest.raises(FingerprintMismatch):
        open_segment(name, directory=str(tmp_path), expect_fingerprint=bytes(32))  # type: ignore[arg-type]
    path = _file(tmp_path, name)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.chmod(0o600)
    path.write_bytes(bytes(raw))
    with pytest.raises(ArtifactCorrupt):
        open_segment(name, directory=str(tmp_path))
    with pytest.raises(ArtifactCorrupt):
        open_segment(name, size=3, directory=str(tmp_path))
    pool.close()


def test_bounded_count_and_gone_segment(tmp_path: Path) -> None:
    chain = make_chain(5)
    pool = _pool(tmp_path, "e0", max_segments=2)
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
    for bad in ("../../etc/passwd", "../../etc/passwd:1:0", "kdn-e0-1-0123456789abcdef"):
        with pytest.raises(InvalidInput):
            open_segment(bad, directory=str(tmp_path))
    dead_pid = 2**22 + 12345  # above pid_max on common kernels
    stale = tmp_path / f"kdn-e0-{dead_pid}-0123456789abcdef"
    stale.write_bytes(b"x")
    live = tmp_path / f"kdn-e0-{os.getpid()}-0123456789abcdef"
    live.write_bytes(b"y")
    pool = _pool(tmp_path, "e1")
    assert pool.swept == 1 and not stale.exists() and live.exists()


def test_segment_cache_maps_once_and_still_verifies(tmp_path: Path) -> None:
    from kdn.edge.shm import SegmentCache

    chain = make_chain(3)
    pool = _pool(tmp_path, "e0")
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
    pool = _pool(tmp_path, "e0")
    cache = SegmentCache(str(tmp_path), max_maps=32, max_bytes=2 * size + size // 2)
    for k, b in zip(chain.keys, chain.blobs):
        cache.open(pool.publish("default", k, b)).close()
    assert len(cache) == 2
    cache.close()
    pool.close()


def test_a_segment_rewritten_in_place_is_not_handed_out_again(tmp_path: Path) -> None:
    """A process of the edge's uid rewrites a published segment with a checksum-valid forgery of
    the same size: the edge's next answer names a fresh segment holding the real bytes."""
    chain = make_chain(1)
    pool = _pool(tmp_path, "e0")
    ref = pool.publish("default", chain.keys[0], chain.blobs[0])
    path = _file(tmp_path, ref)
    forged = _forgery(chain.blobs[0])
    assert len(forged) == len(chain.blobs[0]) and forged != chain.blobs[0]
    path.chmod(0o600)  # the mode is 0400: a writer has to change it first
    with open(path, "r+b") as f:
        f.write(forged)
    path.chmod(0o400)
    again = pool.publish("default", chain.keys[0], chain.blobs[0])
    assert again != ref and pool.changed == 1
    with open_segment(again, expect_key=chain.keys[0], directory=str(tmp_path)) as art:
        assert bytes(art.data) == chain.blobs[0]
    pool.close()


@pytest.mark.parametrize("planted", ["symlink", "file", "fifo"])
def test_the_reader_refuses_whatever_else_lies_under_a_recycled_name(tmp_path: Path, planted: str) -> None:
    """The edge recycled a segment a client still names; someone then puts something under that
    name in the shared directory (a link to a checksum-valid artifact, such a file itself, a FIFO
    that would block an open): the reader refuses it and opens no other file."""
    chain = make_chain(1)
    pool = _pool(tmp_path, "e0")
    ref = pool.publish("default", chain.keys[0], chain.blobs[0])
    pool.forget("default", chain.keys[0])  # recycled: unlinked
    path = _file(tmp_path, ref)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(_forgery(chain.blobs[0]))
    if planted == "symlink":
        path.symlink_to(elsewhere)
    elif planted == "file":
        path.write_bytes(_forgery(chain.blobs[0]))
    else:
        os.mkfifo(path)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            open_segment(ref, expect_key=chain.keys[0], directory=str(tmp_path)).close()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    assert outcome, "the reader blocked on what lies under the name"
    assert isinstance(outcome[0], (Unavailable, ArtifactCorrupt)), outcome
    pool.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another uid needs root")
def test_the_sweep_leaves_other_users_files_and_links_alone(tmp_path: Path) -> None:
    """A root edge's start-up sweep: another user's file with a segment's name, and a link with
    one, stay; only a dead edge's own file goes."""
    dead_pid = 2**22 + 12345
    theirs = tmp_path / f"kdn-e0-{dead_pid}-0123456789abcdef"
    theirs.write_bytes(b"x")
    os.chown(theirs, 65534, 65534)
    target = tmp_path / "target"
    target.write_bytes(b"t")
    link = tmp_path / f"kdn-e0-{dead_pid}-00000000000000ff"
    link.symlink_to(target)
    mine = tmp_path / f"kdn-e0-{dead_pid}-fedcba9876543210"
    mine.write_bytes(b"y")
    pool = _pool(tmp_path, "e1")
    assert pool.swept == 1 and not mine.exists()
    assert theirs.exists() and link.is_symlink() and target.exists()
    pool.close()


def test_a_changed_segment_is_not_unlinked_by_the_pool(tmp_path: Path) -> None:
    """The pool removes only the file it made: one replaced under the name stays."""
    chain = make_chain(1)
    pool = _pool(tmp_path, "e0", max_segments=1)
    ref = pool.publish("default", chain.keys[0], chain.blobs[0])
    path = _file(tmp_path, ref)
    path.unlink()
    path.write_bytes(b"someone else's")
    pool.close()
    assert path.read_bytes() == b"someone else's"
    with pytest.raises(KdnError):
        open_segment(ref, directory=str(tmp_path))


def _publish_together(pool: ShmPool, key: ChunkKey, blob: bytes, threads: int = 4) -> list[str]:
    """The references ``threads`` threads get from publishing ``key`` at the same instant."""
    start = threading.Barrier(threads)
    refs: list[str] = []

    def publish() -> None:
        start.wait()
        refs.append(pool.publish("default", key, blob))

    running = [threading.Thread(target=publish) for _ in range(threads)]
    for t in running:
        t.start()
    for t in running:
        t.join()
    return refs


def test_concurrent_first_publications_of_a_key_all_get_a_live_segment(tmp_path: Path) -> None:
    """Two first fetches of one key may both write a segment; neither reference handed out may be
    unlinked by the other's publication (a client maps it after the answer)."""
    chain = make_chain(1, shape=(4, 8, 128, 64))  # 1 MiB: writing it takes long enough to overlap
    pool = _pool(tmp_path, "race")
    for attempt in range(20):
        pool.forget("default", chain.keys[0])
        refs = _publish_together(pool, chain.keys[0], chain.blobs[0])
        assert len(set(refs)) == 1, f"attempt {attempt}: {len(set(refs))} segments handed out for one key"
        art = open_segment(refs[0], directory=str(tmp_path))
        assert bytes(art.data) == chain.blobs[0]
        art.close()
        assert len(list(tmp_path.iterdir())) == 1  # the files that lost were removed
    pool.close()


def test_a_changed_segment_found_by_concurrent_fetches_counts_once(tmp_path: Path) -> None:
    """Fetches of one key that all find its segment rewritten (a same-host read-ahead and its
    confirmation arrive together) drop it once, count it once, and all get one fresh segment."""
    chain = make_chain(1, shape=(4, 8, 128, 64))
    pool = _pool(tmp_path, "race")
    for attempt in range(10):
        ref = pool.publish("default", chain.keys[0], chain.blobs[0])
        path = _file(tmp_path, ref)
        path.chmod(0o600)
        with open(path, "r+b") as f:
            f.write(_forgery(chain.blobs[0]))
        path.chmod(0o400)
        refs = _publish_together(pool, chain.keys[0], chain.blobs[0])
        assert pool.changed == attempt + 1, f"attempt {attempt}: counted {pool.changed}"
        assert len(set(refs)) == 1 and refs[0] != ref
        with open_segment(refs[0], expect_key=chain.keys[0], directory=str(tmp_path)) as art:
            assert bytes(art.data) == chain.blobs[0]
        assert len(list(tmp_path.iterdir())) == 1  # the changed file and the losers' files are gone
    pool.close()
