"""The emphasize hint, host -> edge -> origin in one process (no sockets): the origin computes the
steered variant of an ingested document, the edge fetches and serves it, a client that names the
variant reuses it; bad requests get a clear error (issue 14)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kdn.client import AsyncKdnClient, ClientConfig
from kdn.transport import GrpcEdgeTransport
from kdn.edge.admin import AsyncEdgeClient, hint_request
from kdn.edge.cli import main as edge_main
from kdn.edge.config import EdgeConfig
from kdn.testing import InMemoryUpstream, InProcessEdge
from kdn.edge.upstream import origin_upstream
from kdn.errors import InvalidInput, NotFound
from kdn.keys import ChunkKey, Namespace
from kdn.models import load_model
from kdn.origin.ingest.documents import read_text
from kdn.origin.worker import DocumentTask
from kdn.proto import kdn_pb2 as pb
from kdn.steer import Emphasis
from tests.origins import origin_in_process

CHUNK = 32
TEXT = "".join(f"{'POLICY: keep it warm' if i % 4 == 1 else 'plain filler line'} {i}\n" for i in range(10))
NS = Namespace("acme")
MD_TOKEN = "tok-acme"


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", chunk_size=CHUNK)


@pytest.fixture()
def origin(tmp_path, lm):
    srv, inproc = origin_in_process(tmp_path / "origin", lm, chunk_size=CHUNK, tokens={MD_TOKEN: ["acme"]})
    doc = tmp_path / "policy.md"
    doc.write_text(TEXT)
    d = read_text(doc)
    res = srv.compute.ingest(lm.fingerprint, DocumentTask(str(doc), d.text, d.digest, "acme"))
    assert res.status == "stored" and res.keys
    yield srv, inproc, doc
    srv.close()


def test_emphasize_hint_has_the_origin_compute_and_the_edge_serve_the_variant(lm, origin) -> None:
    srv, origin_rpc, doc = origin
    emphasis = Emphasis("re-read", regex="^POLICY").to_json()

    async def main() -> None:
        upstream = origin_upstream(EdgeConfig(upstream_token=MD_TOKEN), address="inproc:origin",
                                   channel=origin_rpc.channel())
        edge = await InProcessEdge(origin=upstream).start()
        async with AsyncEdgeClient("inproc:e0", token=MD_TOKEN, channel=edge.channel()) as admin:
            resp = await admin.hint(hint_request(pb.HintRequest.EMPHASIZE, fingerprint=lm.fingerprint, namespace=NS,
                                                 document="policy.md", emphasis=emphasis))
            assert resp.steer_variant and resp.affected > 0
            rec = srv.store.document("acme", lm.fingerprint, str(doc) + "#steer")
            assert rec is not None and resp.affected == len(rec.keys)
            assert all(edge.node.store.contains(k, tenant="acme") for k in rec.keys)  # the edge holds them now
            assert srv.stats().counters["emphasized"] == 1
            # asked again: the origin finds it stored, computes nothing, same variant
            again = await admin.hint(hint_request(pb.HintRequest.EMPHASIZE, fingerprint=lm.fingerprint, namespace=NS,
                                                  document="policy.md", emphasis=emphasis))
            assert again.steer_variant == resp.steer_variant
            with pytest.raises(InvalidInput, match="unknown --emphasize method"):
                await admin.hint(hint_request(pb.HintRequest.EMPHASIZE, fingerprint=lm.fingerprint, namespace=NS,
                                              document="policy.md", emphasis='{"method": "boost"}'))
            with pytest.raises(NotFound):
                await admin.hint(hint_request(pb.HintRequest.EMPHASIZE, fingerprint=lm.fingerprint, namespace=NS,
                                              document="nope.md", emphasis=emphasis))
            with pytest.raises(InvalidInput, match="needs a document and an emphasis"):
                await admin.hint(hint_request(pb.HintRequest.EMPHASIZE, fingerprint=lm.fingerprint, namespace=NS,
                                              document="policy.md"))
        tokens = lm.tokenizer.encode(TEXT)
        transport = GrpcEdgeTransport("inproc:e0", channel=edge.channel())
        cfg = ClientConfig(edge="inproc:e0", tenant="acme", token=MD_TOKEN, steer=resp.steer_variant)
        async with AsyncKdnClient(cfg, transport=transport) as client:
            got = await client.reuse(tokens, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert got.chunks == len(rec.keys) and got.warning is None
        doc.write_text(TEXT + "changed\n")  # the origin re-reads the file: a changed one is refused
        async with AsyncEdgeClient("inproc:e0", token=MD_TOKEN, channel=edge.channel()) as admin:
            with pytest.raises(InvalidInput, match="changed since it was ingested"):
                await admin.hint(hint_request(pb.HintRequest.EMPHASIZE, fingerprint=lm.fingerprint, namespace=NS,
                                              document="policy.md", emphasis=Emphasis("re-read").to_json()))
        await edge.stop()

    asyncio.run(main())


def test_an_edge_asks_its_origin_and_fetches_what_it_answers() -> None:
    key = ChunkKey(bytes(range(32)))
    origin = InMemoryUpstream({}, documents={"a.md#steer": [key]})

    async def main() -> None:
        edge = await InProcessEdge(origin=origin).start()
        async with AsyncEdgeClient("inproc:e0", channel=edge.channel()) as admin:
            with pytest.raises(NotFound):  # the fake holds no bytes for the key: the fetch says so
                await admin.hint(hint_request(pb.HintRequest.EMPHASIZE, fingerprint=ChunkKey(bytes(32)),
                                              namespace=Namespace("default"), document="a.md", emphasis="{}"))
        assert origin.emphasized == [("a.md", "{}")]
        await edge.stop()

    asyncio.run(main())


@pytest.mark.parametrize("args, message", [
    (["--method", "boost"], "unknown --emphasize method"),
    (["--method", "key-edit"], "key-edit needs marks"),
    (["--method", "key-edit", "--regex", "(["], "bad --emphasize regex"),
    (["--method", "key-edit", "--spans", "1:5", "--strength", "0"], "must be in (0, 8]"),
    (["--method", "re-read", "--spans", "x"], "bad --emphasize-spans item"),
])
def test_edge_emphasize_refuses_bad_input_before_sending(capsys, args, message) -> None:
    rc = edge_main(["emphasize", "--edge", "127.0.0.1:1", "--document", "a.md", "--fingerprint", "ab" * 32,
                    "--deadline", "0.5", "--json", *args])
    assert rc == 1
    err = json.loads(capsys.readouterr().out)
    assert message in err["message"], err
