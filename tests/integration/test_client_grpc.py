"""The client through a real EdgeServer and OriginServer on loopback gRPC, and `kdn query` faults.

One origin (in-process, no Ray) and one edge per module; every test uses its own tenant so the
edge's cache state of one test does not leak into another.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from kdn.client import ClientConfig, KdnClient
from kdn.integrations.transformers import generate
from kdn.keys import PIECE_TOKENS, Namespace
from kdn.models import load_model
from kdn.ops.query import main as query_main
from tests.children import reap

pytestmark = pytest.mark.integration

CHUNK = 64
DOC = "".join(f"Clause {i}: the tenant keeps the premises in good repair and pays rent monthly. " for i in range(12))
QUESTION = " Question: who keeps the premises in repair? Answer:"


class LoopThread:
    """An asyncio loop on a thread, for async servers in synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", chunk_size=CHUNK)


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    from kdn.origin.config import OriginConfig
    from kdn.origin.server import OriginServer

    cfg = OriginConfig(store_dir=str(tmp_path_factory.mktemp("origin")), models=["tiny"], listen="127.0.0.1:0",
                       codecs=["raw"], chunk_size=CHUNK, verify_on_start="none", fsync=False)
    srv = OriginServer(cfg)
    srv.start()
    yield srv
    srv.stop()


def start_edge(loop: LoopThread, origin_address: str | None, tmp: Path, node_id: str = "e1", **extra):
    from kdn.edge.config import EdgeConfig
    from kdn.edge.server import EdgeServer

    cfg = EdgeConfig(node_id=node_id, listen="127.0.0.1:0", origin=origin_address, memory_bytes=256 << 20,
                     disk_dir=str(tmp / node_id), fetch_deadline_s=10.0, **extra)
    server = EdgeServer(cfg)
    loop.run(server.start())
    return server


@pytest.fixture(scope="module")
def edge(origin, tmp_path_factory):
    loop = LoopThread()
    server = start_edge(loop, origin.address, tmp_path_factory.mktemp("edge"))
    yield server
    loop.run(server.stop())
    loop.close()


def ingest(origin, tenant: str, text: str = DOC) -> int:
    return len(origin.ingest_text(text, namespace=Namespace(tenant), doc_id=f"doc-{tenant}"))


@pytest.mark.parametrize("via", ["shm", "bulk", "grpc"])
def test_reuse_through_edge_from_origin_equals_recompute(lm, origin, edge, via):
    tenant = f"t-{via}"
    n = ingest(origin, tenant)
    assert n == len(DOC) // CHUNK
    paths = {"shm": dict(shm="on"), "bulk": dict(shm="off", bulk=True), "grpc": dict(shm="off", bulk=False)}
    with KdnClient(ClientConfig(edge=edge.address, tenant=tenant, **paths[via])) as client:
        got = generate(lm, DOC + QUESTION, client=client, max_new_tokens=8)
        again = generate(lm, DOC + QUESTION, client=client, max_new_tokens=8)  # reused buffers/mappings
    base = generate(lm, DOC + QUESTION, max_new_tokens=8)
    tail = len(lm.tokenizer.encode_prompt(DOC)) % CHUNK // PIECE_TOKENS * PIECE_TOKENS  # the document's tail pieces
    assert got.reused_tokens == n * CHUNK + tail and not got.warnings
    assert got.via == via and again.via == via
    assert got.tokens == base.tokens and again.tokens == base.tokens


