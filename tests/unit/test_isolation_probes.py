"""Adversarial probes of tenant isolation and integrity at the edge's data plane.

Each test plays an outside reviewer's attack on one path (gRPC Fetch/Put, the bulk socket,
shared memory, peers, hints, Stats, /metrics, the disk tier, the host's transport) and states
what must hold: one tenant never reads or poisons another's KV, and no corrupted, foreign-model
or mislabelled container is stored or served.

Most probes run in process (:class:`kdn.testing.InProcessEdge`, :class:`kdn.testing.InMemoryOverlay`,
no sockets). The few that need a real :class:`kdn.edge.server.EdgeServer` (the bulk socket,
peers over gRPC) bind **loopback only**: this module narrows the unit suite's socket guard to
127.0.0.1/::1 instead of lifting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from kdn import errors as e
from kdn.artifact import read_header
from kdn.edge.config import EdgeConfig
from kdn.edge.server import EdgeServer
from kdn.edge.store import build_store
from kdn.edge.upstream import FetchSpec
from kdn.keys import ModelFingerprint, Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.testing import InMemoryOverlay, InProcessEdge, make_chain, origin_with, reseal
from kdn.transport import GrpcEdgeTransport
from kdn.wire.auth import EdgeKey, TokenAuth
from kdn.wire.channel import auth_metadata
from kdn.wire.client_calls import EdgeCalls
from kdn.wire.convert import HintAction, HintAsk, hint_request, prefetch_request, put_messages
from kdn.wire.errors import rpc_errors
from kdn.wire.frames import decode_chunk, encode_chunk
from kdn.wire.inproc import InProcessServer
from kdn.wire.service import service_stub

TIMEOUT = 10.0
TOKENS = {"tok-a": ["acme"], "tok-b": ["globex"], "tok-ops": ["*"]}
ACME, GLOBEX = Namespace("acme"), Namespace("globex")
CLUSTER_KEY = "probe-cluster-key-0123456789abcdef"
_LOOPBACK = {"127.0.0.1", "::1", "localhost", ""}


@pytest.fixture(autouse=True)
def _no_inet_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overrides the unit suite's guard for this module: internet sockets only on loopback."""
    real_bind, real_connect, real_connect_ex = socket.socket.bind, socket.socket.connect, socket.socket.connect_ex

    def guard(real: Any) -> Any:
        def wrapper(self: socket.socket, address: Any, *args: object) -> Any:
            if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOOPBACK:
                raise RuntimeError(f"probe tried a non-loopback address {address!r}")
            return real(self, address, *args)

        return wrapper

    monkeypatch.setattr(socket.socket, "bind", guard(real_bind))
    monkeypatch.setattr(socket.socket, "connect", guard(real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guard(real_connect_ex))


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))


def _other_kv(blob: bytes) -> bytes:
    """``blob`` with other KV and every checksum recomputed: a valid container under the same key
    (checksums are unkeyed; anyone can make one)."""
    return reseal(blob, payloads=lambda ps: [bytes(b ^ 0x11 for b in p) for p in ps])


def _other_model(blob: bytes, fp: bytes = bytes(range(1, 33))) -> bytes:
    """``blob`` relabelled as another model's, every checksum recomputed."""
    def relabel(h: Any) -> None:
        h.fingerprint = fp

    return reseal(blob, header=relabel)


async def _fetch(t: GrpcEdgeTransport, spec: FetchSpec) -> tuple[bytes, str]:
    got, via = bytearray(), ""
    async for piece, via in t.fetch(spec, timeout=TIMEOUT):
        got += piece
    return bytes(got), via


def _inproc(**config: Any) -> InProcessEdge:
    return InProcessEdge(tokens=TOKENS, **config)


def _transport(edge: InProcessEdge, token: str | None) -> GrpcEdgeTransport:
    return GrpcEdgeTransport(f"inproc:{edge.config.node_id}", token=token, channel=edge.channel())


# -- gRPC Fetch/Put: one key, two tenants --------------------------------------------------------


