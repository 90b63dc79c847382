"""Edge memory under a Put flood: RSS of a real edge process before, during and
after floods of refused Puts, with the default config (1 GiB memory tier, 512 MiB artifact bound,
1 GiB ``put_buffer_bytes``).

- **junk**: 4 concurrent streams x 300 MiB of random bytes, repeated: the edge refuses each at its
  first message (bad magic) and never reads the rest;
- **valid prefix, junk body**: the same with a real artifact header in front, so the prefix check
  passes and the body is buffered until the stream ends or the budget for in-flight Puts
  refuses it; memory is bounded by ``put_buffer_bytes``, and given back after.

    .venv/bin/python benchmarks/put_flood.py [--quick]

Records the run as ``put_flood`` (``benchmarks/_results.py``; goal: RSS after each flood within
100 MB of before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from _results import Record  # noqa: E402

from kdn.testing import make_chain  # noqa: E402
from kdn.proto import kdn_pb2 as pb  # noqa: E402
from kdn.proto import kdn_pb2_grpc as pbg  # noqa: E402
from kdn.wire.channel import grpc_options  # noqa: E402

METHOD = """A real edge process (`kdn edge` with its defaults: 1 GiB memory tier, 512 MiB artifact bound,
1 GiB `put_buffer_bytes`) receives rounds of 4 concurrent Put streams of 300 MiB each, every one of
which it must refuse: random bytes (refused at the first message, bad magic), and a real artifact
header followed by junk (the prefix check passes; the body is refused by its section lengths or
checksums). The edge's RSS is sampled before, during and a second after each flood; the goal is
RSS after within 100 MB of before."""

MiB = 1 << 20


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def spawn(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdn.edge.cli", "--listen", "127.0.0.1:0", "--node-id", "flood", "--no-shm"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=open(os.environ.get("KDN_FLOOD_LOG", os.devnull), "ab"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    return proc, ready["address"]


async def flood(address: str, *, streams: int, mib: int, prefix: bytes, key: bytes, fp: bytes) -> list[str]:
    piece = 4 * MiB - 1024
    junk = os.urandom(piece)

    def messages():  # type: ignore[no-untyped-def]
        header = pb.PutHeader(key=key, fingerprint=fp, namespace=pb.Namespace(tenant="default"), total_size=mib * MiB)
        sent = 0
        first = True
        while sent < mib * MiB:
            data = (prefix or junk) if first else junk[: mib * MiB - sent]  # a valid prefix rides alone
            yield pb.PutChunk(header=header, data=data) if first else pb.PutChunk(data=data)
            first = False
            sent += len(data)

    async with grpc.aio.insecure_channel(address, options=grpc_options(8 * MiB)) as ch:
        stub = pbg.EdgeServiceStub(ch)

        async def one() -> str:
            try:
                await stub.Put(messages(), timeout=120)
                return "OK"
            except grpc.aio.AioRpcError as exc:
                if os.environ.get("KDN_FLOOD_DEBUG"):
                    print(exc.code().name, exc.details(), file=sys.stderr)
                return exc.code().name

        return list(await asyncio.gather(*(one() for _ in range(streams))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print only; record nothing")
    args = ap.parse_args()
    rec = None if args.no_write else Record(__file__, "put_flood", "Edge memory under a Put flood, default config")
    rounds, mib = (2, 100) if args.quick else (5, 300)
    chain = make_chain(1)
    real = chain.blobs[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = spawn(Path(tmp))
        try:
            time.sleep(1.0)
            header_end = 12 + int.from_bytes(real[8:12], "little") + 8  # prefix, header, header check
            for name, prefix in (("junk", b""), ("valid prefix, junk body", real[:header_end])):
                before = rss_mb(proc.pid)
                peak = before
                stop = threading.Event()

                def sample() -> None:
                    nonlocal peak
                    while not stop.is_set():
                        peak = max(peak, rss_mb(proc.pid))
                        time.sleep(0.05)

                t = threading.Thread(target=sample, daemon=True)
                t.start()
                t0 = time.perf_counter()
                codes: dict[str, int] = {}
                for _ in range(rounds):
                    for c in asyncio.run(flood(address, streams=4, mib=mib, prefix=prefix,
                                               key=bytes(chain.keys[0]), fp=bytes(chain.fingerprint))):
                        codes[c] = codes.get(c, 0) + 1
                took = time.perf_counter() - t0
                time.sleep(1.0)
                stop.set()
                t.join()
                after = rss_mb(proc.pid)
                rows.append((name, rounds, mib, before, peak, after, took, codes))
                print(f"{name}: RSS {before:.0f} -> peak {peak:.0f} -> after {after:.0f} MB "
                      f"({rounds} rounds x 4 x {mib} MiB, {took:.1f} s, {codes})", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if rec is not None:
        rec.set_rounds(rounds)
        for name, r, m, b, p, a, took, codes in rows:
            rec.goal(f"RSS after minus before, {name} flood", "≤ 100 MB", median=a - b, unit="MB", digits=0, at_most=100)
        lines = ["| flood | rounds x streams x size | RSS before | peak | after | after - before | statuses |",
                 "|---|---|---|---|---|---|---|"]
        for name, r, m, b, p, a, took, codes in rows:
            lines.append(f"| {name} | {r} x 4 x {m} MiB | {b:.0f} MB | {p:.0f} MB | {a:.0f} MB | "
                         f"{a - b:+.0f} MB | {', '.join(f'{k} {v}' for k, v in sorted(codes.items()))} |")
        rec.markdown(lines)
        rec.save()
    worst = max(a - b for _, _, _, b, _, a, _, _ in rows)
    return 0 if worst <= 100 else 1


if __name__ == "__main__":
    sys.exit(main())
