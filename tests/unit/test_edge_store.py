"""The edge's tiered store: budgets, demotion/promotion, pins, TTLs, priorities, tenants, disk faults."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from kdn.edge.clock import FakeClock
from kdn.edge.eviction import make_policy
from kdn.edge.config import EdgeConfig
from kdn.edge.store import RETENTION_FILE, DiskTier, EntryId, MemoryTier, TieredStore, build_store
from kdn import blobstore
from kdn.artifact import encode_artifact
from kdn.errors import ArtifactCorrupt, FingerprintMismatch, InvalidInput, StorageFull, Unavailable
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, chunk_keys
from tests.children import dead_pid, reap

FP = ModelFingerprint(bytes(range(32)))
POLICY = EdgeConfig.default("policy")  # the edge's own eviction policy
OTHER_FP = ModelFingerprint(bytes(32))


def make_chain(n: int, *, seed: int = 0, tenant: str = "acme", tokens_per_chunk: int = 4) -> list[tuple[ChunkKey, bytes]]:
    """``n`` chained artifacts of small random KV ``(L=2, 2, H=2, T, D=8)``, all of the same size.

    ``chunk_index`` counts from 1 here: protobuf leaves a zero field out, so an index of 0 would
    make the first header two bytes shorter than the others.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n * tokens_per_chunk,), generator=g).tolist()
    keys = chunk_keys(tokens, fingerprint=FP, namespace=Namespace(tenant), chunk_size=tokens_per_chunk)
    out, parent = [], ROOT_KEY
    for i, key in enumerate(keys):
        kv = torch.randn(2, 2, 2, tokens_per_chunk, 8, generator=g).to(torch.float16)  # (L, 2, H, T, D)
        out.append((key, encode_artifact(kv, key=key, parent_key=parent, fingerprint=FP, chunk_index=i + 1)))
        parent = key
    return out


CHAIN = make_chain(12)
SIZE = len(CHAIN[0][1])
assert all(len(d) == SIZE for _, d in CHAIN)


def mem_disk(tmp_path: Path, mem_items: int, disk_items: int, *, policy: str = "lru", clock=None) -> TieredStore:
    return TieredStore(
        [MemoryTier(mem_items * SIZE), DiskTier(tmp_path / "disk", disk_items * SIZE, fsync=False, verify_on_open=False)],
        policy=policy,
        clock=clock or FakeClock(),
    )


def put_all(store: TieredStore, entries: list[tuple[ChunkKey, bytes]], **kw: object) -> list[ChunkKey]:
    """Put each artifact of ``entries`` (a slice of ``CHAIN``) for tenant acme; their keys, in order."""
    for _, data in entries:
        store.put(data, tenant="acme", **kw)  # type: ignore[arg-type]
    return [key for key, _ in entries]


def tiers_of(store: TieredStore, keys, tenant: str = "acme") -> list[str | None]:
    by_key = {s.meta.key: s.tier for s in store.entries(tenant=tenant)}
    return [by_key.get(k) for k in keys]


# ---------------------------------------------------------------------------------------------
# put / get basics and verification


def test_a_graceful_close_keeps_every_acknowledged_memory_entry_across_a_restart(tmp_path: Path) -> None:
    """Issue 19 measured 0/300 after SIGTERM + restart with the default memory tier over disk."""
    chain = make_chain(120, seed=4)
    store = mem_disk(tmp_path, 200, 400)
    put_all(store, chain)
    store.pin([chain[0][0]], tenant="acme")
    assert set(tiers_of(store, [k for k, _ in chain])) == {"memory"}  # all acknowledged, none on disk yet
    store.close()

    again = mem_disk(tmp_path, 200, 400)
    assert len(again.entries(tenant="acme")) == len(chain)  # N/N back
    for key, data in chain:
        assert again.get(key, tenant="acme", promote=False) == (data, "disk")
    assert again.stats()["pinned"] == 1
    again.close()

    # a disk budget smaller than memory: what fits is kept, and nothing breaks
    small = tmp_path / "small"
    store = TieredStore([MemoryTier(50 * SIZE), DiskTier(small, 10 * SIZE, fsync=False, verify_on_open=False)],
                        policy="lru", clock=FakeClock())
    put_all(store, chain[:40])
    store.close()
    back = TieredStore([MemoryTier(50 * SIZE), DiskTier(small, 10 * SIZE, fsync=False, verify_on_open=False)],
                       policy="lru", clock=FakeClock())
    assert len(back.entries(tenant="acme")) == 10
    back.close()


