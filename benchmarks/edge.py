"""Edge Fetch performance, each figure a ratio against a baseline measured in the same run.

- Fetch throughput over loopback gRPC (edge in its own process, artifacts in its memory tier)
  vs raw TCP over loopback (asyncio streams in their own process sending the same bytes; goal >= 0.6)
  vs a Redis server on loopback through redis-py GET of the same artifacts (goal: faster);
- the same-host shared-memory path (RPC + map + verify every checksum) vs memcpy of the bytes (goal >= 0.5);
- p50/p99 Fetch latency with 32 concurrent clients;
- Lookup RPCs/s (chains of 16 keys) and in-process overlay owner lookups/s.

    .venv/bin/python benchmarks/edge.py [--quick]

Appends a dated section to BENCHMARKS.md and writes benchmarks/results/edge.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kdn.edge.admin import AsyncEdgeClient  # noqa: E402
from kdn.edge.shm import open_segment  # noqa: E402
from kdn.edge.testing import Chain, make_chain  # noqa: E402

_LEN = struct.Struct("<Q")


# -- raw TCP baseline server (runs in its own process) -------------------------------------------


def serve_tcp(blob_dir: str) -> None:
    blobs = [p.read_bytes() for p in sorted(Path(blob_dir).glob("*.bin"))]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (idx,) = struct.unpack("<I", await reader.readexactly(4))
                data = blobs[idx]
                writer.write(_LEN.pack(len(data)))
                writer.write(data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class TcpClient:
    """Blocking socket, ``recv_into`` a preallocated buffer: the strongest plain-Python TCP reader."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def get(self, idx: int) -> bytearray:
        self.sock.sendall(struct.pack("<I", idx))
        head = self._read(8)
        (n,) = _LEN.unpack(head)
        return self._read(n)

    def _read(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError("TCP server closed")
            got += k
        return buf

    async def close(self) -> None:
        self.sock.close()


# -- helpers ---------------------------------------------------------------------------------------


def _spawn_json(args: list[str], timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], dict]:
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    line = proc.stdout.readline()
    if not line or time.monotonic() > end:
        proc.kill()
        raise RuntimeError(f"{args[:4]} did not start")
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def _timed_rounds(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    """Best wall time of ``rounds`` runs of ``await fn()``."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        await fn()
        best = min(best, time.perf_counter() - t0)
    return best


# -- the benchmark ---------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict:
    quick = args.quick
    tmp = Path(tempfile.mkdtemp(prefix="kdn-bench-edge-"))
    # big artifacts for throughput: one 256-token chunk of a 125M-shape model (L=12, H=12, D=64) fp16 = 9.4 MB
    big = make_chain(4 if quick else 8, shape=(12, 12, 256, 64), seed=1)
    # small artifacts for latency: 256 tokens of a 4-layer, 4-head model ~ 1 MB
    small = make_chain(16, shape=(4, 4, 256, 64), seed=2)
    for i, blob in enumerate(big.blobs):
        (tmp / f"{i:03d}.bin").write_bytes(blob)
    total_big = sum(len(b) for b in big.blobs)
    results: dict = {"artifact_bytes": len(big.blobs[0]), "small_artifact_bytes": len(small.blobs[0])}
    rounds = 4 if quick else 10
    procs: list[subprocess.Popen[bytes]] = []
    try:
        edge, ready = _spawn_json([sys.executable, "-m", "kdn.edge.cli", "--listen", "127.0.0.1:0", "--node-id", "bench",
                                   "--memory-bytes", "2G", "--policy", "lru"])
        procs.append(edge)
        tcp, tcp_ready = _spawn_json([sys.executable, str(Path(__file__).resolve()), "--serve-tcp", str(tmp)])
        procs.append(tcp)
        address = ready["address"]

        async with AsyncEdgeClient(address, deadline_s=60) as c:
            await c.wait_ready()
            for chain in (big, small):
                for k, blob in zip(chain.keys, chain.blobs):
                    await c.put(blob, key=k, fingerprint=chain.fingerprint, namespace=chain.namespace)

            async def grpc_all() -> None:
                for k, blob in zip(big.keys, big.blobs):
                    data = await c.fetch(k, fingerprint=big.fingerprint, namespace=big.namespace)
                    assert len(data) == len(blob)

            tc = TcpClient(tcp_ready["port"])
            await tc.open()

            async def tcp_all() -> None:
                for i, blob in enumerate(big.blobs):
                    data = await tc.get(i)
                    assert len(data) == len(blob)

            # shm: RPC + open/map (cached by name) + verify every checksum, vs memcpy of the same bytes
            async def shm_all(verify: bool = True) -> None:
                for k in big.keys:
                    with await c.fetch_shm(k, fingerprint=big.fingerprint, namespace=big.namespace, verify=verify) as art:
                        assert len(art) > 0

            async def memcpy_all() -> None:
                for blob in big.blobs:
                    bytearray(blob)

            # interleaved rounds, best of each: the machine is shared, so a slow moment hits all paths alike
            paths = {"grpc": grpc_all, "tcp": tcp_all, "shm": shm_all, "shm_noverify": lambda: shm_all(False),
                     "memcpy": memcpy_all}
            best = {name: float("inf") for name in paths}
            for name, fn in paths.items():
                await fn()  # warm
            for _ in range(rounds):
                for name, fn in paths.items():
                    best[name] = min(best[name], await _timed_rounds(fn, 1))
            t_grpc, t_tcp, t_shm, t_shm_noverify, t_memcpy = (
                best["grpc"], best["tcp"], best["shm"], best["shm_noverify"], best["memcpy"])
            await tc.close()

        # Redis
        t_redis = None
        redis_note = ""
        redis_bin = shutil.which("redis-server")
        if redis_bin:
            import redis

            port = _free_port()
            rproc = subprocess.Popen([redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--proto-max-bulk-len", "1gb"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(rproc)
            r = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(100):
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            for k, blob in zip(big.keys, big.blobs):
                r.set(bytes(k), blob)

            def redis_all() -> None:
                for k, blob in zip(big.keys, big.blobs):
                    data = r.get(bytes(k))
                    assert data is not None and len(data) == len(blob)

            redis_all()
            t_redis = float("inf")
            async with AsyncEdgeClient(address, deadline_s=60) as c2:
                async def grpc_again() -> None:
                    for k in big.keys:
                        await c2.fetch(k, fingerprint=big.fingerprint, namespace=big.namespace)

                for _ in range(rounds):  # interleaved with gRPC again, same reason
                    t_redis = min(t_redis, _time(redis_all))
                    t_grpc = min(t_grpc, await _timed_rounds(grpc_again, 1))
            r.close()
        else:
            redis_note = "redis-server not installed: Redis comparison skipped (apt-get install -y redis-server)"

        # latency with 32 concurrent clients on ~1 MB artifacts
        n_clients, per_client = 32, (10 if quick else 30)
        lat: list[float] = []
        clients = [AsyncEdgeClient(address, deadline_s=60) for _ in range(n_clients)]  # one channel per client

        async def caller(i: int) -> None:
            cl = clients[i % len(clients)]
            for j in range(per_client):
                k = small.keys[(i + j) % len(small.keys)]
                t0 = time.perf_counter()
                await cl.fetch(k, fingerprint=small.fingerprint, namespace=small.namespace)
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(caller(i) for i in range(4)))  # warm
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(n_clients)))
        t_lat = time.perf_counter() - t0
        lat.sort()
        p50 = lat[len(lat) // 2]
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]

        # single-client latency (one at a time) as the baseline for the concurrent figures
        single: list[float] = []
        for j in range(40):
            k = small.keys[j % len(small.keys)]
            t0 = time.perf_counter()
            await clients[0].fetch(k, fingerprint=small.fingerprint, namespace=small.namespace)
            single.append(time.perf_counter() - t0)
        single.sort()

        # Lookup RPCs/s: chains of 16 keys, 16 concurrent callers
        n_lookups = 400 if quick else 1500
        done = 0

        async def looker(i: int) -> None:
            nonlocal done
            cl = clients[i % len(clients)]
            while done < n_lookups:
                done += 1
                resp = await cl.lookup(small.keys, fingerprint=small.fingerprint, namespace=small.namespace, local_only=True)
                assert resp.available == len(small.keys)

        t0 = time.perf_counter()
        await asyncio.gather(*(looker(i) for i in range(16)))
        t_lookup = time.perf_counter() - t0
        for cl in clients:
            await cl.close()

        # overlay owner lookups in-process (what every miss does)
        from kdn.edge.overlay import Member, Overlay

        members = [Member(f"e{i}", f"h{i}:1") for i in range(10)]
        ov = Overlay(members[0], members, replicas=2)
        keys = [os.urandom(32) for _ in range(20_000)]
        t0 = time.perf_counter()
        for k in keys:
            ov.owners(k)
        t_owners = time.perf_counter() - t0

        results.update({
            "grpc_gbps": _gbps(total_big, t_grpc),
            "tcp_gbps": _gbps(total_big, t_tcp),
            "redis_gbps": _gbps(total_big, t_redis) if t_redis else None,
            "shm_gbps": _gbps(total_big, t_shm),
            "shm_noverify_gbps": _gbps(total_big, t_shm_noverify),
            "memcpy_gbps": _gbps(total_big, t_memcpy),
            "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3,
            "single_p50_ms": single[len(single) // 2] * 1e3,
            "concurrent_fetches_per_s": len(lat) / t_lat,
            "lookup_rpcs_per_s": n_lookups / t_lookup,
            "lookup_keys_per_s": n_lookups * len(small.keys) / t_lookup,
            "overlay_owner_lookups_per_s": len(keys) / t_owners,
            "redis_note": redis_note,
        })
    finally:
        for p in procs:
            _stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def report(res: dict, command: str) -> str:
    r = res
    lines = [
        f"## Edge Fetch over gRPC vs raw TCP, Redis, shm, memcpy ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Command: `{command}`  ",
        f"Artifacts: {r['artifact_bytes'] / 1e6:.1f} MB each (one 256-token chunk, 125M-shape model, fp16, raw codec), "
        "served from the edge's memory tier; edge, TCP server and Redis each in their own process; one client, "
        f"sequential fetches, best of interleaved rounds (shm maps cached by name, checksums verified on every fetch). Load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.",
        "",
        "| path | GB/s | ratio | goal |",
        "|---|---|---|---|",
        f"| raw TCP loopback (socket recv_into), baseline | {r['tcp_gbps']:.2f} | 1.00x | |",
        f"| edge Fetch over gRPC | {r['grpc_gbps']:.2f} | {r['grpc_gbps'] / r['tcp_gbps']:.2f}x of TCP | >= 0.6x |",
    ]
    if r["redis_gbps"]:
        lines.append(f"| Redis GET via redis-py | {r['redis_gbps']:.2f} | gRPC is {r['grpc_gbps'] / r['redis_gbps']:.2f}x Redis | > 1x |")
    lines += [
        f"| memcpy (bytearray copy), baseline | {r['memcpy_gbps']:.2f} | 1.00x | |",
        f"| shm: RPC + mmap + verify all checksums | {r['shm_gbps']:.2f} | {r['shm_gbps'] / r['memcpy_gbps']:.2f}x of memcpy | >= 0.5x |",
        f"| shm: RPC + mmap + header only (no verify) | {r['shm_noverify_gbps']:.2f} | {r['shm_noverify_gbps'] / r['memcpy_gbps']:.2f}x of memcpy | |",
        "",
        f"Latency, {r['small_artifact_bytes'] / 1e6:.2f} MB artifacts, 32 concurrent clients (one channel each): "
        f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms ({r['concurrent_fetches_per_s']:.0f} fetches/s); "
        f"one client alone: p50 {r['single_p50_ms']:.2f} ms.  ",
        f"Lookup RPCs (16-key chains, local, 16 concurrent callers): {r['lookup_rpcs_per_s']:.0f}/s "
        f"= {r['lookup_keys_per_s']:.0f} keys/s. Overlay owners(key, r=2) in-process, 10 nodes: "
        f"{r['overlay_owner_lookups_per_s']:.0f}/s.",
    ]
    if r["redis_note"]:
        lines.append(f"\n{r['redis_note']}")
    goals = [
        ("gRPC >= 0.6x raw TCP", r["grpc_gbps"] / r["tcp_gbps"] >= 0.6),
        ("shm >= 0.5x memcpy", r["shm_gbps"] / r["memcpy_gbps"] >= 0.5),
    ]
    if r["redis_gbps"]:
        goals.append(("faster than Redis GET", r["grpc_gbps"] > r["redis_gbps"]))
    lines += ["", "Goals: " + "; ".join(f"{g}: {'MET' if ok else 'NOT MET'}" for g, ok in goals) + ".",
              "Plot: `benchmarks/results/edge.png`.", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["raw TCP", "edge gRPC", "Redis GET", "memcpy", "shm+verify", "shm (no verify)"]
    vals = [res["tcp_gbps"], res["grpc_gbps"], res["redis_gbps"] or 0.0, res["memcpy_gbps"], res["shm_gbps"],
            res["shm_noverify_gbps"]]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    bars = ax.bar(names, vals, color=["#999", "#1f77b4", "#d62728", "#999", "#2ca02c", "#98df8a"])
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel("GB/s (one client, 9.4 MB artifacts)")
    ax.set_title("Edge fetch throughput over loopback")
    ax.tick_params(axis="x", rotation=20)
    ax2.bar(["p50", "p99"], [res["p50_ms"], res["p99_ms"]], color="#1f77b4")
    ax2.set_ylabel("ms")
    ax2.set_title("32 concurrent clients, ~1 MB")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--serve-tcp", help=argparse.SUPPRESS)
    p.add_argument("--no-append", action="store_true", help="print only; do not touch BENCHMARKS.md")
    args = p.parse_args()
    if args.serve_tcp:
        serve_tcp(args.serve_tcp)
        return 0
    res = asyncio.run(run(args))
    command = "python benchmarks/edge.py" + (" --quick" if args.quick else "")
    text = report(res, command)
    print(text)
    print(json.dumps({k: v for k, v in res.items() if k != "redis_note"}, indent=1))
    plot(res, REPO / "benchmarks" / "results" / "edge.png")
    if not args.no_append:
        with open(REPO / "BENCHMARKS.md", "a") as fh:
            fh.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
