"""benchmarks/edge.py's client processes against a real edge on loopback (issue 12): the JSON-line
protocol, KDN GETs over gRPC and shared memory with every checksum verified, and the forked
client group of the scaling run answering with one shared start."""

from __future__ import annotations

import importlib.util
import inspect
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from kdn.transport import GrpcEdgeTransport
from kdn.testing import make_chain

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "edge.py"
SHAPE = (2, 2, 16, 8)  # (L, H, T, D)


@pytest.fixture(scope="module")
def edge_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("edge_bench_it", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_clients_fetch_verified_from_a_real_edge(edge_bench: ModuleType, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    edge_bench.write_data(data, {"big": (make_chain(2, shape=SHAPE, seed=1), SHAPE),
                                 "small": (make_chain(4, shape=SHAPE, seed=2), SHAPE)})
    peers = [edge_bench.start_edge(tmp_path), edge_bench.start_tcp(tmp_path, data)]
    workers = []
    try:
        edge, tcp = peers
        kdn = edge_bench.Worker(sys.executable, "kdn", data, edge.address, tmp_path / "kdn.log")
        group = edge_bench.Worker(sys.executable, "kdn", data, edge.address, tmp_path / "group.log",
                                  "--sets", "small", "--fork", "2")
        raw = edge_bench.Worker(sys.executable, "tcp", data, tcp.address, tmp_path / "tcp.log")
        workers = [kdn, group, raw]
        assert kdn.wait_ready()["ready"] == "kdn"
        assert group.wait_ready()["children"] == 2
        raw.wait_ready()
        for s in ("big", "small"):
            kdn.ask("load", set=s)
        got = kdn.ask("get", set="big", n=3)
        assert got["s"] > 0 and sum(got["via"].values()) >= 3 and set(got["via"]) <= {"grpc", "bulk"}
        if "bulk" in inspect.signature(GrpcEdgeTransport).parameters:
            # picked up, over TCP as from another host
            assert kdn.info["transport_kwargs"] == ["bulk", "bulk_local"] and got["via"].get("bulk", 0) >= 3
        assert kdn.ask("unread", set="big", n=2)["s"] > 0
        shm = kdn.ask("shm", set="big", n=2)
        assert shm["via"].get("shm", 0) >= 2  # the edge answered over shared memory, verified by the reader
        assert kdn.ask("put", set="big", n=2)["s"] > 0
        burst = kdn.ask("burst", set="small", n=20, inflight=4, start_at=0)
        assert len(burst["lat"]) == 20
        outs = group.ask("fanout", k=2, cmd={"op": "burst", "set": "small", "n": 5, "inflight": 1,
                                              "start_at": time.monotonic() + 0.1})["results"]
        assert len(outs) == 2 and all(len(o["lat"]) == 5 for o in outs)
        assert raw.ask("get", set="big", n=2)["s"] > 0
        with pytest.raises(RuntimeError, match="no shared-memory path"):
            raw.ask("shm", set="big", n=1)
    finally:
        for w in workers:
            w.close()
        for p in peers:
            edge_bench._stop(p.proc)
    assert all(w.proc.returncode is not None for w in workers)


def test_a_missing_peer_says_why(edge_bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(edge_bench, "LMCACHE_SERVER", tmp_path / "nowhere" / "lmcache_server")
    monkeypatch.setattr(edge_bench, "REDIS_ROOT", tmp_path / "nowhere")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    lmc, red = edge_bench.start_lmcache(tmp_path), edge_bench.start_redis(tmp_path)
    assert not lmc.up and "install.sh" in lmc.missing
    assert not red.up and "install.sh" in red.missing