def test_a_tenant_holding_the_same_key_never_shadows_or_reads_the_other_tenants_entry() -> None:
    """globex Puts a valid container of its own under acme's key K (in its own namespace, which it
    may): acme still gets acme's bytes, globex its own, and globex cannot Put into acme's."""
    acme = make_chain(1, namespace=ACME)
    forged = _other_kv(acme.blobs[0])
    key, fp = acme.keys[0], acme.fingerprint

    async def main() -> None:
        async with _inproc() as edge:
            a, b = _transport(edge, "tok-a"), _transport(edge, "tok-b")
            try:
                assert await b.put(fp, GLOBEX, key, forged, timeout=TIMEOUT)  # globex first: "first writer wins"
                assert await a.put(fp, ACME, key, acme.blobs[0], timeout=TIMEOUT)
                with pytest.raises(e.Unauthorized):
                    await b.put(fp, ACME, key, forged, timeout=TIMEOUT)
                assert (await _fetch(a, FetchSpec(key, fp, ACME)))[0] == acme.blobs[0]
                assert (await _fetch(b, FetchSpec(key, fp, GLOBEX)))[0] == forged
                with pytest.raises(e.Unauthorized):
                    await _fetch(b, FetchSpec(key, fp, ACME))
            finally:
                await a.close()
                await b.close()

    asyncio.run(main())


@pytest.mark.parametrize("case", ["declared key", "declared model", "trailing bytes", "truncated", "empty"])
def test_a_put_whose_declaration_does_not_match_its_container_is_refused_and_stores_nothing(case: str) -> None:
    chain = make_chain(2, namespace=ACME)
    blob, key, fp = chain.blobs[0], chain.keys[0], chain.fingerprint
    if case == "declared key":
        key = chain.keys[1]
    elif case == "declared model":
        fp = ModelFingerprint(bytes(range(1, 33)))
    elif case == "trailing bytes":
        blob = blob + b"\0" * 16
    elif case == "truncated":
        blob = blob[:-1]
    else:
        blob = b""

    async def main() -> None:
        async with _inproc() as edge:
            t = _transport(edge, "tok-a")
            try:
                with pytest.raises(e.KdnError) as refused:
                    await t.put(fp, ACME, key, blob, timeout=TIMEOUT)
                assert not isinstance(refused.value, (e.Unavailable, e.Unauthorized))
                assert edge.node.store.entries() == []
            finally:
                await t.close()

    asyncio.run(main())


def test_every_flipped_byte_of_a_put_is_refused_before_anything_is_stored() -> None:
    """One bit flipped at every byte position of a container (header, lengths, payload, checksums,
    trailer): the edge's Put path refuses each and stores nothing."""
    chain = make_chain(1, namespace=ACME)
    blob = chain.blobs[0]

    async def main() -> None:
        async with _inproc() as edge:
            from kdn.wire.convert import PutHeader

            header = PutHeader(chain.keys[0], chain.fingerprint, ACME, len(blob))
            passed = []
            for i in range(len(blob)):
                bad = bytearray(blob)
                bad[i] ^= 1 << (i % 8)
                try:
                    await edge.front.put(header, bytes(bad))
                except e.KdnError:
                    continue
                passed.append(i)
            assert passed == [], f"flips at byte offsets {passed[:20]} were stored (of {len(blob)})"
            assert edge.node.store.entries() == []

    asyncio.run(main())


# -- the disk tier -------------------------------------------------------------------------------


def _lossy_label(blob: bytes) -> bytes:
    """``blob`` relabelled as lossy (a client that requires lossless must never get it), resealed."""
    def relabel(h: Any) -> None:
        h.lossy = True

    return reseal(blob, header=relabel)