def test_put_get_roundtrip_and_meta() -> None:
    store = TieredStore([MemoryTier(10 * SIZE)], policy=POLICY, clock=FakeClock())
    key, data = CHAIN[1]
    meta = store.put(data, tenant="acme", expect_fingerprint=FP)
    assert meta.key == key and meta.parent == CHAIN[0][0] and meta.size == SIZE
    assert meta.chunk_index == 2 and meta.codec == "raw" and not meta.lossy and meta.fingerprint == FP
    assert store.get(key, tenant="acme") == (data, "memory")
    assert store.meta(key, tenant="acme") == meta
    s = store.stats()
    assert s["hits"] == 1 and s["hits_memory"] == 1 and s["bytes_memory"] == SIZE and s["entries"] == 1


def test_put_refuses_corrupt_and_foreign_model_artifacts_and_stores_nothing() -> None:
    store = TieredStore([MemoryTier(10 * SIZE)], policy=POLICY, clock=FakeClock())
    key, data = CHAIN[0]
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    with pytest.raises(ArtifactCorrupt):
        store.put(bytes(flipped), tenant="acme")
    with pytest.raises(ArtifactCorrupt):
        store.put(data[:-3], tenant="acme")
    with pytest.raises(FingerprintMismatch):
        store.put(data, tenant="acme", expect_fingerprint=OTHER_FP)
    with pytest.raises(InvalidInput):
        store.put(data, tenant="../etc")
    with pytest.raises(InvalidInput, match="reserved"):
        store.put(data, tenant=RETENTION_FILE)
    assert store.get(key, tenant="acme") is None
    assert store.stats()["entries"] == 0


def test_duplicate_put_is_idempotent() -> None:
    store = TieredStore([MemoryTier(10 * SIZE)], policy=POLICY, clock=FakeClock())
    key, data = CHAIN[0]
    store.put(data, tenant="acme")
    store.put(memoryview(data), tenant="acme")
    s = store.stats()
    assert s["entries"] == 1 and s["bytes_memory"] == SIZE and s["duplicate_puts"] == 1


def test_lookup_returns_tiers_of_the_leading_run(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 2, 10)
    put_all(store, CHAIN[:4])
    keys = [k for k, _ in CHAIN[:6]]
    assert store.lookup(keys, tenant="acme") == ["disk", "disk", "memory", "memory"]
    store.delete(keys[1], tenant="acme")
    assert store.lookup(keys, tenant="acme") == ["disk"]
    assert store.lookup(keys[2:], tenant="acme") == ["memory", "memory"]
    assert store.lookup(keys, tenant="other") == []


# ---------------------------------------------------------------------------------------------
# budgets, demotion, promotion


def test_budgets_hold_and_victims_are_demoted_then_dropped(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 2, 3)
    keys = [k for k, _ in CHAIN[:7]]
    for _, data in CHAIN[:7]:
        store.put(data, tenant="acme")
        s = store.stats()
        assert s["bytes_memory"] <= 2 * SIZE and s["bytes_disk"] <= 3 * SIZE
    # LRU: newest 2 in memory, next 3 on disk, oldest 2 gone
    assert tiers_of(store, keys) == [None, None, "disk", "disk", "disk", "memory", "memory"]
    s = store.stats()
    assert s["demotions"] == 5 and s["evictions"] == 2 and s["entries"] == 5
    # what was demoted is really on disk, as a complete artifact
    disk = store.tiers[1]
    assert isinstance(disk, DiskTier)
    assert disk.blob_path(EntryId("acme", keys[2])).read_bytes() == CHAIN[2][1]
    assert not disk.blob_path(EntryId("acme", keys[0])).exists()


