"""A real-TCP lab for checking what the simulator reports: two network namespaces joined by a
link of chosen rate and round-trip time, timed transfers across it, and the same transfers run
through the simulator's engine (:func:`reported`).

Layout (built by :func:`main`, which must run as root of a private network namespace, e.g. under
``unshare -rn``; :func:`run_lab` starts it so)::

    client (namespace A)  kdnA ──[ delay line: a forwarder process holding each packet rtt/2 ]── kdnB  server (namespace B)
                                                                    tbf (rate) on kdnB's egress ┘

``kdnA`` / ``kdnB`` are TUN devices; the forwarder reads packets from one and writes them to the
other after the one-way delay (netem is not available here, so the delay line is ours). The
server's egress (the data direction) is shaped by a ``tbf`` qdisc to the link rate, with a queue of
16 MB, so nothing is dropped (:func:`_tbf`). A transfer is: the client sends the size wanted (8
bytes), the server sends that many bytes; ``parallel`` transfers start together, each on its own
connection, each timed at the client from the common start (just before ``connect`` for a cold
one, before the request for a pooled one) to its last byte. Pooled (``warm``): each connection
first carries :data:`WARMUP_BYTES` (all of them together), then sits idle ``idle_s`` seconds.

:func:`reported` builds the same case as a simulation (one origin, one edge at the same place,
the link as the origin's uplink, the RTT as the two sites' access latency; every request fetches
its chunks from the origin) and returns the per-request fetch times the engine reports, the
figure ``kdn simulate`` prints and the tuner optimises.

Only the standard library and ``ip``/``tc`` (iproute2) inside the namespaces; prints one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import json
import mmap
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["BLOCK_BYTES", "Case", "Measured", "available", "run_lab", "default_cases", "reported", "goodput_Bps"]

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
CLIENT_IP, SERVER_IP, PORT = "10.77.0.1", "10.77.0.2", 5001
BLOCK_TOKENS = 16  # tokens per chunk in the simulated case: 16 x 128 KiB of Llama-3.1-8B KV = 2 MiB
BLOCK_BYTES = 2 * 1024 * 1024
WARMUP_BYTES = 2 * BLOCK_BYTES  # what a pooled connection carries before the timed transfer
MODEL = "llama-3.1-8b"


@dataclass(frozen=True, slots=True)
class Case:
    nbytes: int  # a whole number of BLOCK_BYTES
    rtt_s: float
    warm: bool  # pooled connections that have carried WARMUP_BYTES (else: new connections)
    parallel: int  # transfers started together, one connection each
    idle_s: float = 0.0  # how long the pooled connections sat idle before the timed transfers

    @property
    def mode(self) -> str:
        return "cold" if not self.warm else (f"after {self.idle_s:g} s idle" if self.idle_s > 0 else "warm")

    @property
    def label(self) -> str:
        mb = self.nbytes / 2**20
        return f"{mb:g} MiB, RTT {self.rtt_s * 1000:g} ms, {self.mode}, {self.parallel} at once"


@dataclass(frozen=True, slots=True)
class Measured:
    case: Case
    seconds: tuple[float, ...]  # each transfer's time, sorted: the median over the runs, rank by rank
    runs: tuple[tuple[float, ...], ...] = ()  # every run's sorted times


def goodput_Bps(rate_mbit: float, mss: int = 1448) -> float:
    """Payload bytes/s through a link shaped to ``rate_mbit`` (tbf counts whole IP packets:
    ``mss`` bytes of payload in ``mss + 52`` on the wire, IPv4 and TCP with timestamps)."""
    return rate_mbit * 1e6 / 8 * mss / (mss + 52)


BASE_RTT_S = 0.0002  # the delay line's own round trip when set to 0 (a Python forwarder, two TUN hops)


def simulate_fetches(requests: list[tuple[float, int]], rtt_s: float, rate_mbit: float, cc: str = "cubic") -> list[float]:
    """The fetch times (arrival to data at the GPUs) the engine reports for ``requests``
    (``(arrival s, chunks of BLOCK_BYTES)``, in arrival order), from a run of
    :func:`kdn.simulator.engine.run_policy` on a one-origin, one-edge scenario: the origin's uplink
    is a link of ``rate_mbit`` (its payload rate, :func:`goodput_Bps`), the two sites' RTT is
    ``rtt_s`` (their access latencies), every request fetches all its chunks from the origin over
    pooled connections under congestion control ``cc``."""
    import numpy as np

    from kdn.simulator.engine import run_policy
    from kdn.simulator.geo import CityIndex
    from kdn.simulator.presets import load_presets
    from kdn.simulator.scenario import parse_scenario
    from kdn.simulator.topology import build_topology
    from kdn.simulator.workload import Requests

    presets = load_presets()
    if presets.models[MODEL].kv_bytes_per_token * BLOCK_TOKENS != BLOCK_BYTES:
        raise ValueError(f"{MODEL}'s KV per chunk of {BLOCK_TOKENS} tokens is not {BLOCK_BYTES} bytes")
    where = {"lat": 0.0, "lon": 0.0, "access_ms": rtt_s / 4 * 1000}  # one-way latency = access at each end
    cities = CityIndex.default()
    sc = parse_scenario({
        "name": "netlab", "model": MODEL, "gpu": "h100-sxm", "block_tokens": BLOCK_TOKENS,
        "topology": {"origins": [{**where, "name": "server", "uplink_gbps": goodput_Bps(rate_mbit) * 8 / 1e9}],
                     "regions": [{**where, "name": "client", "uplink_gbps": 10.0}]},
        "workload": {"kind": "synthetic", "requests": 1, "duration_s": 1.0},
        "cache": {"edge_cache_gb": 0.0},
        "codecs": {"metro": "raw", "regional": "raw", "long_haul": "raw"},
        "policies": ["origin_only"],
        "params": {"decision": "fetch", "publish_to_origin": False},
        "network": {"link_sharing": "fair", "connections": "pooled", "congestion_control": cc},
    }, source="netlab", cities=cities, presets=presets)
    topo = build_topology(sc, cities)
    t = np.asarray([r[0] for r in requests], dtype=float)
    blocks = np.asarray([r[1] for r in requests], dtype=np.int64)
    off = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(blocks, out=off[1:])
    keys = np.arange(1, int(off[-1]) + 1, dtype=np.int64)  # every chunk its own: nothing is cached
    reqs = Requests(t, np.zeros(len(requests), dtype=np.int64), blocks * BLOCK_TOKENS, off, keys,
                    np.zeros(0), np.zeros(0, dtype=np.int64), BLOCK_TOKENS, True, float(t[-1]))
    return [float(x) for x in run_policy(sc, topo, reqs, presets, "origin_only").fetch]


def reported(case: Case, rate_mbit: float, cc: str = "cubic", base_rtt_s: float = BASE_RTT_S) -> tuple[float, ...]:
    """What the simulator reports for ``case`` (:func:`simulate_fetches`): each timed request's
    fetch time, sorted. The RTT is ``case.rtt_s``, ``base_rtt_s`` at least (what the delay line
    adds at 0). Warm cases: ``parallel`` requests of WARMUP_BYTES at t=0, the timed ones
    ``idle_s`` after the last of them is in (found by a first run of the warm-ups alone)."""
    if case.nbytes % BLOCK_BYTES:
        raise ValueError(f"case size {case.nbytes} is not a whole number of {BLOCK_BYTES}-byte chunks")
    rtt = max(case.rtt_s, base_rtt_s)
    warm = [(0.0, WARMUP_BYTES // BLOCK_BYTES)] * case.parallel if case.warm else []
    start = max(simulate_fetches(warm, rtt, rate_mbit, cc)) + case.idle_s if warm else 0.0
    fetch = simulate_fetches(warm + [(start, case.nbytes // BLOCK_BYTES)] * case.parallel, rtt, rate_mbit, cc)
    return tuple(sorted(fetch[len(warm):]))


def default_cases() -> list[Case]:
    """The grid: 2 and 20 MiB, ~0 and 100 ms RTT, two and four transfers at once on the link,
    on new connections, on pooled warm ones, and on pooled ones after 1 s idle."""
    modes = ((False, 0.0), (True, 0.0), (True, 1.0))
    return [Case(n, rtt, warm, par, idle) for rtt in (0.0, 0.1) for n in (BLOCK_BYTES, 10 * BLOCK_BYTES)
            for par in (2, 4) for warm, idle in modes]


def available() -> str | None:
    """None if the lab can run here, else why not."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    try:
        r = subprocess.run(["unshare", "-rn", "sh", "-c", "test -r /dev/net/tun -a -w /dev/net/tun && tc qdisc add dev lo root tbf rate 100mbit burst 16kb latency 50ms"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -rn failed: {exc}"
    if r.returncode != 0:
        return f"unshare -rn with /dev/net/tun and tc tbf not permitted here: {(r.stderr or r.stdout).strip()[:200]}"
    return None


def run_lab(
    cases: list[Case], *, rate_mbit: float = 100.0, repeats: int = 1, cc: str | None = None, queue: str = "deep", timeout_s: float = 300.0
) -> tuple[list[Measured], dict[str, str]]:
    """Run ``cases`` in a fresh pair of namespaces; each case ``repeats`` times (each transfer
    rank's median is :attr:`Measured.seconds`, every run is kept). ``cc``: the sender's congestion control (default: the
    system's); ``queue``: the shaper's queue (:func:`_tbf`). Returns the measurements and facts
    about the lab (congestion control, kernel, queue)."""
    if queue not in QUEUES:
        raise ValueError(f"unknown queue {queue!r}; known: {', '.join(QUEUES)}")
    spec = json.dumps({"rate_mbit": rate_mbit, "repeats": repeats, "cc": cc, "queue": queue, "cases": [asdict(c) for c in cases]})
    r = subprocess.run(["unshare", "-rn", sys.executable, "-m", "kdn.simulator.netlab", spec], capture_output=True, text=True, timeout=timeout_s,
                       cwd=str(Path(__file__).resolve().parents[2]))
    if r.returncode != 0:
        raise RuntimeError(f"netlab failed (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    measured = []
    for m in out["measured"]:
        runs = tuple(tuple(r) for r in m["runs"])
        median = tuple(sorted(r[k] for r in runs)[len(runs) // 2] for k in range(len(runs[0])))
        measured.append(Measured(Case(**m["case"]), median, runs))
    return measured, out["facts"]


# ---- inside the namespace ------------------------------------------------------------------


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


QUEUES = ("deep", "bdp")


def _tbf(rate_mbit: float, rtt_s: float, queue: str = "deep") -> list[str]:
    """The shaper: ``rate_mbit``, a 32 KB burst, and a queue of ``queue``: ``deep``, 16 MB, so
    nothing is dropped (a queue of 1.5 bandwidth-delay products made two BBR flows lose packets
    and share the link unevenly, 0.60 s instead of 0.43 s for two warm 2 MB transfers at 100 ms);
    ``bdp``, two bandwidth-delay products and at least 256 KB, as a router's buffer is sized:
    loss-based congestion control (cubic) converges to fair shares only through the losses a
    finite queue causes; with 16 MB and no loss, two cubic flows kept unequal windows (3.1 s and
    7.2 s for four warm 20 MiB transfers at 100 ms where fair sharing gives 7.1 s each)."""
    if queue not in QUEUES:
        raise ValueError(f"unknown queue {queue!r}; known: {', '.join(QUEUES)}")
    limit = 16_000_000 if queue == "deep" else max(256_000, int(2 * rate_mbit * 1e6 / 8 * rtt_s))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", "32kb", "limit", str(limit)]


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _forward(ta: int, tb: int, delay: mmap.mmap) -> None:
    """The delay line: every packet read from one TUN is written to the other after the one-way
    delay (read from the shared ``delay`` cell, seconds as a double). Runs until killed."""
    q: list[tuple[float, int, int, bytes]] = []
    seq = 0
    other = {ta: tb, tb: ta}
    while True:
        now = time.monotonic()
        timeout = max(0.0, q[0][0] - now) if q else 0.05
        ready, _, _ = select.select([ta, tb], [], [], timeout)
        d = struct.unpack_from("d", delay, 0)[0]
        now = time.monotonic()
        for fd in ready:
            for _ in range(256):
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if d <= 0:
                    os.write(other[fd], pkt)
                else:
                    seq += 1
                    heapq.heappush(q, (now + d, seq, other[fd], pkt))
        now = time.monotonic()
        while q and q[0][0] <= now:
            _, _, out, pkt = heapq.heappop(q)
            os.write(out, pkt)


def _serve(listener: socket.socket) -> None:
    """Each connection: read an 8-byte size, send that many bytes; repeat until closed."""
    blob = memoryview(bytes(4 * BLOCK_BYTES))

    def one(conn: socket.socket) -> None:
        with conn:
            while True:
                head = b""
                while len(head) < 8:
                    got = conn.recv(8 - len(head))
                    if not got:
                        return
                    head += got
                n = struct.unpack("!Q", head)[0]
                while n > 0:
                    k = min(n, len(blob))
                    conn.sendall(blob[:k])
                    n -= k

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def _fetch(sock: socket.socket, n: int, buf: memoryview) -> None:
    sock.sendall(struct.pack("!Q", n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[: min(len(buf), n - got)])
        if k == 0:
            raise ConnectionError("server closed")
        got += k


def _connect() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.connect((SERVER_IP, PORT))
    return s


def _timed_together(socks: list[socket.socket | None], n: int) -> list[float]:
    """Start one transfer of ``n`` bytes on each socket at once (None: a new connection, its
    handshake timed too) from a single thread with non-blocking sockets, so the transfers start
    microseconds apart; each one's seconds from the common start to its last byte."""
    import selectors

    sel = selectors.DefaultSelector()
    buf = memoryview(bytearray(1 << 20))
    got = [0] * len(socks)
    times = [0.0] * len(socks)
    request = struct.pack("!Q", n)
    t0 = time.perf_counter()
    for k, s in enumerate(socks):
        if s is None:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
            s.connect_ex((SERVER_IP, PORT))
            socks[k] = s
            sel.register(s, selectors.EVENT_WRITE, k)
        else:
            s.setblocking(False)
            s.send(request)
            sel.register(s, selectors.EVENT_READ, k)
    left = len(socks)
    while left:
        for key, events in sel.select(timeout=30):
            k, s = key.data, key.fileobj
            if events & selectors.EVENT_WRITE:  # connected: send the request
                s.send(request)
                sel.modify(s, selectors.EVENT_READ, k)
                continue
            r = s.recv_into(buf)
            if r == 0:
                raise ConnectionError("server closed")
            got[k] += r
            if got[k] >= n:
                times[k] = time.perf_counter() - t0
                sel.unregister(s)
                left -= 1
    sel.close()
    return times


def _one_case(c: Case) -> tuple[float, ...]:
    socks: list[socket.socket | None] = [None] * c.parallel
    if c.warm:  # warm the connections together, then leave them idle for c.idle_s

        def warm(k: int) -> None:
            s = _connect()
            _fetch(s, WARMUP_BYTES, memoryview(bytearray(1 << 20)))
            socks[k] = s

        warmers = [threading.Thread(target=warm, args=(k,)) for k in range(c.parallel)]
        for t in warmers:
            t.start()
        for t in warmers:
            t.join()
        if c.idle_s > 0:
            time.sleep(c.idle_s)
    times = _timed_together(socks, c.nbytes)
    for s in socks:
        if s is not None:
            s.close()
    return tuple(sorted(times))


def main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    _sh("ip", "link", "set", "lo", "up")
    ns_b = subprocess.Popen(["unshare", "-n", "sleep", "3600"])
    own = os.readlink("/proc/self/ns/net")
    for _ in range(500):
        try:
            if os.readlink(f"/proc/{ns_b.pid}/ns/net") != own:
                break
        except OSError:
            pass
        time.sleep(0.01)
    children = [ns_b.pid]
    try:
        ta = _open_tun("kdnA")
        _sh("ip", "addr", "add", CLIENT_IP, "peer", SERVER_IP, "dev", "kdnA")
        _sh("ip", "link", "set", "kdnA", "up")
        own_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        b_fd = os.open(f"/proc/{ns_b.pid}/ns/net", os.O_RDONLY)
        _setns(b_fd)
        tb = _open_tun("kdnB")
        _sh("ip", "link", "set", "lo", "up")
        _sh("ip", "addr", "add", SERVER_IP, "peer", CLIENT_IP, "dev", "kdnB")
        _sh("ip", "link", "set", "kdnB", "up")
        rate = spec["rate_mbit"]
        _sh("tc", "qdisc", "add", "dev", "kdnB", "root", *_tbf(rate, 0.0))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if spec.get("cc"):  # the sender's congestion control (accepted sockets inherit it)
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, spec["cc"].encode())
        listener.bind((SERVER_IP, PORT))
        listener.listen(16)
        cc = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
        pid = os.fork()
        if pid == 0:  # the server, in namespace B
            try:
                _serve(listener)
            finally:
                os._exit(0)
        children.append(pid)
        listener.close()
        _setns(own_fd)
        delay = mmap.mmap(-1, 8)
        struct.pack_into("d", delay, 0, 0.0)
        pid = os.fork()
        if pid == 0:
            try:
                _forward(ta, tb, delay)
            finally:
                os._exit(0)
        children.append(pid)
        measured = []
        for c in spec["cases"]:
            case = Case(**c)
            struct.pack_into("d", delay, 0, case.rtt_s / 2)
            _sh("nsenter", "-t", str(ns_b.pid), "-n", "tc", "qdisc", "change", "dev", "kdnB", "root", *_tbf(rate, case.rtt_s, spec.get("queue", "deep")))
            time.sleep(0.05 + case.rtt_s)
            runs = [_one_case(case) for _ in range(spec["repeats"])]
            measured.append({"case": c, "runs": [list(r) for r in runs]})
        facts = {"congestion_control": cc, "kernel": os.uname().release, "rate_mbit": str(rate), "queue": spec.get("queue", "deep")}
        print(json.dumps({"measured": measured, "facts": facts}))
        return 0
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ns_b.wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="run inside `unshare -rn`: time real TCP transfers through a shaped, delayed link")
    ap.add_argument("spec", help='JSON: {"rate_mbit": 100, "repeats": 1, "cases": [{"nbytes":..,"rtt_s":..,"warm":..,"parallel":..,"idle_s":..}]}')
    sys.exit(main(ap.parse_args().spec))
