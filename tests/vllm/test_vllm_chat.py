"""``vllm serve`` with the KDN connector and the trained model, through the OpenAI chat endpoint.

A document is ingested at the origin (``kdn ingest --layout system``, not vLLM's own write-back),
an edge pulls from that origin, and a chat request whose system message is the document must
load the origin's chunks (``cached_tokens`` > 0 with the engine's own prefix cache empty) and
answer exactly as vLLM alone does (fp32, greedy). The connector's per-request line must be in
``vllm serve``'s log. One server start (minutes on a 2-core CPU) serves every assertion.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.vllm import require_vllm
from tests.vllm.faults import EdgeProc, kdn_command

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
SAMPLE = Path(__file__).resolve().parents[2] / "kdn" / "ops" / "samples" / "lease_policy.txt"
QUESTION = "On which days are bins emptied?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # vllm serve's engine core is a child of its own
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_vllm()
    from kdn.pretrained import model_dir

    tmp = tmp_path_factory.mktemp("vllm-chat")
    model = model_dir("smollm2-135m")
    store = tmp / "origin"
    ingest = subprocess.run([kdn_command(), "ingest", str(SAMPLE), "--model", "smollm2-135m", "--layout", "system",
                             "--store", str(store), "--codec", "raw", "--workers", "0", "--json"],
                            capture_output=True, text=True, timeout=600, cwd=tmp)
    assert ingest.returncode == 0, ingest.stderr[-3000:]
    summary = json.loads(ingest.stdout)
    assert summary["chunks"] >= 4 and summary["layout"] == "system"
    origin = subprocess.Popen([kdn_command(), "origin", "--store", str(store), "--model", "smollm2-135m",
                               "--listen", "127.0.0.1:0", "--json"], stdout=subprocess.PIPE, text=True, cwd=tmp)
    serve = edge = None
    try:
        assert origin.stdout is not None
        origin_address = json.loads(origin.stdout.readline())["address"]
        edge = EdgeProc(tmp, "--origin", origin_address)
        port = _free_port()
        log_path = tmp / "serve.log"
        ktc = {"kv_connector": "KdnConnector", "kv_connector_module_path": "kdn.integrations.vllm",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"edge": edge.address, "chunk_size": 256}}
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        with log_path.open("w") as log:
            serve = subprocess.Popen(
                [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--dtype", "float32",
                 "--max-model-len", "4096", "--enforce-eager", "--port", str(port), "--host", "127.0.0.1",
                 "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(ktc)],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=env, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while True:
            assert serve.poll() is None, log_path.read_text()[-6000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                assert time.monotonic() < deadline, "vllm serve did not answer /health in 900 s"
                time.sleep(2)
        yield base, str(model), log_path
    finally:
        if serve is not None:
            _stop(serve)
        if edge is not None:
            edge.stop()
        if origin.poll() is None:
            origin.terminate()
            origin.wait(30)


def _chat(base: str, model: str, **extra) -> dict:
    document = SAMPLE.read_text(encoding="utf-8")
    return _post(base + "/v1/chat/completions", {
        "model": model, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "system", "content": document}, {"role": "user", "content": QUESTION}], **extra})


def test_a_chat_whose_system_message_was_ingested_loads_the_origins_chunks_and_answers_as_vllm_alone(served):
    base, model, log_path = served
    # vLLM alone: the connector skips this request, and its own salt keeps vLLM's prefix cache apart
    alone = _chat(base, model, cache_salt="reference-only", kv_transfer_params={"kdn": False})
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] in (0, None)
    with_kdn = _chat(base, model)
    cached = with_kdn["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt = with_kdn["usage"]["prompt_tokens"]
    from transformers import AutoTokenizer

    from kdn.prompts import HFTokenizer, document_tokens

    stored = len(document_tokens(HFTokenizer(AutoTokenizer.from_pretrained(model)), SAMPLE.read_text(), "system"))
    # the whole document from the edge: its chunks, then every tail piece of it, ending inside a
    # vLLM block (128 tokens on a CPU) where the document does
    from kdn.keys import PIECE_TOKENS

    assert cached == stored // PIECE_TOKENS * PIECE_TOKENS > 0, (with_kdn["usage"], stored)
    assert with_kdn["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert "tuesday" in alone["choices"][0]["message"]["content"].lower()
    time.sleep(1)
    log = log_path.read_text(errors="replace")
    line = next((ln for ln in log.splitlines() if "KDN request" in ln and "source: edge" in ln), None)
    assert line is not None, log[-4000:]
    assert f"{prompt} prompt tokens" in line and f"loaded {cached}" in line
