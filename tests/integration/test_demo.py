"""`kdn demo` end to end: Ray, ingest, origin, edge, table — with the trained default model (its
answers must be right and identical with and without reuse) and with a random-init one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_demo_with_the_trained_model_answers_right_and_the_same_with_reuse(tmp_path):
    """What a user sees first: real documents as chat system messages, real questions, answers that
    state the documents' facts, the same tokens through the edge as by recompute."""
    proc = subprocess.run([sys.executable, "-m", "kdn.ops.cli", "demo", "--json"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["model"] == "smollm2-135m" and not out["untrained"] and out["layout"] == "system"
    assert len(out["queries"]) == 3
    for q in out["queries"]:
        assert q["outputs_match"] and not q["warnings"], q
        assert q["correct"] is True, (q["question"], q["text"])
        assert q["reused_tokens"] >= 256 * (q["prompt_tokens"] // 256 - 1)


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
    assert out["all_outputs_match"] and out["ingest"]["chunks"] > 0 and out["layout"] == "text"
    assert set(out["load_average"]) == {"start_1min", "end_1min", "cpus"} and out["load_average"]["cpus"] >= 1
