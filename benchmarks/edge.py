"""KDN's edge beside LMCache's server, Redis and raw TCP, interleaved round by round.

Every figure is a ratio against a peer measured in the same round, reported as the median
[min–max] of the per-round ratios, with the load average at start and end:

- 32 MiB object GET: KDN edge Fetch (every checksum verified, decoded into a reused buffer) vs
  LMCache 0.5.6's ``LMCServerConnector`` GET from ``lmcache_server`` vs redis-py GET from
  ``redis-server`` vs raw TCP ``recv_into`` one reused buffer (goals: >= 1.0x LMCache, >= 0.8x TCP);
- 32 MiB PUT, acknowledged, of a key the server holds and of a new key: KDN vs LMCache's connector
  (goal >= 1.0x);
- 4,000 x 1 MiB GETs, 8 in flight, one client, cycling through 128 distinct artifacts: requests/s
  and p50/p99, KDN over bulk TCP (``bulk_local=False``: the path a client on another host takes)
  vs LMCache (goal >= 1.0x), and KDN over the default same-host path (``shm=True``, what a
  co-located inference host takes, its control over the edge's same-host socket) vs LMCache
  (goal >= 1.5x);
- the same 1 MiB GETs at one offered load, open loop (Poisson arrivals at 60% of the round's
  slowest closed-loop rate, the same seeded arrivals for every system, at most 8 in flight), each
  timed from its scheduled arrival: p50/p99, KDN over bulk and over shm vs LMCache (goal: p99
  <= 2x LMCache's). The closed-loop p50/p99 are printed too, but judged by no goal: LMCache's
  connector runs its GETs one at a time, each timed from its own start, while KDN's eight in
  flight are timed from their issue, so by Little's law KDN's there is 8 / its rate;
- scaling: 1, 2, 4, 8 client processes fetching 1 MiB objects, aggregate requests/s and p50/p99,
  KDN and LMCache;
- per-request p50/p99 of every 32 MiB row (GET, PUT), pooled over the rounds;
- same-host shared memory on the inference client's path (``shm=True``, every checksum verified,
  decoded into a reused buffer) vs memcpy of the same bytes into a reused buffer (goal >= 0.6x);
- Lookup RPCs/s and in-process overlay owner lookups/s (no peer; for continuity).

Each server runs in its own process (the edge via ``kdn.edge.cli``, artifacts in its memory tier)
and so does each client (``benchmarks/peers/worker.py``; LMCache's in its own venv), timing itself
in-process, so no client pays for another's imports. Within a round the order of the systems
rotates, and the 32 MiB measurements alternate systems one object at a time. Peers come from ``bash benchmarks/peers/install.sh`` (``.peers/``); a missing peer is
reported as missing, with the reason, and the rest still runs.

    .venv/bin/python benchmarks/edge.py [--quick] [--rounds N] [--busy-core] [--no-append]

Prints a table, records the run as ``edge`` (``benchmarks/_results.py``; unless --no-append) and
writes benchmarks/results/edge.png. ``--busy-core`` is the contended condition: one process that
spins in Python holds a core for the whole run (as another job on the host would); that run is
recorded as ``edge-busy`` (``edge-busy.png``), beside the idle one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Callable

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kdn.edge.admin import AsyncEdgeClient  # noqa: E402
from kdn.testing import Chain, make_chain  # noqa: E402
from kdn.wire.channel import free_port  # noqa: E402

PEERS = REPO / ".peers"
WORKER = REPO / "benchmarks" / "peers" / "worker.py"
LMCACHE_PY = PEERS / "lmcache-venv" / "bin" / "python"

METHOD = """Every figure is a ratio against a peer measured in the same round, reported as the median
[min–max] of the per-round ratios. Each server runs in its own process (the edge as `kdn edge`,
artifacts in its memory tier; LMCache 0.5.6's `lmcache_server`; `redis-server`; a raw TCP server)
and so does each client (`benchmarks/peers/worker.py`), timing itself. Within a round the order of
the systems rotates, and the 32 MiB measurements alternate systems one object at a time. Every KDN
GET verifies every checksum into a reused destination, as `kdn.client` does; LMCache stores and
returns the bare KV bytes. Measured: 32 MiB GETs (against LMCache's connector, redis-py and raw TCP
`recv_into` one reused buffer), 32 MiB PUTs of a held and of a new key, 4,000 x 1 MiB GETs with 8
in flight (closed loop: throughput), the same GETs at one offered load (open loop: Poisson arrivals,
each timed from its scheduled arrival: the tails), scaling over 1/2/4/8 client processes, and
same-host shared memory on the inference client's path against memcpy into a reused buffer."""
LMCACHE_SERVER = PEERS / "lmcache-venv" / "bin" / "lmcache_server"
REDIS_ROOT = PEERS / "redis"
MiB = 1 << 20
# (L, H, T, D) fp16, raw codec: 32 MiB and 1 MiB of KV per artifact (L·2·H·T·D·2 bytes)
BIG_SHAPE = (32, 8, 256, 128)
SMALL_SHAPE = (8, 8, 64, 64)
SMALL_OBJECTS = 128  # distinct 1 MiB artifacts the bursts cycle through (a working set, not one hot key)
SCALING = (1, 2, 4, 8)
PACED_SHARE = 0.6
"""The open-loop latency run offers every system this share of the slowest closed-loop 1 MiB rate
of the round: one load that each can carry, the same Poisson arrivals for all."""


# -- processes -------------------------------------------------------------------------------------


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"not listening on port {port} after {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


class Worker:
    """One client process speaking JSON lines (benchmarks/peers/worker.py)."""

    def __init__(self, python: str | Path, kind: str, data_dir: Path, address: str, log: Path, *extra: str) -> None:
        self.kind = kind
        self.log = log
        args = [str(python), str(WORKER), kind, str(data_dir), address, *extra]
        self._err: IO[bytes] = open(log, "wb")
        self.proc = subprocess.Popen(args, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err)
        self.info: dict = {}

    def _read(self, timeout: float = 900.0) -> dict:
        """The worker's next answer; a worker silent for ``timeout`` seconds is a failure, not a hang."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise RuntimeError(f"{self.kind} worker silent for {timeout:.0f} s: {_tail(self.log)}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.kind} worker exited: {_tail(self.log)}")
        return json.loads(line)

    def wait_ready(self) -> dict:
        self.info = self._read()
        if "error" in self.info:
            raise RuntimeError(self.info["error"])
        return self.info

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self) -> dict:
        res = self._read()
        if not res.get("ok"):
            raise RuntimeError(f"{self.kind}: {res.get('error')}")
        return res

    def ask(self, op: str, **kw: Any) -> dict:
        self.send(op, **kw)
        return self.recv()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("quit")
                self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        _stop(self.proc)
        self._err.close()


@dataclass
class Peer:
    """A server the benchmark runs beside the edge, or why it could not."""

    name: str
    python: str | Path = sys.executable
    address: str = ""
    proc: subprocess.Popen | None = None
    missing: str = ""
    workers: list[Worker] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return not self.missing


def start_edge(tmp: Path) -> Peer:
    log = open(tmp / "edge.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kdn.edge.cli", "--listen", "127.0.0.1:0", "--node-id", "bench",
                             "--memory-bytes", "2G", "--policy", "lru"], cwd=REPO, stdout=subprocess.PIPE, stderr=log)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"edge did not start: {_tail(tmp / 'edge.log')}")
    return Peer("kdn", address=json.loads(line)["address"], proc=proc)


def start_tcp(tmp: Path, data: Path) -> Peer:
    proc = subprocess.Popen([sys.executable, str(WORKER), "serve-tcp", str(data)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=open(tmp / "tcp.log", "wb"))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"TCP baseline server did not start: {_tail(tmp / 'tcp.log')}")
    return Peer("tcp", address=f"127.0.0.1:{json.loads(line)['port']}", proc=proc)


def _start_on_port(name: str, label: str, argv: Callable[[int], list[str]], tmp: Path, log_name: str,
                   env: dict[str, str] | None = None, **peer: Any) -> Peer:
    """Start a server that is told its port on the command line (``argv(port)``): a peer that is up
    once the port answers, else one that says why not (``label``, then the tail of its log)."""
    port = free_port("127.0.0.1")
    log = tmp / log_name
    proc = subprocess.Popen(argv(port), cwd=tmp, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        _wait_port(port, proc)
    except RuntimeError as exc:
        _stop(proc)
        return Peer(name, missing=f"{label} {exc}: {_tail(log)}")
    return Peer(name, address=f"127.0.0.1:{port}", proc=proc, **peer)


def start_lmcache(tmp: Path) -> Peer:
    if not LMCACHE_SERVER.exists():
        return Peer("lmcache", missing=f"{LMCACHE_SERVER} not found: run bash benchmarks/peers/install.sh")
    return _start_on_port("lmcache", "lmcache_server", lambda port: [str(LMCACHE_SERVER), "127.0.0.1", str(port), "cpu"],
                          tmp, "lmcache_server.log", python=LMCACHE_PY)


def start_redis(tmp: Path) -> Peer:
    binary = REDIS_ROOT / "usr" / "bin" / "redis-server"
    env = dict(os.environ, LD_LIBRARY_PATH=str(REDIS_ROOT / "usr" / "lib" / "x86_64-linux-gnu"))
    if not binary.exists():
        found = shutil.which("redis-server")
        if not found:
            return Peer("redis", missing="redis-server not found: run bash benchmarks/peers/install.sh")
        binary, env = Path(found), dict(os.environ)
    return _start_on_port("redis", "redis-server",
                          lambda port: [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                        "--appendonly", "no", "--proto-max-bulk-len", "1gb"],
                          tmp, "redis.log", env=env)


# -- data ------------------------------------------------------------------------------------------


def write_data(data: Path, chains: dict[str, tuple[Chain, tuple[int, int, int, int]]]) -> None:
    manifest: dict = {"sets": {}}
    for name, (chain, shape) in chains.items():
        files = []
        for i, blob in enumerate(chain.blobs):
            (data / f"{name}_{i:03d}.bin").write_bytes(blob)
            files.append(f"{name}_{i:03d}.bin")
        manifest["sets"][name] = {"keys": [bytes(k).hex() for k in chain.keys], "shape": list(shape), "files": files}
        manifest["fingerprint"] = bytes(chain.fingerprint).hex()
        manifest["tenant"] = chain.namespace.tenant
    (data / "manifest.json").write_text(json.dumps(manifest))


# -- statistics ------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def _tail_ms(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 of per-request ``seconds``, in ms."""
    return {"p50_ms": _pct(seconds, 0.5) * 1e3, "p99_ms": _pct(seconds, 0.99) * 1e3}


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """``median [min–max]`` of per-round figures."""
    if not xs:
        return "missing"
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}–{fmt.format(max(xs))}]"


