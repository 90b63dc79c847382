"""The bulk byte path (kdn.wire.bulk, kdn.edge.bulk) through a real edge on loopback.

What must hold: the bytes are the stored container, verified by the client; the same tokens and
tenants are enforced as on gRPC; bad frames, bad tickets and a flipped bit get clear errors and the
edge keeps serving; an edge that does not offer the path (TLS, switched off) is served over gRPC;
a killed connection falls back to gRPC before the first byte and never hands out torn bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import sys
from typing import Any, AsyncIterator

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
from kdn.wire.convert import fetch_request_bytes

pytestmark = pytest.mark.integration

TIMEOUT = 10.0


def edge_config(**kw: Any) -> EdgeConfig:
    return EdgeConfig(node_id=kw.pop("node_id", "bulk"), listen="127.0.0.1:0", memory_bytes=256 << 20, shm=False, **kw)


@contextlib.asynccontextmanager
async def served(config: EdgeConfig) -> AsyncIterator[tuple[EdgeServer, GrpcEdgeTransport]]:
    """A running edge and a transport to it; the transport is closed before the edge stops."""
    async with EdgeServer(config) as srv:
        t = GrpcEdgeTransport(srv.address)
        try:
            yield srv, t
        finally:
            await t.close()


@contextlib.asynccontextmanager
async def shm_edge(node_id: str, chain: Chain) -> AsyncIterator[tuple[EdgeServer, GrpcEdgeTransport]]:
    """An edge with a shared-memory pool holding ``chain``, and a same-host transport to it (the
    client maps from the default directory, so the edge publishes there and unlinks on close)."""
    cfg = edge_config(node_id=node_id).model_copy(update={"shm": True})
    async with EdgeServer(cfg) as srv:
        t = GrpcEdgeTransport(srv.address, shm=True)
        try:
            for key, blob in zip(chain.keys, chain.blobs):
                assert await t.put(chain.fingerprint, chain.namespace, key, blob, timeout=TIMEOUT)
            yield srv, t
        finally:
            await t.close()


async def fetch_verified(t: GrpcEdgeTransport, chain: Chain, i: int) -> tuple[bytes, str]:
    reader = ArtifactReader(expect_fingerprint=chain.fingerprint, expect_key=chain.keys[i], decode=False)
    got, via = bytearray(), ""
    async for piece, via in t.fetch(chain.spec(i), timeout=TIMEOUT):
        reader.feed(piece)
        got += piece
    reader.finish()
    return bytes(got), via


def big_chain(n: int = 3, seed: int = 1, tenant: str = "default") -> Chain:
    # (L, H, T, D) = (4, 4, 64, 64): 256 KiB a chunk, many socket reads per answer
    return make_chain(n, seed=seed, shape=(4, 4, 64, 64), namespace=Namespace(tenant))


def test_put_and_fetch_over_bulk_match_the_stored_bytes_and_reuse_buffers() -> None:
    chain = big_chain()

    async def main() -> None:
        async with served(edge_config()) as (srv, t):
            assert srv.bulk is not None and srv.bulk.port
            for key, blob in zip(chain.keys, chain.blobs):
                assert await t.put(chain.fingerprint, chain.namespace, key, blob, timeout=TIMEOUT)
            for _round in range(3):
                for i, blob in enumerate(chain.blobs):
                    got, via = await fetch_verified(t, chain, i)
                    assert via == "bulk" and got == blob
            # every fetch after the first of a size class reused a buffer; connections were kept
            assert t.bulk_path.buffers.allocated == 1 and t.bulk_path.buffers.reused == 3 * len(chain.blobs) - 1
            assert t.bulk_path.client is not None and t.bulk_path.client.connections == 1
            # a miss is NotFound, and the connection stays usable
            with pytest.raises(e.NotFound):
                await fetch_verified(t, make_chain(1, seed=77), 0)
            assert (await fetch_verified(t, chain, 0))[0] == chain.blobs[0]
            assert t.bulk_path.client.connections == 1
            # the edge's thread counts a fetch's bytes once its sendall returns, which may be
            # just after the client has them all
            want = 3 * sum(map(len, chain.blobs)) + len(chain.blobs[0])
            counter = srv.node.metrics.bytes_out.labels("bulk")._value
            for _ in range(100):
                if counter.get() == want:
                    break
                await asyncio.sleep(0.02)
            assert counter.get() == want

    asyncio.run(main())


def test_bulk_enforces_the_same_tokens_and_tenants_as_grpc() -> None:
    acme = big_chain(1, seed=2, tenant="acme")

    async def main() -> None:
        cfg = edge_config(tokens={"tok-acme": ["acme"], "tok-globex": ["globex"]})
        async with EdgeServer(cfg) as srv:
            owner = GrpcEdgeTransport(srv.address, token="tok-acme")
            other = GrpcEdgeTransport(srv.address, token="tok-globex")
            nobody = GrpcEdgeTransport(srv.address, token="wrong")
            try:
                assert await owner.put(acme.fingerprint, acme.namespace, acme.keys[0], acme.blobs[0], timeout=TIMEOUT)
                assert (await fetch_verified(owner, acme, 0)) == (acme.blobs[0], "bulk")
                # a valid token for another tenant gets a ticket, but no request for acme passes
                with pytest.raises(e.Unauthorized):
                    await fetch_verified(other, acme, 0)
                assert other.bulk_path.client is not None  # it was refused on the bulk path, not on gRPC
                with pytest.raises(e.Unauthorized):
                    await other.put(acme.fingerprint, acme.namespace, acme.keys[0], acme.blobs[0], timeout=TIMEOUT)
                # an unknown token gets no ticket: refused, whichever path
                with pytest.raises(e.Unauthorized):
                    await fetch_verified(nobody, acme, 0)
                # the refused Put left the stored artifact as it was
                assert (await fetch_verified(owner, acme, 0))[0] == acme.blobs[0]
            finally:
                for t in (owner, other, nobody):
                    await t.close()

    asyncio.run(main())


async def _raw(port: int, payload: bytes, *, answers: int = 1) -> bytes:
    """Send ``payload`` on a fresh bulk connection; return the edge's first ``answers`` answers
    (header and text each; fewer if it closes first)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = b""
    try:
        writer.write(payload)
        await writer.drain()
        for _ in range(answers):
            try:
                head = await asyncio.wait_for(reader.readexactly(wb.ANSWER.size), TIMEOUT)
            except asyncio.IncompleteReadError:
                break
            tlen = wb.ANSWER.unpack(head)[2]
            out += head + await asyncio.wait_for(reader.readexactly(tlen), TIMEOUT)
        return out
    finally:
        writer.close()


