"""A real-TCP lab for checking the transfer model: two network namespaces joined by a link of
chosen rate and round-trip time, and timed transfers across it.

Layout (built by :func:`main`, which must run as root of a private network namespace, e.g. under
``unshare -rn``; :func:`run_lab` starts it so)::

    client (namespace A)  kdnA ──[ delay line: a forwarder process holding each packet rtt/2 ]── kdnB  server (namespace B)
                                                                    tbf (rate) on kdnB's egress ┘

``kdnA`` / ``kdnB`` are TUN devices; the forwarder reads packets from one and writes them to the
other after the one-way delay (netem is not available here, so the delay line is ours). The
server's egress (the data direction) is shaped by a ``tbf`` qdisc to the link rate, with a queue of
16 MB, so nothing is dropped (:func:`_tbf`). A transfer is: the client sends the size wanted (8 bytes), the server
sends that many bytes; it is timed at the client from just before ``connect`` (cold) or the
request (warm: a connection that has just carried a 20 MB transfer; two are warmed together) to
the last byte received.
Two at once: two connections started together, each timed from the common start.

Only the standard library and ``ip``/``tc`` (iproute2); prints one JSON object.
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

__all__ = ["Case", "Measured", "available", "run_lab", "default_cases", "predict", "goodput_Bps"]

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
CLIENT_IP, SERVER_IP, PORT = "10.77.0.1", "10.77.0.2", 5001
WARMUP_BYTES = 20_000_000


@dataclass(frozen=True, slots=True)
class Case:
    nbytes: int
    rtt_s: float
    warm: bool
    parallel: int  # transfers started together (1 or 2)

    @property
    def label(self) -> str:
        mb = self.nbytes / 1e6
        return f"{mb:g} MB, RTT {self.rtt_s * 1000:g} ms, {'warm' if self.warm else 'cold'}, {self.parallel} at once"


@dataclass(frozen=True, slots=True)
class Measured:
    case: Case
    seconds: tuple[float, ...]  # each transfer's time, sorted


def goodput_Bps(rate_mbit: float, mss: int = 1448) -> float:
    """Payload bytes/s through a link shaped to ``rate_mbit`` (tbf counts whole IP packets:
    ``mss`` bytes of payload in ``mss + 52`` on the wire, IPv4 and TCP with timestamps)."""
    return rate_mbit * 1e6 / 8 * mss / (mss + 52)


def predict(case: Case, rate_mbit: float, mode: str = "fair") -> tuple[float, ...]:
    """What the simulator's link and TCP models say each transfer of ``case`` takes (request to
    last byte at the client), sorted. ``fair``: the link's processor-sharing departures (each
    flow's final time, as the later flow made it) plus its window-limited time; ``fifo``: the
    FIFO link's figures at commit."""
    from kdn.simulator.links import FairLinks, Links
    from kdn.simulator.tcp import TcpModel

    tcp = TcpModel()
    rate = goodput_Bps(rate_mbit)
    rtt = case.rtt_s
    lat = rtt / 2
    cwnd = tcp.window_after(WARMUP_BYTES, rtt, rate) if case.warm else tcp.initial_window
    if mode == "fifo":
        links = Links([rate], tcp)
        return tuple(sorted(links.commit(0, lat, case.nbytes, rtt, cwnd, not case.warm) + lat for _ in range(case.parallel)))
    fair = FairLinks([rate], tcp, record=True)
    ids = []
    for _ in range(case.parallel):
        fair.commit(0, lat, case.nbytes, rtt, cwnd, not case.warm)
        ids.append(fair.last_id)
    fair.settle(0)
    assert fair.left_at is not None and fair.extra is not None
    return tuple(sorted(fair.left_at[i] + fair.extra[i] + lat for i in ids))


def default_cases() -> list[Case]:
    """The issue's grid: 2 MB and 20 MB, ~0 and 100 ms RTT, cold and warm, one and two at once."""
    return [Case(n, rtt, warm, par) for rtt in (0.0, 0.1) for n in (2_000_000, 20_000_000) for warm in (False, True) for par in (1, 2)]


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


def run_lab(cases: list[Case], *, rate_mbit: float = 100.0, repeats: int = 1, cc: str | None = None, timeout_s: float = 300.0) -> tuple[list[Measured], dict[str, str]]:
    """Run ``cases`` in a fresh pair of namespaces; each case ``repeats`` times (the median run,
    by its slowest transfer, is kept). ``cc``: the sender's congestion control (default: the
    system's). Returns the measurements and facts about the lab (congestion control, kernel)."""
    spec = json.dumps({"rate_mbit": rate_mbit, "repeats": repeats, "cc": cc, "cases": [asdict(c) for c in cases]})
    r = subprocess.run(["unshare", "-rn", sys.executable, "-m", "kdn.simulator.netlab", spec], capture_output=True, text=True, timeout=timeout_s,
                       cwd=str(Path(__file__).resolve().parents[2]))
    if r.returncode != 0:
        raise RuntimeError(f"netlab failed (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    measured = [Measured(Case(**m["case"]), tuple(m["seconds"])) for m in out["measured"]]
    return measured, out["facts"]


# ---- inside the namespace ------------------------------------------------------------------


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _tbf(rate_mbit: float, rtt_s: float) -> list[str]:
    """The shaper: ``rate_mbit``, a 32 KB burst, and a queue deep enough that nothing is dropped
    (16 MB; a queue of 1.5 bandwidth-delay products made two BBR flows lose packets and share
    the link unevenly, 0.60 s instead of 0.43 s for two warm 2 MB transfers at 100 ms)."""
    limit = 16_000_000
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
    blob = memoryview(bytes(WARMUP_BYTES))

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
    if c.warm:  # warm the connections together, so none sits idle past its RTO (a restart)

        def warm(k: int) -> None:
            s = _connect()
            _fetch(s, WARMUP_BYTES, memoryview(bytearray(1 << 20)))
            socks[k] = s

        warmers = [threading.Thread(target=warm, args=(k,)) for k in range(c.parallel)]
        for t in warmers:
            t.start()
        for t in warmers:
            t.join()
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
            _sh("nsenter", "-t", str(ns_b.pid), "-n", "tc", "qdisc", "change", "dev", "kdnB", "root", *_tbf(rate, case.rtt_s))
            time.sleep(0.05 + case.rtt_s)
            runs = sorted((_one_case(case) for _ in range(spec["repeats"])), key=lambda x: x[-1])
            measured.append({"case": c, "seconds": list(runs[len(runs) // 2])})
        facts = {"congestion_control": cc, "kernel": os.uname().release, "rate_mbit": str(rate)}
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
    ap.add_argument("spec", help='JSON: {"rate_mbit": 100, "repeats": 1, "cases": [{"nbytes":..,"rtt_s":..,"warm":..,"parallel":..}]}')
    sys.exit(main(ap.parse_args().spec))
