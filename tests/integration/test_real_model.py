"""The trained model and the engine's tokens, host -> edge -> origin over loopback gRPC.

- A document ingested at the origin as a chat's system message is reused by a chat request that
  carries it (``generate(messages=...)``, ``kdn query --layout system``), with exactly the tokens
  of a full recompute (fp32) and a correct answer.
- A tokenizer that adds a BOS: the origin stores documents under the BOS-led tokens a completion
  request has, so they are reused; a request tokenized without the BOS (what an origin that left
  special tokens out used to store) misses, and the miss is reported loudly and counted, by the
  client and by the edge (``kdn stats``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kdn.client import ClientConfig, KdnClient
from kdn.integrations.model_dir import save_builtin
from kdn.integrations.transformers import generate
from kdn.models import load_model
from kdn.origin.config import OriginConfig
from kdn.origin.server import OriginServer
from kdn.origin.worker import DocumentTask
from kdn.ops.query import main as query_main
from kdn.prompts import document_tokens
from tests.integration.test_client_grpc import LoopThread, start_edge

pytestmark = pytest.mark.integration

SAMPLES = Path(__file__).resolve().parents[2] / "kdn" / "ops" / "samples"
QUESTION = "On which days are bins emptied?"


def _bos_model_dir(path: Path) -> Path:
    """The tiny spec as a model directory whose tokenizer adds ``<s>`` (id 1) to every prompt,
    as Llama 2/3 and Mistral tokenizers do."""
    save_builtin("tiny", path, dtype="float32")
    tj = json.loads((path / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    tj["post_processor"] = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    (path / "tokenizer.json").write_text(json.dumps(tj))
    return path


def _serve(tmp: Path, model: str, chunk: int):
    cfg = OriginConfig(store_dir=str(tmp / "origin"), models=[model], listen="127.0.0.1:0", codecs=["raw"],
                       chunk_size=chunk, verify_on_start="none", fsync=False)
    origin = OriginServer(cfg)
    origin.start()
    loop = LoopThread()
    edge = start_edge(loop, origin.address, tmp, node_id=f"e-{tmp.name}")
    return origin, loop, edge


def _ingest(origin: OriginServer, text: str, layout: str, doc_id: str) -> tuple[list[str], list[str]]:
    """The document's chunk keys and tail piece keys, all stored at the origin."""
    res = origin.compute.ingest(origin.default_fingerprint, DocumentTask(doc_id, text, "h", "default", layout=layout))
    assert res.status == "stored", res
    return list(res.keys), list(res.piece_keys)


def test_a_chat_whose_system_message_was_ingested_is_reused_with_the_same_answer(tmp_path, capsys):
    document = (SAMPLES / "lease_policy.txt").read_text()
    origin, loop, edge = _serve(tmp_path, "smollm2-135m", 256)
    try:
        keys, pieces = _ingest(origin, document, "system", str(SAMPLES / "lease_policy.txt"))
        lm = origin.model()
        stored = document_tokens(lm.tokenizer, document, "system")
        assert len(keys) == len(stored) // 256 >= 4 and len(pieces) == len(stored) % 256 // 32
        whole = 256 * len(keys) + 32 * len(pieces)  # the whole document but < 32 tokens
        messages = [{"role": "system", "content": document}, {"role": "user", "content": QUESTION}]
        base = generate(lm, messages=messages, max_new_tokens=16)
        with KdnClient(ClientConfig(edge=edge.address, write_back=False)) as client:
            hit = generate(lm, messages=messages, client=client, max_new_tokens=16)
        assert hit.reused_tokens == whole and not hit.warnings
        assert hit.prompt_tokens - hit.reused_tokens < 32 + 24  # left: under a piece, and the question
        assert hit.tokens == base.tokens and "tuesday" in (hit.text or "").lower()

        doc = tmp_path / "lease.txt"
        doc.write_text(document)
        rc = query_main(["--edge", edge.address, "--model", "smollm2-135m", "--layout", "system", "--prompt-file",
                         str(doc), "--prompt", QUESTION, "--max-new-tokens", "16", "--compare", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert rc == 0 and out["reused_tokens"] == whole and out["outputs_match"], out
        assert out["tokens"] == base.tokens and out["layout"] == "system" and not out["untrained"]
    finally:
        loop.run(edge.stop())
        loop.close()
        origin.stop()


def test_a_bos_adding_tokenizer_matches_and_a_mismatched_request_is_reported(tmp_path, caplog):
    model = str(_bos_model_dir(tmp_path / "bos-model"))
    text = "".join(f"Clause {i}: the tenant keeps the premises in good repair. " for i in range(12))
    origin, loop, edge = _serve(tmp_path, model, 64)
    try:
        keys, _ = _ingest(origin, text, "text", "clauses.txt")
        lm = load_model(model, chunk_size=64)
        assert lm.tokenizer.encode_prompt(text)[0] == 1  # the engine's prompt starts with the BOS
        base = generate(lm, text + " Who repairs?", max_new_tokens=4)
        with KdnClient(ClientConfig(edge=edge.address, write_back=False)) as client:
            hit = generate(lm, text + " Who repairs?", client=client, max_new_tokens=4)
            assert hit.reused_tokens >= 64 * (len(keys) - 1) > 0 and not hit.warnings
            assert hit.tokens == base.tokens
            # the same text tokenized without its BOS: what a request from another tokenization sends
            bare = lm.tokenizer.encode(text + " Who repairs?")
            with caplog.at_level(logging.WARNING, logger="kdn.client"):
                miss = generate(lm, bare, client=client, max_new_tokens=4)
            assert miss.reused_tokens == 0
            assert any("BOS" in w and "another tokenization" in w for w in miss.warnings), miss.warnings
            assert any("another tokenization" in r.getMessage() for r in caplog.records)
            assert client.counters["tokenization_mismatch"] == 1
        counters = loop.run(edge.node.stats())[0]
        assert counters.get("kdn_edge_tokenization_mismatch_total") == 1, counters
    finally:
        loop.run(edge.stop())
        loop.close()
        origin.stop()