def test_bad_frames_and_tickets_get_clear_errors_and_the_edge_keeps_serving() -> None:
    chain = big_chain(1, seed=3)

    async def main() -> None:
        async with served(edge_config()) as (srv, t):
            assert srv.bulk is not None
            port = srv.bulk.port
            await t.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=TIMEOUT)
            # not our protocol at all
            out = await _raw(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(20))
            status, _, tlen, _ = wb.ANSWER.unpack_from(out)
            assert status and b"bad magic" in out[wb.ANSWER.size : wb.ANSWER.size + tlen]
            # a forged ticket
            out = await _raw(port, wb.HELLO.pack(wb.MAGIC, wb.VERSION, bytes(32)))
            assert wb.ANSWER.unpack_from(out)[0] and b"ticket" in out
            # a valid ticket, then an unknown op and an oversized request: refused, connection closed
            ticket = srv.bulk.grant(None)
            hello = wb.HELLO.pack(wb.MAGIC, wb.VERSION, ticket)
            for bad in (wb.REQUEST.pack(9, 4) + b"abcd", wb.REQUEST.pack(wb.FETCH, wb.MAX_REQUEST + 1)):
                out = await _raw(port, hello + bad, answers=2)
                assert out[: wb.ANSWER.size] == wb.answer(0)  # hello accepted
                assert wb.ANSWER.unpack_from(out, wb.ANSWER.size)[0] == 3  # INVALID_ARGUMENT
            # a request that is not a FetchRequest: InvalidInput, and the connection goes on
            out = await _raw(port, hello + wb.REQUEST.pack(wb.FETCH, 3) + b"\xff\xff\xff", answers=2)
            assert wb.ANSWER.unpack_from(out, wb.ANSWER.size)[0] == 3
            # a Put that declares more than the edge takes: refused before a byte of it is read
            big = pb.PutHeader(fingerprint=bytes(chain.fingerprint), namespace=pb.Namespace(tenant="default"),
                               key=bytes(chain.keys[0]), total_size=srv.config.max_artifact_bytes + 1)
            raw = big.SerializeToString()
            out = await _raw(port, hello + wb.REQUEST.pack(wb.PUT, len(raw)) + raw, answers=2)
            assert wb.ANSWER.unpack_from(out, wb.ANSWER.size)[0] == 8  # RESOURCE_EXHAUSTED
            # a connection that hangs up mid-request leaves nothing behind
            out = await _raw(port, hello + wb.REQUEST.pack(wb.FETCH, 100) + b"\x0a")
            # the edge still serves, over both paths
            assert (await fetch_verified(t, chain, 0)) == (chain.blobs[0], "bulk")
            g = GrpcEdgeTransport(srv.address, bulk=False)
            assert (await fetch_verified(g, chain, 0)) == (chain.blobs[0], "grpc")
            await g.close()

    asyncio.run(main())


