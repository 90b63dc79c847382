"""Child processes that tests start: leave none behind."""

from __future__ import annotations

import subprocess


def reap(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Kill ``proc`` if it still runs (a test that failed half-way), then wait for it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=timeout)
