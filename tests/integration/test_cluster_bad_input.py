"""`kdn up` refuses bad input with a clear error and leaves nothing half-started."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
