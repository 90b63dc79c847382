"""`kdn up` refuses bad input with a clear error and leaves nothing half-started."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _up(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kdn.ops.cli", "up", "--state-dir", str(state), *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, "KDN_CACHE": str(state)},
    )


def _ours(state: Path) -> list[str]:
    """Processes whose command line mentions this state dir (a half-started cluster would)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(state) in cmd and "pytest" not in cmd:
                out.append(cmd)
    return out


def _assert_nothing_left(state: Path) -> None:
    assert not (state / "cluster.json").exists()
    assert _ours(state) == []


def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _up(tmp_path, "--head-port", str(port))
    assert r.returncode == 1
    assert f"head port {port} is already in use" in r.stderr
    _assert_nothing_left(tmp_path)


def test_address_that_does_not_answer(tmp_path):
    with socket.socket() as s:  # a loopback port that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _up(tmp_path, "--address", f"127.0.0.1:{port}")
    assert r.returncode == 1
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in r.stderr
    _assert_nothing_left(tmp_path)


def test_zero_edges(tmp_path):
    r = _up(tmp_path, "--edge-nodes", "0")
    assert r.returncode == 1
    assert "edge_nodes" in r.stderr and "greater than or equal to 1" in r.stderr
    _assert_nothing_left(tmp_path)


def test_config_file_with_unknown_key(tmp_path):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("edge_nodes: 2\nedge_nodez: 3\n")
    r = _up(tmp_path, "--config", str(cfg))
    assert r.returncode == 1
    assert "edge_nodez" in r.stderr and "Extra inputs are not permitted" in r.stderr
    _assert_nothing_left(tmp_path)


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _dead_port() -> int:
    with socket.socket() as s:  # a loopback port that nobody listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_head_address_comes_from_this_run_and_must_answer(tmp_path):
    """An earlier run's line in the head's log (whose address still answers here) is not taken;
    the address on this run's port is, once something answers there."""
    from kdn.ops.cluster import _wait_for_head

    with _listening() as old, _listening() as new:
        log = tmp_path / "head.log"
        log.write_text(f"  ray start --address='127.0.0.1:{old.getsockname()[1]}'\n"
                       f"  ray start --address='127.0.0.1:{new.getsockname()[1]}'\n")
        head = subprocess.Popen(["sleep", "60"])
        try:
            assert _wait_for_head(head, log, new.getsockname()[1], timeout_s=30) == f"127.0.0.1:{new.getsockname()[1]}"
        finally:
            head.kill()
            head.wait()


def test_head_that_does_not_answer_fails_within_its_bound(tmp_path):
    from kdn.ops.cluster import _wait_for_head
    from kdn.errors import Unavailable

    port = _dead_port()
    log = tmp_path / "head.log"
    log.write_text(f"  ray start --address='127.0.0.1:{port}'\n")
    head = subprocess.Popen(["sleep", "60"])
    start = time.monotonic()
    try:
        with pytest.raises(Unavailable) as err:
            _wait_for_head(head, log, port, timeout_s=2)
    finally:
        head.kill()
        head.wait()
    assert time.monotonic() - start < 2 + 10  # its bound, and slack for a loaded machine
    assert str(err.value) == f"the Ray head's GCS did not answer at 127.0.0.1:{port} within 2s (log: {log})"

    log.write_text("")  # a head that never prints its address
    head = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(Unavailable, match=f"did not answer on port {port} .*within 1s"):
            _wait_for_head(head, log, port, timeout_s=1)
    finally:
        head.kill()
        head.wait()

    log.write_text("some start-up output\nError: the head could not bind its port\n")
    head = subprocess.Popen(["true"])
    head.wait()
    with pytest.raises(Unavailable) as err:
        _wait_for_head(head, log, port, timeout_s=30)
    assert "\n" not in str(err.value)
    assert "the Ray head exited with code 0" in str(err.value)
    assert "last line: Error: the head could not bind its port" in str(err.value)


def test_down_of_a_joined_cluster_without_its_token_is_one_line(tmp_path):
    """Issue 17 item 5: `kdn down` from a shell without the Ray token says so in one line (it
    printed ~20 lines of InvalidAuthToken over 20 s) and still stops its own nodes."""
    from kdn.ops import cluster
    from kdn.procs import stop_sessions
    from kdn.wire.channel import free_port

    head_dir, joined = tmp_path / "head", tmp_path / "joined"
    head_dir.mkdir()
    joined.mkdir()
    cluster._new_ray_auth_token(head_dir)
    port = free_port()
    log = head_dir / "head.log"
    head = cluster._start_node(["--head", f"--port={port}", "--include-dashboard=false", "--node-ip-address=127.0.0.1",
                                f"--ray-client-server-port={free_port()}", f"--temp-dir={cluster.ray_temp_dir(head_dir)}",
                                "--num-cpus=1"], log, cluster.ray_auth_env(head_dir))
    try:
        address = cluster._wait_for_head(head, log, port, 120)
        # what `kdn up --address` recorded, in a shell that had no token exported
        cluster.ClusterState(address=address, state_dir=str(joined), edges=[{"node_id": "edge-9"}],
                             boot_id=cluster._boot_id()).save()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        r = subprocess.run([sys.executable, "-m", "kdn.ops.cli", "down", "--state-dir", str(joined)],
                           capture_output=True, text=True, timeout=120, env=env)
    finally:
        stop_sessions([head.pid])
        shutil.rmtree(cluster.ray_temp_dir(head_dir), ignore_errors=True)
    assert r.returncode == 0
    assert r.stderr.count("\n") == 1 and "InvalidAuthToken" not in r.stderr, r.stderr
    assert "refused this driver without an auth token" in r.stderr and "edge-9 not removed" in r.stderr
    assert r.stdout.strip() == "stopped 0 processes"
    assert not (joined / "cluster.json").exists()