def test_disk_hit_is_verified_and_promoted(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 2, 5)
    keys = put_all(store, CHAIN[:4])
    assert tiers_of(store, keys) == ["disk", "disk", "memory", "memory"]
    assert store.get(keys[0], tenant="acme") == (CHAIN[0][1], "disk")
    # promoted; the LRU memory victim (keys[2]) went down to disk in its place
    assert tiers_of(store, keys) == ["memory", "disk", "disk", "memory"]
    assert store.get(keys[0], tenant="acme") == (CHAIN[0][1], "memory")
    s = store.stats()
    assert s["promotions"] == 1 and s["hits_disk"] == 1 and s["hits_memory"] == 1 and s["misses_memory"] == 1
    assert store.get(keys[1], tenant="acme", promote=False) == (CHAIN[1][1], "disk")
    assert tiers_of(store, keys)[1] == "disk"


def test_artifact_bigger_than_a_tier_skips_it(tmp_path: Path) -> None:
    store = TieredStore(
        [MemoryTier(SIZE - 1), DiskTier(tmp_path / "d", 3 * SIZE, fsync=False, verify_on_open=False)],
        policy="lru", clock=FakeClock(),
    )
    key, data = CHAIN[0]
    store.put(data, tenant="acme")
    assert store.get(key, tenant="acme") == (data, "disk")  # and no promotion into a too-small tier
    assert tiers_of(store, [key]) == ["disk"]
    with pytest.raises(StorageFull):
        TieredStore([MemoryTier(SIZE - 1)], policy=POLICY, clock=FakeClock()).put(data, tenant="acme")


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "sieve", "prefix"])
def test_every_policy_keeps_budgets_and_serves_correct_bytes(tmp_path: Path, policy: str) -> None:
    chains = [make_chain(6, seed=s) for s in range(4)]
    store = mem_disk(tmp_path, 4, 8, policy=policy)
    import random

    rng = random.Random(1)
    for step in range(150):
        chain = chains[rng.randrange(4)]
        for key, data in chain[: rng.randrange(1, 7)]:
            got = store.get(key, tenant="acme")
            if got is None:
                store.put(data, tenant="acme")
            else:
                assert got[0] == data
        s = store.stats()
        assert s["bytes_memory"] <= 4 * SIZE and s["bytes_disk"] <= 8 * SIZE
        assert s["bytes_memory"] + s["bytes_disk"] == s["entries"] * SIZE
    assert store.stats()["hits"] > 0


def test_prefix_policy_keeps_chain_heads_in_memory(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 3, 20, policy="prefix")
    keys = [k for k, _ in CHAIN[:6]]
    put_all(store, CHAIN[:6])
    # leaves go first: the chain's tail is demoted, the root stays hot
    assert tiers_of(store, keys)[0] == "memory"
    assert store.lookup(keys, tenant="acme") != []
    assert len(store.lookup(keys, tenant="acme")) == 6


def test_unknown_policy_and_bad_tiers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="unknown eviction policy"):
        TieredStore([MemoryTier(10)], policy="nope")
    with pytest.raises(InvalidInput):
        TieredStore([], policy=POLICY)
    with pytest.raises(InvalidInput):
        TieredStore([MemoryTier(10), MemoryTier(10)], policy=POLICY)
    with pytest.raises(InvalidInput):
        MemoryTier(-1)
    store = TieredStore([MemoryTier(10 * SIZE)], policy=lambda i, n: make_policy("sieve"))
    store.put(CHAIN[0][1], tenant="acme")
    assert store.contains(CHAIN[0][0], tenant="acme")


# ---------------------------------------------------------------------------------------------
# pins, priorities, TTLs


def test_pinned_entries_are_never_evicted_or_demoted(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 2, 2)
    k0, d0 = CHAIN[0]
    store.put(d0, tenant="acme", pin=True)
    assert store.pin([k0, CHAIN[11][0]], tenant="acme") == 1  # only resident keys count
    put_all(store, CHAIN[1:9])
    assert tiers_of(store, [k0]) == ["memory"]
    assert store.get(k0, tenant="acme") == (d0, "memory")
    assert store.stats()["pinned"] == 1
    # unpinned, it becomes an ordinary LRU entry again: demoted, then dropped
    assert store.unpin([k0], tenant="acme") == 1
    put_all(store, CHAIN[9:11])
    assert tiers_of(store, [k0]) == ["disk"]
    put_all(store, CHAIN[11:12] + CHAIN[1:2])
    assert tiers_of(store, [k0]) == [None]


