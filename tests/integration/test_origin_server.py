"""The origin over real gRPC on loopback (in-process, no Ray): serving, transcoding, compute on
demand, auth, restart, and bad requests."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kdn.artifact import decode_artifact
from kdn.errors import FingerprintMismatch, InvalidInput, NotFound, Unauthorized
from kdn.keys import Namespace, chunk_keys
from kdn.prefill import document_tokens, logits_with_chunks
from tests.stored import document_keys
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pbg
from kdn.wire.channel import STREAM_PIECE, auth_metadata, sync_channel
from kdn.wire.errors import from_rpc_error
from kdn.origin.config import OriginConfig
from kdn.origin.server import OriginServer
from tests.children import reap

pytestmark = pytest.mark.integration

TEXT = "Origins turn documents into KV artifacts and serve them to edges. " * 20  # 1340 tokens


@pytest.fixture(scope="module")
def origin(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("origin")
    cfg = OriginConfig(
        store_dir=str(d), models=["tiny"], codecs=["raw"], listen="127.0.0.1:0", fsync=False,
        tokens={"tok-a": ["acme"], "tok-b": ["beta"], "tok-ops": ["*"]},
    )
    srv = OriginServer(cfg, preloaded=(tiny_model,))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(origin):
    ch = sync_channel(origin.address)
    yield pbg.OriginServiceStub(ch)
    ch.close()


def _call(fn, *args, token="tok-a", **kw):
    try:
        return fn(*args, metadata=auth_metadata(token), timeout=30, **kw)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from exc


def _fetch(stub, fp, key, *, token="tok-a", tenant="acme", codec="", lossless=False):
    try:
        msgs = list(stub.Fetch(pb.FetchRequest(fingerprint=bytes(fp), namespace=pb.Namespace(tenant=tenant), key=bytes(key),
                                              codec=codec, require_lossless=lossless), metadata=auth_metadata(token), timeout=30))
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from exc
    return msgs


def test_health_serving(origin):
    ch = sync_channel(origin.address)
    h = health_pb2_grpc.HealthStub(ch)
    for name in ("", "kdn.v1.OriginService"):
        assert h.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    ch.close()


def test_ingested_text_is_looked_up_and_fetched(origin, stub, tiny_model):
    lm = tiny_model
    ns = Namespace("acme")
    keys = origin.ingest_text(TEXT, namespace=ns, doc_id="doc-1")
    host_keys = chunk_keys(document_tokens(lm, TEXT), fingerprint=lm.fingerprint, namespace=ns, chunk_size=lm.chunk_size)
    assert keys == host_keys and len(keys) == 5
    r = _call(stub.Lookup, pb.LookupRequest(fingerprint=bytes(lm.fingerprint), namespace=pb.Namespace(tenant="acme"),
                                            keys=[bytes(k) for k in keys] + [b"\x00" * 32]))
    assert r.available == 5 and all(l.tier == "origin" for l in r.locations)
    msgs = _fetch(stub, lm.fingerprint, keys[2])
    data = b"".join(m.data for m in msgs)
    assert msgs[0].total_size == len(data) and msgs[0].source == "origin"
    assert all(len(m.data) <= STREAM_PIECE for m in msgs)
    art = decode_artifact(data, expect_key=keys[2], expect_fingerprint=lm.fingerprint)
    assert art.header.chunk_index == 2 and art.header.codec == "raw"
    doc = _call(stub.Document, pb.DocumentRequest(namespace=pb.Namespace(tenant="acme"), document="doc-1"))
    chain, pieces = document_keys(lm, TEXT, ns)  # a document's keys: its chain, then its tail's pieces
    assert [bytes(k) for k in doc.keys] == [bytes(k) for k in (*keys, *pieces)] and chain == keys


def test_fetch_transcodes_and_caches(origin, stub, tiny_model):
    lm = tiny_model
    keys = origin.ingest_text(TEXT, namespace=Namespace("acme"), doc_id="doc-1")
    before = origin.stats().counters.get("transcodes", 0)
    raw = decode_artifact(b"".join(m.data for m in _fetch(stub, lm.fingerprint, keys[0], codec="raw")))
    z = decode_artifact(b"".join(m.data for m in _fetch(stub, lm.fingerprint, keys[0], codec="zstd:3")))
    assert z.header.codec == "zstd" and z.header.codec_level == "3"
    assert z.kv.equal(raw.kv)  # lossless transcode: bit-identical KV
    assert origin.store.artifact(keys[0], "zstd:3") is not None  # cached
    _fetch(stub, lm.fingerprint, keys[0], codec="zstd:3")
    assert origin.stats().counters["transcodes"] == before + 1
    q = decode_artifact(b"".join(m.data for m in _fetch(stub, lm.fingerprint, keys[0], codec="int8")))
    assert q.header.lossy
    from kdn.errors import LossyRefused

    with pytest.raises(LossyRefused):
        _fetch(stub, lm.fingerprint, keys[0], codec="int8", lossless=True)


def test_compute_on_demand_stores_a_chain_that_reproduces_logits(origin, stub, tiny_model):
    lm = tiny_model
    text = "Compute on demand: an edge asks for a chain nobody ingested. " * 15
    toks = document_tokens(lm, text)
    r = _call(stub.Compute, pb.ComputeRequest(fingerprint=bytes(lm.fingerprint), namespace=pb.Namespace(tenant="acme"), tokens=toks))
    n = len(toks) // lm.chunk_size
    assert (r.computed, r.already_stored, len(r.keys)) == (n, 0, n)
    assert [bytes(k) for k in r.keys] == chunk_keys(toks, fingerprint=lm.fingerprint, namespace=Namespace("acme"), chunk_size=lm.chunk_size)
    chunks = [decode_artifact(b"".join(m.data for m in _fetch(stub, lm.fingerprint, k))).kv for k in r.keys]
    import torch

    rest = toks[n * lm.chunk_size :][:16]
    reused = logits_with_chunks(lm, chunks, rest)
    with torch.inference_mode():
        fresh = lm.model(input_ids=torch.tensor([toks[: n * lm.chunk_size + len(rest)]])).logits[0, n * lm.chunk_size :]
    torch.testing.assert_close(reused, fresh, rtol=1e-4, atol=1e-4)
    again = _call(stub.Compute, pb.ComputeRequest(fingerprint=bytes(lm.fingerprint), namespace=pb.Namespace(tenant="acme"), tokens=toks))
    assert (again.computed, again.already_stored) == (0, n)


def test_bad_requests_get_clear_statuses(stub, tiny_model):
    lm = tiny_model
    ns = pb.Namespace(tenant="acme")
    with pytest.raises(FingerprintMismatch, match="does not serve"):
        _call(stub.Compute, pb.ComputeRequest(fingerprint=b"\x07" * 32, namespace=ns, tokens=[5] * 300))
    with pytest.raises(InvalidInput, match="fingerprint"):
        _call(stub.Compute, pb.ComputeRequest(fingerprint=b"short", namespace=ns, tokens=[5] * 300))
    with pytest.raises(InvalidInput, match="token ids"):
        _call(stub.Compute, pb.ComputeRequest(fingerprint=bytes(lm.fingerprint), namespace=ns, tokens=[10**6] * 300))
    with pytest.raises(InvalidInput, match="codec"):
        _call(stub.Compute, pb.ComputeRequest(fingerprint=bytes(lm.fingerprint), namespace=ns, tokens=[5] * 300, codec="nope"))
    with pytest.raises(InvalidInput, match="chunk key"):
        _fetch(stub, lm.fingerprint, b"abc")
    with pytest.raises(NotFound):
        _fetch(stub, lm.fingerprint, b"\x01" * 32)
    with pytest.raises(NotFound):
        _call(stub.Document, pb.DocumentRequest(namespace=ns, document="never-ingested"))


def test_tenants_are_isolated(origin, stub, tiny_model):
    lm = tiny_model
    keys = origin.ingest_text(TEXT, namespace=Namespace("acme"), doc_id="doc-1")
    with pytest.raises(Unauthorized):
        _fetch(stub, lm.fingerprint, keys[0], token=None)
    with pytest.raises(Unauthorized):
        _fetch(stub, lm.fingerprint, keys[0], token="wrong")
    with pytest.raises(Unauthorized):
        _fetch(stub, lm.fingerprint, keys[0], token="tok-b", tenant="acme")  # beta's token, acme's namespace
    with pytest.raises(NotFound):
        _fetch(stub, lm.fingerprint, keys[0], token="tok-b", tenant="beta")  # acme's key under beta: absent
    r = _call(stub.Lookup, pb.LookupRequest(fingerprint=bytes(lm.fingerprint), namespace=pb.Namespace(tenant="beta"),
                                            keys=[bytes(k) for k in keys]), token="tok-b")
    assert r.available == 0
    assert _fetch(stub, lm.fingerprint, keys[0], token="tok-ops")  # wildcard grant


def test_restart_serves_everything_and_drops_a_corrupted_blob(tmp_path, tiny_model):
    lm = tiny_model
    cfg = OriginConfig(store_dir=str(tmp_path), models=["tiny"], codecs=["raw", "zstd:3"], listen="127.0.0.1:0")
    srv = OriginServer(cfg, preloaded=(lm,))
    srv.start()
    keys = srv.ingest_text(TEXT, namespace=Namespace("default"), doc_id="d")
    srv.stop()
    victim = next(p for p in (tmp_path / "blobs").rglob(f"{bytes(keys[1]).hex()}.raw"))
    raw = bytearray(victim.read_bytes())
    raw[200] ^= 0xFF
    victim.write_bytes(bytes(raw))
    srv2 = OriginServer(cfg, preloaded=(lm,))
    assert srv2.store.check is not None and srv2.store.check.dropped_corrupt == 1
    srv2.start()
    try:
        ch = sync_channel(srv2.address)
        stub2 = pbg.OriginServiceStub(ch)
        for k in keys:  # every key still served: keys[1] from its zstd copy
            data = b"".join(m.data for m in _fetch(stub2, lm.fingerprint, k, tenant="default", token=None))
            assert decode_artifact(data, expect_key=k).header.key == bytes(k)
        ch.close()
    finally:
        srv2.stop()


def test_kdn_origin_command_serves_until_sigterm(tmp_path):
    """`kdn origin` as a process: prints one JSON ready line, serves health, exits 0 on SIGTERM."""
    import json
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "kdn.ops.cli", "origin", "--model", "tiny", "--store", str(tmp_path), "--listen", "127.0.0.1:0",
         "--codec", "raw", "--token", "tok=acme", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()  # blocks until ready (or the process dies: empty line)
        assert line, proc.stderr.read()
        ready = json.loads(line)
        assert ready["event"] == "ready" and ready["port"] > 0
        ch = sync_channel(ready["address"])
        h = health_pb2_grpc.HealthStub(ch)
        assert h.Check(health_pb2.HealthCheckRequest(service="kdn.v1.OriginService"), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        stub = pbg.OriginServiceStub(ch)
        fp = bytes.fromhex(next(iter(ready["models"])))
        r = _call(stub.Compute, pb.ComputeRequest(fingerprint=fp, namespace=pb.Namespace(tenant="acme"), tokens=[9] * 600),
                  token="tok")
        assert r.computed == 2
        with pytest.raises(Unauthorized):
            _call(stub.Compute, pb.ComputeRequest(fingerprint=fp, namespace=pb.Namespace(tenant="acme"), tokens=[9] * 600),
                  token=None)
        ch.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)


def test_an_origin_over_blobs_in_an_unknown_codec_starts_and_answers_not_found(tmp_path, tiny_model):
    """Issue 19 item 9: a store holding a newer version's blobs (a codec this version does not
    know) starts; Lookup does not offer them and Fetch answers NOT_FOUND, never INTERNAL."""
    from kdn.origin.store import OriginStore, _blob_name
    from tests.reframe import frame, split

    ns = Namespace("acme")
    cfg = OriginConfig(store_dir=str(tmp_path), models=["tiny"], codecs=["raw"], listen="127.0.0.1:0", fsync=False,
                       tokens={"tok-a": ["acme"]}, verify_on_start="full")
    with OriginServer(cfg, preloaded=(tiny_model,)) as srv:
        keys = srv.ingest_text(TEXT, namespace=ns, doc_id="doc-1")
    store = OriginStore(tmp_path, fsync=False, verify="none")
    newer = {}
    for k in keys[:2]:  # the newer version re-wrote the first two chunks in its codec and dropped raw
        _, header, payloads = split(store.get(k, "raw", tenant="acme"))
        header.codec = "zstd-next"
        newer[k] = frame(header, payloads)
        store.blobs.put("acme", _blob_name(k, "zstd-next"), newer[k])
        store.delete(k, "raw")
    store._execute("INSERT INTO artifacts VALUES (?,?,?,?,?,?,?,?,?)",
                   (bytes(keys[0]), "zstd-next", "acme", bytes(tiny_model.fingerprint), len(newer[keys[0]]), 256, 0, 0, 0.0))
    store.close()  # keys[0]: blob and row; keys[1]: a blob only
    with OriginServer(cfg, preloaded=(tiny_model,)) as srv:
        assert srv.store.check is not None and srv.store.check.unknown_codec == 2
        ch = sync_channel(srv.address)
        stub = pbg.OriginServiceStub(ch)
        r = _call(stub.Lookup, pb.LookupRequest(fingerprint=bytes(tiny_model.fingerprint), namespace=pb.Namespace(tenant="acme"),
                                                keys=[bytes(k) for k in keys]))
        assert r.available == 0  # the chain's first chunk is not servable here any more
        for k in keys[:2]:
            with pytest.raises(NotFound):
                _fetch(stub, tiny_model.fingerprint, k)
        assert decode_artifact(b"".join(m.data for m in _fetch(stub, tiny_model.fingerprint, keys[2]))).header.key == bytes(keys[2])
        ch.close()


def test_a_document_is_found_by_the_path_it_was_ingested_as(origin, stub, tiny_model):
    """Issue 17 item 1: ids are absolute paths; `docs/manual.md` (as ingested) names one."""
    ns = pb.Namespace(tenant="acme")
    fp = bytes(tiny_model.fingerprint)
    keys = origin.ingest_text(TEXT, namespace=Namespace("acme"), doc_id="/home/u/docs/manual.md")
    origin.ingest_text(TEXT + " v2", namespace=Namespace("acme"), doc_id="/home/u/old/guide.md")
    origin.ingest_text(TEXT + " v3", namespace=Namespace("acme"), doc_id="/home/u/new/guide.md")
    pieces = document_keys(tiny_model, TEXT, Namespace("acme"))[1]
    for name in ("docs/manual.md", "./docs/manual.md", "manual.md", "/home/u/docs/manual.md"):
        got = _call(stub.Document, pb.DocumentRequest(namespace=ns, fingerprint=fp, document=name))
        assert [bytes(k) for k in got.keys] == [bytes(k) for k in (*keys, *pieces)], name
    with pytest.raises(NotFound, match="ambiguous.*/home/u/new/guide.md.*/home/u/old/guide.md"):
        _call(stub.Document, pb.DocumentRequest(namespace=ns, fingerprint=fp, document="guide.md"))
    with pytest.raises(NotFound, match="with that name: /home/u/docs/manual.md"):
        _call(stub.Document, pb.DocumentRequest(namespace=ns, fingerprint=fp, document="other/manual.md"))
    with pytest.raises(NotFound, match="name a document by its ingest path"):
        _call(stub.Document, pb.DocumentRequest(namespace=ns, fingerprint=fp, document="nothing.md"))
    with pytest.raises(NotFound, match="no document is ingested"):  # another tenant sees none of acme's
        _call(stub.Document, pb.DocumentRequest(namespace=pb.Namespace(tenant="beta"), fingerprint=fp,
                                                document="docs/manual.md"), token="tok-b")