def test_write_back_makes_the_next_request_a_hit(lm, edge):
    text = "A document the origin never saw. " * 10
    with KdnClient(ClientConfig(edge=edge.address, tenant="wb")) as client:
        first = generate(lm, text + "Q1", client=client, max_new_tokens=4)
        client.flush(10)
        assert client.counters["written_back"] == len(text + "Q1") // CHUNK
        second = generate(lm, text + "Q2", client=client, max_new_tokens=4)
    assert first.reused_tokens == 0 and second.reused_tokens == (len(text) // CHUNK) * CHUNK
    assert second.tokens == generate(lm, text + "Q2", max_new_tokens=4).tokens


def test_another_tenant_gets_nothing(lm, origin, edge):
    ingest(origin, "owner")
    with KdnClient(ClientConfig(edge=edge.address, tenant="intruder", write_back=False)) as client:
        got = generate(lm, DOC + QUESTION, client=client, max_new_tokens=2)
    assert got.reused_tokens == 0 and not got.warnings


def _query(capsys, *args: str) -> dict:
    code = query_main([*args, "--model", "tiny", "--chunk-size", str(CHUNK), "--max-new-tokens", "8",
                       "--compare", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    return out


def test_kdn_query_hit(origin, edge, tmp_path, capsys):
    ingest(origin, "q")
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    out = _query(capsys, "--edge", edge.address, "--tenant", "q", "--prompt-file", str(doc), "--prompt", QUESTION)
    whole = len(DOC) // CHUNK * CHUNK + len(DOC) % CHUNK // PIECE_TOKENS * PIECE_TOKENS  # chunks, then tail pieces
    assert out["reused_tokens"] == whole and out["outputs_match"] and not out["warnings"]
    assert set(out["timings"]) >= {"lookup_s", "fetch_s", "decode_s", "prefill_s", "first_token_s", "ttft_s"}


def test_kdn_query_with_the_edge_killed(origin, tmp_path, capsys):
    loop = LoopThread()
    server = start_edge(loop, origin.address, tmp_path, node_id="doomed")
    address = server.address
    loop.run(server.stop(grace=0))
    loop.close()
    out = _query(capsys, "--edge", address, "--prompt", DOC + QUESTION, "--timeout", "2")
    assert out["outputs_match"] and out["reused_tokens"] == 0
    assert len(out["warnings"]) == 1 and "Unavailable" in out["warnings"][0]


def test_kdn_query_with_the_origin_stopped(lm, tmp_path, capsys):
    from kdn.origin.config import OriginConfig
    from kdn.origin.server import OriginServer

    cfg = OriginConfig(store_dir=str(tmp_path / "o"), models=["tiny"], listen="127.0.0.1:0", codecs=["raw"],
                       chunk_size=CHUNK, verify_on_start="none", fsync=False)
    origin = OriginServer(cfg)
    origin.start()
    loop = LoopThread()
    server = start_edge(loop, origin.address, tmp_path, node_id="lonely")
    try:
        ingest(origin, "os")
        held = "Held text. " * 20
        ingest(origin, "os", held)
        # the edge pulls `held` once, then the origin goes away
        with KdnClient(ClientConfig(edge=server.address, tenant="os", write_back=False)) as client:
            assert generate(lm, held + "?", client=client, max_new_tokens=1).reused_tokens > 0
        origin.stop()
        kept = _query(capsys, "--edge", server.address, "--tenant", "os", "--prompt", held + "?", "--no-write-back")
        assert kept["outputs_match"] and kept["reused_tokens"] == (len(held) // CHUNK) * CHUNK
        lost = _query(capsys, "--edge", server.address, "--tenant", "os", "--prompt", DOC + QUESTION,
                      "--no-write-back", "--timeout", "3")
        assert lost["outputs_match"] and lost["reused_tokens"] == 0
    finally:
        loop.run(server.stop(grace=0))
        loop.close()
        origin.stop()


def test_kdn_query_with_a_corrupted_artifact(origin, edge, capsys):
    """An artifact that went bad in the origin store: it is refused before it reaches the model,
    the answer is recomputed past the last good chunk, and the one warning names the chunk."""
    tenant = "corrupt"
    keys = origin.ingest_text(DOC, namespace=Namespace(tenant), doc_id="doc-c")
    # corrupt chunk 1 inside the origin store, before the edge ever saw it
    path = _blob_path(origin, keys[1])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    out = _query(capsys, "--edge", edge.address, "--tenant", tenant, "--prompt", DOC + QUESTION)
    assert out["outputs_match"]
    assert out["reused_tokens"] == CHUNK  # chunk 0 verified and used, chunk 1 refused
    assert len(out["warnings"]) == 1 and "chunk 1" in out["warnings"][0]


def _blob_path(origin, key) -> Path:
    hexkey = bytes(key).hex()
    hits = [p for p in Path(origin.config.store_dir).rglob("*") if p.is_file() and hexkey in p.name]
    assert hits, f"no blob file for {hexkey[:16]} under {origin.config.store_dir}"
    return hits[0]


def test_a_token_for_one_tenant_cannot_read_another_tenants_chunks(lm, tmp_path):
    """With tokens on the edge: bob's token naming alice's tenant is refused; bob still gets the
    right answer (recomputed) and one warning; alice with her token reuses her chunks."""
    from kdn.artifact import encode_artifact
    from kdn.keys import ROOT_KEY
    from kdn.prefill import prefill_chunks

    loop = LoopThread()
    server = start_edge(loop, None, tmp_path, node_id="guarded", tokens={"tok-a": ["alice"], "tok-b": ["bob"]})
    try:
        tokens = lm.tokenizer.encode(DOC)
        with KdnClient(ClientConfig(edge=server.address, tenant="alice", token="tok-a")) as alice:
            keys = alice.keys_for(tokens, lm.fingerprint, CHUNK)
            for i, kv in enumerate(prefill_chunks(lm, tokens)):
                assert alice.put(lm.fingerprint, keys[i], encode_artifact(
                    kv, key=keys[i], parent_key=keys[i - 1] if i else ROOT_KEY, fingerprint=lm.fingerprint,
                    chunk_index=i))
            mine = generate(lm, DOC + QUESTION, client=alice, max_new_tokens=4)
        with KdnClient(ClientConfig(edge=server.address, tenant="alice", token="tok-b")) as bob:
            stolen = generate(lm, DOC + QUESTION, client=bob, max_new_tokens=4)
    finally:
        loop.run(server.stop(grace=0))
        loop.close()
    assert mine.reused_tokens == len(keys) * CHUNK and not mine.warnings
    assert stolen.reused_tokens == 0 and len(stolen.warnings) == 1 and "Unauthorized" in stolen.warnings[0]
    assert stolen.tokens == mine.tokens


def test_edge_process_sigkilled_between_requests(lm, origin, tmp_path, capsys):
    """A real `kdn edge` process, SIGKILLed: a long-lived client and a fresh `kdn query` both
    answer exactly like a recompute and say the edge was unavailable."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ingest(origin, "killed")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kdn.edge.cli import main; sys.exit(main(sys.argv[1:]))",
         "--listen", "127.0.0.1:0", "--node-id", "victim", "--origin", origin.address],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        address = None
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"edge exited with {proc.returncode}")
            if line.startswith("{") and json.loads(line).get("event") == "ready":
                address = json.loads(line)["address"]
        assert address, "edge did not become ready"
        prompt = DOC + QUESTION
        base = generate(lm, prompt, max_new_tokens=6)
        with KdnClient(ClientConfig(edge=address, tenant="killed", fetch_timeout_s=3, lookup_timeout_s=2)) as client:
            hit = generate(lm, prompt, client=client, max_new_tokens=6)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            after = generate(lm, prompt, client=client, max_new_tokens=6)
        assert hit.reused_tokens > 0 and hit.tokens == base.tokens
        assert after.reused_tokens == 0 and after.tokens == base.tokens
        assert len(after.warnings) == 1 and "Unavailable" in after.warnings[0]
        out = _query(capsys, "--edge", address, "--tenant", "killed", "--prompt", prompt, "--timeout", "2")
        assert out["outputs_match"] and out["reused_tokens"] == 0 and "Unavailable" in out["warnings"][0]
    finally:
        reap(proc, 10)