@pytest.mark.parametrize("swap", ["another model", "lossy label", "flipped bit"])
def test_a_disk_blob_replaced_in_place_is_dropped_not_served_or_promoted(tmp_path: Path, swap: str) -> None:
    """A blob on disk replaced by something else under the same key: a flipped bit, or a valid
    container (every checksum recomputed) whose header names another model fingerprint or says
    lossy. The disk read must drop it (fetched again elsewhere), not serve it under the entry's
    verified metadata (the fingerprint and lossiness the edge checks requests against)."""
    chain = make_chain(1, namespace=ACME)
    if swap == "another model":
        replaced = _other_model(chain.blobs[0])
    elif swap == "lossy label":
        replaced = _lossy_label(chain.blobs[0])
    else:
        raw = bytearray(chain.blobs[0])
        raw[len(raw) // 3] ^= 0x04
        replaced = bytes(raw)
    cfg = EdgeConfig(node_id="d0", memory_bytes=1 << 20, disk_dir=str(tmp_path / "disk"), disk_bytes=1 << 20)
    store = build_store(cfg.model_copy(update={"memory_bytes": 0}))
    try:
        store.put(chain.blobs[0], tenant="acme", expect_fingerprint=bytes(chain.fingerprint))
        disk = store.tiers[-1]
        path = disk.blob_path(store.entries()[0].meta.eid)  # type: ignore[attr-defined]
        path.write_bytes(replaced)
        got = store.get(chain.keys[0], tenant="acme")
        assert got is None or bytes(read_header(got[0]).fingerprint) == bytes(chain.fingerprint)
        assert got is None and store.stats()["corrupt_dropped"] == 1  # dropped: fetched again elsewhere
        assert not store.contains(chain.keys[0], tenant="acme")
    finally:
        store.close()


# -- Stats, /metrics, hints and prefetch: nothing of another tenant -------------------------------


def test_stats_for_one_tenant_name_nothing_of_another_and_metrics_carry_no_tenant_or_key() -> None:
    acme = make_chain(2, namespace=ACME)
    glob = make_chain(1, namespace=GLOBEX, seed=5)

    async def main() -> None:
        async with _inproc() as edge:
            a, b = _transport(edge, "tok-a"), _transport(edge, "tok-b")
            try:
                for k, blob in zip(acme.keys, acme.blobs):
                    assert await a.put(acme.fingerprint, ACME, k, blob, timeout=TIMEOUT)
                assert await b.put(glob.fingerprint, GLOBEX, glob.keys[0], glob.blobs[0], timeout=TIMEOUT)
                await edge.hints.apply(HintAsk(HintAction.SCHEDULE_PREFETCH, ACME, list(acme.keys), cron="0 8 * * *",
                                               schedule_id="acme-secret"), ACME, "tok-a", list(acme.keys))
                seen = await b.calls.stats(timeout=TIMEOUT)
                text = repr(seen.as_dict())
                for secret in ("acme", "acme-secret", *(bytes(k).hex()[:16] for k in acme.keys)):
                    assert secret not in text, f"globex's Stats name {secret!r}"
                assert seen.counters["tenant_entries"] == 1.0
                exposition = edge.node.metrics.exposition().decode()
                for secret in ("acme", "globex", *(bytes(k).hex()[:16] for k in acme.keys + glob.keys)):
                    assert secret not in exposition
            finally:
                await a.close()
                await b.close()

    asyncio.run(main())


def test_hints_lookup_and_prefetch_of_one_tenant_never_reach_the_other_tenants_entries() -> None:
    acme = make_chain(2, namespace=ACME)

    async def main() -> None:
        async with _inproc() as edge:
            a = _transport(edge, "tok-a")
            stub = service_stub(edge.channel(), "EdgeService")
            md_b = auth_metadata("tok-b")
            try:
                for k, blob in zip(acme.keys, acme.blobs):
                    assert await a.put(acme.fingerprint, ACME, k, blob, timeout=TIMEOUT)
                # globex names its own namespace and acme's keys: nothing of acme's is touched or told
                for action in (HintAction.PIN, HintAction.SET_PRIORITY, HintAction.SET_TTL):
                    req = hint_request(action, fingerprint=b"", namespace=GLOBEX, keys=acme.keys,  # type: ignore[arg-type]
                                       ttl_s=1.0, priority=5)
                    with rpc_errors("edge"):
                        resp = await stub.Hint(req, timeout=TIMEOUT, metadata=md_b)
                    assert resp.affected == 0
                states = edge.node.store.entries(tenant="acme")
                assert len(states) == 2 and not any(s.pinned for s in states)
                assert all(s.priority == 0 and s.ttl_left_s is None for s in states)
                b = _transport(edge, "tok-b")
                try:
                    assert await b.lookup(acme.fingerprint, GLOBEX, acme.keys, timeout=TIMEOUT) == 0
                    with pytest.raises(e.Unauthorized):
                        await b.lookup(acme.fingerprint, ACME, acme.keys, timeout=TIMEOUT)
                finally:
                    await b.close()
                # acme's namespace with globex's token: refused before anything is looked up or queued
                for call, req in (
                    (stub.Prefetch, prefetch_request(acme.keys, fingerprint=acme.fingerprint, namespace=ACME)),
                    (stub.Hint, hint_request(HintAction.UNPIN, fingerprint=acme.fingerprint, namespace=ACME,
                                             keys=acme.keys)),
                ):
                    with pytest.raises(e.Unauthorized), rpc_errors("edge"):
                        await call(req, timeout=TIMEOUT, metadata=md_b)
                assert edge.node.prefetcher.offered == 0
            finally:
                await a.close()

    asyncio.run(main())


def test_concurrent_misses_of_one_key_by_two_tenants_never_share_an_upstream_answer() -> None:
    """acme's key K exists only at the origin, for acme. globex asks for K in its own namespace
    while acme's miss of K is in flight: the two are separate flights, and globex gets NotFound."""
    acme = make_chain(1, namespace=ACME)
    origin = origin_with([acme], delay_s=0.05)

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin) as ov:
            node = ov.nodes["e0"]
            got_a, got_b = await asyncio.gather(
                node.fetch_bytes(acme.spec(0)),
                node.fetch_bytes(FetchSpec(acme.keys[0], acme.fingerprint, GLOBEX)),
                return_exceptions=True,
            )
            assert not isinstance(got_a, BaseException) and got_a[0] == acme.blobs[0]
            assert isinstance(got_b, e.NotFound)
            assert not node.store.contains(acme.keys[0], tenant="globex")
            assert origin.fetches == 2

    asyncio.run(main())


