"""`kdn origin` and `kdn ingest` refuse bad input with one clear line and a non-zero exit, never a
traceback or a hang (issue 19 item 8). Runs the real CLI in a subprocess, in-process workers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _kdn(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kdn.ops.cli", *args], capture_output=True, text=True, timeout=timeout)


def _origin(store: Path, *args: str) -> subprocess.CompletedProcess:
    return _kdn("origin", "--model", "tiny", "--workers", "0", "--store", str(store), *args)


def _one_line(r: subprocess.CompletedProcess) -> str:
    """Exit 2, no traceback, and our one line last (gRPC's C core may log its own line before)."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in err, err
    ours = [line for line in err.splitlines() if line.startswith("kdn origin: ")]
    assert len(ours) == 1 and err.splitlines()[-1] == ours[0], err
    return ours[0]


def test_origin_on_a_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _one_line(_origin(tmp_path / "store", "--listen", f"127.0.0.1:{port}"))
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err


def test_origin_with_a_corrupt_manifest(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.sqlite").write_bytes(b"garbage, not sqlite" * 64)
    err = _one_line(_origin(store, "--listen", "127.0.0.1:0"))
    assert "manifest" in err and "move it" in err


def test_origin_with_a_binary_config_file(tmp_path):
    (tmp_path / "origin.yaml").write_bytes(b"\x00\xff\xfe\x01 binary")
    err = _one_line(_origin(tmp_path / "store", "--listen", "127.0.0.1:0", "--config", str(tmp_path / "origin.yaml")))
    assert "not UTF-8" in err


def test_origin_with_a_store_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    err = _one_line(_origin(tmp_path / "afile", "--listen", "127.0.0.1:0"))
    assert "not a directory" in err


def test_a_fifo_named_txt_in_an_ingested_directory_is_skipped_not_waited_on(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("A good document about caches. " * 20)
    os.mkfifo(docs / "pipe.txt")  # nobody ever writes to it: reading it would block forever
    r = _kdn("ingest", str(docs), "--model", "tiny", "--workers", "0", "--store", str(tmp_path / "store"),
             "--codec", "raw", "--no-progress", timeout=90)
    assert r.returncode == 0, r.stderr
    assert "not regular files" in r.stdout and "pipe.txt" in r.stdout and "1 stored" in r.stdout
