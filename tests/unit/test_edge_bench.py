"""benchmarks/edge.py and its client worker (issue 12): what the figures stand on, without sockets.

- the KDN client verifies every checksum of every GET and decodes into its reused buffer, so a
  flipped bit fails the GET instead of being timed as a success;
- every system leads a round once as the order rotates;
- ratios are taken within a round, and a peer that could not run is reported as missing, with the
  reason, rather than dropped or counted as a win.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kdn.artifact import decode_artifact
from kdn.testing import MemoryEdgeTransport, make_chain
from kdn.errors import ArtifactCorrupt

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SHAPE = (2, 2, 4, 8)  # (L, H, T, D)


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    return mod


@pytest.fixture(scope="module")
def edge_bench() -> ModuleType:
    return _load("edge_bench", BENCH / "edge.py")


@pytest.fixture(scope="module")
def worker() -> ModuleType:
    return _load("edge_bench_worker", BENCH / "peers" / "worker.py")


def _kdn_client(edge_bench: ModuleType, worker: ModuleType, tmp_path: Path):  # type: ignore[no-untyped-def]
    """The benchmark's KDN client over an in-memory edge, with a set "small" of three chunks;
    the client, the chain and the in-memory transport (to count calls or corrupt keys)."""
    chain = make_chain(3, shape=SHAPE, seed=5)
    edge_bench.write_data(tmp_path, {"small": (chain, SHAPE)})
    client = worker.KdnClient(tmp_path, "memory")
    mem = MemoryEdgeTransport()
    client.attach(mem, mem)
    return client, chain, mem


def test_kdn_get_decodes_into_the_reused_buffer(edge_bench: ModuleType, worker: ModuleType, tmp_path: Path) -> None:
    client, chain, mem = _kdn_client(edge_bench, worker, tmp_path)
    objs = client.sets["small"]

    async def go() -> None:
        await client.load(objs)
        client.prepare(objs, 1)
        out = client.out[("small", 0)]
        for i, blob in enumerate(chain.blobs):
            await client.get_one(objs, i)
            assert client.out[("small", 0)] is out  # reused, not reallocated
            assert torch.equal(out, decode_artifact(blob).kv)  # (L, 2, H, T, D)

    asyncio.run(go())
    assert mem.calls["put"] == 3 and mem.calls["fetch"] == 3
    assert client.vias["memory"] >= 3  # pieces, each fed to the verifying reader


def test_the_shm_burst_goes_over_the_same_host_transport_only(edge_bench: ModuleType, worker: ModuleType,
                                                             tmp_path: Path) -> None:
    client, chain, mem = _kdn_client(edge_bench, worker, tmp_path)
    shm = MemoryEdgeTransport(store=mem.store)  # the same edge, as the shm=True transport sees it
    client.attach(mem, shm)
    objs = client.sets["small"]

    async def go() -> tuple[dict, dict]:
        await client.load(objs)
        return (await client.op_shm_burst(objs, n=6, inflight=2, start_at=0),
                await client.op_burst(objs, n=4, inflight=2, start_at=0))

    over_shm, plain = asyncio.run(go())
    assert len(over_shm["lat"]) == 6 and len(plain["lat"]) == 4
    assert shm.calls["fetch"] == 6 and mem.calls["fetch"] == 4  # and the flag does not outlive the burst


def test_kdn_get_of_a_flipped_bit_fails(edge_bench: ModuleType, worker: ModuleType, tmp_path: Path) -> None:
    client, chain, mem = _kdn_client(edge_bench, worker, tmp_path)
    objs = client.sets["small"]

    async def go() -> None:
        await client.load(objs)
        mem.corrupt.add(bytes(chain.keys[1]))
        client.prepare(objs, 1)
        await client.get_one(objs, 0)
        with pytest.raises(ArtifactCorrupt):
            await client.get_one(objs, 1)

    asyncio.run(go())


def test_the_worker_answers_a_failed_get_as_an_error(edge_bench: ModuleType, worker: ModuleType,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver then marks the figure missing instead of timing a failed GET."""
    client, chain, mem = _kdn_client(edge_bench, worker, tmp_path)

    async def attached() -> dict:
        return {}

    monkeypatch.setattr(client, "open", attached)
    mem.corrupt.add(bytes(chain.keys[2]))
    commands = io.StringIO("\n".join(json.dumps(c) for c in [
        {"op": "load", "set": "small"}, {"op": "get", "set": "small", "n": 2}, {"op": "get", "set": "small", "n": 3},
        {"op": "quit"}]) + "\n")
    answers = io.StringIO()
    asyncio.run(worker.serve(client, "kdn", commands, answers))
    ready, load, good, bad, bye = [json.loads(line) for line in answers.getvalue().splitlines()]
    assert ready["ready"] == "kdn" and load["ok"] and bye["ok"]
    assert good["ok"] and good["s"] > 0
    assert not bad["ok"] and bad["error"].startswith("ArtifactCorrupt")


