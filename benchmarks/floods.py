"""One tenant floods a real edge process; another tenant's fetches are timed before, during and after.

Four floods, each ``--count`` (10,000) strong, one after another, against one ``kdn edge`` process
(cluster key, tokens for two tenants, WebRTC signalling at an in-process origin, bulk path and
``/metrics`` on):

- **WebRTC offers**: offers sent through signalling by a holder of the cluster key (tenants
  cannot send any), from one node id and then from 100 ids;
- **idle bulk connections**: TCP connections to the bulk port that never send a hello;
- **idle /metrics connections**: connections to ``/metrics`` that never send a request;
- **OpenBulk calls**: tenant B asks for a bulk ticket ``--count`` times, 100 at a time.

Meanwhile tenant A fetches a 256 KiB artifact over the bulk path in a loop. The edge's open file
descriptors, threads and RSS are sampled every 50 ms.

    .venv/bin/python benchmarks/floods.py [--count 10000] [--no-write]

Records the run as ``floods`` (``benchmarks/_results.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import Record  # noqa: E402

METHOD = """A real edge process (`kdn edge`: cluster key, tokens for tenants A and B, WebRTC signalling
at an in-process origin, the bulk path and `/metrics` on; `bulk_timeout_s` 10 s, every other bound
at its default) takes four floods of N (10,000) in turn: WebRTC offers sent through signalling by
a holder of the cluster key (from one node id, then from 100), TCP connections to the bulk port
that never say hello, connections to `/metrics` that never send a request, and N `OpenBulk` calls
by tenant B. Tenant A fetches a 256 KiB artifact over the bulk path in a loop all along. The
edge's open file descriptors, threads and RSS are sampled every 50 ms; each flood's peak is
compared with the edge's figures before it, and with the figures once its connections have timed
out (the bound stated in each goal line). Tenant A's fetch latency is reported as the median and
p99 before, during and after each flood; the ratio goal is during/before of the medians."""

TOK_A, TOK_B = "tok-bench-a", "tok-bench-b"
KEY = "floods-benchmark-cluster-key"
BULK_TIMEOUT_S = 10.0
# bounds the edge's config sets (defaults of EdgeConfig, with bulk_timeout_s above)
BULK_PENDING, METRICS_CONNS, RTC_ANSWERS = 256, 64, 64


def proc_figures(pid: int) -> tuple[int, int, float]:
    """(open fds, threads, RSS MB) of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads, rss = 0, 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            threads = int(line.split()[1])
        elif line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return fds, threads, rss