# -- edge tokens: what a "peer" may do -----------------------------------------------------------


def test_a_put_claiming_to_come_from_a_peer_needs_a_fresh_edge_token_for_that_tenant_and_node() -> None:
    chain = make_chain(1, namespace=ACME)
    sender = EdgeKey(CLUSTER_KEY, "e1")
    stranger = EdgeKey("some-other-cluster-key-0123456789", "e1")

    async def main() -> None:
        async with _inproc(cluster_key=CLUSTER_KEY) as edge:
            edge.front.auth = TokenAuth.from_config(TOKENS, EdgeKey(CLUSTER_KEY, "e0"))  # as EdgeServer builds it
            stub = service_stub(edge.channel(), "EdgeService")
            async def put(token: str | None, ns: Namespace = ACME) -> None:
                msgs = put_messages(chain.blobs[0], key=chain.keys[0], fingerprint=chain.fingerprint, namespace=ns)
                with rpc_errors("edge"):
                    await stub.Put(msgs, timeout=TIMEOUT, metadata=auth_metadata(token))

            replayed = sender.mint("e0", "tenant:acme")
            for token in (None, "kdn-edge1.forged", stranger.mint("e0", "tenant:acme"),
                          sender.mint("e9", "tenant:acme"), sender.mint("e0", "tenant:globex"), sender.mint("e0", "signal")):
                with pytest.raises(e.Unauthorized):
                    await put(token)
            await put(replayed)  # a fresh token of the cluster, to this node, for acme: a peer's Put
            with pytest.raises(e.Unauthorized):
                await put(replayed)  # ... good once
            assert edge.node.store.contains(chain.keys[0], tenant="acme")
            # an edge token is no operator: no Stats, no bulk ticket
            for call, req in ((stub.Stats, pb.StatsRequest()), (stub.OpenBulk, pb.BulkRequest())):
                with pytest.raises(e.Unauthorized), rpc_errors("edge"):
                    await call(req, timeout=TIMEOUT, metadata=auth_metadata(sender.mint("e0", "tenant:acme")))

    asyncio.run(main())


