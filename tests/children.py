"""Child processes that tests start: leave none behind."""

from __future__ import annotations

import subprocess


def dead_pid() -> int:
    """The pid of a child that has exited and been reaped: what a killed writer's temporary names.
    (A fixed number may be a live process of this machine, whose temporary is rightly kept.)"""
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


def reap(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Kill ``proc`` if it still runs (a test that failed half-way), then wait for it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=timeout)


def ready_line(proc: subprocess.Popen, what: str, timeout: float = 60.0) -> dict:
    """The JSON object on ``proc``'s first stdout line (its "ready" event), read within ``timeout``
    seconds; when none comes, ``proc`` is reaped and ``TimeoutError`` names ``what`` and its exit
    status. Reads the raw descriptor, so ``proc.stdout`` may be text or bytes."""
    import json
    import os
    import selectors
    import time

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    end = time.monotonic() + timeout
    line = b""
    try:
        while time.monotonic() < end and not line.endswith(b"\n"):
            if not sel.select(timeout=max(0.0, end - time.monotonic())):
                break
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            line += chunk
    finally:
        sel.close()
    if not line.endswith(b"\n"):
        reap(proc)
        raise TimeoutError(f"{what} not ready within {timeout:g}s (rc={proc.poll()})")
    return json.loads(line.splitlines()[0])