class Sampler:
    """Samples the edge's figures every 50 ms; ``peak()`` since the last ``reset()``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._peak = proc_figures(pid)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = proc_figures(self.pid)
            with self._lock:
                self._peak = tuple(max(a, b) for a, b in zip(self._peak, now))  # type: ignore[assignment]
            time.sleep(0.05)

    def reset(self) -> tuple[int, int, float]:
        now = proc_figures(self.pid)
        with self._lock:
            self._peak = now
        return now

    def peak(self) -> tuple[int, int, float]:
        with self._lock:
            return self._peak

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


class Fetcher:
    """Tenant A: fetches one artifact over the bulk path in a loop, on its own thread and loop."""

    def __init__(self, address: str, chain) -> None:  # noqa: ANN001
        self.address, self.chain = address, chain
        self.samples: list[tuple[float, float]] = []  # (when, seconds)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        from kdn.artifact import ArtifactReader
        from kdn.transport import GrpcEdgeTransport

        t = GrpcEdgeTransport(self.address, token=TOK_A)
        try:
            c = self.chain
            await t.put(c.fingerprint, c.namespace, c.keys[0], c.blobs[0], timeout=30)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    reader = ArtifactReader(expect_key=c.keys[0], expect_fingerprint=c.fingerprint, decode=False)
                    await t.fetch_into(c.spec(0), reader, timeout=30)
                    reader.finish()
                    self.samples.append((time.monotonic(), time.perf_counter() - t0))
                except Exception as exc:  # noqa: BLE001 - counted and reported: the point of the benchmark
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.005)
        finally:
            await t.close()

    def start(self) -> None:
        self._t.start()

    def stop(self) -> None:
        self._stop.set()
        self._t.join(60)

    def between(self, t0: float, t1: float) -> list[float]:
        return [s for when, s in self.samples if t0 <= when < t1]


def spawn_edge(tmp: Path, origin: str) -> tuple[subprocess.Popen[bytes], dict]:
    import yaml

    cfg = {
        "node_id": "edge-flooded", "listen": "127.0.0.1:0", "origin": origin, "memory_bytes": 256 << 20,
        "shm": False, "metrics_port": 0, "tokens": {TOK_A: ["tenant-a"], TOK_B: ["tenant-b"]},
        "upstream_token": TOK_A, "cluster_key": KEY, "rtc_signal": origin, "rtc_prewarm": False,
        "bulk_timeout_s": BULK_TIMEOUT_S,
    }
    path = tmp / "edge.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "kdn.edge.cli", "--config", str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=open(os.environ.get("KDN_FLOOD_LOG", os.devnull), "ab"))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"kdn edge exited with {proc.wait(10)} before it was ready")
    return proc, json.loads(line)


# -- the floods ---------------------------------------------------------------------------------


async def flood_offers(origin: str, n: int) -> str:
    import aiortc

    from kdn.wire.auth import EdgeKey
    from kdn.wire.signal import SignalClient

    pc = aiortc.RTCPeerConnection(aiortc.RTCConfiguration(iceServers=[]))
    pc.createDataChannel("kdn/1")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    senders = ["rogue-0"] * (n // 2) + [f"rogue-{1 + i % 100}" for i in range(n - n // 2)]
    clients: dict[str, SignalClient] = {}
    try:
        for node in sorted(set(senders)):
            clients[node] = SignalClient(origin, edge=EdgeKey(KEY, node))
            await clients[node].announce(node, "192.0.2.1:1", ttl_s=600)
        sent = 0
        for i in range(0, n, 50):
            await asyncio.gather(*(clients[s].send("edge-flooded", s, f"{s}-{i + j}", "offer", sdp)
                                   for j, s in enumerate(senders[i : i + 50])))
            sent += len(senders[i : i + 50])
        return f"{sent} offers sent"
    finally:
        for c in clients.values():
            await c.close()


def flood_idle(port: int, n: int) -> tuple[str, list[socket.socket]]:
    socks: list[socket.socket] = []
    failed = 0
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            failed += 1
    return f"{len(socks)} connections open, {failed} not accepted in 5 s", socks


async def flood_open_bulk(address: str, n: int) -> str:
    import grpc

    from kdn.proto import kdn_pb2 as pb
    from kdn.proto import kdn_pb2_grpc as pbg

    async with grpc.aio.insecure_channel(address) as ch:
        stub = pbg.EdgeServiceStub(ch)
        md = (("authorization", f"Bearer {TOK_B}"),)
        for i in range(0, n, 100):
            await asyncio.gather(*(stub.OpenBulk(pb.BulkRequest(), timeout=30, metadata=md) for _ in range(min(100, n - i))))
    return f"{n} tickets granted"


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--no-write", action="store_true", help="print only; record nothing")
    args = ap.parse_args()
    n = args.count
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 4096), hard))
    rec = None if args.no_write else Record(__file__, "floods", "One tenant floods an edge; another keeps fetching")

    from kdn.testing import make_chain
    from kdn.keys import Namespace
    from kdn.origin.config import OriginConfig
    from kdn.origin.server import OriginServer

    chain = make_chain(1, seed=3, shape=(4, 4, 64, 64), namespace=Namespace("tenant-a"))  # 256 KiB
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        origin = OriginServer(OriginConfig(store_dir=f"{tmp}/origin", models=["tiny"], listen="127.0.0.1:0",
                                           verify_on_start="none", fsync=False, cluster_key=KEY,
                                           tokens={TOK_A: ["*"], TOK_B: ["tenant-b"]}))
        origin.start()
        proc, ready = spawn_edge(Path(tmp), origin.address)
        sampler = Sampler(proc.pid)
        fetcher = Fetcher(ready["address"], chain)
        try:
            fetcher.start()
            time.sleep(3.0)
            floods = [
                ("WebRTC offers", lambda: asyncio.run(flood_offers(origin.address, n)), 12.0),
                ("idle bulk connections", lambda: flood_idle(ready["bulk_port"], n), BULK_TIMEOUT_S + 3),
                ("idle /metrics connections", lambda: flood_idle(ready["metrics_port"], n), 8.0),
                ("OpenBulk calls by tenant B", lambda: asyncio.run(flood_open_bulk(ready["address"], n)), 2.0),
            ]
            for name, run, settle in floods:
                base = sampler.reset()
                t_before = time.monotonic()
                time.sleep(2.0)
                t0 = time.monotonic()
                sampler.reset()
                out = run()
                socks: list[socket.socket] = []
                if isinstance(out, tuple):
                    out, socks = out
                time.sleep(1.0)
                t1 = time.monotonic()
                peak = sampler.peak()
                for s in socks:
                    s.close()
                time.sleep(settle)  # the edge's timeouts close what is left
                t2 = time.monotonic()
                time.sleep(2.0)
                t3 = time.monotonic()
                after = proc_figures(proc.pid)
                lat = [fetcher.between(a, b) for a, b in ((t_before, t0), (t0, t1), (t2, t3))]
                rows.append((name, out, base, peak, after, lat, t1 - t0))
                print(f"{name}: {out} in {t1 - t0:.1f} s; edge fds/threads/RSS {base[0]}/{base[1]}/{base[2]:.0f} MB -> "
                      f"peak {peak[0]}/{peak[1]}/{peak[2]:.0f} MB -> after {after[0]}/{after[1]}/{after[2]:.0f} MB; "
                      "tenant A fetch ms (median/p99, n) " + "; ".join(
                          f"{statistics.median(x) * 1e3:.2f}/{quantile(x, 0.99) * 1e3:.2f} ({len(x)})" if x else "none"
                          for x in lat), flush=True)
        finally:
            fetcher.stop()
            sampler.stop()
            proc.terminate()
            proc.wait(timeout=30)
            origin.stop()
    print(f"tenant A: {len(fetcher.samples)} fetches, {len(fetcher.errors)} errors {fetcher.errors[:3]}", flush=True)
    bounds = {  # what each flood may add to the edge at its peak: its listener's bound, and slack
        "WebRTC offers": (2 * RTC_ANSWERS + 64, 4),
        "idle bulk connections": (BULK_PENDING + 64, 4),
        "idle /metrics connections": (METRICS_CONNS + 64, 4),
        "OpenBulk calls by tenant B": (64, 4),
    }
    ok = not fetcher.errors
    if rec is not None:
        for name, out, base, peak, after, lat, took in rows:
            fd_bound, thread_bound = bounds[name]
            rec.goal(f"{name}: edge fds at peak minus before", f"≤ {fd_bound}", median=peak[0] - base[0], unit="fds",
                     digits=0, at_most=fd_bound)
            rec.goal(f"{name}: edge threads at peak minus before", f"≤ {thread_bound}", median=peak[1] - base[1],
                     unit="threads", digits=0, at_most=thread_bound)
            rec.goal(f"{name}: edge RSS at peak minus before", "≤ 200 MB", median=peak[2] - base[2], unit="MB",
                     digits=0, at_most=200)
            if lat[0] and lat[1]:
                ratios = [x / statistics.median(lat[0]) for x in lat[1]]
                rec.goal(f"{name}: tenant A fetch latency during / before", "— (reported)", ratios, unit="x")
        rec.goal("tenant A fetches that failed, all floods", "0", median=len(fetcher.errors), unit="fetches",
                 digits=0, at_most=0)
        head = ["flood", "what was sent", "seconds", "fds before / peak / after", "threads before / peak / after",
                "RSS MB before / peak / after", "A's fetch ms before (median / p99)", "during", "after"]
        table = []
        for name, out, base, peak, after, lat, took in rows:
            table.append([
                name, out, f"{took:.1f}", f"{base[0]} / {peak[0]} / {after[0]}", f"{base[1]} / {peak[1]} / {after[1]}",
                f"{base[2]:.0f} / {peak[2]:.0f} / {after[2]:.0f}",
                *(f"{statistics.median(x) * 1e3:.2f} / {quantile(x, 0.99) * 1e3:.2f} (n={len(x)})" if x else "none"
                  for x in lat),
            ])
        rec.table(head, table, title=f"Floods of {n}")
        rec.save()
    for name, out, base, peak, after, lat, took in rows:
        fd_bound, thread_bound = bounds[name]
        ok &= peak[0] - base[0] <= fd_bound and peak[1] - base[1] <= thread_bound and peak[2] - base[2] <= 200
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
