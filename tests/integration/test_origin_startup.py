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
