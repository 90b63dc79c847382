"""Processes by pid: is one alive, which belong to a session, stop a session's processes.

Used where KDN must act on exactly the processes it started (``kdn down``) or must not touch the
work of a live process (a blob writer's temporary, an edge's shared-memory segment).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["pid_alive", "session_members", "start_local_ray", "stop_sessions"]


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def session_members(sids: set[int]) -> list[int]:
    """Pids of every live process whose session id is in ``sids`` (reads /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # field 6 is the session id; the command name (field 2) may hold spaces, so split after ')'
        fields = stat.rsplit(")", 1)[1].split()
        state, sid = fields[0], int(fields[3])
        if sid in sids and state != "Z":
            out.append(int(entry))
    return out


def stop_sessions(session_pids: list[int], *, grace_s: float = 10.0) -> list[int]:
    """SIGTERM every process in those sessions, then SIGKILL what is left. Returns what was signalled."""
    sids = set(session_pids)
    victims = session_members(sids)
    for pid in victims:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and session_members(sids):
        time.sleep(0.2)
    for pid in session_members(sids):
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and session_members(sids):
        time.sleep(0.1)
    return victims


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def start_local_ray(**init_kwargs: object) -> None:
    """``ray.init`` of a new local node, started once more if it times out starting.

    Ray gives a new node's raylet a fixed 30 s to register (not configurable); on a busy 2-core
    host, with other Ray sessions starting beside it, that is not always enough, and the first
    start fails with "The current node timed out during startup". The half-started node is shut
    down and a second start gets the same 30 s again; any other error, or a second timeout, is
    raised as Ray raised it.
    """
    import ray

    try:
        ray.init(**init_kwargs)  # type: ignore[arg-type]
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()
        ray.init(**init_kwargs)  # type: ignore[arg-type]