def test_a_flipped_bit_in_a_put_is_refused_and_never_stored() -> None:
    chain = big_chain(1, seed=4)

    async def main() -> None:
        async with served(edge_config()) as (srv, t):
            bad = bytearray(chain.blobs[0])
            bad[len(bad) // 2] ^= 0x04
            with pytest.raises(e.ArtifactError):
                await t.put(chain.fingerprint, chain.namespace, chain.keys[0], bytes(bad), timeout=TIMEOUT)
            with pytest.raises(e.NotFound):
                await fetch_verified(t, chain, 0)
            assert await t.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=TIMEOUT)
            assert (await fetch_verified(t, chain, 0)) == (chain.blobs[0], "bulk")

    asyncio.run(main())


def test_bulk_bytes_are_verified_by_the_client() -> None:
    """An edge that serves a corrupted container over bulk: the client's reader refuses it."""
    chain = big_chain(1, seed=5)

    async def main() -> None:
        async with served(edge_config()) as (srv, t):
            await t.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=TIMEOUT)
            stored, tier = srv.node.store.get(chain.keys[0], tenant="default")
            assert tier == "memory"
            # flip a bit in the memory tier's copy: what the edge will send as-is
            corrupt = bytearray(stored)
            corrupt[len(corrupt) // 3] ^= 0x01

            real_get = srv.node.store.get

            def serve_corrupt(key, **kw):  # noqa: ANN001, ANN003
                got = real_get(key, **kw)
                return (bytes(corrupt), got[1]) if got is not None else None

            srv.node.store.get = serve_corrupt  # type: ignore[method-assign]
            with pytest.raises(e.ArtifactCorrupt):
                await fetch_verified(t, chain, 0)

    asyncio.run(main())


def test_tls_edge_does_not_offer_bulk_and_switched_off_edge_streams_over_grpc() -> None:
    chain = big_chain(1, seed=6)

    async def main() -> None:
        async with served(edge_config(bulk=False)) as (srv, t):
            assert srv.bulk is None
            assert await t.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=TIMEOUT)
            assert (await fetch_verified(t, chain, 0)) == (chain.blobs[0], "grpc")
            assert t.bulk_path is not None and t.bulk_path.offered is False  # asked once, told no

    asyncio.run(main())


def test_a_dead_bulk_listener_falls_back_to_grpc_before_the_first_byte() -> None:
    chain = big_chain(1, seed=7)

    async def main() -> None:
        async with served(edge_config()) as (srv, t):
            assert await t.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=TIMEOUT)
            assert (await fetch_verified(t, chain, 0))[1] == "bulk"
            assert srv.bulk is not None
            await srv.bulk.stop()  # connections reset, the port closed; gRPC still serves
            got, via = await fetch_verified(t, chain, 0)
            assert got == chain.blobs[0] and via == "grpc"
            # resting: the next call goes straight to gRPC
            assert (await fetch_verified(t, chain, 0))[1] == "grpc"

    asyncio.run(main())


