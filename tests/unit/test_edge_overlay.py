"""Overlay membership and failover, against in-process nodes (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from kdn.edge.clock import FakeClock
from kdn.edge.config import EdgeConfig
from kdn.edge.overlay import Member, Overlay
from kdn.testing import InMemoryOverlay, NodeUpstream, make_chain, origin_with
from kdn.edge.upstream import FetchSpec
from kdn.errors import NotFound, Unavailable

MEMBERS = [Member(f"n{i}", f"mem://n{i}") for i in range(5)]


def _overlay(clock: FakeClock, members=MEMBERS, **kw) -> Overlay:  # type: ignore[no-untyped-def]
    """n0's overlay over ``members`` (a list or a provider), with the config's settings except those given."""
    c = EdgeConfig()
    return Overlay(MEMBERS[0], members, clock=clock, **{"replicas": c.replicas, "backoff_s": c.peer_backoff_s, **kw})


def test_owners_distinct_and_stable() -> None:
    ov = _overlay(FakeClock(), replicas=3)
    again = _overlay(FakeClock(), replicas=3)
    for i in range(200):
        key = i.to_bytes(32, "little")
        owners = [m.node_id for m in ov.owners(key)]
        assert len(owners) == 3 == len(set(owners))
        assert owners == [m.node_id for m in again.owners(key)]


def test_down_member_keys_move_to_next_owner_and_come_back() -> None:
    clock = FakeClock()
    ov = _overlay(clock, replicas=2, backoff_s=5.0)
    keys = [i.to_bytes(32, "big") for i in range(300)]
    before = {k: [m.node_id for m in ov.owners(k)] for k in keys}
    ov.mark_down("n3")
    during = {k: [m.node_id for m in ov.owners(k)] for k in keys}
    for k in keys:
        assert "n3" not in during[k]
        if "n3" not in before[k]:
            assert during[k] == before[k]  # only the down node's keys move
        else:
            assert [n for n in before[k] if n != "n3"] == during[k][: len(before[k]) - 1]
    clock.advance(5.1)  # backoff over: offered again ("half-open")
    assert {k: [m.node_id for m in ov.owners(k)] for k in keys} == before
    ov.mark_down("n3")  # failed again: the backoff doubles
    clock.advance(5.1)
    assert not ov.is_up("n3")
    clock.advance(5.0)
    assert ov.is_up("n3")
    ov.mark_up("n3")
    ov.mark_down("n3")  # success resets the backoff
    clock.advance(5.1)
    assert ov.is_up("n3")


def test_never_marks_itself_down_and_provider_refresh() -> None:
    members = list(MEMBERS[:2])
    ov = _overlay(FakeClock(), lambda: list(members))
    ov.mark_down("n0")
    assert ov.is_up("n0")
    assert set(ov.members) == {"n0", "n1"}
    members.append(Member("n9", "mem://n9", 2.0))
    assert ov.refresh() is True
    assert set(ov.members) == {"n0", "n1", "n9"}
    assert ov.refresh() is False


def test_fetch_fails_over_when_an_owner_is_killed_and_returns() -> None:
    chain = make_chain(1)
    origin = origin_with([chain])

    async def main() -> None:
        async with InMemoryOverlay(5, origin=origin, peer_backoff_s=2.0) as ov:
            key = chain.keys[0]
            primary, secondary, third = (m.node_id for m in ov.nodes["e0"].overlay.owners(key, 3))
            client_node, other = (n for nid, n in ov.nodes.items() if nid not in (primary, secondary, third))
            assert (await client_node.fetch_bytes(chain.spec(0)))[0] == chain.blobs[0]
            assert origin.fetches == 1  # through the primary owner, which keeps a copy
            assert await ov.nodes[primary].lookup_local([key], tenant="default") == ["memory"]

            ov.kill(primary)  # as a SIGKILL would: every link to it fails
            data, source = await other.fetch_bytes(chain.spec(0))
            assert data == chain.blobs[0] and source == "peer"  # via the secondary, which refetched
            assert primary in ov.nodes[secondary].overlay.down()
            assert [m.node_id for m in ov.nodes[secondary].overlay.owners(key)] == [secondary, third]
            assert origin.fetches == 2
            other.store.delete(key, tenant="default")
            data, source = await other.fetch_bytes(chain.spec(0))
            assert data == chain.blobs[0] and source == "peer"
            assert origin.fetches == 2  # the secondary kept it

            ov.revive(primary)
            ov.clock.advance(2.1)  # type: ignore[attr-defined]
            assert [m.node_id for m in other.overlay.owners(key)][0] == primary
            other.store.delete(key, tenant="default")
            data, source = await other.fetch_bytes(chain.spec(0))
            assert data == chain.blobs[0] and source == "peer"
            assert primary not in other.overlay.down()

    asyncio.run(main())


class _CorruptPeer(NodeUpstream):
    async def fetch(self, spec: FetchSpec, *, token: str | None = None) -> bytes:
        data = bytearray(await super().fetch(spec, token=token))
        data[len(data) // 2] ^= 0x40
        return bytes(data)


def test_corrupt_bytes_from_a_peer_are_dropped_and_fetched_elsewhere() -> None:
    chain = make_chain(1)
    origin = origin_with([chain])

    async def main() -> None:
        async with InMemoryOverlay(3, origin=origin) as ov:
            key = chain.keys[0]
            primary = ov.owners(key)[0]
            ov.nodes[primary].store.put(chain.blobs[0], tenant="default")
            client_node = ov.non_owner(key)
            ov.links[(client_node.node_id, primary)] = _CorruptPeer(primary, ov.nodes[primary])
            data, source = await client_node.fetch_bytes(chain.spec(0))
            assert data == chain.blobs[0]
            assert source in ("peer", "origin")
            counters, _ = await client_node.stats()
            assert counters["kdn_edge_corrupt_upstream_total"] == 1

    asyncio.run(main())


def test_origin_down_serves_what_it_holds_and_reports_it() -> None:
    chain = make_chain(2)
    origin = origin_with([chain])

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin) as ov:
            node = ov.nodes["e0"]
            await node.fetch_bytes(chain.spec(0))
            origin.up = False
            assert (await node.fetch_bytes(chain.spec(0)))[0] == chain.blobs[0]
            with pytest.raises(Unavailable):  # a miss with the origin down
                await node.fetch_bytes(chain.spec(1))
            counters, details = await node.stats()
            assert counters["origin_available"] == 0.0 and details["origin"]["available"] is False
            origin.up = True
            counters, _ = await node.stats()
            assert counters["origin_available"] == 1.0

    asyncio.run(main())


def test_local_only_never_goes_upstream() -> None:
    chain = make_chain(1)
    origin = origin_with([chain])

    async def main() -> None:
        async with InMemoryOverlay(2, origin=origin) as ov:
            with pytest.raises(NotFound):
                await ov.nodes["e0"].fetch_bytes(chain.spec(0, local_only=True))
            assert origin.fetches == 0

    asyncio.run(main())


def test_inconsistent_views_do_not_bounce_a_key_between_edges() -> None:
    """Two edges that each think the other owns a key: one forward, then the origin, no loop."""
    chain = make_chain(1)
    origin = origin_with([chain], delay_s=0.01)

    async def main() -> None:
        async with InMemoryOverlay(2, origin=origin, replicas=1) as ov:
            key = chain.keys[0]
            owner = ov.owners(key)[0]
            other = next(n for n in ov.ids if n != owner)
            # the owner's view is stale: it believes the other node owns everything
            ov.nodes[owner].overlay.owners = lambda k, r=None: [ov.nodes[owner].overlay.members[other]]  # type: ignore[method-assign]
            results = await asyncio.wait_for(
                asyncio.gather(*(ov.nodes[n].fetch_bytes(chain.spec(0)) for n in (owner, other) for _ in range(5))), 5
            )
            assert all(data == chain.blobs[0] for data, _ in results)
            assert 1 <= origin.fetches <= 2

    asyncio.run(main())


def test_peers_file_provider_keeps_last_good_list(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kdn.edge.overlay import file_members

    f = tmp_path / "peers"
    read = file_members(f, {"b": 2.0})
    assert read() == []  # missing file: nothing yet
    f.write_text('{"a": "127.0.0.1:1", "b": "127.0.0.1:2"}')
    assert [(m.node_id, m.weight) for m in read()] == [("a", 1.0), ("b", 2.0)]
    f.write_text("# lines work too\nc=127.0.0.1:3\n")
    assert [m.node_id for m in read()] == ["c"]
    f.write_text('{"a": ')  # half-written
    assert [m.node_id for m in read()] == ["c"]


class _FixedPeer(NodeUpstream):
    """A peer that answers every fetch with the same (checksum-valid) bytes."""

    blob = b""

    async def fetch(self, spec: FetchSpec, *, token: str | None = None) -> bytes:
        return self.blob


def _hostile_peer_blobs() -> dict[str, bytes]:
    from kdn.testing import reseal

    honest = make_chain(1).blobs[0]
    kvq = make_chain(1, codec="kvq").blobs[0]

    def codec(name: str):  # type: ignore[no-untyped-def]
        def edit(h) -> None:  # type: ignore[no-untyped-def]
            h.codec, h.codec_level = name, ""
        return edit

    def kvq_meta(meta: bytes):  # type: ignore[no-untyped-def]
        def edit(h) -> None:  # type: ignore[no-untyped-def]
            h.codec_meta = meta
        return edit

    def layout(h) -> None:  # type: ignore[no-untyped-def]
        h.layout_version = 99

    return {
        "unknown_codec": reseal(honest, header=codec("zzz-next-release")),
        "oversized": make_chain(1, shape=(8, 8, 4, 64)).blobs[0],  # same key, far bigger
        "kvq_infinity": reseal(kvq, header=kvq_meta(b'{"v":1,"k_bits":Infinity,"v_bits":4}')),
        "kvq_float_bits": reseal(kvq, header=kvq_meta(b'{"v":1,"k_bits":4.5,"v_bits":4}')),
        "kvq_table_infinity": reseal(kvq, header=kvq_meta(b'{"v":1,"k_bits":4,"v_bits":4,"table":[[1e999,4]]}')),
        "kvq_deep": reseal(kvq, header=kvq_meta(b"[" * 20000 + b"]" * 20000)),
        "newer_layout": reseal(honest, header=layout),
    }


@pytest.mark.parametrize("case", sorted(_hostile_peer_blobs()))
def test_any_unusable_artifact_from_a_peer_falls_back_to_the_origin(case: str) -> None:
    """Not only checksum failures: whatever makes a peer's bytes unusable here (a codec from a
    newer release, a size over this edge's bound, hostile codec metadata, a newer layout), the
    fetch drops them and goes on to the next source."""
    chain = make_chain(1)
    origin = origin_with([chain])
    bad = _hostile_peer_blobs()[case]
    assert bad != chain.blobs[0]

    async def main() -> None:
        async with InMemoryOverlay(3, origin=origin, max_artifact_bytes=16 << 10) as ov:
            key = chain.keys[0]
            primary = ov.owners(key)[0]
            client_node = ov.non_owner(key)
            peer = _FixedPeer(primary, ov.nodes[primary])
            peer.blob = bad
            for other in ov.owners(key):
                ov.links[(client_node.node_id, other)] = peer
            data, source = await client_node.fetch_bytes(chain.spec(0))
            assert data == chain.blobs[0] and source == "origin"
            assert client_node.store.contains(key, tenant="default")

    asyncio.run(main())


class _CountingPeer(NodeUpstream):
    calls = 0
    keys: list[bytes]

    async def fetch(self, spec: FetchSpec, *, token: str | None = None) -> bytes:
        self.calls += 1
        self.keys = [*getattr(self, "keys", []), bytes(spec.key)]
        return await super().fetch(spec, token=token)


def test_a_hot_key_spreads_over_its_replicas_under_bounded_load() -> None:
    """One hot key, 3 edges, 2 replicas: the edge that is not an owner (and, its memory full,
    keeps nothing) sends every read upstream. Bounded load spreads them over both owners (each
    at most c = 1.25 x its share) instead of piling all of them on the first owner."""
    from kdn.edge.store import build_store

    hot = make_chain(1)
    cold = make_chain(40, seed=8)
    origin = origin_with([hot, cold])

    async def main() -> None:
        async with InMemoryOverlay(3, origin=origin, replicas=2) as ov:
            key = hot.keys[0]
            owners = ov.owners(key)
            client = ov.non_owner(key)
            client.store = build_store(client.config.model_copy(update={"memory_bytes": 16, "disk_dir": None}))
            links = {o: _CountingPeer(o, ov.nodes[o]) for o in ov.ids if o != client.node_id}
            for o, link in links.items():
                ov.links[(client.node_id, o)] = link
            for _ in range(100):
                data, _ = await client.fetch_bytes(hot.spec(0))
                assert data == hot.blobs[0]
            calls = [links[o].calls for o in owners]
            assert sum(calls) == 100 and max(calls) <= 63 and min(calls) >= 37, calls
            assert origin.fetches <= 2  # the owners still fetch it from the origin once each at most

            # keys that are not hot keep their preferred owner: locality is not given up
            for link in links.values():
                link.calls, link.keys = 0, []
            first = {bytes(k): ov.owners(k)[0] for k in cold.keys if client.node_id not in ov.owners(k)}
            for i, k in enumerate(cold.keys):
                if bytes(k) in first:
                    await client.fetch_bytes(cold.spec(i))
            assert sum(link.calls for link in links.values()) == len(first)
            preferred = sum(1 for k, o in first.items() if k in links[o].keys)
            assert preferred >= 0.7 * len(first), (preferred, len(first))

    asyncio.run(main())
