"""The bulk listener's bounds, on loopback: what a hostile or broken client can hold, and for how long.

- a Put that declares 512 MiB and sends nothing holds neither the Put budget nor the memory it
  declared, and goes when it stops moving; another tenant's Puts go through meanwhile;
- one tenant's ``OpenBulk`` calls never evict another tenant's ticket, and a client whose ticket
  the edge forgot renews it once and keeps fetching over bulk (refused again: gRPC);
- idle connections with no hello, lying lengths and readers that never read take no thread for
  long and no slot another client needs; one token cannot take every connection.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any

import pytest

from kdn import errors as e
from kdn.artifact import ArtifactReader
from kdn.transport import GrpcEdgeTransport
from kdn.edge.config import EdgeConfig
from kdn.edge.server import EdgeServer
from kdn.testing import Chain, make_chain
from kdn.keys import Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.wire import bulk as wb

pytestmark = pytest.mark.integration

TIMEOUT = 10.0
TOKENS = {"tok-a": ["tenant-a"], "tok-b": ["tenant-b"]}


def edge_config(**kw: Any) -> EdgeConfig:
    base: dict[str, Any] = dict(node_id="bounds", listen="127.0.0.1:0", memory_bytes=256 << 20, shm=False,
                                tokens=TOKENS, bulk_timeout_s=1.0, bulk_idle_s=2.0)
    return EdgeConfig(**{**base, **kw})


def chain_of(tenant: str, seed: int, n: int = 1, shape: tuple[int, ...] = (4, 4, 64, 64)) -> Chain:
    return make_chain(n, seed=seed, shape=shape, namespace=Namespace(tenant))


async def fetch_via(t: GrpcEdgeTransport, chain: Chain, i: int = 0) -> str:
    reader = ArtifactReader(expect_fingerprint=chain.fingerprint, expect_key=chain.keys[i], decode=False)
    via = ""
    async for piece, via in t.fetch(chain.spec(i), timeout=TIMEOUT):
        reader.feed(piece)
    reader.finish()
    return via


async def hello(port: int, ticket: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """A connection that presented ``ticket``; the hello answer's status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(wb.HELLO.pack(wb.MAGIC, wb.VERSION, ticket))
    head = await asyncio.wait_for(reader.readexactly(wb.ANSWER.size), TIMEOUT)
    status, _, tlen, _ = wb.ANSWER.unpack(head)
    await reader.readexactly(tlen)
    return reader, writer, status


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


async def until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_a_put_that_declares_much_and_sends_nothing_holds_no_budget_and_goes() -> None:
    a = chain_of("tenant-a", 1)

    async def main() -> None:
        async with EdgeServer(edge_config()) as srv:
            assert srv.bulk is not None
            rss0 = rss_mib()
            liars = []
            for seed in (11, 12):  # two headers declaring 512 MiB each, then silence
                b = chain_of("tenant-b", seed)
                raw = pb.PutHeader(fingerprint=bytes(b.fingerprint), namespace=pb.Namespace(tenant="tenant-b"),
                                   key=bytes(b.keys[0]), total_size=512 << 20).SerializeToString()
                reader, writer, status = await hello(srv.bulk.port, srv.bulk.grant("tok-b"))
                assert status == 0
                writer.write(wb.REQUEST.pack(wb.PUT, len(raw)) + raw)
                go = await asyncio.wait_for(reader.readexactly(wb.ANSWER.size), TIMEOUT)
                assert wb.ANSWER.unpack(go)[0] == 0  # the go-ahead: the header was fine
                liars.append((reader, writer))
            await asyncio.sleep(0.2)
            # what they hold: at most one first step each, not what they declared
            assert srv.put_budget.used <= 2 << 20, srv.put_budget.used
            assert rss_mib() - rss0 < 256, (rss0, rss_mib())
            # another tenant's Puts, over bulk and over gRPC, go through meanwhile
            for bulk in (True, False):
                t = GrpcEdgeTransport(srv.address, token="tok-a", bulk=bulk)
                try:
                    assert await t.put(a.fingerprint, a.namespace, a.keys[0], a.blobs[0], timeout=TIMEOUT)
                finally:
                    await t.close()
            # silent past bulk_timeout_s: closed by the edge, and everything they held is back
            for reader, _writer in liars:
                assert await asyncio.wait_for(reader.read(), 5) == b""
            assert await until(lambda: srv.put_budget.used == 0 and not srv.bulk._threads)
            for _reader, writer in liars:
                writer.close()

    asyncio.run(main())


def test_one_tenants_open_bulk_calls_never_evict_another_tenants_ticket() -> None:
    a = chain_of("tenant-a", 2)

    async def main() -> None:
        async with EdgeServer(edge_config()) as srv:
            assert srv.bulk is not None
            t = GrpcEdgeTransport(srv.address, token="tok-a")
            try:
                assert await t.put(a.fingerprint, a.namespace, a.keys[0], a.blobs[0], timeout=TIMEOUT)
                assert t.bulk_path.client is not None
                ticket_a = t.bulk_path.client.ticket
                flood = GrpcEdgeTransport(srv.address, token="tok-b")
                try:  # 4,200 OpenBulk calls by tenant B, as a client makes them
                    from kdn.proto import kdn_pb2_grpc as pbg

                    stub = pbg.EdgeServiceStub(flood._channel)
                    md = (("authorization", "Bearer tok-b"),)
                    for _ in range(42):
                        await asyncio.gather(*(stub.OpenBulk(pb.BulkRequest(), timeout=TIMEOUT, metadata=md)
                                               for _ in range(100)))
                finally:
                    await flood.close()
                _r, writer, status = await hello(srv.bulk.port, ticket_a)  # A's ticket still opens a connection
                writer.close()
                assert status == 0
                t.bulk_path.client.close()  # only new connections present the ticket
                assert await fetch_via(t, a) == "bulk" and t.bulk_path.client.renewed == 0
            finally:
                await t.close()

    asyncio.run(main())


