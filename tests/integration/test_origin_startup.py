"""`kdn origin` says what it is doing before its ready line (issue 17 item 2): the first line comes
before torch and transformers are imported; stdout holds only the ready line. Real CLI, loopback."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.children import reap

pytestmark = pytest.mark.integration


def test_origin_prints_its_stages_before_the_ready_line(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdn.ops.cli", "origin", "--model", "tiny", "--workers", "0",
         "--store", str(tmp_path / "store"), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready = proc.stdout.readline()  # blocks until the origin is ready (or has exited)
        assert "serving on 127.0.0.1:" in ready, (ready, proc.stderr.read() if proc.poll() is not None else "")
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    finally:
        reap(proc)
    stages = [line for line in err.splitlines() if re.match(r"^origin \[\s*\d+\.\d+s\] ", line)]
    assert "starting: importing torch" in stages[0]
    assert any("loading tiny in this process" in s for s in stages)
    assert any("binding 127.0.0.1:0" in s for s in stages)
    assert out.strip() == ""  # nothing but the ready line on stdout


def _origin_fails(tmp_path, *args: str) -> list[str]:
    """stderr lines of a ``kdn origin`` that cannot start, less its progress lines."""
    r = subprocess.run(
        [sys.executable, "-m", "kdn.ops.cli", "origin", "--model", "tiny", "--workers", "0",
         "--store", str(tmp_path / "store"), *args],
        capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    return [line for line in r.stderr.splitlines() if not re.match(r"^origin \[\s*\d+\.\d+s\] ", line)]


def test_a_busy_port_is_one_line_and_no_grpc_log(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        lines = _origin_fails(tmp_path, "--listen", f"127.0.0.1:{port}")
    assert len(lines) == 1 and lines[0].startswith("kdn origin:"), lines  # gRPC's own E... line came first
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0]


def test_a_missing_tls_certificate_is_named(tmp_path):
    cfg = tmp_path / "origin.yaml"
    cfg.write_text(f"tls_cert: {tmp_path}/no-such-cert.pem\ntls_key: {tmp_path}/no-such-key.pem\n")
    lines = _origin_fails(tmp_path, "--listen", "127.0.0.1:0", "--config", str(cfg))
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert f"{tmp_path}/no-such-cert.pem" in lines[0], lines
