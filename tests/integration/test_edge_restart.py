"""A real edge process: acknowledged Puts held in memory survive SIGTERM + restart (issue 19: 0/300)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from kdn.edge.admin import AsyncEdgeClient
from kdn.testing import make_chain
from tests.children import ready_line, reap

REPO = Path(__file__).resolve().parents[2]


def _spawn(disk: Path) -> tuple[subprocess.Popen[bytes], str]:
    args = [sys.executable, "-m", "kdn.edge.cli", "--listen", "127.0.0.1:0", "--node-id", "r",
            "--disk-dir", str(disk), "--disk-bytes", "64M", "--memory-bytes", "32M"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, ready_line(proc, "edge")["address"]

def test_sigterm_then_restart_keeps_every_acknowledged_put(tmp_path: Path) -> None:
    chain = make_chain(300, seed=3)

    async def put_all(address: str) -> int:
        async with AsyncEdgeClient(address, deadline_s=10.0) as c:
            return sum([await c.put(b, key=k, fingerprint=chain.fingerprint, namespace=chain.namespace)
                        for k, b in zip(chain.keys, chain.blobs)])

    async def held(address: str) -> int:
        async with AsyncEdgeClient(address, deadline_s=10.0) as c:
            n = 0
            for k, b in zip(chain.keys, chain.blobs):
                r = await c.lookup([k], fingerprint=chain.fingerprint, namespace=chain.namespace, local_only=True)
                if r.available and r.locations[0].tier == "disk":
                    n += await c.fetch(k, fingerprint=chain.fingerprint, namespace=chain.namespace) == b
            return n

    proc, address = _spawn(tmp_path / "disk")
    try:
        assert asyncio.run(put_all(address)) == 300  # all acknowledged, all in the memory tier
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        reap(proc)
    proc, address = _spawn(tmp_path / "disk")
    try:
        assert asyncio.run(held(address)) == 300  # 300/300 back, from disk, byte for byte
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            reap(proc)
