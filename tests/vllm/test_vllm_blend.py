"""The store's blend in an unmodified vLLM (``tests/vllm/blend_cases.py``, one engine process).

Documents in an order never seen load the origin's blend variant, and vLLM's greedy answer is the
transformers blend's; the same prompt without the opt-in gets exact KV only (from the edge) and
vLLM's own answer; an opt-in that cannot be honoured (no blend salt, documents the store lacks,
no verdict) is answered exactly as vLLM alone answers, with the connector's warning and the
origin's counter. Marked ``vllm``: runs in CI's third stage (``KDN_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_vllm()
    out = tmp_path_factory.mktemp("vllm-blend") / "cases.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.blend_cases", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    return json.loads(out.read_text())


def test_documents_in_a_new_order_load_the_blend_variant_and_answer_as_the_transformers_blend(run) -> None:
    assert run["fingerprint_equal"]
    c = run["cases"]["blend"]
    assert c["variant_loaded"], c["refused"]
    assert c["cached"] == run["covered"]  # the whole blended region came from the origin's variant
    assert c["tokens"] == run["transformers_blend"]
    assert c["origin"]["blend_computed"] == 1 and c["origin"]["blend_fetches"] >= run["covered"] // 64
    again = run["cases"]["blend_again"]
    assert again["tokens"] == c["tokens"] and again["cached"] == run["covered"]
    assert again["origin"]["blend_cached"] == 1 and again["origin"]["blend_computed"] == 1


def test_a_request_without_the_opt_in_gets_exact_kv_only(run) -> None:
    c = run["cases"]["plain"]
    before = run["cases"]["blend_again"]["origin"]
    assert not c["variant_loaded"] and c["cached"] == run["covered"]  # the edge's exact chain
    assert c["tokens"] == c["reference"]
    assert c["origin"]["blend_fetches"] == before["blend_fetches"]  # nothing fetched from the variant


@pytest.mark.parametrize("name,why", [("no_salt", "cache_salt"), ("unknown_documents", "no_segments"),
                                      ("no_verdict", "no_verdict")])
def test_an_opt_in_that_cannot_be_honoured_is_answered_exactly(run, name, why) -> None:
    c = run["cases"][name]
    assert not c["variant_loaded"] and c["tokens"] == c["reference"]
    assert any(why in line for line in c["refused"]), c["refused"]
    if name != "no_salt":
        assert c["origin"][f"blend_refused_{why}"] == 1