def test_each_system_leads_one_round(edge_bench: ModuleType) -> None:
    systems = ["kdn", "lmcache", "redis", "tcp"]
    orders = [edge_bench.rotated(systems, r) for r in range(4)]
    assert sorted(o[0] for o in orders) == sorted(systems)
    assert all(sorted(o) == sorted(systems) for o in orders)


def _result(lmcache: bool) -> dict:
    get = {"kdn": [1.0, 3.0, 2.0], "tcp": [2.0, 3.0, 4.0], "redis": [0.5, 1.0, 1.0], "kdn unread": [2.0, 3.0, 4.0]}
    put = {"kdn": [0.2, 0.2, 0.2]}
    new_put = {"kdn": [0.9, 1.2, 0.8]}
    burst = {"kdn": [{"rps": 100.0, "p50_ms": 5.0, "p99_ms": 9.0}] * 3}
    scale = {"kdn": {"1": [100.0] * 3, "2": [150.0] * 3, "4": [190.0] * 3, "8": [200.0] * 3}}
    missing = {}
    if lmcache:
        get["lmcache"] = [2.0, 2.0, 2.0]
        put["lmcache"] = [0.4, 0.1, 0.2]
        new_put["lmcache"] = [1.0, 1.0, 1.0]
        burst["lmcache"] = [{"rps": 50.0, "p50_ms": 1.0, "p99_ms": 2.0}] * 3
        scale["lmcache"] = {"1": [100.0] * 3, "2": [100.0] * 3, "4": [100.0] * 3, "8": [100.0] * 3}
    else:
        missing["lmcache"] = "lmcache_server exited with status 1 before listening: ImportError: no module named zmq"
    return {
        "plan": {"rounds": 3, "burst": 4000, "inflight": 8, "scaling_total": 1200}, "load_start": (1.0, 1.0, 1.0),
        "load_end": (2.0, 1.0, 1.0), "cpus": 2, "big_bytes": 32 << 20, "small_bytes": 1 << 20, "missing": missing,
        "get_gbps": get, "put_gbps": put, "new_put_gbps": new_put, "burst": burst, "scale": scale,
        "shm": {"shm": [1.0, 1.0, 1.0], "memcpy": [2.0, 1.0, 4.0]}, "via": {"grpc": 3},
        "lookup_rpcs_per_s": 1000.0, "overlay_owner_lookups_per_s": 1e5, "phases_s": {"rounds": 1.0},
    }


def test_ratios_are_taken_within_a_round(edge_bench: ModuleType) -> None:
    text = edge_bench.report(_result(lmcache=True), "python benchmarks/edge.py")
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    # KDN 1, 3, 2 against LMCache 2, 2, 2: per-round 0.5, 1.5, 1.0
    assert "1.00 [0.50–1.50]x" in rows["| 32 MiB GET vs LMCache connector GET"]
    # against TCP 2, 3, 4: 0.5, 1.0, 0.5 — not median(KDN) / median(TCP) = 1.0
    assert "0.50 [0.50–1.00]x" in rows["| 32 MiB GET vs raw TCP recv_into one reused buffer"]
    assert "2.00 [2.00–2.00]x" in rows["| 4000 x 1 MiB GET, 8 in flight, vs LMCache"]
    # PUTs of held and of new keys are separate rows with their own goals
    assert "1.00 [0.50–2.00]x" in rows["| 32 MiB PUT of a held key (acknowledged) vs LMCache connector PUT"]
    assert "0.90 [0.80–1.20]x" in rows["| 32 MiB PUT of a new key (acknowledged) vs LMCache connector PUT"]
    assert "PUT of a held key >= 1.0x LMCache: MET" in text and "PUT of a new key >= 1.0x LMCache: NOT MET" in text
    assert "1.00 [1.00–1.00]x" in rows["| (diagnostic) KDN byte path alone, pieces dropped unread, vs raw TCP"]
    assert "32 MiB GET >= 1.0x LMCache: MET" in text and "32 MiB GET >= 0.8x raw TCP: NOT MET" in text
    assert "1.00 at start, 2.00 at end" in text  # the load average


