"""A steered variant in an unmodified vLLM (``tests/vllm/steer_cases.py``, one engine process).

Haystacks ingested with ``kdn ingest --emphasize key-edit`` at an origin reach vLLM through an
edge: a request naming the variant (``kdn_steer`` and a ``cache_salt`` containing it) loads the
steered chain and answers as the transformers path's steered hit (fp32, greedy); the same request
without the name gets the plain chain and vLLM's own answer. A steered request without the salt,
or for another tenant, gets no steered KV (it answers as vLLM alone). Marked ``vllm``: runs in CI's
third stage (``KDN_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_vllm()
    out = tmp_path_factory.mktemp("vllm-steer") / "cases.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.steer_cases", str(out), "--haystacks", "2",
                           "--length", "1024"], cwd=REPO, env=env, capture_output=True, text=True, timeout=2300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    return json.loads(out.read_text())


def test_vllm_answers_a_steered_request_as_the_transformers_steered_hit(run) -> None:
    chunk = run["chunk"]
    for p in run["prompts"]:
        full = p["stored"] // chunk * chunk
        # the steered chain came from the edge, its tail pieces too: as much reused as a plain hit
        assert p["hf_steered_reused"] == p["hf_plain_reused"] >= full and not p["hf_steered_warnings"], p
        assert p["vllm_steered_cached"] == p["vllm_plain_cached"] >= full, p
        assert p["vllm_steered"] == p["hf_steered"], p
        assert p["vllm_plain"] == p["hf_plain"] and p["vllm_alone"] == p["hf_alone"], p
    # the variant changes what the model reads: somewhere the steered answer differs from the plain one
    assert any(p["hf_steered"] != p["hf_plain"] for p in run["prompts"]), run["prompts"]


def test_a_steered_request_without_its_salt_or_for_another_tenant_gets_no_steered_kv(run) -> None:
    first = run["prompts"][0]
    for case in ("no_salt", "other_tenant"):
        c = run["bad"][case]
        assert c["tokens"] == first["vllm_alone"], (case, c)
        assert c["cached"] == 0, (case, c)