def test_when_everything_is_pinned_puts_go_down_then_fail(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 2, 2)
    put_all(store, CHAIN[:2], pin=True)
    store.put(CHAIN[2][1], tenant="acme")
    assert tiers_of(store, [CHAIN[2][0]]) == ["disk"]
    store.put(CHAIN[3][1], tenant="acme", pin=True)
    store.put(CHAIN[4][1], tenant="acme", pin=True)  # disk: evicts unpinned CHAIN[2]
    assert tiers_of(store, [k for k, _ in CHAIN[:5]]) == ["memory", "memory", None, "disk", "disk"]
    with pytest.raises(StorageFull, match="no tier can take"):
        store.put(CHAIN[5][1], tenant="acme")
    # nothing already stored was harmed
    for key, data in CHAIN[:2] + CHAIN[3:5]:
        assert store.get(key, tenant="acme", promote=False)[0] == data


def test_higher_priority_is_evicted_after_lower(tmp_path: Path) -> None:
    store = TieredStore([MemoryTier(3 * SIZE)], policy="lru", clock=FakeClock())
    k = [key for key, _ in CHAIN]
    store.put(CHAIN[0][1], tenant="acme", priority=5)  # oldest, but important
    store.put(CHAIN[1][1], tenant="acme")
    store.put(CHAIN[2][1], tenant="acme")
    assert store.set_priority([k[2]], 1, tenant="acme") == 1
    store.put(CHAIN[3][1], tenant="acme")  # evicts k1 (prio 0), not k0 (older, prio 5)
    assert tiers_of(store, k[:4]) == ["memory", None, "memory", "memory"]
    store.put(CHAIN[4][1], tenant="acme")  # k0 (5) and k2 (1) are passed over: k3 (0) goes
    assert tiers_of(store, k[:5]) == ["memory", None, "memory", None, "memory"]
    store.put(CHAIN[5][1], tenant="acme")  # k4 (0) goes
    store.set_priority([k[5]], 1, tenant="acme")
    # the newcomer is judged beside the residents: as the only class-0 entry it goes itself
    store.put(CHAIN[6][1], tenant="acme")
    assert tiers_of(store, k[:7]) == ["memory", None, "memory", None, None, "memory", None]
    store.put(CHAIN[7][1], tenant="acme", priority=1)  # class 1 only above k0: its LRU (k2) goes
    assert tiers_of(store, k[:8]) == ["memory", None, None, None, None, "memory", None, "memory"]
    with pytest.raises(InvalidInput):
        store.set_priority([k[0]], 1.5, tenant="acme")  # type: ignore[arg-type]


def test_ttl_expires_lazily_and_in_bulk_with_a_fake_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    store = mem_disk(tmp_path, 2, 10, clock=clock)
    k = put_all(store, CHAIN[:4])
    assert store.set_ttl(k[:2], 60, tenant="acme") == 2  # these two are on disk
    store.put(CHAIN[4][1], tenant="acme", ttl_s=30, pin=True)  # pinned, yet the TTL wins
    assert store.set_ttl([k[3]], 10, tenant="acme") == 1
    assert store.set_ttl([k[3]], None, tenant="acme") == 1  # cleared
    clock.advance(29.9)
    assert store.expire() == 0
    clock.advance(0.2)
    assert store.get(CHAIN[4][0], tenant="acme") is None  # lazily, on read
    clock.advance(30)
    assert store.expire() == 2
    assert store.lookup(k, tenant="acme") == []
    assert tiers_of(store, k) == [None, None, "disk", "memory"]  # k2 made room for CHAIN[4]
    assert not any((tmp_path / "disk").rglob(k[0].hex()))  # the disk blob is gone too
    assert store.stats()["expired"] == 3
    for bad in (0, -1, float("inf"), float("nan"), "10"):
        with pytest.raises(InvalidInput):
            store.set_ttl(k, bad, tenant="acme")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# tenants