def test_latency_is_reported_for_the_32_mib_rows_and_every_scaling_point(edge_bench: ModuleType) -> None:
    res = _result(lmcache=True)
    res["call_ms"] = {"get": {"kdn": [10.0, 12.0, 30.0], "lmcache": [9.0, 9.0, 9.0], "kdn unread": [1.0]},
                      "put": {"kdn": [20.0] * 3, "lmcache": [25.0] * 3}, "new_put": {}}
    res["scale_lat"] = {n: {k: [{"p50_ms": 0.5 * int(k), "p99_ms": 2.0 * int(k)}] * 3 for k in ("1", "2", "4", "8")}
                        for n in ("kdn", "lmcache")}
    text = edge_bench.report(res, "python benchmarks/edge.py")
    line = next(x for x in text.splitlines() if x.startswith("Per-request latency of the 32 MiB rows"))
    assert "GET: kdn p50 12.0 / p99 30.0 ms, lmcache p50 9.0 / p99 9.0 ms" in line and "unread" not in line
    assert "PUT of a held key: kdn p50 20.0" in line and "new key" not in line  # a row with no calls says nothing
    rows = {r.split(" | ")[0]: r for r in text.splitlines() if r.startswith("| ")}
    assert rows["| 4"].endswith("| 2.00 / 8.00 | 2.00 / 8.00 |")
    # a result recorded before latencies were kept still reports
    assert "Per-request latency" not in edge_bench.report(_result(lmcache=True), "python benchmarks/edge.py")


def test_a_missing_peer_is_reported_with_its_reason(edge_bench: ModuleType) -> None:
    text = edge_bench.report(_result(lmcache=False), "python benchmarks/edge.py")
    row = next(line for line in text.splitlines() if line.startswith("| 32 MiB GET vs LMCache"))
    assert "missing" in row and "no module named zmq" in row
    assert "32 MiB GET >= 1.0x LMCache: missing" in text
    assert "PUT of a held key >= 1.0x LMCache: missing" in text and "PUT of a new key >= 1.0x LMCache: missing" in text
    assert "32 MiB GET >= 0.8x raw TCP: NOT MET" in text  # the peers that ran are still reported


def test_one_object_at_a_time_still_cycles_through_every_object(edge_bench: ModuleType, worker: ModuleType,
                                                                 tmp_path: Path) -> None:
    client, _chain, _mem = _kdn_client(edge_bench, worker, tmp_path)
    objs = client.sets["small"]  # 3 objects
    assert [client.indices(objs, 1)[0] for _ in range(4)] == [0, 1, 2, 0]
    assert client.indices(objs, 3) == [1, 2, 0]


def test_a_run_with_one_core_busy_says_so_and_is_recorded_beside_the_idle_one(edge_bench: ModuleType,
                                                                               monkeypatch) -> None:
    saved: list = []

    class FakeRecord:  # stands in for benchmarks/_results.Record: what record() asks of it
        def __init__(self, script, name, title, command=None) -> None:
            self.doc = {"load": {}, "name": name, "title": title, "notes": []}
            saved.append(self)

        def note(self, text: str) -> None:
            self.doc["notes"].append(text)

        def __getattr__(self, attr: str):
            return lambda *a, **k: None

    monkeypatch.setitem(sys.modules, "_results", ModuleType("_results"))
    monkeypatch.setattr(sys.modules["_results"], "Record", FakeRecord, raising=False)
    res = _result(lmcache=True)
    res["command"] = "python benchmarks/edge.py"
    edge_bench.record(res, edge_bench.report(res, res["command"]), Path("edge.png"))
    res["busy_core"] = True
    text = edge_bench.report(res, res["command"] + " --busy-core")
    edge_bench.record(res, text, Path("edge-busy.png"))
    assert "One core held by a spinning process" in text
    assert [r.doc["name"] for r in saved] == ["edge", "edge-busy"]
    assert "one core busy" in saved[1].doc["title"] and any("--busy-core" in n for n in saved[1].doc["notes"])
    assert not saved[0].doc["notes"] or not any("--busy-core" in n for n in saved[0].doc["notes"])


