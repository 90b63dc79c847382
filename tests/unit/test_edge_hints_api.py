"""The Hint RPC's logic on a node: pin/TTL/priority, scheduled prefetch with a fake clock, persistence."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kdn.edge.clock import FakeClock
from kdn.edge.operator_hints import HintService
from kdn.edge.schedules import SCHEDULES_FILE
from kdn.testing import InMemoryOverlay, make_chain, origin_with
from kdn.errors import InvalidInput, NotFound
from kdn.keys import Namespace
from kdn.proto import kdn_pb2 as pb

A = pb.HintRequest


def _req(action: int, chain, **kw) -> pb.HintRequest:  # type: ignore[no-untyped-def]
    return pb.HintRequest(action=action, fingerprint=bytes(chain.fingerprint),
                          namespace=pb.Namespace(tenant=chain.namespace.tenant), **kw)


def test_pin_fetches_and_protects_ttl_expires(tmp_path: Path) -> None:
    chain = make_chain(3)
    origin = origin_with([chain])

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin) as ov:
            node = ov.nodes["e0"]
            hints = HintService(node, disk_dir=None, clock=ov.clock)
            n, _ = await hints.apply(_req(A.PIN, chain), chain.namespace, None, chain.keys[:2])
            assert n == 2 and origin.fetches == 2  # pinning names the model, so missing keys are fetched
            assert node.store.stats()["pinned"] == 2
            n, _ = await hints.apply(_req(A.UNPIN, chain), chain.namespace, None, chain.keys[:1])
            assert n == 1 and node.store.stats()["pinned"] == 1
            n, _ = await hints.apply(_req(A.SET_TTL, chain, ttl_s=60), chain.namespace, None, chain.keys[:2])
            assert n == 2
            ov.clock.advance(61)
            await hints.run_due()  # the tick loop expires TTL'd entries
            assert await node.lookup_local(chain.keys, tenant="default") == []
            n, _ = await hints.apply(_req(A.SET_PRIORITY, chain, priority=3), chain.namespace, None, chain.keys)
            assert n == 0  # nothing resident any more
            with pytest.raises(InvalidInput):
                await hints.apply(_req(A.SET_TTL, chain, ttl_s=-1), chain.namespace, None, chain.keys)

    asyncio.run(main())


def test_scheduled_document_prefetch_fires_and_survives_restart(tmp_path: Path) -> None:
    chain = make_chain(3, namespace=Namespace("acme"))
    origin = origin_with([chain], documents={"manual": chain.keys})
    from datetime import datetime, timezone

    clock = FakeClock(datetime(2026, 3, 2, 7, 58, tzinfo=timezone.utc))

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin, clock=clock) as ov:
            node = ov.nodes["e0"]
            hints = HintService(node, disk_dir=str(tmp_path), clock=clock)
            n, sid = await hints.apply(_req(A.SCHEDULE_PREFETCH, chain, document="manual", cron="0 8 * * *"),
                                       chain.namespace, None, [])
            assert n == 1 and sid
            with pytest.raises(InvalidInput):
                await hints.apply(_req(A.SCHEDULE_PREFETCH, chain, document="manual", cron="61 8 * * *"), chain.namespace, None, [])
            assert await hints.run_due() == 0
            clock.advance(121)  # 08:00:01
            assert await hints.run_due() == 1
            await node.prefetcher.drain()
            assert len(await node.lookup_local(chain.keys, tenant="acme")) == 3
            # restart: the schedule comes back from .hint-schedules.json
            again = HintService(node, disk_dir=str(tmp_path), clock=clock)
            assert [d["schedule_id"] for d in again.describe()] == [sid]
            assert (tmp_path / SCHEDULES_FILE).is_file()
            # another tenant cannot cancel it; its owner can
            with pytest.raises(NotFound):
                await again.apply(pb.HintRequest(action=A.CANCEL_SCHEDULE, schedule_id=sid), Namespace("globex"), None, [])
            await again.apply(pb.HintRequest(action=A.CANCEL_SCHEDULE, schedule_id=sid), chain.namespace, None, [])
            assert again.describe() == []

    asyncio.run(main())
