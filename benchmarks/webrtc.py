"""WebRTC between edges behind NAT: setup time, throughput vs plain TCP on one link.

Run as root from the repo root: ``python benchmarks/webrtc.py`` (about 2 minutes). It builds the
NAT lab of :mod:`kdn.simulator.natlab` twice:

1. **shaped**: natA's LAN side limited to 50 Mbit/s by ``tbf`` (every byte into site A crosses
   it). Site B's process answers WebRTC data-channel Fetches (:mod:`kdn.wire.rtc`, the edges'
   transport, 60 KiB messages, back-pressure on ``bufferedAmount``) of a random 16 MiB artifact;
   site A's process dials it (signalling through a ``SignalService`` on the public segment) and
   times fresh connection setups (offer to open channel) and fetches. The baseline: plain TCP
   from a server on the public segment to site A, across the same shaped link, same bytes.
2. **unshaped** (veth speed): the same, to find the CPU ceiling of the pure-Python data channel.

``--relay`` adds a third lab: the shaped link with direct UDP between the sites blocked and a
TURN server (coturn on the public segment) in both ends' ICE configuration; site A dials as an
edge does (every candidate, and a relay-only attempt beside it after ``rtc_relay_after_s``,
1.5 s), so its setup time is what an edge meets; a connection that does not come up is reported
as such.

The artifact is a KV container (random fp16 KV, ``kdn.testing.make_chain``, raw codec). In
every lab site A fetches it twice over: as stored (the wire's own rate) and with the edges' link
codec (``--link-codec``, default ``zstd:1``, the edge default ``rtc_link_codec``): site B
transcodes each fetch on a worker thread as an edge does, site A verifies and restores the raw
container; that row's MB/s is raw container bytes delivered per second, transcoding included,
against plain TCP moving the raw container. Random KV is the conservative case (it compresses
1.18x; a trained model's fp16 KV 1.27x, bf16 1.61x, ``benchmarks/codecs.py``).
Each figure: median of ``--repeats`` runs with the range, load average before and after.
Records the run as ``webrtc`` (``benchmarks/_results.py``) and writes ``benchmarks/results/webrtc.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZE = 16 << 20  # KV bytes of the artifact: (L, H, T, D) = (16, 8, 256, 128) fp16 ...
SHAPE = (16, 8, 256, 128)  # ... in a container a few hundred bytes longer
SIGNAL_PORT = 50999
TCP_PORT = 5201
TURN_SECRET = "bench-turn-secret"

METHOD = """Two sites behind masquerading NATs in network namespaces (`kdn.simulator.natlab`). Site B
answers WebRTC data-channel Fetches (`kdn.wire.rtc`, the edges' transport) of a 16 MiB KV container
(random fp16, raw, the conservative case for compression); site A dials it through a
`SignalService` on the public segment and times fresh connection setups and fetches, once as stored
and once in the edges' lossless link codec (site B transcodes per fetch, site A verifies and
restores the raw container; MB/s in raw bytes delivered, transcoding included). The baseline of
the same run is plain TCP from the public segment to site A across the same link. Labs: natA's LAN
side shaped to 50 Mbit/s by `tbf`; unshaped (the CPU ceiling of the pure-Python data channel);
and with `--relay`, the shaped link with direct UDP between the sites blocked and a TURN server
(coturn), dialled as an edge dials."""


# -- children (run inside the namespaces) -------------------------------------------------------


def child_signal() -> None:
    import grpc

    from kdn.wire.auth import TokenAuth
    from kdn.wire.service import add_servicer
    from kdn.wire.signal import SignalBoard, SignalServicer

    async def main() -> None:
        server = grpc.aio.server()
        add_servicer(server, SignalServicer(SignalBoard(), TokenAuth()), "SignalService")
        server.add_insecure_port(f"0.0.0.0:{SIGNAL_PORT}")
        await server.start()
        print(json.dumps({"event": "ready"}), flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def _ice(relay: bool) -> list:
    from kdn.simulator.natlab import PUBLIC_IP, TURN_PORT, TURN_USER
    from kdn.wire.rtc import IceServer

    return [IceServer((f"stun:{PUBLIC_IP}:{TURN_PORT}",)),
            IceServer((f"turn:{PUBLIC_IP}:{TURN_PORT}?transport=udp",), TURN_USER, TURN_SECRET)] if relay else \
        [IceServer((f"stun:{PUBLIC_IP}:{TURN_PORT}",))]


def _container() -> bytes:
    from kdn.testing import make_chain

    return make_chain(1, shape=SHAPE, seed=18).blobs[0]


def child_serve(relay: str, link_codec: str) -> None:
    from kdn.artifact import transcode
    from kdn.simulator.natlab import PUBLIC_IP
    from kdn.proto import kdn_pb2 as pb
    from kdn.wire.errors import status_for, status_value
    from kdn.wire.rtc import RtcEndpoint
    from kdn.wire.signal import SignalClient

    blob = _container()
    codec = link_codec

    class Handler:
        """What an edge's handler does with these requests (kdn.edge.rtc.EdgeRtcHandler)."""

        async def lookup(self, request, token):
            return pb.LookupResponse(available=0)

        async def fetch(self, request, token, *, forwarded, link_codec=False):
            if link_codec and codec:
                return await asyncio.to_thread(transcode, blob, codec), "memory"
            return blob, "memory"

        def refuse(self, rpc, exc):
            code, message = status_for(exc)
            return status_value(code), message

    async def main() -> None:
        sig = SignalClient(f"{PUBLIC_IP}:{SIGNAL_PORT}")
        await sig.announce("b", "b", ttl_s=600)
        # as an edge: the session id says when the dialler wants relay candidates only
        ep = RtcEndpoint("b", sig, ice_servers=_ice(relay == "1"), handler=Handler())
        ep.start()
        print(json.dumps({"event": "ready"}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def child_dial(relay: str, repeats: str, link: str) -> None:
    from kdn.artifact import read_header, transcode
    from kdn.simulator.natlab import PUBLIC_IP
    from kdn.proto import kdn_pb2 as pb
    from kdn.wire.rtc import RtcEndpoint
    from kdn.wire.signal import SignalClient

    size = len(_container())

    async def main() -> dict:
        sig = SignalClient(f"{PUBLIC_IP}:{SIGNAL_PORT}")
        await sig.announce("a", "a", ttl_s=600)
        # as an edge dials (kdn.wire.rtc.RtcEndpoint._dial): every candidate, and with TURN
        # configured a relay-only attempt beside it after relay_after_s; the first channel wins
        ep = RtcEndpoint("a", sig, ice_servers=_ice(relay == "1"), connect_timeout_s=20)
        ep.start()
        setups, paths, rates = [], [], []
        req = pb.FetchRequest(key=b"k", namespace=pb.Namespace(tenant="t"))
        for _ in range(int(repeats)):
            client = await ep._dial("b")  # a fresh connection each time: setup is what is timed
            setups.append(client.setup_s)
            paths.append(client.path)
            cpu0, t0 = time.process_time(), time.perf_counter()
            data, _ = await client.fetch(req, token=None, timeout_s=120, limit=2 * size, link_codec=link == "1")
            wire = len(data)
            if read_header(data).codec != "raw":  # what an edge does (RtcPeerUpstream.fetch)
                data = await asyncio.to_thread(transcode, data, "raw")
            dt = time.perf_counter() - t0
            assert len(data) == size
            rates.append({"MBps": size / dt / 1e6, "cpu_s": time.process_time() - cpu0, "s": dt, "wire": wire})
            await client.close()
        await ep.close()
        return {"setup_s": setups, "paths": paths, "fetch": rates}

    print(json.dumps(asyncio.run(main())), flush=True)


def child_tcpserve() -> None:
    blob = _container()
    srv = socket.create_server(("0.0.0.0", TCP_PORT))
    print(json.dumps({"event": "ready"}), flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.recv(8)
            conn.sendall(blob)


def child_tcpget(repeats: str) -> None:
    from kdn.simulator.natlab import PUBLIC_IP

    size = len(_container())
    out = []
    for _ in range(int(repeats)):
        t0 = time.perf_counter()
        with socket.create_connection((PUBLIC_IP, TCP_PORT)) as s:
            s.sendall(b"g" * 8)
            got = 0
            while got < size:
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                got += len(chunk)
        dt = time.perf_counter() - t0
        assert got == size
        out.append({"MBps": size / dt / 1e6, "s": dt})
    print(json.dumps(out), flush=True)


# -- driver -------------------------------------------------------------------------------------


def _wait_ready(p: subprocess.Popen, what: str) -> None:
    line = p.stdout.readline()
    if '"ready"' not in line:
        raise RuntimeError(f"{what} did not start: {line!r}")


def _run(lab, role: str, *args: str, timeout: float = 600) -> object:
    r = subprocess.run(["ip", "netns", "exec", lab.ns(role), sys.executable, __file__, "child", *args],
                       capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"{role} {args}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_lab(rate_mbit: float | None, repeats: int, relay: bool, workdir: Path, link_codec: str) -> dict:
    """One lab; site A dials as stored and, with ``link_codec``, in the link codec (same lab,
    same serving process: the request's flag decides)."""
    from kdn.simulator.natlab import NatLab

    lab = NatLab(rate_mbit=rate_mbit, block_direct=relay, prefix=f"kb{os.getpid() % 10000}")
    try:
        lab.build()
        lab.start_turn(TURN_SECRET, workdir)
        for role, args in (("pub", ["signal"]), ("pub", ["tcpserve"]),
                           ("siteB", ["serve", "1" if relay else "0", link_codec])):
            p = lab.spawn(role, [sys.executable, __file__, "child", *args], log=workdir / f"{role}-{args[0]}.err")
            _wait_ready(p, f"{role} {args[0]}")
        sender = p  # `ip netns exec` execs: this pid is the answering (sending) Python process
        tcp = _run(lab, "siteA", "tcpget", str(repeats))
        out = {"tcp": tcp}
        for name, link in (("rtc", "0"), ("rtc_link", "1"))[: 2 if link_codec else 1]:
            cpu0, t0 = _cpu_s(sender.pid), time.perf_counter()
            try:
                rtc = _run(lab, "siteA", "dial", "1" if relay else "0", str(repeats), link)
                # the sender's CPU over the whole dial run (setups included) per second of it
                rtc["sender_cpu"] = (_cpu_s(sender.pid) - cpu0) / (time.perf_counter() - t0)
            except RuntimeError as exc:
                rtc = {"error": str(exc).splitlines()[-1][:200]}
            out[name] = rtc
        return out
    finally:
        lab.close()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _goal(res: dict | None, which: str = "rtc") -> str:
    """MET / NOT MET for one shaped link: the median WebRTC rate against 0.8x the median TCP rate."""
    if not res or which not in res or "error" in res[which]:
        return "not measured (see its row)"
    ratio = statistics.median([x["MBps"] for x in res[which]["fetch"]]) / statistics.median([x["MBps"] for x in res["tcp"]])
    return f"{ratio:.2f}x: {'MET' if ratio >= 0.8 else 'NOT MET'}"


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}–{max(xs):.3g})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate-mbit", type=float, default=50.0)
    ap.add_argument("--relay", action="store_true", help="also try the relayed (TURN) path")
    ap.add_argument("--link-codec", default="zstd:1",
                    help="lossless codec for the second fetch in each lab ('' = as stored only)")
    ap.add_argument("--no-record", action="store_true", help="print only; record nothing")
    args = ap.parse_args()
    from _results import Record

    rec = None if args.no_record else Record(__file__, "webrtc", "WebRTC between edges behind NAT")
    from kdn.simulator.natlab import available

    why = available()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"kdn-webrtc-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    load0 = open("/proc/loadavg").read().split()[:3]
    codec = args.link_codec
    results = {
        "shaped": run_lab(args.rate_mbit, args.repeats, False, work, codec),
        "unshaped": run_lab(None, args.repeats, False, work, codec),
    }
    if args.relay:
        results["shaped relayed"] = run_lab(args.rate_mbit, args.repeats, True, work, codec)
    load1 = open("/proc/loadavg").read().split()[:3]

    rows = []
    for name, r in results.items():
        tcp = [x["MBps"] for x in r["tcp"]]
        for which, label in (("rtc", name), ("rtc_link", f"{name}, {codec} on the link")):
            if which not in r:
                continue
            rtc = r[which]
            if "error" in rtc:
                rows.append(f"| {label} | — | — | {_med(tcp)} | — | no connection: {rtc['error']} |")
                continue
            mbps = [x["MBps"] for x in rtc["fetch"]]
            ratio = [a / statistics.median(tcp) for a in mbps]
            cpu = [x["cpu_s"] / x["s"] for x in rtc["fetch"]]
            wire = statistics.median(x["wire"] for x in rtc["fetch"])
            rows.append(f"| {label} | {_med([s * 1000 for s in rtc['setup_s']])} | {_med(mbps)} | {_med(tcp)} | "
                        f"{_med(ratio)} | {', '.join(sorted(set(rtc['paths'])))}; {wire / 2**20:.1f} MiB on the wire; "
                        f"receiver CPU {_med(cpu)} cores, sender {rtc['sender_cpu']:.2f} cores (whole run) |")
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = "\n".join([
        f"\n## WebRTC between edges behind NAT ({stamp})\n",
        f"Command: `python benchmarks/webrtc.py{' --relay' if args.relay else ''}` (root; network namespaces)  ",
        f"Two sites behind masquerading NATs (kdn.simulator.natlab), a {SIZE >> 20} MiB KV container (random fp16, raw) per fetch; "
        f"rows 'on the link': site B transcodes it to {codec or '-'} per fetch, site A verifies and restores it raw, MB/s in "
        "raw container bytes, transcoding included; "
        f"median (range) of {args.repeats}; shaped = natA's LAN side tbf {args.rate_mbit:g} Mbit/s, which every byte "
        f"into site A crosses (WebRTC from site B, TCP from the public segment). Load average {' '.join(load0)} "
        f"before, {' '.join(load1)} after, 2 CPUs shared.\n",
        "| link | setup (ms) | WebRTC MB/s | plain TCP MB/s | WebRTC / TCP | path |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"goal (WebRTC >= 0.8x TCP on the {args.rate_mbit:g} Mbit/s link): "
        + "; ".join(f"{label}{suffix} {_goal(results.get(key), which)}"
                    for label, key in (("direct", "shaped"), ("relayed", "shaped relayed")) if key in results
                    for which, suffix in (("rtc", ", as stored"), ("rtc_link", f", {codec} on the link"))
                    if which in results[key]),
        "",
    ])
    print(text)
    (work / "results.json").write_text(json.dumps(results))
    try:
        _plot(results, REPO / "benchmarks" / "results" / "webrtc.png")
        text += "Plot: `benchmarks/results/webrtc.png`.\n"
    except Exception as exc:  # noqa: BLE001 - a plot is a convenience
        print(f"no plot: {exc}", file=sys.stderr)
    if rec is not None:
        rec.set_rounds(args.repeats)
        for label, key in (("direct", "shaped"), ("relayed (TURN)", "shaped relayed")):
            for which, suffix in (("rtc", "as stored"), ("rtc_link", f"{codec} on the link")):
                r = results.get(key)
                what = f"WebRTC vs plain TCP, {args.rate_mbit:g} Mbit/s link, {label}, {suffix}"
                if not r or which not in r:
                    continue
                if "error" in r[which]:
                    rec.goal(what, "≥ 0.8x", met=False)
                    rec.note(f"{what}: no connection ({r[which]['error']})")
                    continue
                tcp = statistics.median([x["MBps"] for x in r["tcp"]])
                rec.goal(what, "≥ 0.8x", [x["MBps"] / tcp for x in r[which]["fetch"]], at_least=0.8, digits=3)
        rec.markdown(line for line in text.splitlines()  # the goal line is recorded above
                     if not line.startswith(("## WebRTC", "Command: ", "goal (", "Plot: ")))
        if (REPO / "benchmarks" / "results" / "webrtc.png").is_file():
            rec.plot(REPO / "benchmarks" / "results" / "webrtc.png")
        rec.save()
    return 0


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rtc, tcp = [], [], []
    for name, r in results.items():
        for which, label in (("rtc", name), ("rtc_link", f"{name}\n+link codec")):
            if which not in r or "error" in r[which]:
                continue
            names.append(label)
            rtc.append(statistics.median([x["MBps"] for x in r[which]["fetch"]]))
            tcp.append(statistics.median([x["MBps"] for x in r["tcp"]]))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], rtc, 0.4, label="WebRTC data channel")
    ax.bar([x + 0.2 for x in xs], tcp, 0.4, label="plain TCP")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("MB/s (median)")
    ax.set_yscale("log")
    ax.set_title("16 MiB of KV across a NAT: WebRTC (as stored, link codec) vs TCP")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        cmd, *rest = sys.argv[2:]
        {"signal": child_signal, "serve": child_serve, "dial": child_dial, "tcpserve": child_tcpserve,
         "tcpget": child_tcpget}[cmd](*rest)
    else:
        sys.exit(main())
