"""Real faults for the vLLM connector tests: an edge process that can be killed, and a TCP proxy
that kills it, or flips one byte, at a chosen point of the edge -> client byte stream.

The proxy sits between vLLM's connector and the edge (the connector runs with ``shm: off`` so
every artifact byte crosses it). Armed with ``kill_after(n)`` it SIGKILLs the edge process and
drops every connection once ``n`` more bytes went downstream: the edge dies in the middle of a
multi-chunk load. ``flip_at(n)`` XORs the ``n``-th downstream byte: a byte of an artifact in
flight is corrupted (a checksum catches it; a flip in framing breaks the call instead — either
way the load fails mid-way).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


def kdn_command() -> str:
    """The ``kdn`` console script of this interpreter's environment."""
    return str(Path(sys.executable).with_name("kdn"))


class EdgeProc:
    """``kdn edge`` in a child process, on a free loopback port; address from its ready line."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.tmp, self.extra = tmp, extra
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [kdn_command(), "edge", "--listen", "127.0.0.1:0", "--memory-bytes", "512MiB", *self.extra],
            stdout=subprocess.PIPE, text=True, cwd=self.tmp,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the edge prints one JSON "ready" line when it serves
        if not line:
            raise RuntimeError(f"kdn edge exited with {self.proc.wait(10)} before it was ready")
        self.address = json.loads(line)["address"]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class FaultProxy:
    """Loopback TCP proxy to ``edge.address`` with one-shot downstream faults."""

    def __init__(self, edge: EdgeProc) -> None:
        self.edge = edge
        self._mode: tuple[str, int] | None = None
        self._count = 0
        self.fired = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop).result(10)
        self.address = "127.0.0.1:%d" % self._server.sockets[0].getsockname()[1]

    def kill_after(self, n: int) -> None:
        self._arm("kill", n)

    def flip_at(self, n: int) -> None:
        self._arm("flip", n)

    def _arm(self, mode: str, n: int) -> None:
        self.fired.clear()
        self._count = 0
        self._mode = (mode, n)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.edge.address.rsplit(":", 1)
        try:
            up_r, up_w = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_w}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, downstream: bool) -> None:
            try:
                while data := await src.read(65536):
                    if downstream and self._mode is not None:
                        data = self._fault(data)
                        if data is None:
                            return
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_w, False), pump(up_r, writer, True))
        self._writers -= {writer, up_w}

    def _fault(self, data: bytes) -> bytes | None:
        assert self._mode is not None
        mode, n = self._mode
        start, self._count = self._count, self._count + len(data)
        if self._count <= n:
            return data
        self._mode = None
        if mode == "flip":
            b = bytearray(data)
            b[n - start] ^= 0x5A
            self.fired.set()
            return bytes(b)
        self.edge.kill()  # the edge dies mid-stream; the client sees its connections drop
        for w in list(self._writers):
            w.close()
        self.fired.set()
        return None

    def close(self) -> None:
        self._server.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
