"""Who the overlay trusts, end to end on loopback: an origin serving signalling, two real edges
with the cluster key, and tenant B with a valid token of its own and a gRPC server of its own.

- B announces a node at its server, re-points edge-a's id, sends offers and a forged peer answer,
  and reads edge-a's mailbox: every call is refused, B's server is never dialled, and no token of
  any edge reaches it; tenant A's generation reuses its KV, equal to recompute, and every byte the
  edges hold for A is the origin's;
- between the edges only one-use edge tokens travel, never the ``*`` upstream token;
- a flood of WebRTC offers (from a holder of the cluster key: tenants cannot send any) leaves the
  edge's file descriptors within its answering bounds, and they close again.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import pytest

pytest.importorskip("aiortc")

from kdn.client import ClientConfig, KdnClient  # noqa: E402
from kdn.errors import Unauthorized  # noqa: E402
from kdn.integrations.transformers import generate  # noqa: E402
from kdn.keys import Namespace  # noqa: E402
from kdn.models import load_model  # noqa: E402
from kdn.wire.auth import EDGE_TOKEN_PREFIX, EdgeKey  # noqa: E402
from kdn.wire.signal import SignalClient  # noqa: E402

pytestmark = pytest.mark.integration

CHUNK = 64
KEY = "trust-test-cluster-key"
TOK_A, TOK_B, TOK_OPS = "tok-tenant-a", "tok-tenant-b", "tok-ops-star"
DOC = "".join(f"Clause {i}: the tenant keeps the premises in good repair and pays rent monthly. " for i in range(10))
PROMPT = DOC + " Question: who keeps the premises in repair? Answer:"


@pytest.fixture(autouse=True)
def loopback_candidates(monkeypatch):
    import aioice.ice

    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _origin(tmp_path):
    from kdn.origin.config import OriginConfig
    from kdn.origin.server import OriginServer

    origin = OriginServer(OriginConfig(
        store_dir=str(tmp_path / "origin"), models=["tiny"], listen="127.0.0.1:0", codecs=["raw"], chunk_size=CHUNK,
        verify_on_start="none", fsync=False, cluster_key=KEY,
        tokens={TOK_A: ["tenant-a"], TOK_B: ["tenant-b"], TOK_OPS: ["*"]}))
    origin.start()
    return origin


def _edge_config(tmp_path, name: str, origin: str, **kw):
    from kdn.edge.config import EdgeConfig

    return EdgeConfig(node_id=f"edge-{name}", listen="127.0.0.1:0", origin=origin, memory_bytes=64 << 20,
                      disk_dir=str(tmp_path / name), tokens={TOK_A: ["tenant-a"], TOK_B: ["tenant-b"]},
                      upstream_token=TOK_OPS, cluster_key=KEY, rtc_signal=origin, rtc_announce_s=0.3,
                      membership_refresh_s=0.2, shm=False, bulk=False, replicas=2, **kw)


class Recorder(grpc.GenericRpcHandler):
    """Tenant B's own gRPC server: records every call that reaches it (method, metadata)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def service(self, details):
        self.calls.append((details.method, tuple(details.invocation_metadata or ())))
        return None  # UNIMPLEMENTED: nothing B answers matters, that it is asked does


class SeenTokens:
    """Wraps an edge's TokenAuth: records the token of every data call it checks."""

    def __init__(self, auth) -> None:
        self._auth = auth
        self.tokens: list[str | None] = []

    def check(self, token, tenant):
        self.tokens.append(token)
        return self._auth.check(token, tenant)

    def __getattr__(self, name):
        return getattr(self._auth, name)


@pytest.mark.timeout(240)
def test_tenant_b_cannot_join_the_overlay_and_tenant_a_gets_exactly_its_own_kv(tmp_path):
    from kdn.edge.server import EdgeServer

    lm = load_model("tiny", chunk_size=CHUNK)
    origin = _origin(tmp_path)
    loop = LoopThread()
    edges: dict[str, EdgeServer] = {}
    evil = None
    try:
        assert origin.ingest_text(DOC, namespace=Namespace("tenant-a"), doc_id="lease")

        async def b_server():
            server = grpc.aio.server()
            rec = Recorder()
            server.add_generic_rpc_handlers((rec,))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, rec, f"127.0.0.1:{port}"

        evil, rec, evil_addr = loop.run(b_server())
        for name in ("a", "b"):
            edges[name] = EdgeServer(_edge_config(tmp_path, name, origin.address))
            loop.run(edges[name].start())
        seen_at_b = SeenTokens(edges["b"].front.auth)
        edges["b"].front.auth = seen_at_b  # type: ignore[assignment]

        deadline = time.monotonic() + 10
        while len(edges["a"].node.overlay.members) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(edges["a"].node.overlay.members) == {"edge-a", "edge-b"}

        async def tenant_b() -> list[str]:
            """Everything B tries with its own valid token, and with a key it made up."""
            refused = []
            attempts = {
                "announce its own node": lambda s: s.announce("edge-evil", evil_addr, ttl_s=600),
                "re-point edge-a": lambda s: s.announce("edge-a", evil_addr, ttl_s=600),
                "send an offer as itself": lambda s: s.send("edge-a", "edge-evil", "s1", "offer", "v=0"),
                "send an offer as edge-b": lambda s: s.send("edge-a", "edge-b", "s2", "offer", "v=0"),
                "forge edge-b's answer": lambda s: s.send("edge-a", "edge-b", "s3", "answer", "v=0 forged"),
                "read edge-a's mailbox": lambda s: s.receive("edge-a", wait_s=0),
            }
            for client in (SignalClient(origin.address, token=TOK_B),
                           SignalClient(origin.address, edge=EdgeKey("a-key-tenant-b-made-up", "edge-evil"))):
                try:
                    for what, call in attempts.items():
                        try:
                            await call(client)
                        except Unauthorized:
                            refused.append(what)
                finally:
                    await client.close()
            return refused

        assert len(loop.run(tenant_b())) == 12  # six attempts, with either credential: all refused
        time.sleep(1.0)  # a few announce rounds: had anything got in, the edges would have dialled it
        assert set(edges["a"].node.overlay.members) == {"edge-a", "edge-b"}
        assert {m.address for m in edges["a"].node.overlay.members.values()} == {edges["a"].address,
                                                                                edges["b"].address}

        cfg = dict(token=TOK_A, tenant="tenant-a", lookup_timeout_s=20.0, fetch_timeout_s=20.0, shm="off", bulk=False,
                   write_back=False)  # what the edges hold for A then came from the origin alone
        with KdnClient(ClientConfig(edge=edges["a"].address, **cfg)) as client:
            got = generate(lm, PROMPT, client=client, max_new_tokens=6)
        base = generate(lm, PROMPT, max_new_tokens=6)
        assert got.reused_tokens >= CHUNK and got.tokens == base.tokens and not got.warnings

        # what the edges hold for A is, byte for byte, what the origin made
        held = {e: edges[e].node.store.entries(tenant="tenant-a") for e in edges}
        assert held["a"]
        for name, entries in held.items():
            for entry in entries:
                data, _tier = edges[name].node.store.get(entry.meta.key, tenant="tenant-a")
                assert bytes(data) == origin.artifact_bytes(entry.meta.key, Namespace("tenant-a"), None, "", False)

        # B's server was never asked anything: no token of any edge left the cluster
        assert rec.calls == []
        # edge-b was asked by edge-a (A's misses, local copies) with one-use edge tokens only
        assert seen_at_b.tokens and all(t and t.startswith(EDGE_TOKEN_PREFIX) for t in seen_at_b.tokens)
        assert TOK_OPS not in seen_at_b.tokens
    finally:
        for e in edges.values():
            loop.run(e.stop())
        if evil is not None:
            loop.run(evil.stop(None))
        loop.close()
        origin.stop()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(180)
