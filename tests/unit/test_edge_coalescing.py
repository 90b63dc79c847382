"""Request coalescing: N concurrent misses of one key cause exactly one upstream fetch."""

from __future__ import annotations

import asyncio

import pytest

from kdn.testing import InMemoryOverlay, make_chain, origin_with
from kdn.edge.upstream import SingleFlight
from kdn.errors import NotFound, Unavailable


def test_singleflight_runs_once_per_burst() -> None:
    calls = 0

    async def work() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return "v"

    async def main() -> None:
        sf: SingleFlight[str, str] = SingleFlight()
        results = await asyncio.gather(*[sf.do("k", work) for _ in range(100)])
        assert calls == 1
        assert [r for r, _ in results] == ["v"] * 100
        assert sum(shared for _, shared in results) == 99
        assert sf.coalesced == 99 and len(sf) == 0
        await sf.do("k", work)  # a later burst runs again
        assert calls == 2

    asyncio.run(main())


def test_singleflight_shares_exceptions_and_survives_cancelled_waiter() -> None:
    async def boom() -> str:
        await asyncio.sleep(0.01)
        raise Unavailable("origin down")

    async def slow() -> str:
        await asyncio.sleep(0.05)
        return "ok"

    async def main() -> None:
        sf: SingleFlight[str, str] = SingleFlight()
        outs = await asyncio.gather(*[sf.do("k", boom) for _ in range(5)], return_exceptions=True)
        assert all(isinstance(o, Unavailable) for o in outs)
        first = asyncio.ensure_future(sf.do("s", slow))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(sf.do("s", slow))
        await asyncio.sleep(0.01)
        first.cancel()  # the client that started the fetch goes away
        assert (await second)[0] == "ok"

    asyncio.run(main())


@pytest.mark.parametrize("at_owner", [True, False])
def test_100_concurrent_fetches_one_origin_fetch(at_owner: bool) -> None:
    chain = make_chain(1)
    origin = origin_with([chain], delay_s=0.02)

    async def main() -> None:
        async with InMemoryOverlay(3, origin=origin) as ov:
            key = chain.keys[0]
            node = ov.nodes[ov.owners(key)[0]] if at_owner else ov.non_owner(key)
            results = await asyncio.gather(*[node.fetch_bytes(chain.spec(0)) for _ in range(100)])
            assert origin.fetches == 1
            assert all(data == chain.blobs[0] for data, _ in results)
            counters, _ = await node.stats()
            assert counters["kdn_edge_coalesced_requests_total"] == 99
            # now it is held: more fetches are local hits, still one origin fetch
            data, source = await node.fetch_bytes(chain.spec(0))
            assert data == chain.blobs[0] and source == "memory"
            assert origin.fetches == 1

    asyncio.run(main())


def test_missing_everywhere_is_not_found_once() -> None:
    chain = make_chain(1)
    origin = origin_with([], delay_s=0.01)

    async def main() -> None:
        async with InMemoryOverlay(3, origin=origin) as ov:
            node = ov.nodes[ov.owners(chain.keys[0])[0]]
            outs = await asyncio.gather(*[node.fetch_bytes(chain.spec(0)) for _ in range(20)], return_exceptions=True)
            assert all(isinstance(o, NotFound) for o in outs)
            assert origin.fetches == 1

    asyncio.run(main())