def test_another_tenant_sees_exactly_what_an_absent_key_gives(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 2, 10)
    put_all(store, CHAIN[:3])
    owned, absent = CHAIN[2][0], ChunkKey(b"\x07" * 32)

    def view(key: ChunkKey) -> tuple:
        return (
            store.get(key, tenant="evil"),
            store.contains(key, tenant="evil"),
            store.meta(key, tenant="evil"),
            store.lookup([key], tenant="evil"),
            store.delete(key, tenant="evil"),
            store.pin([key], tenant="evil"),
            store.set_ttl([key], 1, tenant="evil"),
            store.set_priority([key], 3, tenant="evil"),
        )

    assert view(owned) == view(absent) == (None, False, None, [], False, 0, 0, 0)
    # the owner is untouched: not deleted, not pinned, no TTL
    assert store.get(owned, tenant="acme")[0] == CHAIN[2][1]
    assert [s.pinned or s.ttl_left_s is not None for s in store.entries(tenant="acme")] == [False] * 3
    # a foreign put of the same key is a separate entry, not an overwrite
    store.put(CHAIN[2][1], tenant="evil")
    assert store.delete(owned, tenant="evil")
    assert store.get(owned, tenant="acme")[0] == CHAIN[2][1]


# ---------------------------------------------------------------------------------------------
# disk faults and restart


def test_corrupt_disk_blob_is_detected_dropped_and_reported_as_a_miss(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 1, 10)
    put_all(store, CHAIN[:3])
    key = CHAIN[0][0]
    path = store.tiers[1].blob_path(EntryId("acme", key))  # type: ignore[attr-defined]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    assert store.get(key, tenant="acme") is None
    assert not path.exists()
    assert not store.contains(key, tenant="acme")
    assert store.stats()["corrupt_dropped"] == 1
    store.put(CHAIN[0][1], tenant="acme")  # fetched again
    assert store.get(key, tenant="acme")[0] == CHAIN[0][1]
    # a blob that vanished from under the store is a miss as well
    path = store.tiers[1].blob_path(EntryId("acme", CHAIN[1][0]))  # type: ignore[attr-defined]
    path.unlink()
    assert store.get(CHAIN[1][0], tenant="acme") is None
    assert store.stats()["lost"] == 1


def test_restart_rebuilds_the_disk_index(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 1, 10)
    put_all(store, CHAIN[:5])
    store.put(CHAIN[0][1], tenant="beta")
    on_disk = {s.meta.key for s in store.entries(tenant="acme") if s.tier == "disk"}
    assert len(on_disk) == 5  # beta's put pushed the last one down
    assert [s.tier for s in store.entries(tenant="beta")] == ["memory"]
    store.close()
    with pytest.raises(Unavailable):
        store.get(CHAIN[0][0], tenant="acme")

    again = mem_disk(tmp_path, 1, 10)
    assert {s.meta.key for s in again.entries(tenant="acme")} == on_disk
    assert [s.tier for s in again.entries(tenant="beta")] == ["disk"]  # the graceful close moved it down
    for key, data in CHAIN[:5]:
        assert again.get(key, tenant="acme", promote=False) == (data, "disk")
    meta = again.meta(CHAIN[1][0], tenant="acme")
    assert meta is not None and meta.parent == CHAIN[0][0] and meta.chunk_index == 2 and meta.size == SIZE
    # a smaller budget on restart is enforced at once
    third = mem_disk(tmp_path, 1, 2)
    assert third.stats()["bytes_disk"] <= 2 * SIZE


