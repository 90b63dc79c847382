"""A real ``kdn edge`` process that cannot start says why in one line (issue 19): no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _edge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kdn.edge.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    err = r.stderr.strip()
    assert r.returncode != 0 and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("kdn edge:"), err
    return err


def test_port_in_use_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _one_line(_edge("--listen", f"127.0.0.1:{port}"))
    assert f"127.0.0.1:{port}" in err and "in use" in err.lower()


def test_tls_key_that_is_not_the_certificates_is_one_line(tmp_path: Path) -> None:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "a.key", "-out", "a.pem", "-subj", "/CN=a", "-days", "1")
    openssl("req", "-x509", *ec, "-keyout", "b.key", "-out", "b.pem", "-subj", "/CN=b", "-days", "1")
    err = _one_line(_edge("--listen", "127.0.0.1:0", "--tls-cert", str(tmp_path / "a.pem"),
                          "--tls-key", str(tmp_path / "b.key")))
    assert "does not match" in err


def test_a_missing_tls_certificate_is_named(tmp_path: Path) -> None:
    err = _one_line(_edge("--listen", "127.0.0.1:0", "--tls-cert", str(tmp_path / "gone.pem"),
                          "--tls-key", str(tmp_path / "gone.key")))
    assert str(tmp_path / "gone.pem") in err and "No such file" in err
