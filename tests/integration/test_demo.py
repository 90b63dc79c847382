"""`kdn demo` end to end (with the `tiny` model so it stays quick): Ray, ingest, origin, edge, table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_demo_json_reports_reuse_and_equal_outputs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kdn.ops.cli", "demo", "--model", "tiny", "--max-new-tokens", "4", "--json"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # exactly one JSON object on stdout; progress went to stderr
    assert "ingesting" in proc.stderr
    assert len(out["queries"]) == 3
    for q in out["queries"]:
        assert {"ttft_recompute_s", "ttft_kdn_s", "reused_tokens", "outputs_match"} <= set(q)
        assert q["outputs_match"] and not q["warnings"]
        assert q["reused_tokens"] >= 256 * (q["prompt_tokens"] // 256 - 1)
    assert out["all_outputs_match"] and out["ingest"]["chunks"] > 0
    assert set(out["load_average"]) == {"start_1min", "end_1min", "cpus"} and out["load_average"]["cpus"] >= 1