class _TimedClient:
    """A stand-in client for the open-loop run: each GET takes ``service_s``, either holding the
    event loop (as LMCache's connector does) or yielding it; counts the GETs in flight."""

    def __init__(self, worker: ModuleType, service_s: float, holds_loop: bool) -> None:
        self.client = worker.Client.__new__(worker.Client)
        self.service_s, self.holds_loop = service_s, holds_loop
        self.now = self.most = 0

        async def get_one(objs, i, slot=0):  # type: ignore[no-untyped-def]
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                if self.holds_loop:
                    time.sleep(self.service_s)
                else:
                    await asyncio.sleep(self.service_s)
            finally:
                self.now -= 1

        self.client.get_one = get_one

    def paced(self, n: int, rate: float, inflight: int) -> dict:
        return asyncio.run(self.client.op_paced([0, 1, 2], n=n, rate=rate, inflight=inflight, seed=1))


def test_the_open_loop_run_times_each_get_from_its_scheduled_arrival(worker: ModuleType) -> None:
    """Arrivals at 1000/s into a server that takes 20 ms a GET and holds the loop: the GETs run
    one at a time, and the last ones waited for the others, which their latency holds (a closed
    loop timing each GET from its own start would say 20 ms for every one)."""
    slow = _TimedClient(worker, 0.02, holds_loop=True)
    out = slow.paced(n=10, rate=1000.0, inflight=8)
    lat = sorted(out["lat"])
    assert len(lat) == 10 and slow.most == 1
    assert lat[0] >= 0.019 and lat[-1] >= 0.15  # ~10 x 20 ms of service, arrivals within ~10 ms

    fast = _TimedClient(worker, 0.002, holds_loop=False)
    out = fast.paced(n=40, rate=200.0, inflight=8)
    assert len(out["lat"]) == 40 and 1 <= fast.most <= 8
    assert statistics.median(out["lat"]) < 0.05  # light load: about the service time, no queue


def test_the_open_loop_run_never_has_more_in_flight_than_asked(worker: ModuleType) -> None:
    busy = _TimedClient(worker, 0.01, holds_loop=False)
    out = busy.paced(n=30, rate=5000.0, inflight=3)  # arrivals far faster than three slots drain
    assert len(out["lat"]) == 30 and busy.most == 3
    assert max(out["lat"]) >= 0.08  # the tenth slot-full of arrivals waited ~9 services for a slot


def test_the_tail_goals_are_judged_at_one_offered_load_not_in_the_closed_loop(edge_bench: ModuleType,
                                                                            monkeypatch) -> None:
    res = _result(lmcache=True)
    res["paced"] = {"kdn": [{"rate": 600.0, "p50_ms": 1.5, "p99_ms": 7.0}] * 3,
                    "lmcache": [{"rate": 600.0, "p50_ms": 1.0, "p99_ms": 4.0}] * 3,
                    "kdn shm": [{"rate": 600.0, "p50_ms": 1.0, "p99_ms": 3.0}] * 3}
    text = edge_bench.report(res, "python benchmarks/edge.py")
    rows = {r.split(" | ")[0]: r for r in text.splitlines() if r.startswith("| ")}
    assert "1.75 [1.75–1.75]x (goal ≤ 2x)" in rows["| kdn"] and "0.75 [0.75–0.75]x" in rows["| kdn shm"]
    assert "Poisson arrivals at 600 [600–600] req/s" in text
    goals: list = []

    class FakeRecord:
        def __init__(self, *a, **k) -> None:
            self.doc = {"load": {}}

        def goal(self, what, goal, values=None, **k) -> None:
            goals.append((what, values))

        def __getattr__(self, attr: str):
            return lambda *a, **k: None

    monkeypatch.setitem(sys.modules, "_results", ModuleType("_results"))
    monkeypatch.setattr(sys.modules["_results"], "Record", FakeRecord, raising=False)
    res["command"] = "python benchmarks/edge.py"
    edge_bench.record(res, text, Path("edge.png"))
    tails = {w: v for w, v in goals if "p99" in w}
    assert tails == {"1 MiB GETs at one offered load (open loop, ≤ 8 in flight): p99 vs LMCache's": [1.75] * 3,
                     "1 MiB GETs at one offered load (open loop, ≤ 8 in flight), default host path (shm): "
                     "p99 vs LMCache's": [0.75] * 3}  # the closed loop's 9 ms vs 2 ms judges nothing
