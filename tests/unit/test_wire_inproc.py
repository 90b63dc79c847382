"""Host → edge → origin in one process, no sockets: the real client transport, the real edge node and
servicer, the real origin servicer and store, every message through kdn.wire's conversions."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kdn.client import AsyncKdnClient, ClientConfig
from kdn.transport import GrpcEdgeTransport
from kdn.edge.admin import AsyncEdgeClient
from kdn.edge.config import EdgeConfig
from kdn.testing import InProcessEdge
from kdn.edge.upstream import origin_upstream
from kdn.errors import InvalidInput, NotFound, Unauthorized
from kdn.keys import ChunkKey, Namespace
from kdn.kv import split_cache
from kdn.models import load_model
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pbg
from kdn.wire.errors import rpc_errors
from kdn.wire.inproc import InProcessRpcError
from tests.origins import origin_in_process

CHUNK = 32
TOKENS = list(range(5, 5 + 4 * CHUNK))  # 4 full chunks


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", chunk_size=CHUNK)


@pytest.fixture()
def origin(tmp_path, lm):
    srv, inproc = origin_in_process(tmp_path / "origin", lm, chunk_size=CHUNK, tokens={"tok-acme": ["acme"]})
    yield srv, inproc
    srv.close()


def prefill_kv(lm, tokens):
    from transformers import DynamicCache

    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([tokens]), cache=DynamicCache(config=lm.config), use_cache=True)
    return split_cache(out.cache, CHUNK)


def test_host_reuses_through_a_real_edge_from_a_real_origin_without_sockets(lm, origin) -> None:
    srv, origin_rpc = origin
    md = (("authorization", "Bearer tok-acme"),)

    async def main() -> None:
        # the origin prefills the chain (Compute over the in-process channel)
        stub = pbg.OriginServiceStub(origin_rpc.channel())
        r = await stub.Compute(pb.ComputeRequest(fingerprint=bytes(lm.fingerprint), namespace=pb.Namespace(tenant="acme"),
                                                 tokens=TOKENS), metadata=md)
        assert r.computed == 4

        upstream = origin_upstream(EdgeConfig(upstream_token="tok-acme"), address="inproc:origin",
                                   channel=origin_rpc.channel())
        edge = await InProcessEdge(origin=upstream).start()
        transport = GrpcEdgeTransport("inproc:e0", channel=edge.channel())
        async with AsyncKdnClient(ClientConfig(edge="inproc:e0", tenant="acme"), transport=transport) as client:
            got = await client.reuse(TOKENS, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
            await edge.node.prefetcher.drain()  # prefetches the edge queued from next_keys are done
            from_origin = srv.stats().counters["fetches"]
            again = await client.reuse(TOKENS, fingerprint=lm.fingerprint, kv_shape=lm.kv_shape, chunk_size=CHUNK)
        assert (got.available, got.chunks, got.tokens) == (4, 4, 4 * CHUNK)
        assert got.warning is None and got.via == "grpc"
        assert torch.equal(got.kv, torch.cat(prefill_kv(lm, TOKENS), dim=3))  # (L, 2, H, 4*T, D), every bit
        assert 4 <= from_origin and again.chunks == 4
        assert srv.stats().counters["fetches"] == from_origin  # the second time entirely from the edge

        # the admin client over the same channel; a refusal comes back as a kdn.errors exception
        async with AsyncEdgeClient("inproc:e0", channel=edge.channel()) as admin:
            assert (await admin.stats()).node_id == "e0"
            with pytest.raises(NotFound):
                await admin.fetch(ChunkKey(bytes(32)), fingerprint=lm.fingerprint, namespace=Namespace("acme"))
        await edge.stop()

    asyncio.run(main())


def test_origin_refusals_map_through_the_one_table(lm, origin) -> None:
    srv, origin_rpc = origin

    async def main() -> None:
        stub = pbg.OriginServiceStub(origin_rpc.channel())
        req = pb.LookupRequest(fingerprint=bytes(lm.fingerprint), namespace=pb.Namespace(tenant="acme"), keys=[bytes(32)])
        with pytest.raises(Unauthorized), rpc_errors("origin"):
            await stub.Lookup(req)  # no token
        with pytest.raises(InProcessRpcError) as info:
            await stub.Lookup(pb.LookupRequest(namespace=pb.Namespace(tenant="")), metadata=(("authorization", "Bearer tok-acme"),))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # an empty tenant is named nowhere
        with pytest.raises(InvalidInput), rpc_errors("origin"):
            await stub.Lookup(pb.LookupRequest(namespace=pb.Namespace(tenant="")))
        assert srv.stats().counters["errors"] == 3

    asyncio.run(main())


def test_empty_tenant_is_refused_at_the_edge_too() -> None:
    async def main() -> None:
        edge = await InProcessEdge().start()
        stub = pbg.EdgeServiceStub(edge.channel())
        with pytest.raises(InvalidInput), rpc_errors("e0"):
            await stub.Lookup(pb.LookupRequest(namespace=pb.Namespace(tenant=""), keys=[bytes(32)]))
        await edge.stop()

    asyncio.run(main())


def test_put_then_fetch_round_trips_bytes(lm) -> None:
    from kdn.testing import make_chain

    chain = make_chain(2, shape=(2, 2, 64, 32))  # ~32 KiB per artifact

    async def main() -> None:
        edge = await InProcessEdge(stream_piece_bytes=4096).start()  # many frames per artifact
        transport = GrpcEdgeTransport("inproc:e0", channel=edge.channel())
        assert await transport.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=5)
        assert await transport.lookup(chain.fingerprint, chain.namespace, chain.keys, timeout=5) == 1
        pieces = [bytes(p) async for p, via in transport.fetch(chain.spec(0), timeout=5)]
        assert b"".join(pieces) == chain.blobs[0] and len(pieces) > 1
        await edge.stop()

    asyncio.run(main())