# -- over loopback: the bulk socket, shared memory, peers ----------------------------------------


@contextlib.asynccontextmanager
async def _served(**config: Any) -> AsyncIterator[EdgeServer]:
    cfg = EdgeConfig(**{"node_id": "p0", "listen": "127.0.0.1:0", "memory_bytes": 64 << 20, "tokens": TOKENS,
                        "shm": False, **config})
    async with EdgeServer(cfg) as srv:
        yield srv


def test_bulk_requests_are_held_to_the_tickets_token_and_to_the_containers_own_key_and_model() -> None:
    acme = make_chain(2, namespace=ACME)

    async def main() -> None:
        async with _served() as srv:
            a, b = GrpcEdgeTransport(srv.address, token="tok-a"), GrpcEdgeTransport(srv.address, token="tok-b")
            try:
                assert await a.put(acme.fingerprint, ACME, acme.keys[0], acme.blobs[0], timeout=TIMEOUT)
                assert a.bulk_path is not None and a.bulk_path.client is not None  # it went over the bulk socket
                assert srv.node.store.contains(acme.keys[0], tenant="acme")
                # globex's ticket, acme's namespace: refused on the bulk socket itself
                with pytest.raises(e.Unauthorized):
                    await _fetch(b, acme.spec(0))
                assert b.bulk_path is not None and b.bulk_path.client is not None
                # globex's own namespace, acme's key: the same as a key nobody has
                with pytest.raises(e.NotFound):
                    await _fetch(b, FetchSpec(acme.keys[0], acme.fingerprint, GLOBEX))
                # a bulk Put whose declared key or model is not its container's
                client = await a.bulk_path.connect(TIMEOUT)
                assert client is not None
                from kdn.wire.convert import put_header_bytes

                for key, fp in ((acme.keys[0], acme.fingerprint), (acme.keys[1], ModelFingerprint(bytes(32)))):
                    hdr = put_header_bytes(acme.blobs[1], key=key, fingerprint=fp, namespace=ACME)
                    with pytest.raises(e.KdnError) as refused:
                        await client.put(hdr, acme.blobs[1])
                    assert isinstance(refused.value, (e.InvalidInput, e.FingerprintMismatch))
                assert not srv.node.store.contains(acme.keys[1], tenant="acme")
                assert (await _fetch(a, acme.spec(0))) == (acme.blobs[0], "bulk")
            finally:
                await a.close()
                await b.close()

    asyncio.run(main())


def test_shared_memory_segments_are_per_tenant_private_to_the_edges_uid_and_name_no_key(tmp_path: Path) -> None:
    acme = make_chain(1, namespace=ACME)
    key, fp = acme.keys[0], acme.fingerprint
    forged = _other_kv(acme.blobs[0])
    shm_dir = tmp_path / "shm"

    async def shm_fetch(calls: EdgeCalls, ns: Namespace) -> tuple[str, int]:
        call = calls.fetch(FetchSpec(key, fp, ns), shm=True, timeout=TIMEOUT)
        with rpc_errors("edge"):
            frames = [decode_chunk(raw) async for raw in call]
        assert len(frames) == 1 and not len(frames[0].data)
        return frames[0].shm_name, frames[0].total_size

    async def main() -> None:
        async with _served(shm=True, shm_dir=str(shm_dir), bulk=False) as srv:
            a, b = GrpcEdgeTransport(srv.address, token="tok-a"), GrpcEdgeTransport(srv.address, token="tok-b")
            try:
                assert await b.put(fp, GLOBEX, key, forged, timeout=TIMEOUT)
                assert await a.put(fp, ACME, key, acme.blobs[0], timeout=TIMEOUT)
                ref_a, size_a = await shm_fetch(a.calls, ACME)
                ref_b, _ = await shm_fetch(b.calls, GLOBEX)
                assert ref_a != ref_b
                file_a, file_b = shm_dir / ref_a.split(":")[0], shm_dir / ref_b.split(":")[0]
                assert file_a.read_bytes() == acme.blobs[0] and file_b.read_bytes() == forged
                for f in (file_a, file_b):
                    st = f.lstat()
                    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o400 and st.st_uid == os.geteuid()
                    for secret in ("acme", "globex", bytes(key).hex()[:8]):
                        assert secret not in f.name
                # globex cannot get acme's segment named to it, by tenant or by guessing: the edge
                # only ever names the (tenant, key) the token was granted
                with pytest.raises(e.Unauthorized):
                    await shm_fetch(b.calls, ACME)
                assert len(srv.shm) == 2  # type: ignore[arg-type]
            finally:
                await a.close()
                await b.close()

    asyncio.run(main())


