"""Read-ahead and operator prefetch, against in-process nodes (no sockets)."""

from __future__ import annotations

import asyncio

from kdn.edge.prefetch import Prefetcher, PrefetchJob
from kdn.testing import InMemoryOverlay, make_chain, origin_with
from kdn.keys import Namespace


def test_read_ahead_fetches_the_next_depth_chunks_only() -> None:
    chain = make_chain(6)
    origin = origin_with([chain])

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin, prefetch_depth=2) as ov:
            node = ov.nodes["e0"]
            await node.fetch_bytes(chain.spec(0), next_keys=chain.keys[1:])
            await node.prefetcher.drain()
            held = await node.lookup_local(chain.keys, tenant="default")
            assert len(held) == 3  # chunk 0 + two ahead, not more
            assert sorted(origin.fetched) == sorted(chain.keys[:3])
            # the following request is a local hit and pushes the window on
            data, source = await node.fetch_bytes(chain.spec(1), next_keys=chain.keys[2:])
            assert source == "memory" and data == chain.blobs[1]
            await node.prefetcher.drain()
            assert len(await node.lookup_local(chain.keys, tenant="default")) == 4

    asyncio.run(main())


def test_prefetch_and_foreground_miss_coalesce() -> None:
    chain = make_chain(3)
    origin = origin_with([chain], delay_s=0.03)

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin, prefetch_depth=2) as ov:
            node = ov.nodes["e0"]
            await node.fetch_bytes(chain.spec(0), next_keys=chain.keys[1:])
            await asyncio.sleep(0.005)  # prefetch of chunk 1 is now in flight
            data, _ = await node.fetch_bytes(chain.spec(1))
            assert data == chain.blobs[1]
            await node.prefetcher.drain()
            assert origin.fetched.count(chain.keys[1]) == 1
            assert origin.fetches == 3

    asyncio.run(main())


def test_queue_is_bounded_and_drops_are_counted() -> None:
    chain = make_chain(10)
    gate = asyncio.Event()

    async def run(job: PrefetchJob) -> None:
        await gate.wait()

    async def main() -> None:
        p = Prefetcher(run, queue_size=3, workers=1)
        p.start()
        results = [p.offer(PrefetchJob(chain.spec(i))) for i in range(10)]
        await asyncio.sleep(0.01)
        assert results[:3] == [True] * 3 and sum(results) == 3
        assert p.dropped == 7
        assert p.offer(PrefetchJob(chain.spec(2))) is False  # already queued: not twice
        gate.set()
        await p.drain()
        assert p.done >= 3 and p.pending == 0
        await p.stop()

    asyncio.run(main())


def test_operator_prefetch_of_a_document_and_of_keys() -> None:
    chain = make_chain(4, namespace=Namespace("acme"))
    origin = origin_with([chain], documents={"handbook": chain.keys})

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin) as ov:
            node = ov.nodes["e0"]
            keys = await node.resolve_keys([], "handbook", fingerprint=chain.fingerprint, namespace=chain.namespace, token=None)
            assert keys == chain.keys
            assert node.prefetch(keys[:2], fingerprint=chain.fingerprint, namespace=chain.namespace) == 2
            await node.prefetcher.drain()
            assert node.prefetch(keys, fingerprint=chain.fingerprint, namespace=chain.namespace) == 2  # 2 held already
            await node.prefetcher.drain()
            assert len(await node.lookup_local(chain.keys, tenant="acme")) == 4
            assert origin.fetches == 4

    asyncio.run(main())
