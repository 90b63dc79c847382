"""Eviction policies: the shared contract, each policy's defining behaviour, BoundedCache."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdn.edge.eviction import (
    LRU,
    POLICIES,
    S3FIFO,
    Belady,
    EvictionPolicy,
    PrefixAware,
    Sieve,
    make_policy,
)
from kdn.errors import InvalidInput
from kdn.simulator.cache import BoundedCache

ALL = sorted(POLICIES)


def test_registry_has_the_policies_and_rejects_unknown_names() -> None:
    assert {"lru", "s3fifo", "sieve", "prefix"} <= set(POLICIES)
    for name, cls in POLICIES.items():
        assert cls.name == name
        assert isinstance(make_policy(name), cls)
    with pytest.raises(InvalidInput, match="unknown eviction policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError):  # InvalidInput is a ValueError too
        make_policy("lru", bogus=1)
    with pytest.raises(InvalidInput):
        make_policy("s3fifo", small_ratio=1.5)


# -- the contract every policy keeps -------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_victim_does_not_remove_and_respects_skip(name: str) -> None:
    p = make_policy(name)
    assert p.victim() is None and len(p) == 0
    parent = None
    for k in range(10):
        p.insert(k, 1, parent)
        parent = k
    assert len(p) == 10 and 3 in p and 10 not in p
    v = p.victim()
    assert v in p and len(p) == 10
    assert p.victim() == v  # asking again, without a remove, names the same key
    pinned = {v}
    w = p.victim(pinned.__contains__)
    assert w is not None and w != v and w in p
    assert p.victim(lambda k: True) is None  # everything pinned: nothing evictable
    p.remove(v)
    p.remove(v)  # idempotent
    assert v not in p and len(p) == 9
    p.touch(12345)  # unknown key: ignored
    p.remove(12345)


@pytest.mark.parametrize("name", ALL)
def test_draining_with_victim_empties_every_policy_without_repeats(name: str) -> None:
    p = make_policy(name)
    rng = random.Random(1)
    for k in range(200):
        p.insert(k, 1, rng.choice([None, k - 1]) if k else None)
        if rng.random() < 0.5:
            p.touch(rng.randrange(k + 1))
    seen = set()
    while (v := p.victim()) is not None:
        assert v not in seen and v in p
        seen.add(v)
        p.remove(v)
    assert seen == set(range(200)) and len(p) == 0


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5), st.booleans()), min_size=1, max_size=300),
    capacity=st.integers(1, 30),
)
def test_bounded_cache_stays_within_budget_and_counts(name: str, ops, capacity: int) -> None:
    cache = BoundedCache(capacity, make_policy(name))
    pinned = None
    for i, (key, size, pin) in enumerate(ops):
        hit = cache.access(key, size, parent=key - 1 if key else None)
        if hit:
            assert key in cache
        if pin and key in cache and pinned is None:
            cache.pin(key)
            pinned = key
        assert cache.bytes_used <= capacity
        assert cache.hits + cache.misses == i + 1
        assert len(cache.policy) == len(cache)
        assert all(k in cache.policy for k in cache.keys())
        if pinned is not None:
            assert pinned in cache  # a pinned key is never evicted


def test_bounded_cache_rejects_oversized_and_negative_budget() -> None:
    cache = BoundedCache(10, LRU())
    assert cache.access("big", 11) is False
    assert "big" not in cache and cache.stats.rejected == 1 and cache.bytes_used == 0
    with pytest.raises(InvalidInput):
        BoundedCache(-1, LRU())


def test_unpin_lets_the_cache_shrink_back_under_budget() -> None:
    cache = BoundedCache(2, LRU())
    cache.access("a", 1)
    cache.access("b", 1)
    cache.pin("a")
    cache.pin("b")
    cache.access("c", 1)  # nothing evictable but c itself
    assert "a" in cache and "b" in cache
    cache.access("d", 2)  # too big to fit beside two pinned keys: evicts c, then d itself
    assert cache.bytes_used >= 2
    cache.unpin("a")
    assert cache.bytes_used <= 2 and "b" in cache


# -- each policy's defining behaviour -------------------------------------------------------------


def test_lru_evicts_least_recently_used() -> None:
    p = LRU()
    for k in "abc":
        p.insert(k, 1)
    p.touch("a")
    assert p.victim() == "b"
    assert p.victim(lambda k: k == "b") == "c"


def test_sieve_hand_clears_visited_bits_and_keeps_its_place() -> None:
    p = Sieve()
    for k in "abcd":
        p.insert(k, 1)
    p.touch("a")
    p.touch("c")
    assert p.victim() == "b"  # a was visited: bit cleared, hand moves on
    p.remove("b")
    assert p.victim() == "d"  # hand continues from where it was: c visited -> d
    p.remove("d")
    assert p.victim() == "a"  # wrapped around; a's bit was cleared on the first pass


def test_s3fifo_one_hit_wonders_leave_from_small_and_ghost_hits_go_to_main() -> None:
    p = S3FIFO(small_ratio=0.1)
    cache = BoundedCache(10, p)
    for k in range(10):  # fill, and make keys 0..4 hot
        cache.access(k, 1)
    for k in range(5):
        cache.access(k, 1)
    for k in range(100, 140):  # a scan of one-hit wonders
        cache.access(k, 1)
    assert all(k in cache for k in range(5)), "hot keys survive a scan"
    assert 100 not in cache
    # The latest one-hit wonders left the small queue into the ghost; one that comes back goes
    # straight to main. (The ghost holds about as many keys as are resident, so 100 is forgotten.)
    back = max(k for k in range(100, 140) if k not in cache)
    cache.access(back, 1)
    assert back in p._main
    cache.access(100, 1)
    assert 100 in p._small


def test_prefix_never_evicts_a_parent_before_its_children() -> None:
    p = PrefixAware()
    chain = list(range(10))
    for _ in range(5):  # a hot chain
        parent = None
        for k in chain:
            if k in p:
                p.touch(k)
            else:
                p.insert(k, 1, parent)
            parent = k
    for k in range(100, 105):  # a cold one
        p.insert(k, 1, k - 1 if k > 100 else None)
    order = []
    while (v := p.victim()) is not None:
        assert all(c not in p for c in ([v + 1] if v + 1 in chain or 100 <= v < 104 else []))
        order.append(v)
        p.remove(v)
    assert order[:5] == [104, 103, 102, 101, 100], "the cold chain goes first, tail first"
    assert order[5:] == chain[::-1], "then the hot chain, also tail first"


def test_prefix_keeps_a_shared_root_that_lru_drops_under_a_scan() -> None:
    def run(policy: EvictionPolicy) -> int:
        cache = BoundedCache(20, policy)
        hits = 0
        for req in range(200):
            ids = [0, 1, 2] if req % 2 == 0 else [1000 + 100 * req + i for i in range(25)]
            parent = None
            for i, x in enumerate(ids):
                hit = cache.access(x, 1, parent)
                hits += hit and all(y in cache for y in ids[:i])
                parent = x
        return hits

    assert run(PrefixAware()) > 250  # the hot 3-block chain survives the 25-block scans
    assert run(LRU()) == 0  # LRU flushes it every time


def test_prefix_evicts_superseded_partial_chunk_first() -> None:
    def run(supersede: bool) -> object:
        p = PrefixAware(supersede=supersede)
        p.insert(50, 1, None)  # an unrelated root, older than everything below
        for k, parent in [(0, None), (1, 0), (2, 1), (99, 2)]:  # turn 1 ends in partial chunk 99
            p.insert(k, 1, parent)
        for k in (0, 1, 2):  # turn 2 reads the prefix and adds the full chunk 3 instead of 99
            p.touch(k)
        p.insert(3, 1, 2)
        return p.victim()

    assert run(True) == 99  # superseded: goes before the older but still possible root
    assert run(False) == 50  # plain score order


def test_prefix_orphans_are_dead_and_go_first_and_revive_with_their_parent() -> None:
    p = PrefixAware()
    p.insert("a", 1)
    p.insert("b", 1, "a")
    p.insert("c", 1, "b")
    p.insert("x", 1)
    p.touch("x")
    p.remove("a")  # e.g. a TTL took the root: b and c can never be read
    assert p.victim() == "c"
    p.insert("a", 1)  # the root comes back: b, c are usable again
    assert p.victim() == "c"  # leaves first still holds...
    p.touch("c")
    p.touch("c")
    assert p.victim() == "x"  # ...but c is alive again and outranks x by score
    q = PrefixAware(reject_orphans=True)
    assert q.admit("k", 1, parent="missing") is False
    assert q.admit("k", 1, parent=None) is True
    q2 = PrefixAware(track_orphans=False)
    q2.insert("y", 1, parent="elsewhere")  # parent in another tier: not dead
    q2.insert("z", 1)
    assert q2.victim() == "y"  # plain score order (older first), no dead-first rank


def test_prefix_treats_the_root_key_as_no_parent() -> None:
    from kdn.keys import ROOT_KEY

    p = PrefixAware(reject_orphans=True)
    k0, k1 = b"\x01" * 32, b"\x02" * 32
    assert p.admit(k0, 1, ROOT_KEY)
    p.insert(k0, 1, ROOT_KEY)  # chunk 0's parent is the fixed root, which is never stored
    p.insert(k1, 1, k0)
    p.insert("other", 1)
    p.touch(k0)
    p.touch(k1)
    assert p.victim() == "other"  # k0's chain is alive, not dead-first


def test_prefix_victim_skips_pinned_leaves_and_falls_back_when_all_leaves_are_pinned() -> None:
    p = PrefixAware()
    p.insert("a", 1)
    p.insert("b", 1, "a")
    assert p.victim(lambda k: k == "b") == "a"  # only leaf pinned: fall back to its parent
    assert p.victim(lambda k: True) is None
    assert p.victim() == "b"


def test_prefix_scores_survive_clock_rescaling() -> None:
    from kdn.edge.eviction.prefix import _RESCALE_AT

    p = PrefixAware(half_life=1.0)  # two accesses a step: the clock passes the rescale point halfway
    p.insert("hot", 1)
    for i in range(int(_RESCALE_AT)):
        p.touch("hot")
        p.insert(i, 1)
        if len(p) > 50:
            v = p.victim()
            assert v != "hot"
            p.remove(v)
    assert "hot" in p and p._vclock <= _RESCALE_AT


def test_belady_is_optimal_against_every_policy_on_random_traces() -> None:
    rng = random.Random(7)
    for trial in range(5):
        seq = [int(rng.paretovariate(1.0)) % 60 for _ in range(2000)]
        results = {}
        for name in ALL + ["belady"]:
            policy = Belady(seq) if name == "belady" else make_policy(name)
            cache = BoundedCache(15, policy)
            results[name] = sum(cache.access(k, 1) for k in seq)
        assert results["belady"] >= max(results.values()), results


def test_belady_refuses_an_access_out_of_sequence() -> None:
    p = Belady([1, 2, 1])
    p.insert(1, 1)
    with pytest.raises(InvalidInput):
        p.insert(3, 1)


def test_victim_with_few_pins_is_cheap() -> None:
    """With 5 pinned keys among 20k, 20k victim() calls visit O(1) keys each (not O(pinned * n))."""
    for name in ALL:
        p = make_policy(name)
        for k in range(20_000):
            p.insert(k, 1, None)
        pinned = {0, 1, 2, 3, 4}
        calls = 0

        def skip(k: object) -> bool:
            nonlocal calls
            calls += 1
            return k in pinned

        for _ in range(19_000):
            v = p.victim(skip)
            assert v not in pinned
            p.remove(v)
        assert calls < 19_000 * 8, (name, calls)


# -- the real trace (slow: runs the whole benchmark replay) ---------------------------------------

TRACE = Path(__file__).resolve().parents[2] / "kdn" / "simulator" / "scenarios" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason="shared trace not present")
def test_prefix_policy_meets_the_goal_on_the_mooncake_trace() -> None:
    spec = importlib.util.spec_from_file_location(
        "eviction_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "eviction.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]
    reqs = bench.load_trace(TRACE)
    unique = len({x for r in reqs for x in r.hash_ids})
    caps = [round(f * unique) for f in bench.FRACTIONS]
    lru = [bench.replay(reqs, c, LRU()) for c in caps]
    pre = [bench.replay(reqs, c, PrefixAware()) for c in caps]
    assert all(p >= l for p, l in zip(pre, lru)), (pre, lru)
    assert pre[0] >= 1.3 * lru[0]


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("itrv"), st.integers(0, 30), st.integers(-1, 30)), max_size=200))
def test_prefix_random_ops_keep_leaves_first_and_drain_cleanly(ops) -> None:
    """Inserts under random parents, touches, outside removals (orphaning subtrees), evictions:
    a live victim never has a resident child, and draining visits every resident key once."""
    p = PrefixAware(half_life=5.0)
    parent_of: dict[int, int | None] = {}
    for op, key, parent in ops:
        if op == "i" and key not in p and parent != key:
            p.insert(key, 1, None if parent < 0 else parent)
            parent_of[key] = None if parent < 0 else parent
        elif op == "t":
            p.touch(key)
        elif op == "r":
            p.remove(key)
        elif op == "v" and (v := p.victim()) is not None:
            assert v in p
            if not p._nodes[v].dead:
                assert not any(parent_of.get(c) == v for c in p._nodes), "a live victim is a leaf"
            p.remove(v)
    left = set(p._nodes)
    seen = set()
    while (v := p.victim()) is not None:
        assert v not in seen
        seen.add(v)
        p.remove(v)
    assert seen == left and len(p) == 0