def test_a_flood_of_offers_holds_a_bounded_number_of_connections_for_a_bounded_time(tmp_path):
    """150 offers from one node, then 5 each from 30 more, to an edge answering at most 4 per
    peer and 16 in all: at most 16 peer connections (two sockets each) are open at any time, and
    none is left once ``rtc_connect_timeout_s`` has passed. A tenant's fetch keeps working."""
    import aiortc

    from kdn.edge.server import EdgeServer

    origin = _origin(tmp_path)
    loop = LoopThread()
    edge = None
    try:
        cfg = _edge_config(tmp_path, "a", origin.address, rtc_mode="always", rtc_connect_timeout_s=2.0,
                           rtc_max_answers=16, rtc_max_answers_per_peer=4, rtc_prewarm=False)
        edge = EdgeServer(cfg)
        loop.run(edge.start())
        base = _fds()

        async def offer_sdp() -> str:
            pc = aiortc.RTCPeerConnection(aiortc.RTCConfiguration(iceServers=[]))
            pc.createDataChannel("kdn/1")
            await pc.setLocalDescription(await pc.createOffer())
            sdp = pc.localDescription.sdp
            await pc.close()
            return sdp

        sdp = loop.run(offer_sdp())
        peak = [0]

        async def flood(senders: list[str], per_sender: int) -> None:
            for node in senders:
                sig = SignalClient(origin.address, edge=EdgeKey(KEY, node))
                try:
                    await sig.announce(node, "192.0.2.1:1", ttl_s=60)
                    for i in range(per_sender):
                        await sig.send("edge-a", node, f"{node}-{i}", "offer", sdp)
                        peak[0] = max(peak[0], len(edge.rtc.endpoint._served))
                        if i % 10 == 0:
                            await asyncio.sleep(0.01)  # let the edge's mailbox loop take them in
                finally:
                    await sig.close()

        keys = origin.ingest_text(DOC, namespace=Namespace("tenant-a"), doc_id="lease")
        fp = origin.default_fingerprint

        async def tenant_a_fetch() -> int:
            from kdn.artifact import ArtifactReader
            from kdn.transport import GrpcEdgeTransport
            from kdn.wire.convert import FetchSpec

            t = GrpcEdgeTransport(edge.address, token=TOK_A, bulk=False)
            try:
                spec = FetchSpec(keys[0], fp, Namespace("tenant-a"))
                reader = ArtifactReader(expect_key=keys[0], expect_fingerprint=fp, decode=False)
                stats = await t.fetch_into(spec, reader, timeout=20)
                reader.finish()
                return stats.bytes
            finally:
                await t.close()

        async def both() -> int:
            flooding = asyncio.ensure_future(flood(["edge-flood"], 150))
            await asyncio.sleep(0.2)
            got = await tenant_a_fetch()  # while the offers pour in
            await flooding
            return got

        assert loop.run(both()) > 0
        loop.run(flood([f"edge-f{i}" for i in range(30)], 5))
        time.sleep(0.5)
        assert peak[0] <= 16 and len(edge.rtc.endpoint._served) <= 16
        during = _fds() - base
        assert during <= 16 * 3 + 8, during  # a few sockets per answered connection, at most 16 of them
        dropped = edge.node.metrics.rtc_offers.labels("dropped")._value.get()
        assert dropped >= 150 + 150 - 16 * 3, dropped  # most offers built nothing at all
        time.sleep(3.0)  # past rtc_connect_timeout_s: every half-open connection closed
        assert not edge.rtc.endpoint._served
        assert _fds() - base <= 4, _fds() - base
    finally:
        if edge is not None:
            loop.run(edge.stop())
        loop.close()
        origin.stop()