@contextlib.asynccontextmanager
async def half_answer_listener(t: GrpcEdgeTransport, blob: bytes) -> AsyncIterator[None]:
    """Point ``t``'s bulk path at a fake listener (loopback) that accepts the hello, answers one
    request with half of ``blob``, and hangs up; closed and awaited on exit."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    lsock.setblocking(False)
    loop = asyncio.get_running_loop()

    async def liar() -> None:
        conn, _ = await loop.sock_accept(lsock)
        conn.setblocking(False)
        await loop.sock_recv(conn, wb.HELLO.size)
        await loop.sock_sendall(conn, wb.answer(0))
        head = await loop.sock_recv(conn, wb.REQUEST.size)
        (_, n) = struct.unpack("<BI", head)
        await loop.sock_recv(conn, n)
        await loop.sock_sendall(conn, wb.answer(0, "memory", len(blob)) + blob[: len(blob) // 2])
        conn.close()

    task = asyncio.create_task(liar())
    try:
        t.bulk_path.client = wb.BulkClient("127.0.0.1", lsock.getsockname()[1], b"x" * 32, peer="liar")
        t.bulk_path.expires = float("inf")
        yield
    finally:
        await task
        lsock.close()


def test_killed_mid_answer_never_yields_torn_bytes() -> None:
    """A listener that sends half an answer and hangs up: the fetch does not yield a partial
    container (it falls back to gRPC, which the real edge serves whole)."""
    chain = big_chain(1, seed=8)
    blob = chain.blobs[0]

    async def main() -> None:
        async with EdgeServer(edge_config()) as srv:
            t = GrpcEdgeTransport(srv.address)
            assert await t.put(chain.fingerprint, chain.namespace, chain.keys[0], blob, timeout=TIMEOUT)
            try:
                async with half_answer_listener(t, blob):
                    pieces = []
                    async for piece, via in t.fetch(chain.spec(0), timeout=TIMEOUT):
                        pieces.append((bytes(piece), via))
                assert [v for _, v in pieces] == ["grpc"] * len(pieces)
                assert b"".join(p for p, _ in pieces) == blob
            finally:
                await t.close()

    asyncio.run(main())


def test_same_host_segment_named_over_the_bulk_socket_is_verified_and_falls_back() -> None:
    """A client on the edge's host asks for shared memory over the bulk socket (no gRPC call):
    the segment holds the stored container, a flipped bit in it is caught by the client's reader,
    a recycled segment is asked for again, and an edge without a pool sends the bytes instead."""
    chain = big_chain(2, seed=9)

    async def main() -> None:
        cfg = edge_config(node_id="bulk-shm")
        async with shm_edge("bulk-shm", chain) as (srv, t):
            for _round in range(2):
                for i, blob in enumerate(chain.blobs):
                    assert await fetch_verified(t, chain, i) == (blob, "shm")
            assert srv.shm is not None and srv.shm.created == 2 and srv.shm.reused == 2
            # the edge's offer stated its segment bounds and the client keeps that many mapped
            assert t.shm_path.maps.bounds == srv.shm.bounds == (cfg.shm_max_segments, cfg.shm_max_bytes)
            # named over one bulk socket (a failed bulk call would have dropped it for gRPC)
            assert t.bulk_path.client is not None and t.bulk_path.client.connections == 1
            assert t.shm_path.maps is not None and len(t.shm_path.maps) == 2  # and mapped once each
            # a flipped bit in the published segment: the cached mapping sees it and the reader
            # refuses it; the edge sees the file changed and names a fresh segment with the bytes
            seg = srv.shm._segments[("default", bytes(chain.keys[0]))]
            path = f"{srv.shm.dir}/{seg.name}"
            with open(path, "r+b") as f:
                f.seek(len(chain.blobs[0]) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x08]))
            with pytest.raises(e.ArtifactCorrupt):
                t.shm_path.maps.open(seg.ref, expect_key=chain.keys[0])
            assert await fetch_verified(t, chain, 0) == (chain.blobs[0], "shm") and srv.shm.changed == 1
            # the segment is recycled (unlinked) after it was named: asked again, still right
            srv.shm.forget("default", chain.keys[0])
            assert await fetch_verified(t, chain, 0) == (chain.blobs[0], "shm")
            # a miss is NotFound over this path too
            with pytest.raises(e.NotFound):
                await fetch_verified(t, big_chain(1, seed=10), 0)
        # an edge without a shared-memory pool answers the same request with the bytes
        async with served(edge_config()) as (srv, _t):
            t = GrpcEdgeTransport(srv.address, shm=True)
            try:
                assert await t.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=TIMEOUT)
                assert srv.shm is None
                assert await fetch_verified(t, chain, 0) == (chain.blobs[0], "bulk")
            finally:
                await t.close()

    asyncio.run(main())


@pytest.mark.parametrize("in_place", [True, False])
def test_received_in_place_equals_fed_and_a_torn_or_corrupt_answer_is_refused(in_place: bool) -> None:
    """``fetch_into`` over the bulk path, received in place (large answers) or whole into a pooled
    buffer (small ones): the KV in the caller's tensor is bit for bit what the stored container
    decodes to; a corrupt answer is ArtifactCorrupt (received in place, its connection holds
    unread bytes and is closed); a connection that dies half-way is Unavailable (the reader holds
    part of the container, so no silent retry) and is not reused."""
    import torch

    from kdn.artifact import decode_artifact

    chain = big_chain(2, seed=11)

    def reader_for(i: int) -> ArtifactReader:
        return ArtifactReader(expect_fingerprint=chain.fingerprint, expect_key=chain.keys[i],
                              out=torch.zeros(4, 2, 4, 64, 64, dtype=torch.float16))

    async def main() -> None:
        async with served(edge_config()) as (srv, t):
            t.bulk_path.land_min_bytes = 0 if in_place else 1 << 30
            for key, blob in zip(chain.keys, chain.blobs):
                assert await t.put(chain.fingerprint, chain.namespace, key, blob, timeout=TIMEOUT)
            for _round in range(2):
                for i, blob in enumerate(chain.blobs):
                    r = reader_for(i)
                    stats = await t.fetch_into(chain.spec(i), r, timeout=TIMEOUT)
                    r.finish()
                    assert stats.via == "bulk" and stats.bytes == len(blob) and stats.decode_s > 0
                    assert r.kv is not None and torch.equal(r.kv, decode_artifact(blob).kv)
            assert t.bulk_path.client is not None and t.bulk_path.client.connections == 1  # one connection, kept
            with pytest.raises(e.NotFound):
                await t.fetch_into(big_chain(1, seed=12).spec(0), reader_for(0), timeout=TIMEOUT)
            # the edge serves a flipped bit: refused, and that connection is dropped
            real_get = srv.node.store.get

            def serve_corrupt(key, **kw):  # noqa: ANN001, ANN003
                got = real_get(key, **kw)
                if got is None:
                    return None
                bad = bytearray(got[0])
                bad[len(bad) // 2] ^= 0x02
                return bytes(bad), got[1]

            srv.node.store.get = serve_corrupt  # type: ignore[method-assign]
            with pytest.raises(e.ArtifactCorrupt):
                await t.fetch_into(chain.spec(0), reader_for(0), timeout=TIMEOUT)
            srv.node.store.get = real_get  # type: ignore[method-assign]
            r = reader_for(0)
            await t.fetch_into(chain.spec(0), r, timeout=TIMEOUT)
            r.finish()
            assert t.bulk_path.client.connections == (2 if in_place else 1)  # unread bytes: that connection closed

            # a listener that dies half-way through the answer
            blob = chain.blobs[0]
            async with half_answer_listener(t, blob):
                r = reader_for(0)
                if in_place:
                    with pytest.raises(e.Unavailable, match="mid-answer"):
                        await t.fetch_into(chain.spec(0), r, timeout=TIMEOUT)
                    assert 0 < r.received < len(blob) and not r.complete
                    with pytest.raises(e.ArtifactCorrupt, match="truncated"):
                        r.finish()
                else:  # nothing reached the reader: the same call is served over gRPC, whole
                    assert (await t.fetch_into(chain.spec(0), r, timeout=TIMEOUT)).via == "grpc"
                    r.finish()
                # resting after the failure: the next fetch goes over gRPC, whole and verified
                r = reader_for(0)
                assert (await t.fetch_into(chain.spec(0), r, timeout=TIMEOUT)).via == "grpc"
                r.finish()

    asyncio.run(main())


def test_a_put_of_a_held_key_lands_in_a_reused_buffer_and_is_still_verified() -> None:
    """Re-putting a key the edge holds: the bytes are received into a pooled buffer (no fresh
    memory), verified (a flipped bit is refused, the stored copy untouched), and dropped; a new
    key's bytes are kept as received, never in a buffer the pool hands out again."""
    chain = big_chain(2, seed=14)

    async def main() -> None:
        async with served(edge_config()) as (srv, t):
            assert srv.bulk is not None
            pool = srv.bulk._put_buffers
            assert await t.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=TIMEOUT)
            assert pool.allocated == 0  # a new key: a buffer of its own, which the store keeps
            for _ in range(3):
                assert await t.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=TIMEOUT)
            assert pool.allocated == 1 and pool.reused == 2
            bad = bytearray(chain.blobs[0])
            bad[len(bad) // 2] ^= 0x20
            with pytest.raises(e.ArtifactError):
                await t.put(chain.fingerprint, chain.namespace, chain.keys[0], bytes(bad), timeout=TIMEOUT)
            assert await t.put(chain.fingerprint, chain.namespace, chain.keys[1], chain.blobs[1], timeout=TIMEOUT)
            for _ in range(2):  # the pooled buffer is written again: nothing stored may change
                assert await t.put(chain.fingerprint, chain.namespace, chain.keys[1], chain.blobs[1], timeout=TIMEOUT)
                assert await t.put(chain.fingerprint, chain.namespace, chain.keys[0], chain.blobs[0], timeout=TIMEOUT)
            for i, blob in enumerate(chain.blobs):
                assert await fetch_verified(t, chain, i) == (blob, "bulk")
                stored, _tier = srv.node.store.get(chain.keys[i], tenant="default")
                assert bytes(stored) == blob

    asyncio.run(main())


def test_shared_memory_read_ahead_counts_only_once_the_edge_says_yes() -> None:
    """A repeated same-host fetch reads the segment it was last given while the edge answers:
    the KV equals the stored artifact's, the edge still serves (and counts) every fetch, and its
    refusal, a flipped bit in the mapping, or a bulk socket that breaks before the answer each end
    as they would without the read-ahead."""
    import torch

    from kdn.artifact import decode_artifact

    chain = big_chain(2, seed=11)
    want = [decode_artifact(b).kv for b in chain.blobs]

    async def fetch_kv(t: GrpcEdgeTransport, i: int) -> tuple[torch.Tensor, str]:
        out = torch.full_like(want[i], float("nan"))
        reader = ArtifactReader(expect_fingerprint=chain.fingerprint, expect_key=chain.keys[i], out=out)
        stats = await t.fetch_into(chain.spec(i), reader, timeout=TIMEOUT)
        reader.finish()
        return out, stats.via

    async def main() -> None:
        async with shm_edge("bulk-ahead", chain) as (srv, t):
            for _round in range(3):
                for i in range(2):
                    out, via = await fetch_kv(t, i)
                    assert via == "shm" and torch.equal(out, want[i])
            assert t.shm_path.read_ahead == 4  # the first fetch of each key maps, the next ones read ahead
            assert srv.shm is not None and srv.shm.created == 2 and srv.shm.reused == 4  # all 6 asked

            # the bulk socket breaks after the request went out and the segment was read:
            # the fetch is confirmed over gRPC instead
            bulk = t.bulk_path.client
            assert bulk is not None

            async def broken(*_a: object, **_kw: object) -> Any:
                raise ConnectionResetError("bulk socket gone")

            bulk._answer = broken  # type: ignore[method-assign]
            out, via = await fetch_kv(t, 1)
            assert via == "shm" and torch.equal(out, want[1]) and t.shm_path.read_ahead == 5
            # the edge got the request before the break, and the confirmation over gRPC
            assert t.bulk_path.client is None and srv.shm.reused == 6
            t.bulk_path.backoff.clear()

            # it breaks before anything was read (a refused connection): the usual path
            bulk = await t.bulk_path.connect(TIMEOUT)
            assert bulk is not None

            async def unreachable(*_a: object, **_kw: object) -> Any:
                raise ConnectionRefusedError("no bulk listener")

            bulk.fetch_shm_ahead = unreachable  # type: ignore[method-assign]
            out, via = await fetch_kv(t, 1)
            assert via == "shm" and torch.equal(out, want[1]) and t.shm_path.read_ahead == 5
            assert srv.shm.reused == 7
            t.bulk_path.backoff.clear()

            # a flipped bit in the mapping the client reads ahead from: refused; then the edge,
            # which sees the file changed, names a fresh segment holding the stored bytes
            seg = srv.shm._segments[("default", bytes(chain.keys[0]))].name
            with open(f"{srv.shm.dir}/{seg}", "r+b") as f:
                f.seek(len(chain.blobs[0]) - 100)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x01]))
            with pytest.raises(e.ArtifactCorrupt):
                await fetch_kv(t, 0)
            out, via = await fetch_kv(t, 0)
            assert via == "shm" and torch.equal(out, want[0]) and srv.shm.changed == 1

            # the edge no longer holds key 1 (its segment is still mapped here): NotFound
            assert srv.node is not None and srv.node.store.delete(chain.keys[1], tenant="default")
            srv.shm.forget("default", chain.keys[1])
            ahead = t.shm_path.read_ahead
            with pytest.raises(e.NotFound):
                await fetch_kv(t, 1)
            assert t.shm_path.read_ahead == ahead

    asyncio.run(main())