def test_a_peer_fetch_carries_the_asking_tenant_and_never_hands_one_tenants_copy_to_another() -> None:
    """Two edges of one cluster (cluster key, tokens), each an owner of every key: acme's K put on
    p0 is served to acme through p1 (a peer fetch), never to globex asking for K in its own
    namespace through either edge."""
    from kdn.wire.channel import free_port

    acme = make_chain(1, namespace=ACME)
    ports = {"p0": free_port("127.0.0.1"), "p1": free_port("127.0.0.1")}
    peers = {n: f"127.0.0.1:{p}" for n, p in ports.items()}

    async def main() -> None:
        common = {"replicas": 2, "cluster_key": CLUSTER_KEY, "peers": peers, "bulk": False}
        async with _served(node_id="p0", listen=peers["p0"], **common) as s0, \
                _served(node_id="p1", listen=peers["p1"], **common) as s1:
            a0, a1 = GrpcEdgeTransport(s0.address, token="tok-a"), GrpcEdgeTransport(s1.address, token="tok-a")
            b0, b1 = GrpcEdgeTransport(s0.address, token="tok-b"), GrpcEdgeTransport(s1.address, token="tok-b")
            try:
                assert await a0.put(acme.fingerprint, ACME, acme.keys[0], acme.blobs[0], timeout=TIMEOUT)
                for t in (b0, b1):
                    with pytest.raises(e.NotFound):
                        await _fetch(t, FetchSpec(acme.keys[0], acme.fingerprint, GLOBEX))
                assert not s1.node.store.contains(acme.keys[0], tenant="globex")
                assert (await _fetch(a1, acme.spec(0)))[0] == acme.blobs[0]  # through the peer
                assert s1.node.store.contains(acme.keys[0], tenant="acme")
                with pytest.raises(e.NotFound):  # and p1's copy is acme's alone, too
                    await _fetch(b1, FetchSpec(acme.keys[0], acme.fingerprint, GLOBEX))
                with pytest.raises(e.Unauthorized):
                    await _fetch(b1, acme.spec(0))
            finally:
                for t in (a0, a1, b0, b1):
                    await t.close()

    asyncio.run(main())


# -- the host's transport ------------------------------------------------------------------------


class _ShmAnsweringEdge:
    """An edge that names a shared-memory segment in every Fetch answer, asked for or not."""

    async def Fetch(self, request: Any, context: Any) -> AsyncIterator[bytes]:
        yield encode_chunk(b"", total_size=1024, shm_name="kdn-evil-1-0123456789abcdef:1:0")

    Lookup = Put = Prefetch = Hint = OpenBulk = Stats = None


def test_a_transport_that_did_not_ask_for_shared_memory_refuses_a_segment_with_a_kdn_error() -> None:
    """The transport's contract: only KdnError. An edge answering a plain Fetch with a segment
    name must get a clear refusal, not an AssertionError (or, under ``python -O``, an
    AttributeError)."""
    from kdn.wire.service import add_servicer

    chain = make_chain(1)

    async def main() -> None:
        server = InProcessServer()
        add_servicer(server, _ShmAnsweringEdge(), "EdgeService")  # type: ignore[arg-type]
        t = GrpcEdgeTransport("inproc:evil", channel=server.channel())
        try:
            with pytest.raises(e.KdnError):
                await _fetch(t, chain.spec(0))
        finally:
            await t.close()

    asyncio.run(main())