def ratios(a: list[float], b: list[float]) -> list[float]:
    """Per-round ratios a/b (rounds where both were measured)."""
    return [x / y for x, y in zip(a, b) if x and y]


# -- the benchmark ---------------------------------------------------------------------------------


@dataclass
class Plan:
    rounds: int
    big_gets: int  # 32 MiB GETs per system per round
    big_puts: int
    burst: int  # 1 MiB GETs in the 8-in-flight run
    inflight: int
    scaling_total: int  # 1 MiB GETs per scaling point, split across the client processes
    shm_gets: int


def plan_for(args: argparse.Namespace) -> Plan:
    if args.quick:
        p = Plan(rounds=2, big_gets=3, big_puts=2, burst=1000, inflight=8, scaling_total=320, shm_gets=3)
    else:
        p = Plan(rounds=5, big_gets=6, big_puts=3, burst=4000, inflight=8, scaling_total=1200, shm_gets=6)
    if args.rounds:
        p.rounds = args.rounds
    return p


def rotated(items: list, r: int) -> list:
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def run(args: argparse.Namespace) -> dict:
    plan = plan_for(args)
    tmp = Path(tempfile.mkdtemp(prefix="kdn-bench-edge-"))
    data = tmp / "data"
    data.mkdir()
    load_start = os.getloadavg()
    res: dict = {"plan": plan.__dict__, "load_start": load_start, "missing": {}, "cpus": os.cpu_count()}
    peers: dict[str, Peer] = {}
    t_start = time.monotonic()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - t_start - sum(phases.values()), 1)

    res["phases_s"] = phases
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=False) as progress:
        setup = progress.add_task("setup: artifacts, servers, clients", total=6)
        chains = {
            "big": (make_chain(4, shape=BIG_SHAPE, seed=1), BIG_SHAPE),
            "small": (make_chain(SMALL_OBJECTS, shape=SMALL_SHAPE, seed=2), SMALL_SHAPE),
            # 32 MiB objects each PUT once over the run: keys the servers have never held
            "fresh": (make_chain(plan.rounds * plan.big_puts, shape=BIG_SHAPE, seed=3), BIG_SHAPE),
        }
        write_data(data, chains)
        res["big_bytes"] = len(chains["big"][0].blobs[0])
        res["small_bytes"] = len(chains["small"][0].blobs[0])
        phase("artifacts")
        progress.advance(setup)
        try:
            peers["kdn"] = start_edge(tmp)
            peers["lmcache"] = start_lmcache(tmp)
            peers["redis"] = start_redis(tmp)
            peers["tcp"] = start_tcp(tmp, data)
            progress.advance(setup)
            # one client per system, then for the scaling run a group of forked clients (1 MiB set only)
            for name, peer in peers.items():
                if peer.up:  # only KDN and LMCache PUT the fresh set
                    sets = () if name in ("kdn", "lmcache") else ("--sets", "big,small")
                    peer.workers.append(Worker(peer.python, name, data, peer.address, tmp / f"{name}-w0.log", *sets))
            for name in ("kdn", "lmcache"):
                peer = peers[name]
                if peer.up:
                    peer.workers.append(Worker(peer.python, name, data, peer.address, tmp / f"{name}-group.log",
                                               "--sets", "small", "--fork", str(max(SCALING))))
            for name, peer in peers.items():
                for w in peer.workers:
                    try:
                        info = w.wait_ready()
                    except RuntimeError as exc:
                        peer.missing = f"client did not start: {exc}"
                        break
                    if w is peer.workers[0]:
                        res.setdefault("client_info", {})[name] = info
            phase("servers and clients up")
            progress.advance(setup)
            for name, peer in peers.items():
                if peer.up:
                    try:
                        for s in ("big", "small"):
                            peer.workers[0].ask("load", set=s)
                        peer.workers[0].ask("get", set="big", n=1)  # warm
                        peer.workers[0].ask("get", set="small", n=8)
                        if name == "kdn":
                            # publish every 32 MiB object to shared memory once, as a hot artifact
                            # is: the timed shm fetches then measure the path a host uses on every
                            # reuse, not the one-time publication (timed here, reported on its own)
                            res["shm_first_s"] = peer.workers[0].ask("shm", set="big", n=4)["s"] / 4
                    except RuntimeError as exc:
                        peer.missing = f"load failed: {exc}"
            for name, peer in peers.items():
                if peer.missing:
                    res["missing"][name] = peer.missing
            phase("load")
            progress.advance(setup)
            if not peers["kdn"].up:
                raise RuntimeError(f"KDN edge unusable: {peers['kdn'].missing}")
            measure(peers, plan, res, progress)
            phase("rounds")
            progress.advance(setup)
            res.update(lookup_and_overlay(peers["kdn"].address, chains["small"][0], args.quick))
            phase("lookup and overlay")
            progress.advance(setup)
        finally:
            for peer in peers.values():
                for w in peer.workers:
                    w.close()
                if peer.proc is not None:
                    _stop(peer.proc)
            shutil.rmtree(tmp, ignore_errors=True)
    res["load_end"] = os.getloadavg()
    return res