def test_a_ticket_the_edge_forgot_is_renewed_once_and_refused_again_means_grpc() -> None:
    a = chain_of("tenant-a", 3)

    async def main() -> None:
        async with EdgeServer(edge_config()) as srv:
            assert srv.bulk is not None
            t = GrpcEdgeTransport(srv.address, token="tok-a")
            try:
                assert await t.put(a.fingerprint, a.namespace, a.keys[0], a.blobs[0], timeout=TIMEOUT)
                assert t.bulk_path.client is not None
                t.bulk_path.client.close()
                srv.bulk._tickets.clear()  # the edge forgot every ticket (restarted listener, expiry)
                vias = await asyncio.gather(*(fetch_via(t, a) for _ in range(24)))  # concurrent, new connections
                assert vias == ["bulk"] * 24 and t.bulk_path.client.renewed == 1
                # an edge that refuses the renewed ticket too: this call and the next go over gRPC
                t.bulk_path.client.close()
                real = srv.bulk._redeem
                srv.bulk._redeem = lambda ticket: (_ for _ in ()).throw(e.Unauthorized("unknown or expired bulk ticket"))
                try:
                    assert await fetch_via(t, a) == "grpc"
                    assert await fetch_via(t, a) == "grpc"  # the bulk path rests
                finally:
                    srv.bulk._redeem = real
            finally:
                await t.close()

    asyncio.run(main())


def test_idle_connections_lying_lengths_and_readers_that_never_read_take_no_slot_for_long() -> None:
    a = chain_of("tenant-a", 4)
    big = chain_of("tenant-a", 5, shape=(16, 8, 256, 64))  # 4 MiB: more than the socket buffers take

    async def main() -> None:
        async with EdgeServer(edge_config(bulk_max_pending=64)) as srv:
            assert srv.bulk is not None
            port = srv.bulk.port
            t = GrpcEdgeTransport(srv.address, token="tok-a")
            try:
                for c in (a, big):
                    assert await t.put(c.fingerprint, c.namespace, c.keys[0], c.blobs[0], timeout=TIMEOUT)
                t.bulk_path.client.close()
                threads0 = threading.active_count()
                idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(300)]  # no hello, ever
                await asyncio.sleep(0.2)
                assert threading.active_count() <= threads0 + 1 and not srv.bulk._threads  # no thread each
                assert len(getattr(srv.bulk, "_pending", ())) <= 64  # and at most bulk_max_pending sockets
                assert await fetch_via(t, a) == "bulk"  # a client that says hello at once gets through
                # a lying length and a reader that never reads: each closed within the timeouts
                ticket = srv.bulk.grant("tok-a")
                liar_r, liar_w, _ = await hello(port, ticket)
                liar_w.write(wb.REQUEST.pack(wb.FETCH, 1000) + b"\x0a\x01")
                sleeper = socket.create_connection(("127.0.0.1", port))
                sleeper.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sleeper.sendall(wb.HELLO.pack(wb.MAGIC, wb.VERSION, ticket))
                req = big.spec(0).to_proto().SerializeToString()
                sleeper.sendall(wb.REQUEST.pack(wb.FETCH, len(req)) + req)  # ... and never reads the answer
                assert await until(lambda: len(srv.bulk._threads) >= 2, 5)
                assert await until(lambda: not srv.bulk._threads, 10)
                assert await asyncio.wait_for(liar_r.read(), 5) == b""
                sleeper.close()
                liar_w.close()
                for _r, w in idle:
                    w.close()
                assert await fetch_via(t, a) == "bulk"
            finally:
                await t.close()

    asyncio.run(main())


def test_one_token_cannot_take_every_connection() -> None:
    a = chain_of("tenant-a", 6)

    async def main() -> None:
        cfg = edge_config(bulk_max_connections=16, bulk_max_connections_per_token=4, bulk_idle_s=30.0)
        async with EdgeServer(cfg) as srv:
            assert srv.bulk is not None
            ticket_b = srv.bulk.grant("tok-b")
            held, statuses = [], []
            for _ in range(10):
                r, w, status = await hello(srv.bulk.port, ticket_b)
                held.append(w)
                statuses.append(status)
            assert statuses.count(0) == 4 and set(statuses) - {0} == {8}  # RESOURCE_EXHAUSTED past 4
            t = GrpcEdgeTransport(srv.address, token="tok-a")
            try:
                assert await t.put(a.fingerprint, a.namespace, a.keys[0], a.blobs[0], timeout=TIMEOUT)
                assert await fetch_via(t, a) == "bulk"
            finally:
                await t.close()
                for w in held:
                    w.close()

    asyncio.run(main())
