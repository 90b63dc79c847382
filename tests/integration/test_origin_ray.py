"""The origin on a real local Ray cluster with two origin workers (issue 3's "Must show").

One Ray cluster for the module (``kdn_origin: 4``, 3 logical CPUs: the two prefill workers of the
scenario, plus room for an origin server actor and a compute worker), temp dir, no dashboard, always shut down.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from kdn.artifact import decode_artifact, verify_artifact
from kdn.keys import Namespace, chunk_keys
from kdn.prefill import document_tokens, logits_with_chunks
from tests.stored import document_keys
from kdn.origin.config import OriginConfig
from kdn.origin.ingest import RayExecutor, ingest
from kdn.origin.store import OriginStore
from kdn.origin.worker import spawn_workers
from kdn.procs import start_local_ray

pytestmark = pytest.mark.integration

NS = Namespace("acme", "pepper")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    tmp = tempfile.mkdtemp(prefix="kdnray")  # short: Ray's socket paths must stay under 108 bytes
    start_local_ray(
        num_cpus=3, resources={"kdn_origin": 4}, include_dashboard=False, log_to_driver=False,
        _temp_dir=tmp, configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _mixed_docs_extra(root: Path, n: int) -> Path:
    d = root / "docs"
    for i in range(n):
        (d / f"extra-{i:02d}.md").write_text(f"Document {i}. " + "Chunk keys are chained over the prefix. " * 130)
    return d


def _mixed_docs(root: Path) -> Path:
    d = root / "docs"
    (d / "src").mkdir(parents=True)
    (d / "README.md").write_text("# KDN\n\nA CDN for KV caches: origins, edges, an overlay. " * 25)
    (d / "notes.txt").write_text("Plain notes about reuse and time to first token.\n" * 30)
    (d / "src" / "lib.py").write_text("def area(r: float) -> float:\n    return 3.14159 * r * r\n\n" * 25)
    (d / "src" / "main.c").write_text("int main(void) {\n    return puts(\"kdn\");\n}\n" * 40)
    return d


def _config(store: Path, workers: int = 2) -> OriginConfig:
    return OriginConfig(store_dir=str(store), models=["tiny"], codecs=["raw", "zstd:3"], workers=workers,
                        namespace="acme:pepper", fsync=True)


def _executor(cfg: OriginConfig) -> RayExecutor:
    actors = spawn_workers(cfg, "tiny")  # worker_threads=1, max_restarts as configured
    return RayExecutor(actors, max_attempts=cfg.max_attempts, max_restarts=cfg.max_restarts)


def _assert_store_complete(store_dir: Path, docs: Path, lm, codecs: list[str]) -> int:
    """Every document's host-computed keys are stored in every codec, each blob whole and unique."""
    store = OriginStore(store_dir, verify="none")
    try:
        expected = set()
        for f in sorted(p for p in docs.rglob("*") if p.is_file()):
            keys, pieces = document_keys(lm, f.read_text(), NS)  # the chain, then the tail's pieces
            expected |= {*keys, *pieces}
        rows = store.artifacts()
        assert {r.key for r in rows} == expected
        assert len(rows) == len(expected) * len(codecs)  # one row per (key, codec): nothing duplicated
        blobs = list(store.blobs.scan())
        assert len(blobs) == len(rows)  # no orphan or stray files
        assert not list((store_dir / "blobs").rglob(".*.tmp"))  # no partial file left visible
        for b in blobs:
            verify_artifact(store.blobs.get(b.prefix, b.name))
        return len(expected)
    finally:
        store.close()


@pytest.fixture(scope="module")
def pool(ray_cluster, tmp_path_factory):
    """Two OriginWorker actors on one store, shared by the scenario below (actors cost seconds to start)."""
    root = tmp_path_factory.mktemp("origin-ray")
    cfg = _config(root / "store")
    ex = _executor(cfg)
    yield root, cfg, ex
    ex.close()


def test_two_workers_ingest_keys_match_host_and_logits_match(pool, tiny_model):
    lm = tiny_model
    root, cfg, ex = pool
    docs = _mixed_docs(root)
    assert len(set(ex.pids())) == 2
    s = ingest([docs], cfg, executor=ex)
    assert s.exit_code == 0 and s.count("stored") == 4, s.render()
    assert len({r.worker_pid for r in s.results}) == 2  # both workers did work
    _assert_store_complete(cfg.store_path, docs, lm, cfg.codecs)
    store = OriginStore(cfg.store_path, verify="none")
    try:
        for r in s.results:
            text = Path(r.doc_id).read_text()
            toks = document_tokens(lm, text)
            host = chunk_keys(toks, fingerprint=lm.fingerprint, namespace=NS, chunk_size=lm.chunk_size)
            assert [bytes.fromhex(k) for k in r.keys] == host
            chunks = [decode_artifact(store.get(k, "zstd:3", tenant="acme"), expect_key=k,
                                      expect_fingerprint=lm.fingerprint).kv for k in host]
            n = len(chunks) * lm.chunk_size
            rest = toks[n : n + 12] or [7, 8, 9]
            reused = logits_with_chunks(lm, chunks, rest)  # (R, V)
            with torch.inference_mode():
                fresh = lm.model(input_ids=torch.tensor([toks[:n] + list(rest)])).logits[0, n:]
            torch.testing.assert_close(reused, fresh, rtol=1e-4, atol=1e-4)
    finally:
        store.close()