def test_fetches_in_flight_on_one_loop_take_turns(tmp_path: Any) -> None:
    """Eight callers fetch from one same-host transport to an edge process, each taking the next
    request when its last one is done. A shared-memory read-ahead leaves the edge's answer waiting
    when it is read, so a fetch can complete without suspending: without a turn of the loop per
    request, one caller ran request after request while the others' answers waited (some for the
    whole run). Each caller must get a fair share of the requests."""
    import json
    import subprocess
    import sys

    from tests.children import ready_line, reap

    # 1 MiB artifacts: reading one ahead takes longer than the edge takes to answer
    chain = make_chain(16, seed=5, shape=(8, 8, 64, 64))
    lanes, total = 8, 800
    proc = subprocess.Popen([sys.executable, "-m", "kdn.edge.cli", "--listen", "127.0.0.1:0", "--node-id", "turns",
                             "--memory-bytes", "256M"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    async def main() -> None:
        t = GrpcEdgeTransport(ready_line(proc, "edge")["address"], shm=True)
        try:
            for key, blob in zip(chain.keys, chain.blobs):
                assert await t.put(chain.fingerprint, chain.namespace, key, blob, timeout=TIMEOUT)
            for i in range(len(chain.keys)):  # published and mapped: every later fetch reads ahead
                await fetch_verified(t, chain, i)
            done = [0] * lanes
            taken = 0

            async def lane(k: int) -> None:
                nonlocal taken
                while taken < total:
                    i = taken % len(chain.keys)
                    taken += 1
                    reader = ArtifactReader(expect_fingerprint=chain.fingerprint, expect_key=chain.keys[i],
                                            decode=False)
                    assert (await t.fetch_into(chain.spec(i), reader, timeout=TIMEOUT)).via == "shm"
                    reader.finish()
                    done[k] += 1

            await asyncio.gather(*(lane(k) for k in range(lanes)))
            assert sum(done) == total and t.shm_path.read_ahead >= total // 2
            assert min(done) >= total // lanes // 2, done  # a fair share each (a starved caller gets a few)
        finally:
            await t.close()

    try:
        asyncio.run(main())
    finally:
        proc.terminate()
        reap(proc)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")
def test_a_client_on_the_edges_host_connects_over_its_local_socket_and_falls_back_to_tcp() -> None:
    """The edge offers an abstract Unix socket beside its bulk port; a loopback client's
    connections go there and carry the same verified bytes, tickets and refusals. A local socket
    that is gone (the edge restarted) sends the client to TCP, with nothing lost; a stopped
    listener takes its local socket with it."""
    chain = big_chain(2, seed=12)

    async def main() -> None:
        async with served(edge_config()) as (srv, t):
            assert srv.bulk is not None and srv.bulk.local_name.startswith("@kdn-bulk-")
            for key, blob in zip(chain.keys, chain.blobs):
                assert await t.put(chain.fingerprint, chain.namespace, key, blob, timeout=TIMEOUT)
            for i, blob in enumerate(chain.blobs):
                got, via = await fetch_verified(t, chain, i)
                assert via == "bulk" and got == blob
            client = t.bulk_path.client
            assert client is not None and client.local == srv.bulk.local_name
            assert client.local_connections == client.connections == 1
            with pytest.raises(e.NotFound):  # a refusal is the same answer over either socket
                await fetch_verified(t, make_chain(1, seed=78), 0)

            # a name nobody serves: this connection and every later one go over TCP
            tcp = wb.BulkClient("127.0.0.1", srv.bulk.port, client.ticket, local="@kdn-bulk-gone")
            buf, size, _source = await tcp.fetch(fetch_request_bytes(chain.spec(0)), wb.BufferPool())
            assert buf is not None and bytes(buf[:size]) == chain.blobs[0]
            assert tcp.local == "" and tcp.local_connections == 0 and tcp.connections == 1
            tcp.close()

            # a transport told to take TCP (as from another host) does, though the edge offers it
            remote = GrpcEdgeTransport(srv.address, bulk_local=False)
            try:
                assert (await fetch_verified(remote, chain, 1)) == (chain.blobs[1], "bulk")
                assert remote.bulk_path.client.local == "" and remote.bulk_path.client.local_connections == 0
            finally:
                await remote.close()

            # a name held by a process other than the one it names (the edge gone, another
            # process bound it): refused before the ticket is sent, and TCP from then on
            squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            squat.bind(b"\0kdn-bulk-1-squatted")  # pid 1: not this process
            squat.listen(4)
            squat.setblocking(False)
            try:
                victim = wb.BulkClient("127.0.0.1", srv.bulk.port, client.ticket, local="@kdn-bulk-1-squatted")
                buf, size, _source = await victim.fetch(fetch_request_bytes(chain.spec(1)), wb.BufferPool())
                assert buf is not None and bytes(buf[:size]) == chain.blobs[1]
                assert victim.local == "" and victim.local_connections == 0
                conn, _ = squat.accept()  # it was connected to, and told nothing before the client hung up
                conn.settimeout(TIMEOUT)
                assert conn.recv(64) == b""
                conn.close()
                victim.close()
            finally:
                squat.close()

            name = srv.bulk.local_name
            await srv.bulk.stop()
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with pytest.raises(OSError):
                probe.connect(b"\0" + name[1:].encode())
            probe.close()

    asyncio.run(main())


def test_a_prefix_fetched_over_bulk_leaves_its_destination_free_for_the_next_request(monkeypatch) -> None:
    """Fetched in place over the bulk path, a prefix's destination is reused by the next request as
    soon as the caller drops it: nothing but the caller's tensors refers to it (a reader kept in a
    cycle held it until a garbage collection, and every request mapped and faulted a fresh one)."""
    import gc

    import torch

    from kdn import kv as kdn_kv
    from kdn.client import AsyncKdnClient, ClientConfig
    from kdn.kv import KVShape

    monkeypatch.setattr(kdn_kv, "PREFAULT_MIN_BYTES", 1 << 16)  # the pool serves destinations this small
    chain = big_chain(3)
    L, H, T, D = 4, 4, 64, 64

    async def main() -> None:
        async with served(edge_config()) as (srv, t):
            for key, blob in zip(chain.keys, chain.blobs):
                assert await t.put(chain.fingerprint, chain.namespace, key, blob, timeout=TIMEOUT)
            client = AsyncKdnClient(ClientConfig(edge=srv.address, shm="off", bulk=True, write_back=False))
            try:
                shape = KVShape(L, H, D, torch.float16)
                for _ in range(3):
                    kv, usable, error, tally = await client.fetches.prefix(chain.fingerprint, chain.keys, shape,
                                                                           chunk_size=T)
                    assert error is None and usable == 3 and tally.via == "bulk"
                    del kv
            finally:
                await client.close()
            pool = client.destinations
            assert pool.mapped == 1 and pool.reused == 2

    was = gc.isenabled()
    gc.disable()  # what frees a destination must be the caller letting go, not a collection
    try:
        asyncio.run(main())
    finally:
        if was:
            gc.enable()