def measure(peers: dict[str, Peer], plan: Plan, res: dict, progress: Progress) -> None:
    up = [n for n in ("kdn", "lmcache", "redis", "tcp") if peers[n].up]
    pair = [n for n in ("kdn", "lmcache") if peers[n].up]
    big = res["big_bytes"]
    get_gbps: dict[str, list[float]] = {n: [] for n in up}
    put_gbps: dict[str, list[float]] = {n: [] for n in pair}
    new_put_gbps: dict[str, list[float]] = {n: [] for n in pair}
    burst: dict[str, list[dict]] = {n: [] for n in pair + (["kdn shm"] if "kdn" in pair else [])}
    paced: dict[str, list[dict]] = {n: [] for n in burst}
    scale: dict[str, dict[int, list[float]]] = {n: {k: [] for k in SCALING} for n in pair}
    scale_lat: dict[str, dict[int, list[dict]]] = {n: {k: [] for k in SCALING} for n in pair}
    calls: dict[str, dict[str, list[float]]] = {"get": {}, "put": {}, "new_put": {}}  # seconds per 32 MiB call
    shm: dict[str, list[float]] = {"shm": [], "memcpy": []}
    vias: dict[str, int] = {}
    task = progress.add_task("interleaved rounds", total=plan.rounds)
    for r in range(plan.rounds):
        # 32 MiB GET (and KDN's byte path alone, a diagnostic), PUT: one object per system in turn
        got = one_at_a_time(peers, up + ["kdn unread"], "get", plan.big_gets, r, calls=calls["get"])
        for n, s in got.items():
            get_gbps.setdefault(n, []).append(plan.big_gets * big / s / 1e9)
        for n, s in one_at_a_time(peers, pair, "put", plan.big_puts, r, calls=calls["put"]).items():
            put_gbps[n].append(plan.big_puts * big / s / 1e9)
        for n, s in one_at_a_time(peers, pair, "put", plan.big_puts, r, objects="fresh", calls=calls["new_put"]).items():
            new_put_gbps[n].append(plan.big_puts * big / s / 1e9)
        for n in rotated(list(burst), r):  # 1 MiB, 8 in flight (KDN also over the default same-host path)
            system, _, variant = n.partition(" ")
            out = peers[system].workers[0].ask("shm_burst" if variant else "burst", set="small", n=plan.burst,
                                               inflight=plan.inflight, start_at=0)
            burst[n].append({"rps": plan.burst / (out["t1"] - out["t0"]), **_tail_ms(out["lat"])})
        # the same 1 MiB GETs at one offered load, open loop: latency from each scheduled arrival
        rate = PACED_SHARE * min(v[-1]["rps"] for v in burst.values())
        for n in rotated(list(paced), r):
            system, _, variant = n.partition(" ")
            out = peers[system].workers[0].ask("shm_paced" if variant else "paced", set="small", n=plan.burst,
                                               rate=rate, inflight=plan.inflight, seed=r, start_at=0)
            paced[n].append({"rate": rate, **_tail_ms(out["lat"])})
        for k in SCALING:  # 1 MiB, k client processes, one request in flight each
            for n in rotated(pair, r):
                cmd = {"op": "burst", "set": "small", "n": plan.scaling_total // k, "inflight": 1,
                       "start_at": time.monotonic() + 0.2}
                outs = peers[n].workers[1].ask("fanout", k=k, cmd=cmd)["results"]
                t0, t1 = min(o["t0"] for o in outs), max(o["t1"] for o in outs)
                scale[n][k].append((plan.scaling_total // k) * k / (t1 - t0))
                lat = [x for o in outs for x in o["lat"]]  # every client's requests of this point
                scale_lat[n][k].append(_tail_ms(lat))
        # the inference client's shm path vs memcpy of the same bytes, one object each in turn
        for n, s in one_at_a_time(peers, ["kdn shm", "kdn memcpy"], "", plan.shm_gets, r).items():
            shm[n.split()[1]].append(plan.shm_gets * big / s / 1e9)
        vias = peers["kdn"].workers[0].ask("get", set="big", n=0)["via"]
        progress.advance(task)
    res.update({"get_gbps": get_gbps, "put_gbps": put_gbps, "new_put_gbps": new_put_gbps, "burst": burst,
                "paced": paced,
                "scale": {n: {str(k): v for k, v in d.items()} for n, d in scale.items()}, "shm": shm, "via": vias,
                "scale_lat": {n: {str(k): v for k, v in d.items()} for n, d in scale_lat.items()},
                "call_ms": {op: {n: [x * 1e3 for x in v] for n, v in d.items()} for op, d in calls.items()}})


def one_at_a_time(peers: dict[str, Peer], names: list[str], op: str, count: int, r: int,
                  objects: str = "big", calls: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Seconds each system spent on ``count`` 32 MiB operations, taken one object per system in
    turn (order rotated per object and round) so a slow moment of the shared machine hits all
    alike. ``"kdn unread"`` names KDN's client with the ``unread`` op, ``"kdn shm"`` the ``shm`` op.
    ``calls``: each operation's seconds are appended there too, per system."""
    spent = dict.fromkeys(names, 0.0)
    for j in range(count):
        for n in rotated(names, r + j):
            system, _, variant = n.partition(" ")
            s = peers[system].workers[0].ask(variant or op, set=objects, n=1)["s"]
            spent[n] += s
            if calls is not None:
                calls.setdefault(n, []).append(s)
    return spent


def lookup_and_overlay(address: str, small: Chain, quick: bool) -> dict:
    """Lookup RPCs/s (16-key chains, 16 concurrent callers) and in-process overlay owners/s."""
    keys16 = small.keys[:16]

    async def lookups() -> float:
        n_lookups = 400 if quick else 1500
        done = 0
        async with AsyncEdgeClient(address, deadline_s=60) as c:
            async def looker() -> None:
                nonlocal done
                while done < n_lookups:
                    done += 1
                    resp = await c.lookup(keys16, fingerprint=small.fingerprint, namespace=small.namespace,
                                          local_only=True)
                    assert resp.available == len(keys16)

            t0 = time.perf_counter()
            await asyncio.gather(*(looker() for _ in range(16)))
            return n_lookups / (time.perf_counter() - t0)

    lookup_rps = asyncio.run(lookups())
    from kdn.edge.config import EdgeConfig
    from kdn.edge.overlay import Member, Overlay

    members = [Member(f"e{i}", f"h{i}:1") for i in range(10)]
    ov = Overlay(members[0], members, replicas=2, backoff_s=EdgeConfig.default("peer_backoff_s"))
    keys = [os.urandom(32) for _ in range(20_000)]
    t0 = time.perf_counter()
    for k in keys:
        ov.owners(k)
    return {"lookup_rpcs_per_s": lookup_rps, "overlay_owner_lookups_per_s": len(keys) / (time.perf_counter() - t0)}


# -- report ----------------------------------------------------------------------------------------


def _goal(ok: bool | None) -> str:
    return "missing" if ok is None else ("MET" if ok else "NOT MET")


def goal_ratios(res: dict) -> list[tuple[str, str, list[float], float]]:
    """(goal, the row it judges, per-round ratios, the least median that meets it) for every goal;
    an empty list of ratios: the peer is missing."""
    p = res["plan"]
    g, pu, b, shm = res["get_gbps"], res["put_gbps"], res["burst"], res["shm"]
    npu = res.get("new_put_gbps", {})
    rps = {n: [x["rps"] for x in v] for n, v in b.items()}

    def vs(a: list[float], peer: dict, name: str) -> list[float]:
        return ratios(a, peer[name]) if name in peer and a else []

    return [
        ("32 MiB GET >= 1.0x LMCache", "32 MiB GET vs LMCache connector GET", vs(g["kdn"], g, "lmcache"), 1.0),
        ("32 MiB GET >= 0.8x raw TCP", "32 MiB GET vs raw TCP recv_into one reused buffer", vs(g["kdn"], g, "tcp"), 0.8),
        ("32 MiB PUT of a held key >= 1.0x LMCache", "32 MiB PUT of a held key vs LMCache connector PUT",
         vs(pu["kdn"], pu, "lmcache"), 1.0),
        ("32 MiB PUT of a new key >= 1.0x LMCache", "32 MiB PUT of a new key vs LMCache connector PUT",
         vs(npu.get("kdn", []), npu, "lmcache"), 1.0),
        ("1 MiB x 8 in flight >= 1.0x LMCache", f"{p['burst']} x 1 MiB GET, {p['inflight']} in flight, vs LMCache",
         vs(rps["kdn"], rps, "lmcache"), 1.0),
        ("1 MiB x 8 in flight, same-host shm >= 1.5x LMCache",
         f"{p['burst']} x 1 MiB GET, {p['inflight']} in flight, default host path (shm), vs LMCache",
         vs(rps.get("kdn shm", []), rps, "lmcache"), 1.5),
        ("shm >= 0.6x memcpy", "same-host shm on the client path (verified) vs memcpy", ratios(shm["shm"], shm["memcpy"]),
         0.6),
    ]


def record(res: dict, text: str, png: Path) -> None:
    """The run as the ``edge`` record (``edge-busy`` with one core held): a goal line per goal (a
    missing peer's: NOT MET, with why), the report's description and tables as its body."""
    from _results import Record  # benchmarks/ is on sys.path when this runs as a script

    title = "Edge data plane beside LMCache, Redis, raw TCP"
    if res.get("busy_core"):
        rec = Record(__file__, "edge-busy", title + ", one core busy", command=res["command"])
        rec.note("One core was held for the whole run by a process spinning in Python (`--busy-core`), "
                 "as another job on the host would hold it; every server and client shared the rest.")
    else:
        rec = Record(__file__, "edge", title, command=res["command"])
    rec.doc["load"]["start"] = round(res["load_start"][0], 2)
    rec.set_rounds(res["plan"]["rounds"])
    for _, what, rr, limit in goal_ratios(res):
        if rr:
            rec.goal(what, f"≥ {limit}x", rr, at_least=limit)
        else:
            rec.goal(what, f"≥ {limit}x", met=False)
            rec.note(f"{what}: not measured (a peer is missing)")
    g = res["get_gbps"]
    if "redis" in g:
        rec.goal("32 MiB GET vs Redis GET (redis-py)", "faster (> 1x)", ratios(g["kdn"], g["redis"]), at_least=1.0)
    pc, p = res.get("paced", {}), res["plan"]
    if "lmcache" in pc:  # the tail a serving fleet feels: p99 at one offered load, within each round
        lmc = [x["p99_ms"] for x in pc["lmcache"]]
        for n, path in (("kdn", ""), ("kdn shm", ", default host path (shm)")):
            if n in pc:
                rec.goal(f"1 MiB GETs at one offered load (open loop, ≤ {p['inflight']} in flight){path}: "
                         "p99 vs LMCache's", "≤ 2x", ratios([x["p99_ms"] for x in pc[n]], lmc), at_most=2.0)
    rec.markdown(line for line in text.splitlines() if not line.startswith(("## Edge data plane", "Command: ", "Goals (",
                                                                             "Plot: ")))
    rec.plot(png)
    rec.save(load_end=round(res["load_end"][0], 2))


def report(res: dict, command: str) -> str:
    p = res["plan"]
    g, pu, b, sc, shm = res["get_gbps"], res["put_gbps"], res["burst"], res["scale"], res["shm"]
    miss = res["missing"]
    kdn_get = g["kdn"]

    def vs(a: list[float], peer: dict, name: str) -> list[float]:
        return ratios(a, peer[name]) if name in peer else []

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    r_lmc, r_tcp, r_redis = vs(kdn_get, g, "lmcache"), vs(kdn_get, g, "tcp"), vs(kdn_get, g, "redis")
    r_put = vs(pu["kdn"], pu, "lmcache")
    npu = res.get("new_put_gbps", {})
    r_new_put = vs(npu.get("kdn", []), npu, "lmcache")
    rps = {n: [x["rps"] for x in v] for n, v in b.items()}
    r_burst = vs(rps["kdn"], rps, "lmcache")
    r_shm = ratios(shm["shm"], shm["memcpy"])
    la0, la1 = res["load_start"], res["load_end"]
    lines = [
        f"## Edge data plane beside LMCache, Redis, raw TCP ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Command: `{command}`  ",
        f"{p['rounds']} interleaved rounds (order rotated each round; the 32 MiB GET, PUT and shm/memcpy figures "
        "alternate systems one object at a time); figures are median [min–max] of the per-round "
        f"values, ratios taken within a round.{' One core held by a spinning process (--busy-core).' if res.get('busy_core') else ''} "
        f"Load average (1 min) {la0[0]:.2f} at start, {la1[0]:.2f} at end, "
        f"on {res['cpus']} CPUs. Objects: {res['big_bytes'] / MiB:.2f} MiB and {res['small_bytes'] / MiB:.2f} MiB KDN "
        f"containers (fp16 KV, raw codec, shapes (L,H,T,D) {BIG_SHAPE} and {SMALL_SHAPE}); LMCache stores exactly the "
        "KV bytes (32 / 1 MiB, no checksums). Every KDN GET verifies every checksum into a reused destination "
        "(ArtifactReader(out=...) through the transport's fetch_into, as kdn.client does: over the bulk path the raw "
        "KV is received in place and hashed there). Two PUT rows: re-puts of objects the servers already hold (the edge "
        "verifies every checksum and keeps its copy; LMCache's server stores the bytes again), and PUTs of keys "
        "neither server has held (each object once per run, so both keep new memory). Each server and each client "
        "in its own process; clients time themselves.",
        f"KDN transport: {res.get('client_info', {}).get('kdn', {})}; pieces received by path over the run "
        f"(main KDN client): {res['via']}. How each peer is installed and driven: `benchmarks/peers/README.md`.",
        "",
        "| measurement | KDN | peer | KDN / peer, per round | goal |",
        "|---|---|---|---|---|",
    ]

    def row(what: str, kdn_vals: list[float], peer: str, peer_vals: list[float] | None, rr: list[float],
            goal: str, unit: str = "GB/s") -> None:
        if peer_vals is None:
            lines.append(f"| {what} | {spread(kdn_vals)} {unit} | {peer}: missing ({miss.get(peer, '?')}) | missing | {goal} |")
        else:
            lines.append(f"| {what} | {spread(kdn_vals)} {unit} | {spread(peer_vals)} {unit} | {spread(rr)}x | {goal} |")

    row("32 MiB GET vs LMCache connector GET", kdn_get, "lmcache", g.get("lmcache"), r_lmc, ">= 1.0x")
    row("32 MiB GET vs raw TCP recv_into one reused buffer", kdn_get, "tcp", g.get("tcp"), r_tcp, ">= 0.8x")
    row("32 MiB GET vs Redis GET (redis-py)", kdn_get, "redis", g.get("redis"), r_redis, "")
    if "kdn unread" in g:  # diagnostic: where a KDN GET's time goes
        lines.append(f"| (diagnostic) KDN byte path alone, pieces dropped unread, vs raw TCP | {spread(g['kdn unread'])} GB/s "
                     f"| {spread(g.get('tcp', []))} GB/s | {spread(vs(g['kdn unread'], g, 'tcp'))}x | |")
    row("32 MiB PUT of a held key (acknowledged) vs LMCache connector PUT", pu["kdn"], "lmcache", pu.get("lmcache"),
        r_put, ">= 1.0x")
    if npu:
        row("32 MiB PUT of a new key (acknowledged) vs LMCache connector PUT", npu["kdn"], "lmcache", npu.get("lmcache"),
            r_new_put, ">= 1.0x")
    row(f"{p['burst']} x 1 MiB GET, {p['inflight']} in flight, vs LMCache", rps["kdn"], "lmcache", rps.get("lmcache"),
        r_burst, ">= 1.0x", unit="req/s")
    if "kdn shm" in rps:
        row(f"{p['burst']} x 1 MiB GET, {p['inflight']} in flight, default host path (shm), vs LMCache", rps["kdn shm"],
            "lmcache", rps.get("lmcache"), vs(rps["kdn shm"], rps, "lmcache"), ">= 1.5x", unit="req/s")
    lines.append(f"| shm on the inference client path (verified) vs memcpy to a reused buffer | {spread(shm['shm'])} GB/s "
                 f"| {spread(shm['memcpy'])} GB/s | {spread(r_shm)}x | >= 0.6x |")
    if "shm_first_s" in res:
        lines.append(f"| (not in the shm row) first shm fetch of an artifact: the edge publishes it, the client maps it "
                     f"| {res['shm_first_s'] * 1e3:.1f} ms | | | |")
    lat = " ".join(f"{n}: p50 {spread([x['p50_ms'] for x in v], '{:.1f}')} ms, p99 "
                   f"{spread([x['p99_ms'] for x in v], '{:.1f}')} ms;" for n, v in b.items())
    lines += ["", f"Latency in the {p['burst']} x 1 MiB run ({p['inflight']} in flight, closed loop): {lat} "
              "(LMCache's connector receives without yielding, so its GETs run one at a time and each is timed "
              "from its own start: no queueing; KDN's are timed from their issue, behind the other requests in "
              "flight. By Little's law KDN's mean there is 8 / its rate, whatever its speed: these are not "
              "comparable tails, and no goal is judged on them.)", ""]
    pc = res.get("paced", {})
    if pc:
        rates = [x["rate"] for x in next(iter(pc.values()))]
        lines += [f"Latency at one offered load, open loop: {p['burst']} x 1 MiB GETs per system and round, Poisson "
                  f"arrivals at {spread(rates, '{:.0f}')} req/s ({PACED_SHARE:.0%} of the round's slowest "
                  f"closed-loop rate; the same seeded arrivals for every system), at most {p['inflight']} in "
                  "flight, each timed from its scheduled arrival (its wait for a slot or a busy loop counts):", "",
                  "| system | p50 ms | p99 ms | p99 vs LMCache's, per round |", "|---|---|---|---|"]
        lmc = [x["p99_ms"] for x in pc.get("lmcache", [])]
        for n, v in pc.items():
            rr = ratios([x["p99_ms"] for x in v], lmc) if lmc and n != "lmcache" else []
            lines.append(f"| {n} | {spread([x['p50_ms'] for x in v])} | {spread([x['p99_ms'] for x in v])} | "
                         + (f"{spread(rr)}x (goal ≤ 2x)" if rr else "") + " |")
        lines.append("")
    call_ms = res.get("call_ms", {})
    if call_ms:
        what = {"get": "GET", "put": "PUT of a held key", "new_put": "PUT of a new key"}
        parts = [f"{what[op]}: " + ", ".join(f"{n} p50 {_pct(v, 0.5):.1f} / p99 {_pct(v, 0.99):.1f} ms"
                                            for n, v in d.items() if n != "kdn unread")
                 for op, d in call_ms.items() if d]
        lines += [f"Per-request latency of the 32 MiB rows, every round's requests pooled: {'; '.join(parts)}.", ""]
    sl = res.get("scale_lat", {})
    lines += [f"Scaling, 1 MiB GETs, {p['scaling_total']} per point split across k client processes (one in flight "
              "each), aggregate req/s" + (" and per-request p50 / p99 (medians of the rounds)" if sl else "") + ":", "",
              "| clients | " + " | ".join(f"{n} req/s" for n in sc) + " | KDN vs 1 client | KDN / LMCache |"
              + "".join(f" {n} p50 / p99 ms |" for n in sl),
              "|---|" + "---|" * len(sc) + "---|---|" + "---|" * len(sl)]
    for k in SCALING:
        kk = str(k)
        cells = [spread(sc[n][kk], "{:.0f}") for n in sc]
        grow = spread(ratios(sc["kdn"][kk], sc["kdn"]["1"]))
        vs_l = spread(ratios(sc["kdn"][kk], sc["lmcache"][kk])) + "x" if "lmcache" in sc else "missing"
        lat_cells = "".join(f" {statistics.median(x['p50_ms'] for x in sl[n][kk]):.2f} / "
                            f"{statistics.median(x['p99_ms'] for x in sl[n][kk]):.2f} |" for n in sl)
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {grow}x | {vs_l} |" + lat_cells)
    lines += ["", f"Lookup RPCs (16-key chains, local, 16 concurrent callers): {res['lookup_rpcs_per_s']:.0f}/s. "
              f"Overlay owners(key, r=2) in-process, 10 nodes: {res['overlay_owner_lookups_per_s']:.0f}/s.", "",
              f"Seconds per phase: {res['phases_s']}."]
    for name, why in miss.items():
        lines.append(f"\nMissing: {name}: {why}")
    goals = [(name, med(rr) >= limit if rr else None) for name, _, rr, limit in goal_ratios(res)]
    lines += ["", "Goals (median of per-round ratios): " + "; ".join(f"{n}: {_goal(ok)}" for n, ok in goals) + ".",
              f"Plot: `benchmarks/results/edge{'-busy' if res.get('busy_core') else ''}.png`.", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"kdn": "#1f77b4", "lmcache": "#ff7f0e", "redis": "#d62728", "tcp": "#999999"}
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))

    def bars(ax: Any, vals: dict[str, list[float]], ylabel: str, title: str) -> None:
        names = list(vals)
        meds = [statistics.median(v) if v else 0.0 for v in vals.values()]
        lo = [m - min(v) if v else 0.0 for m, v in zip(meds, vals.values())]
        hi = [max(v) - m if v else 0.0 for m, v in zip(meds, vals.values())]
        out = ax.bar(names, meds, yerr=[lo, hi], capsize=4, color=[colors.get(n.split()[0], "#2ca02c") for n in names])
        ax.bar_label(out, fmt="%.2f" if max(meds, default=0) < 100 else "%.0f")
        ax.set_ylabel(ylabel)
        ax.set_title(title)

    bars(axes[0], res["get_gbps"], "GB/s", "32 MiB GET, one client")
    axes[0].tick_params(axis="x", rotation=20)
    bars(axes[1], {**{f"{n} PUT": v for n, v in res["put_gbps"].items()},
                   **{f"{n} PUT new": v for n, v in res.get("new_put_gbps", {}).items()}, **res["shm"]}, "GB/s",
         "32 MiB: PUT (held, new key); kdn shm GET vs memcpy")
    axes[1].tick_params(axis="x", rotation=20)
    bars(axes[2], {n: [x["rps"] for x in v] for n, v in res["burst"].items()}, "requests/s",
         f"{res['plan']['burst']} x 1 MiB, {res['plan']['inflight']} in flight")
    ax = axes[3]
    for n, d in res["scale"].items():
        ks = [int(k) for k in d]
        ax.plot(ks, [statistics.median(v) if v else 0.0 for v in d.values()], "o-", color=colors[n], label=n)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(SCALING), [str(k) for k in SCALING])
    ax.set_xlabel("client processes")
    ax.set_ylabel("aggregate requests/s (1 MiB)")
    ax.set_title("Scaling")
    ax.legend()
    fig.suptitle(f"KDN edge beside LMCache, Redis, raw TCP (loopback, median of {res['plan']['rounds']} rounds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rounds, fewer requests (< 3 min)")
    p.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default 5, --quick 2)")
    p.add_argument("--busy-core", action="store_true",
                   help="hold one core with a spinning process for the whole run (recorded as edge-busy)")
    p.add_argument("--no-append", action="store_true", help="print only; record nothing")
    args = p.parse_args()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy_core else None
    try:
        res = run(args)
    finally:
        if spinner is not None:
            spinner.kill()  # ours, by its handle
            spinner.wait()
    res["busy_core"] = args.busy_core
    command = ("python benchmarks/edge.py" + (" --quick" if args.quick else "")
               + (f" --rounds {args.rounds}" if args.rounds else "") + (" --busy-core" if args.busy_core else ""))
    res["command"] = command
    text = report(res, command)
    print(text)
    from _results import plot_dir

    png = plot_dir(not args.no_append) / ("edge-busy.png" if args.busy_core else "edge.png")
    plot(res, png)
    if args.no_append:
        print(f"not recorded; plot written to {png}")
    else:
        record(res, text, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