def test_sigkill_a_worker_during_ingest(pool, tiny_model):
    root, cfg, ex = pool
    docs = _mixed_docs_extra(root, 8)
    pids = ex.pids()
    killed: list[int] = []

    def on_result(r):
        # Documents go out in name order: README.md (already stored: skipped in milliseconds) to
        # one worker, extra-00.md (new, long: a prefill and 40 writes) to the other. When the
        # skip comes back, the other worker is in the middle of extra-00: kill it there.
        if not killed and r.worker_pid in pids and r.status == "skipped":
            victim = next(p for p in pids if p != r.worker_pid)
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    deaths = ex.deaths
    s = ingest([docs], cfg, executor=ex, on_result=on_result)
    assert killed
    assert ex.deaths > deaths, "the kill should have hit a document in flight"
    new_pids = ex.pids()  # Ray restarted the dead worker
    assert killed[0] not in new_pids and len(set(new_pids)) == 2
    assert s.exit_code == 0, s.render()
    assert s.count("stored") == 8 and s.count("skipped") == 4, s.render()  # the first test's 4 are skipped
    assert any(r.attempts > 1 for r in s.results)  # the in-flight document was redone
    _assert_store_complete(cfg.store_path, docs, tiny_model, cfg.codecs)


def test_restarted_origin_serves_everything_over_grpc(pool, tiny_model):
    """A fresh origin process on the same store (self-check on open) serves every artifact."""
    from kdn.proto import kdn_pb2 as pb
    from kdn.proto import kdn_pb2_grpc as pbg
    from kdn.wire.channel import sync_channel
    from kdn.origin.server import OriginServer

    root, cfg, _ = pool
    lm = tiny_model
    srv = OriginServer(cfg.model_copy(update={"workers": 0, "listen": "127.0.0.1:0"}), preloaded=(lm,))
    try:
        assert srv.store.check is not None
        assert srv.store.check.dropped_corrupt == srv.store.check.dropped_missing == 0
        rows = srv.store.artifacts()
        assert rows
        srv.start()
        ch = sync_channel(srv.address)
        stub = pbg.OriginServiceStub(ch)
        for row in rows:
            msgs = stub.Fetch(pb.FetchRequest(fingerprint=bytes(lm.fingerprint), namespace=pb.Namespace(tenant="acme", salt="pepper"),
                                              key=bytes(row.key), codec=row.codec), timeout=30)
            data = b"".join(m.data for m in msgs)
            assert verify_artifact(data, expect_key=row.key).codec == row.codec.split(":")[0]
        ch.close()
    finally:
        srv.stop()


def test_origin_server_on_ray(pool, tiny_model):
    """The origin server as a Ray actor (serves the store), and an origin whose Compute runs on a
    Ray worker (``kdn origin --workers N``)."""
    import ray

    from kdn.proto import kdn_pb2 as pb
    from kdn.proto import kdn_pb2_grpc as pbg
    from kdn.wire.channel import sync_channel
    from kdn.origin.compute import RayCompute
    from kdn.origin.ray_origin import start_origin_actor
    from kdn.origin.server import OriginServer

    root, cfg, _ = pool
    lm = tiny_model
    ns = pb.Namespace(tenant="acme", salt="pepper")
    actor, address = start_origin_actor(cfg.model_copy(update={"listen": "127.0.0.1:0", "verify_on_start": "size"}))
    try:
        text = "Served by an origin living in a Ray actor. " * 20
        keys = ray.get(actor.ingest_text.remote(text, "actor-doc", "acme", "pepper"), timeout=120)
        expect = chunk_keys(document_tokens(lm, text), fingerprint=lm.fingerprint, namespace=NS, chunk_size=lm.chunk_size)
        assert [bytes.fromhex(k) for k in keys] == expect
        ch = sync_channel(address)
        stub = pbg.OriginServiceStub(ch)
        data = b"".join(m.data for m in stub.Fetch(pb.FetchRequest(fingerprint=bytes(lm.fingerprint), namespace=ns,
                                                                   key=bytes(expect[0])), timeout=30))
        assert verify_artifact(data, expect_key=expect[0]).chunk_index == 0
        ch.close()
    finally:
        ray.get(actor.stop.remote(), timeout=60)
        ray.kill(actor)

    rc = RayCompute(cfg.model_copy(update={"workers": 1}))
    srv = OriginServer(cfg.model_copy(update={"listen": "127.0.0.1:0", "verify_on_start": "size"}), compute=rc)
    try:
        srv.start()
        ch = sync_channel(srv.address)
        stub = pbg.OriginServiceStub(ch)
        toks = document_tokens(lm, "Computed on demand by a Ray origin worker. " * 14)
        r = stub.Compute(pb.ComputeRequest(fingerprint=bytes(lm.fingerprint), namespace=ns, tokens=toks), timeout=120)
        assert [bytes(k) for k in r.keys] == chunk_keys(toks, fingerprint=lm.fingerprint, namespace=NS, chunk_size=lm.chunk_size)
        assert r.computed == len(r.keys) > 0
        ch.close()
    finally:
        srv.stop()  # also kills the RayCompute actors
