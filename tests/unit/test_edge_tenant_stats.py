"""Tenants see only their own schedules, ids and figures (issue 19, item 6); a broken schedules
file does not stop an edge (item 2)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from kdn.edge.config import EdgeConfig
from kdn.edge.operator_hints import HintService
from kdn.edge.schedules import SCHEDULES_FILE
from kdn.edge.front import EdgeFront
from kdn.edge.server import EdgeServicer, PutBudget
from kdn.testing import Aborted, FakeServicerContext, InMemoryOverlay, make_chain, origin_with
from kdn.errors import NotFound
from kdn.keys import Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.wire.auth import TokenAuth

A = pb.HintRequest
TOKENS = {"tok-acme": ["acme"], "tok-globex": ["globex"], "tok-ops": ["*"]}


def _schedule(tenant: str, sid: str, **kw: Any) -> pb.HintRequest:
    return pb.HintRequest(action=A.SCHEDULE_PREFETCH, namespace=pb.Namespace(tenant=tenant), schedule_id=sid,
                          cron="0 8 * * *", **kw)


def test_schedule_ids_are_per_tenant_and_stats_show_a_tenant_only_its_own() -> None:
    acme = make_chain(2, namespace=Namespace("acme"))
    globex = make_chain(1, namespace=Namespace("globex"), seed=3)

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin_with([acme, globex]), tokens=TOKENS) as ov:
            node = ov.nodes["e0"]
            for c in (acme, globex):
                for b in c.blobs:
                    node.store.put(b, tenant=c.namespace.tenant)
            hints = HintService(node, disk_dir=None, clock=ov.clock)
            node.scheduler = hints
            front = EdgeFront(node, auth=TokenAuth.from_config(TOKENS), put_budget=PutBudget(node.config.put_buffer_bytes),
                              hints=hints)
            servicer = EdgeServicer(front)

            async def hint(req: pb.HintRequest, token: str) -> Any:
                ctx = FakeServicerContext(token)
                try:
                    return await servicer.Hint(req, ctx)  # type: ignore[arg-type]
                except Aborted:
                    return ctx.code

            async def stats(token: str) -> tuple[dict[str, float], dict[str, Any]]:
                resp = await servicer.Stats(pb.StatsRequest(), FakeServicerContext(token))  # type: ignore[arg-type]
                return dict(resp.counters), json.loads(resp.json)

            keys = [bytes(k) for k in acme.keys]
            # acme takes "nightly"; globex may use the same id: no global namespace to squat or probe
            assert (await hint(_schedule("acme", "nightly", keys=keys), "tok-acme")).schedule_id == "nightly"
            assert (await hint(_schedule("globex", "nightly", keys=[bytes(globex.keys[0])]), "tok-globex")).schedule_id == "nightly"
            assert (await hint(_schedule("globex", "weekly", keys=[bytes(globex.keys[0])]), "tok-globex")).schedule_id == "weekly"
            # globex cancelling "nightly" cancels its own; acme's stays
            assert (await hint(pb.HintRequest(action=A.CANCEL_SCHEDULE, namespace=pb.Namespace(tenant="globex"),
                                              schedule_id="nightly"), "tok-globex")).affected == 1
            with pytest.raises(NotFound):
                await hints.apply(pb.HintRequest(action=A.CANCEL_SCHEDULE, schedule_id="nightly"), Namespace("globex"), None, [])

            counters, details = await stats("tok-acme")
            assert [(s["tenant"], s["schedule_id"]) for s in details["schedules"]] == [("acme", "nightly")]
            assert counters == {"tenant_entries": 2.0, "tenant_bytes": float(sum(map(len, acme.blobs))), "tenant_pinned": 0.0}
            assert "globex" not in json.dumps(details) and "overlay" not in details

            counters, details = await stats("tok-globex")
            assert [(s["tenant"], s["schedule_id"]) for s in details["schedules"]] == [("globex", "weekly")]
            assert counters["tenant_entries"] == 1.0

            # a '*' token is the operator's: the node's figures, every tenant's schedules
            counters, details = await stats("tok-ops")
            assert details["scope"] == "node" and counters["store_entries"] == 3.0
            assert sorted((s["tenant"], s["schedule_id"]) for s in details["schedules"]) == [
                ("acme", "nightly"), ("globex", "weekly")]

    asyncio.run(main())


def test_a_corrupt_schedules_file_does_not_stop_the_edge(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin_with([])) as ov:
            node = ov.nodes["e0"]
            for body in (b"{not json", b"\x00\xff\xfe binary", b'{"version": 99, "schedules": []}'):
                (tmp_path / SCHEDULES_FILE).write_bytes(body)
                with caplog.at_level(logging.WARNING):
                    hints = HintService(node, disk_dir=str(tmp_path), clock=ov.clock)  # starts, with a warning
                assert hints.describe() == []
                assert "hint schedules" in caplog.text
                assert (tmp_path / (SCHEDULES_FILE + ".bad")).read_bytes() == body  # kept for the operator
                # and schedules work (and persist) again
                await hints.apply(_schedule("acme", "s1", keys=[b"\x01" * 32]), Namespace("acme"), None, [b"\x01" * 32])  # type: ignore[list-item]
                again = HintService(node, disk_dir=str(tmp_path), clock=ov.clock)
                assert [d["schedule_id"] for d in again.describe()] == ["s1"]
                caplog.clear()

    asyncio.run(main())


def test_a_tenant_named_like_a_state_file_cannot_touch_it(tmp_path: Path) -> None:
    """Tenant directories share the disk root with the edge's state files: a tenant can never take
    a state file's name (they start with a dot), and a tenant named like a file (``hints.json``)
    keeps its directory and entries across restarts while schedules work."""
    TENANT = "hints.json"
    from kdn.edge.store import RETENTION_FILE, DiskTier, MemoryTier, TieredStore
    from kdn.errors import InvalidInput

    def store() -> TieredStore:
        return TieredStore([MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20, fsync=False, verify_on_open=False)],
                           policy=EdgeConfig.default("policy"))

    chain = make_chain(1, namespace=Namespace(TENANT))
    s = store()
    for name in (SCHEDULES_FILE, RETENTION_FILE, ".", ".."):
        with pytest.raises(InvalidInput):
            s.put(chain.blobs[0], tenant=name)
    s.put(chain.blobs[0], tenant=TENANT)
    s.close()
    assert (tmp_path / TENANT).is_dir()

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin_with([])) as ov:
            for _ in range(2):  # two restarts of the edge's schedules beside that tenant
                hints = HintService(ov.nodes["e0"], disk_dir=str(tmp_path), clock=ov.clock)
                await hints.apply(_schedule("acme", "s1", keys=[b"\x01" * 32]), Namespace("acme"), None, [b"\x01" * 32])  # type: ignore[list-item]
                assert [d["schedule_id"] for d in hints.describe()] == ["s1"]

    asyncio.run(main())
    assert (tmp_path / TENANT).is_dir() and (tmp_path / SCHEDULES_FILE).is_file()
    again = store()
    assert again.get(chain.keys[0], tenant=TENANT) is not None  # the tenant's entry is intact
    again.close()