def test_restart_drops_partial_and_foreign_files_and_never_shows_a_killed_writers_tmp(tmp_path: Path) -> None:
    store = mem_disk(tmp_path, 1, 10)
    put_all(store, CHAIN[:4])
    disk = store.tiers[1]
    good = [k for k, _ in CHAIN[:3]]
    store.close()
    p0 = disk.blob_path(EntryId("acme", good[0]))  # type: ignore[attr-defined]
    p1 = disk.blob_path(EntryId("acme", good[1]))  # type: ignore[attr-defined]
    # 1) a writer killed mid-write (not atomic): truncated file under the final name
    p0.write_bytes(p0.read_bytes()[: SIZE // 2])
    # 2) a writer killed before its rename: a temporary next to the final name
    tmp_key = CHAIN[7][0]
    tmp_final = disk.blob_path(EntryId("acme", tmp_key))  # type: ignore[attr-defined]
    tmp_final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_final.with_name(f".{tmp_final.name}.{dead_pid()}.abc.tmp")
    tmp.write_bytes(CHAIN[7][1][:100])
    # 3) a valid artifact under the wrong name, and garbage
    wrong = p1.with_name("cd" * 32)
    wrong.parent.mkdir(parents=True, exist_ok=True)
    wrong.write_bytes(CHAIN[1][1])
    junk_dir = tmp_path / "disk" / "acme" / "ff"
    junk_dir.mkdir(parents=True, exist_ok=True)
    (junk_dir / ("ff" * 32)).write_bytes(b"not an artifact at all")

    again = mem_disk(tmp_path, 1, 10)
    keys = {s.meta.key for s in again.entries(tenant="acme")}
    assert keys == {good[1], good[2], CHAIN[3][0]}  # CHAIN[3] was in memory: the close moved it down
    assert again.tiers[1].dropped_on_open >= 3  # type: ignore[attr-defined]
    assert again.tiers[1].swept_tmp == 1  # type: ignore[attr-defined]
    assert not tmp.exists() and not p0.exists() and not wrong.exists()
    assert again.get(tmp_key, tenant="acme") is None
    assert again.get(good[1], tenant="acme")[0] == CHAIN[1][1]


def test_disk_full_raises_storage_full_and_keeps_old_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = TieredStore([DiskTier(tmp_path / "d", 20 * SIZE, fsync=True, verify_on_open=False)], policy="lru",
                        clock=FakeClock())
    put_all(store, CHAIN[:3])

    def enospc(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(blobstore.os, "fsync", enospc)
    with pytest.raises(StorageFull):
        store.put(CHAIN[3][1], tenant="acme")
    monkeypatch.undo()
    assert not store.contains(CHAIN[3][0], tenant="acme")
    s = store.stats()
    assert s["write_failures"] == 1 and s["entries"] == 3 and s["bytes_disk"] == 3 * SIZE
    assert not [p for p in (tmp_path / "d").rglob("*") if p.name.endswith(".tmp")]
    for key, data in CHAIN[:3]:
        assert store.get(key, tenant="acme") == (data, "disk")
    store.put(CHAIN[3][1], tenant="acme")  # space back: works again
    assert store.get(CHAIN[3][0], tenant="acme") == (CHAIN[3][1], "disk")


def test_disk_full_during_demotion_loses_only_that_cache_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = mem_disk(tmp_path, 2, 10)
    store.put(CHAIN[0][1], tenant="acme")
    store.put(CHAIN[1][1], tenant="acme")
    store.put(CHAIN[2][1], tenant="acme")  # CHAIN[0] on disk now

    def enospc(*a: object, **k: object) -> None:
        raise StorageFull("disk full (test)")

    monkeypatch.setattr(store.tiers[1], "put", enospc)
    store.put(CHAIN[3][1], tenant="acme")  # the put itself lands in memory; CHAIN[1]'s demotion fails
    monkeypatch.undo()
    k = [key for key, _ in CHAIN[:4]]
    assert tiers_of(store, k) == ["disk", None, "memory", "memory"]
    s = store.stats()
    assert s["write_failures"] == 1 and s["bytes_disk"] == SIZE
    assert store.get(k[0], tenant="acme", promote=False) == (CHAIN[0][1], "disk")


def test_concurrent_readers_and_writers_see_only_correct_bytes(tmp_path: Path) -> None:
    chains = [make_chain(5, seed=10 + s) for s in range(6)]
    truth = {k: d for c in chains for k, d in c}
    store = mem_disk(tmp_path, 5, 10, policy="prefix", clock=FakeClock())
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        import random

        rng = random.Random(seed)
        try:
            for _ in range(120):
                chain = chains[rng.randrange(len(chains))]
                for key, data in chain[: rng.randrange(1, 6)]:
                    got = store.get(key, tenant="acme")
                    if got is None:
                        store.put(data, tenant="acme")
                    elif got[0] != truth[key]:
                        raise AssertionError("wrong bytes served")
                if rng.random() < 0.05:
                    store.delete(chain[0][0], tenant="acme")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    s = store.stats()
    assert s["bytes_memory"] <= 5 * SIZE and s["bytes_disk"] <= 10 * SIZE
    assert s["bytes_memory"] + s["bytes_disk"] == s["entries"] * SIZE
    # the disk holds exactly the indexed disk entries, each intact
    disk_keys = {e.meta.key for e in store.entries() if e.tier == "disk"}
    files = {p.name for p in (tmp_path / "disk").rglob("*") if p.is_file()}
    assert files == {k.hex() for k in disk_keys}
    resident = {e.meta.key for e in store.entries()}
    store.close()  # moves the memory entries down, as far as the disk budget allows
    reopened = mem_disk(tmp_path, 5, 10)
    back = {e.meta.key for e in reopened.entries()}
    assert back <= resident and len(back) == min(len(resident), 10)


def test_build_store_builds_memory_over_disk(tmp_path: Path) -> None:
    config = EdgeConfig(memory_bytes=2 * SIZE, disk_dir=str(tmp_path / "x"), disk_bytes=4 * SIZE, disk_fsync=False)
    store = build_store(config)
    assert [t.name for t in store.tiers] == ["memory", "disk"]
    put_all(store, CHAIN[:3])
    assert store.stats()["bytes_disk"] == SIZE
    assert [t.name for t in build_store(EdgeConfig(memory_bytes=SIZE)).tiers] == ["memory"]


def test_pins_priorities_and_ttls_survive_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    store = mem_disk(tmp_path, 1, 10, clock=clock)
    k = put_all(store, CHAIN[:6])
    assert store.pin(k[:2], tenant="acme") == 2
    assert store.set_priority([k[2]], 7, tenant="acme") == 1
    assert store.set_ttl([k[3]], 100, tenant="acme") == 1
    assert store.set_ttl([k[4]], 1000, tenant="acme") == 1
    assert store.pin([k[5]], tenant="acme") == 1 and store.unpin([k[5]], tenant="acme") == 1
    store.put(CHAIN[6][1], tenant="acme", ttl_s=5000, priority=2)  # hints given with a put are kept too
    store.put(CHAIN[7][1], tenant="acme", priority=3)  # pushes CHAIN[6] down to disk
    assert tiers_of(store, [CHAIN[6][0]]) == ["disk"]
    store.close()
    clock.advance(500)  # the edge is down for a while: k3's TTL runs out meanwhile

    again = mem_disk(tmp_path, 1, 10, clock=clock)
    state = {s.meta.key: s for s in again.entries(tenant="acme")}
    assert k[3] not in state and again.stats()["expired"] == 1
    assert state[k[0]].pinned and state[k[1]].pinned and not state[k[2]].pinned and not state[k[5]].pinned
    assert state[k[2]].priority == 7
    assert state[k[4]].ttl_left_s == pytest.approx(500)
    assert again.stats()["pinned"] == 2
    assert state[CHAIN[6][0]].ttl_left_s == pytest.approx(4500) and state[CHAIN[6][0]].priority == 2
    assert state[CHAIN[7][0]].priority == 3  # it was in memory: the graceful close moved it to disk
    again.close()

    # a smaller disk budget on restart trims unpinned, low-priority entries first
    third = mem_disk(tmp_path, 1, 4, clock=clock)
    assert {s.meta.key for s in third.entries(tenant="acme")} == {k[0], k[1], k[2], CHAIN[7][0]}
    # an unreadable hints file is ignored, not fatal
    third.close()
    (tmp_path / "disk" / RETENTION_FILE).write_text("{broken")
    fourth = mem_disk(tmp_path, 1, 10, clock=clock)
    assert fourth.stats()["pinned"] == 0 and fourth.stats()["entries"] == 4


_KILLED_WRITER = r"""
import sys, time
from kdn import blobstore
from kdn.edge.store import DiskTier, TieredStore

def stall(fd):
    print("in-fsync", flush=True)  # the bytes are written to the temp file; the rename has not happened
    time.sleep(60)

store = TieredStore([DiskTier(sys.argv[1], 1 << 30, fsync=True, verify_on_open=False)], policy="lru")
blobstore.os.fsync = stall
store.put(sys.stdin.buffer.read(), tenant="acme")
print("finished", flush=True)
"""


def test_a_writer_killed_mid_write_leaves_nothing_visible(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    root = tmp_path / "disk"
    store = TieredStore([DiskTier(root, 1 << 30, fsync=False, verify_on_open=False)], policy="lru", clock=FakeClock())
    store.put(CHAIN[0][1], tenant="acme")
    store.close()
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(CHAIN[1][1])
        child.stdin.close()
        line = child.stdout.readline()
        assert line == b"in-fsync\n", (line, child.stderr.read() if child.stderr else b"")
        assert [p for p in root.rglob("*") if p.name.endswith(".tmp")]  # caught in the act
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        reap(child)
    again = TieredStore([DiskTier(root, 1 << 30, fsync=False, verify_on_open=False)], policy="lru", clock=FakeClock())
    assert again.get(CHAIN[1][0], tenant="acme") is None
    assert again.get(CHAIN[0][0], tenant="acme") == (CHAIN[0][1], "disk")
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]
    assert again.tiers[0].swept_tmp == 1  # type: ignore[attr-defined]


def check_invariants(store: TieredStore, tmp_path: Path | None = None) -> None:
    """Accounting agrees with the entries, budgets hold, and the disk holds exactly its entries."""
    s = store.stats()
    states = store.entries()
    for tier in store.tiers:
        mine = [e for e in states if e.tier == tier.name]
        assert s[f"bytes_{tier.name}"] == sum(e.meta.size for e in mine) == tier.bytes_used
        assert s[f"bytes_{tier.name}"] <= tier.capacity_bytes
        assert s[f"pinned_bytes_{tier.name}"] == sum(e.meta.size for e in mine if e.pinned)
        assert s[f"entries_{tier.name}"] == len(mine)
    assert s["pinned"] == sum(e.pinned for e in states)
    assert s["entries"] == len(states)
    if tmp_path is not None:
        files = {p.name for p in (tmp_path / "disk").rglob("*") if p.is_file() and not p.name.startswith(".")}
        assert files == {e.meta.key.hex() for e in states if e.tier == "disk"}


@pytest.mark.parametrize("policy", ["lru", "prefix"])
def test_random_operations_keep_every_invariant(tmp_path: Path, policy: str) -> None:
    import random

    rng = random.Random(7)
    clock = FakeClock()
    chains = [make_chain(4, seed=100 + s) for s in range(4)]
    items = [item for c in chains for item in c]
    store = mem_disk(tmp_path, 3, 6, policy=policy, clock=clock)
    for step in range(400):
        key, data = items[rng.randrange(len(items))]
        op = rng.random()
        if op < 0.35:
            try:
                store.put(data, tenant="acme", pin=rng.random() < 0.1, priority=rng.choice([None, 0, 0, 1, 2]))
            except StorageFull:
                pass
        elif op < 0.7:
            got = store.get(key, tenant="acme", promote=rng.random() < 0.8)
            assert got is None or got[0] == data
        elif op < 0.78:
            store.unpin([key], tenant="acme")
        elif op < 0.83:
            store.pin([key], tenant="acme")
        elif op < 0.88:
            store.set_ttl([key], rng.choice([None, 5, 50]), tenant="acme")
        elif op < 0.92:
            store.set_priority([key], rng.choice([0, 1, 3]), tenant="acme")
        elif op < 0.96:
            store.delete(key, tenant="acme")
        else:
            clock.advance(rng.choice([1, 10, 30]))
            store.expire()
        check_invariants(store, tmp_path)
    assert store.stats()["demotions"] > 0 and store.stats()["promotions"] > 0
    store.close()
    check_invariants(mem_disk(tmp_path, 3, 6, policy=policy, clock=clock), tmp_path)


def test_a_pinned_newcomer_is_never_the_victim_of_its_own_put() -> None:
    store = TieredStore([MemoryTier(2 * SIZE)], policy="prefix", clock=FakeClock())
    store.put(CHAIN[0][1], tenant="acme")
    store.put(CHAIN[1][1], tenant="acme")
    store.put(CHAIN[5][1], tenant="acme", pin=True)  # an orphan: the prefix policy's first choice
    assert store.contains(CHAIN[5][0], tenant="acme")
    assert store.stats()["pinned"] == 1 and store.stats()["pinned_bytes_memory"] == SIZE
    check_invariants(store)
