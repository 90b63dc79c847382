"""What `kdn up` / `kdn down` read back from an earlier run: only what still belongs to it.

No Ray and no sockets here; the real up/down/up/down cycle is in
``tests/integration/test_cluster_e2e.py`` and the head's bounded wait in
``tests/integration/test_cluster_bad_input.py``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess

from kdn.ops import cluster
from kdn.ops.cluster import ClusterState


def _state(tmp_path, pid: int, **kw) -> ClusterState:
    return ClusterState(address="", state_dir=str(tmp_path), session_pids=[pid], **kw)


def test_live_session_recorded_with_its_start_time_is_ours(tmp_path):
    pid = os.getpid()
    s = _state(tmp_path, pid, boot_id=cluster._boot_id(), session_starts=[cluster._start_time(pid)])
    assert s.our_sessions() == [pid]


def test_reused_pid_is_not_ours(tmp_path):
    pid = os.getpid()  # alive, but it started at another time than the leader we recorded
    s = _state(tmp_path, pid, boot_id=cluster._boot_id(), session_starts=[cluster._start_time(pid) - 1])
    assert s.our_sessions() == []


def test_pids_from_before_a_reboot_are_not_ours(tmp_path):
    pid = os.getpid()
    s = _state(tmp_path, pid, boot_id="another-boot", session_starts=[cluster._start_time(pid)])
    assert s.our_sessions() == []


def test_dead_leader_still_counts_its_session(tmp_path):
    """A leader that died may have left children in its session; `kdn down` must still stop them."""
    child = subprocess.Popen(["true"])
    child.wait()
    s = _state(tmp_path, child.pid, boot_id=cluster._boot_id(), session_starts=[12345])
    assert s.our_sessions() == [child.pid]


def test_state_file_of_an_older_version_loads(tmp_path):
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"address": "h:1", "state_dir": str(tmp_path), "session_pids": [os.getpid()], "started_head": True,
         "origins": [], "edges": [], "started_unix": 1.0, "field_of_a_newer_version": 1}))
    s = ClusterState.load(tmp_path)
    assert s.session_pids == [os.getpid()] and s.session_starts == [] and s.boot_id == ""
    assert s.our_sessions() == [os.getpid()]  # nothing recorded to check against: trusted as before


def test_head_address_is_this_runs_port_only():
    log = ("Ray runtime started.\n  ray start --address='192.0.2.2:40301'\n"  # an earlier run's head
           "Ray runtime started.\n  ray start --address='192.0.2.2:49631'\n")
    assert cluster._head_address(log, 49631) == "192.0.2.2:49631"
    assert cluster._head_address(log, 12345) is None


def test_auth_token_is_fresh_per_head_and_private(tmp_path):
    cluster._new_ray_auth_token(tmp_path)
    path = tmp_path / "ray_auth_token"
    first = path.read_text()
    cluster._new_ray_auth_token(tmp_path)
    assert path.read_text() != first and len(path.read_text()) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert cluster.ray_auth_env(tmp_path)["RAY_AUTH_TOKEN_PATH"] == str(path)


def test_suggested_commands_name_a_non_default_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    assert cluster._state_dir_flag(tmp_path / "cache" / "cluster") == ""
    assert cluster._state_dir_flag(tmp_path / "my state") == f" --state-dir '{tmp_path / 'my state'}'"


POOL = """
import sys, time
from kdn.edge.config import EdgeConfig
from kdn.edge.shm import ShmPool
from kdn.keys import ChunkKey
c = EdgeConfig()
pool = ShmPool("edge-0", directory=sys.argv[1], max_segments=c.shm_max_segments, max_bytes=c.shm_max_bytes)
for i in range(3):
    pool.publish("acme", ChunkKey(bytes([i]) * 32), b"x" * 4096)
print("ready", flush=True)
time.sleep(600)
"""


def test_down_removes_the_shared_memory_segments_of_the_edges_it_stopped(tmp_path):
    """Issue 17 item 6: a killed edge cannot unlink its segments; `kdn down` does, and only theirs."""
    import subprocess
    import sys

    from kdn.ops.cluster import _boot_id, down
    from tests.children import reap

    shm = tmp_path / "shm"
    shm.mkdir()
    other = shm / "kdn-edge-9-1-0123456789abcdef"  # pid 1's: not a process `kdn up` started
    other.write_bytes(b"y")
    unrelated = shm / "someone-elses-segment"
    unrelated.write_bytes(b"z")
    proc = subprocess.Popen([sys.executable, "-c", POOL, str(shm)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert len(list(shm.glob(f"kdn-edge-0-{proc.pid}-*"))) == 3
        state = ClusterState(address="", state_dir=str(tmp_path), started_head=True, boot_id=_boot_id())
        state.add_session(proc.pid)
        state.save()
        result = down(tmp_path, shm_dir=str(shm))
        assert proc.pid in result["stopped"]
        assert result["shm_segments_removed"] == 3 and result["shm_bytes_freed"] == 3 * 4096
        assert sorted(p.name for p in shm.iterdir()) == sorted([other.name, unrelated.name])
        assert "removed 3 shared-memory segments" in result["message"]
    finally:
        reap(proc)
        proc.stdout.close()


def test_down_removes_the_segments_of_edges_killed_before_their_sessions_were_listed(tmp_path):
    """On a joined cluster `kdn down` kills the edge actors first (ray.kill), so their pids are not
    among the processes it then stops; the pids recorded for the edges in the state still count."""
    import signal
    import subprocess
    import sys

    from kdn.ops.cluster import _boot_id, down
    from tests.children import reap

    shm = tmp_path / "shm"
    shm.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", POOL, str(shm)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGKILL)  # what ray.kill does to the edge's actor process
        proc.wait(timeout=10)
        assert len(list(shm.glob(f"kdn-edge-0-{proc.pid}-*"))) == 3
        state = ClusterState(address="", state_dir=str(tmp_path), started_head=True, boot_id=_boot_id())
        state.edges = [{"node_id": "edge-0", "pid": proc.pid}]
        state.save()
        result = down(tmp_path, shm_dir=str(shm))
        assert result["shm_segments_removed"] == 3 and not list(shm.iterdir())
    finally:
        reap(proc)
        proc.stdout.close()
