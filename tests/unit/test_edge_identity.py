"""Edges' identity (kdn.wire.auth.EdgeKey) and what the signalling service lets each caller do.

No sockets: signalling runs on the in-process gRPC (kdn.wire.inproc), WebRTC answering on fake
peer connections. Tenant B holds a valid tenant token, even a ``*`` one; none of it lets B
announce, overwrite, send or read a mailbox, and an answer from any node but the one dialled is
dropped.
"""

from __future__ import annotations

import asyncio

import pytest

from kdn.errors import Unauthorized
from kdn.proto import kdn_pb2 as pb
from kdn.wire.auth import SIGNAL_NODE, SIGNAL_SCOPE, EdgeKey, TokenAuth, tenant_scope
from kdn.wire.inproc import InProcessServer
from kdn.wire.service import add_servicer
from kdn.wire.signal import SignalBoard, SignalClient, SignalServicer

KEY = "cluster-key-for-unit-tests"
TENANT_B = "tok-tenant-b"
OPS = "tok-ops-star"


def test_an_edge_token_is_good_for_one_request_to_one_node_in_one_scope_for_a_minute():
    now = [1000.0]
    a = EdgeKey(KEY, "edge-a", clock=lambda: now[0])
    b = EdgeKey(KEY, "edge-b", clock=lambda: now[0])
    c = EdgeKey(KEY, "edge-c", clock=lambda: now[0])
    tok = a.mint("edge-b", tenant_scope("t1"))
    assert b.verify(tok, tenant_scope("t1")) == "edge-a"
    with pytest.raises(Unauthorized):
        b.verify(tok, tenant_scope("t1"))  # the same token again: a replay
    for verifier, scope in ((c, tenant_scope("t1")), (b, tenant_scope("t2"))):
        with pytest.raises(Unauthorized):
            verifier.verify(a.mint("edge-b", tenant_scope("t1")), scope)  # another node, another tenant
    old = a.mint("edge-b", SIGNAL_SCOPE)
    now[0] += 61
    with pytest.raises(Unauthorized):
        b.verify(old, SIGNAL_SCOPE)  # older than the window
    forged = EdgeKey("not-the-cluster-key!", "edge-a", clock=lambda: now[0]).mint("edge-b", SIGNAL_SCOPE)
    for bad in (forged, OPS, "", None, "kdn-edge1." + "zz.zz.1.2.3", tok.replace("edge", "edgf")):
        with pytest.raises(Unauthorized):
            b.verify(bad, SIGNAL_SCOPE)
    assert KEY not in repr(a)


def test_token_auth_takes_an_edge_token_for_its_tenant_and_tenant_tokens_as_before():
    b = EdgeKey(KEY, "edge-b")
    auth = TokenAuth.from_config({TENANT_B: ["tenant-b"], OPS: ["*"]}, b)
    auth.check(EdgeKey(KEY, "edge-a").mint("edge-b", tenant_scope("tenant-a")), "tenant-a")
    auth.check(OPS, "tenant-a")
    with pytest.raises(Unauthorized):
        auth.check(TENANT_B, "tenant-a")
    with pytest.raises(Unauthorized):  # an edge token for tenant b does not open tenant a
        auth.check(EdgeKey(KEY, "edge-a").mint("edge-b", tenant_scope("tenant-b")), "tenant-a")
    with pytest.raises(Unauthorized):  # and a node-wide call is not an edge's
        auth.check_admin(EdgeKey(KEY, "edge-a").mint("edge-b", tenant_scope("tenant-a")))


def _signalling(board: SignalBoard | None = None):
    """A signalling service as the origin serves it (tokens and a cluster key), in process."""
    server = InProcessServer()
    auth = TokenAuth.from_config({TENANT_B: ["tenant-b"], OPS: ["*"]})
    board = board or SignalBoard()
    add_servicer(server, SignalServicer(board, auth, edges=EdgeKey(KEY, SIGNAL_NODE)), "SignalService")
    return server, board


def _edge(server: InProcessServer, node: str, key: str = KEY) -> SignalClient:
    return SignalClient("inproc", channel=server.channel(), edge=EdgeKey(key, node))


def _tenant(server: InProcessServer, token: str) -> SignalClient:
    return SignalClient("inproc", channel=server.channel(), token=token)


def test_tenant_tokens_cannot_announce_send_or_read_mailboxes():
    async def main():
        server, board = _signalling()
        a = _edge(server, "edge-a")
        await a.announce("edge-a", "10.0.0.1:7070", ttl_s=60)
        for token in (TENANT_B, OPS):  # a tenant's token, and even an operator's "*" one
            b = _tenant(server, token)
            with pytest.raises(Unauthorized):
                await b.announce("evil-node", "203.0.113.66:1", ttl_s=60)
            with pytest.raises(Unauthorized):
                await b.announce("edge-a", "203.0.113.66:1", ttl_s=60)  # re-point a real edge
            with pytest.raises(Unauthorized):
                await b.send("edge-a", "edge-a", "s1", "answer", "v=0")
            with pytest.raises(Unauthorized):
                await b.receive("edge-a", wait_s=0)
        members = await a.announce("edge-a", "10.0.0.1:7070", ttl_s=60)
        assert [(m.node_id, m.address) for m in members] == [("edge-a", "10.0.0.1:7070")]

    asyncio.run(main())


def test_an_edge_acts_only_as_itself():
    async def main():
        server, board = _signalling()
        a, c = _edge(server, "edge-a"), _edge(server, "edge-c")
        await a.announce("edge-a", "10.0.0.1:7070", ttl_s=60)
        await c.announce("edge-c", "10.0.0.3:7070", ttl_s=60)
        with pytest.raises(Unauthorized):
            await c.announce("edge-a", "10.0.0.3:7070", ttl_s=60)  # another node's id
        with pytest.raises(Unauthorized):
            await c.send("edge-a", "edge-b", "s1", "offer", "v=0")  # as another sender
        with pytest.raises(Unauthorized):
            await c.receive("edge-a", wait_s=0)  # another node's mailbox
        with pytest.raises(Unauthorized):  # a node holding another key is no edge of this cluster
            await _edge(server, "edge-x", key="another-clusters-key").announce("edge-x", "10.0.0.9:1", ttl_s=60)
        for i in range(20):
            await c.send("edge-a", "edge-c", f"s{i}", "offer", "v=0")
        got = await a.receive("edge-a", wait_s=0)
        assert [(m.sender, m.session) for m in got] == [("edge-c", f"s{i}") for i in range(20)]
        assert {m.address for m in board.announce(pb.Announcement(node_id="edge-c", address="10.0.0.3:7070",
                                                                  ttl_s=60))} == {"10.0.0.1:7070", "10.0.0.3:7070"}

    asyncio.run(main())


def test_signalling_without_a_cluster_key_refuses_every_token_when_tokens_are_set():
    async def main():
        server = InProcessServer()
        auth = TokenAuth.from_config({OPS: ["*"]})
        add_servicer(server, SignalServicer(SignalBoard(), auth), "SignalService")
        with pytest.raises(Unauthorized, match="cluster_key"):
            await _tenant(server, OPS).announce("edge-a", "10.0.0.1:1", ttl_s=60)

    asyncio.run(main())


# -- WebRTC: who may answer, and how many connections an edge answers ----------------------------


class _Signal:
    """Records what an endpoint sends through signalling."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str, str]] = []

    async def send(self, to, sender, session, kind, sdp=""):
        self.sent.append((to, sender, session, kind))


class _Pc:
    """An aiortc RTCPeerConnection stand-in: answers at once, opens no socket."""

    made: list["_Pc"] = []

    def __init__(self, configuration=None) -> None:
        self.connectionState = "new"
        self.closed = False
        self.localDescription = type("D", (), {"sdp": "v=0 answer"})()
        _Pc.made.append(self)

    def on(self, event):
        return lambda fn: fn

    async def setRemoteDescription(self, d):
        return None

    async def createAnswer(self):
        return None

    async def setLocalDescription(self, d):
        return None

    async def close(self):
        self.closed = True


def _offer(sender: str, session: str) -> pb.SignalMessage:
    return pb.SignalMessage(to="edge-a", sender=sender, session=session, kind="offer", sdp="v=0")


def test_answered_connections_are_bounded_per_peer_and_in_total_and_half_open_ones_close(monkeypatch):
    aiortc = pytest.importorskip("aiortc")
    from kdn.wire import rtc

    monkeypatch.setattr(aiortc, "RTCPeerConnection", _Pc)
    _Pc.made = []

    async def main():
        outcomes: list[str] = []
        ep = rtc.RtcEndpoint("edge-a", _Signal(), connect_timeout_s=0.3, max_answers=8, max_answers_per_peer=2,
                             on_offer=outcomes.append)
        ep.handler = object()  # type: ignore[assignment]
        for i in range(300):  # one peer's flood: two connections answered, the rest dropped unbuilt
            ep._take_offer(_offer("edge-flood", f"f{i}"))
        await asyncio.sleep(0.05)
        assert len(ep._served) == 2 and len(_Pc.made) == 2 and outcomes.count("dropped") == 298
        for i in range(100):  # many peers: at most max_answers at once
            ep._take_offer(_offer(f"edge-{i}", f"m{i}"))
        assert len(ep._served) == 8 and len(_Pc.made) == 8
        await asyncio.sleep(0.5)  # no channel opened within connect_timeout_s: every one closed
        assert not ep._served and all(pc.closed for pc in _Pc.made)
        ep._take_offer(_offer("edge-flood", "later"))  # room again
        assert len(ep._served) == 1
        await ep.close()
        assert all(pc.closed for pc in _Pc.made)

    asyncio.run(main())


def test_a_redialling_peer_replaces_its_oldest_open_connection(monkeypatch):
    aiortc = pytest.importorskip("aiortc")
    from kdn.wire import rtc

    monkeypatch.setattr(aiortc, "RTCPeerConnection", _Pc)
    _Pc.made = []

    async def main():
        ep = rtc.RtcEndpoint("edge-a", _Signal(), connect_timeout_s=5.0, max_answers_per_peer=2)
        ep.handler = object()  # type: ignore[assignment]
        for i in range(2):
            ep._take_offer(_offer("edge-b", f"s{i}"))
            ep._served[f"s{i}"].opened = True  # its channel opened
        ep._take_offer(_offer("edge-b", "s2"))  # the peer restarted and dials again
        await asyncio.sleep(0.01)
        assert list(ep._served) == ["s1", "s2"] and _Pc.made[0].closed
        ep._take_offer(_offer("edge-c", "s1"))  # a session id another peer holds: not taken over
        assert ep._served["s1"].peer == "edge-b"
        await ep.close()

    asyncio.run(main())


def test_an_answer_from_any_node_but_the_one_dialled_is_dropped():
    pytest.importorskip("aiortc")
    from kdn.wire import rtc

    class Mailbox:
        def __init__(self, batches):
            self.batches = batches

        async def receive(self, node_id, wait_s=10.0):
            if self.batches:
                return self.batches.pop(0)
            await asyncio.sleep(3600)

    async def main():
        forged = pb.SignalMessage(to="edge-a", sender="edge-evil", session="s1", kind="answer", sdp="forged")
        real = pb.SignalMessage(to="edge-a", sender="edge-b", session="s1", kind="answer", sdp="real")
        ep = rtc.RtcEndpoint("edge-a", Mailbox([[forged], [real]]))  # type: ignore[arg-type]
        fut = asyncio.get_running_loop().create_future()
        ep._answers["s1"] = ("edge-b", fut)
        ep.start()
        assert await asyncio.wait_for(fut, 2) == "real"
        await ep.close()

    asyncio.run(main())


def test_a_bye_closes_only_the_senders_own_connection(monkeypatch):
    aiortc = pytest.importorskip("aiortc")
    from kdn.wire import rtc

    monkeypatch.setattr(aiortc, "RTCPeerConnection", _Pc)

    class Mailbox:
        def __init__(self):
            self.q: asyncio.Queue = asyncio.Queue()

        async def receive(self, node_id, wait_s=10.0):
            return [await self.q.get()]

    async def main():
        box = Mailbox()
        ep = rtc.RtcEndpoint("edge-a", box, connect_timeout_s=5.0)  # type: ignore[arg-type]
        ep.handler = object()  # type: ignore[assignment]
        ep._take_offer(_offer("edge-b", "s1"))
        ep.start()
        await box.q.put(pb.SignalMessage(to="edge-a", sender="edge-evil", session="s1", kind="bye"))
        await asyncio.sleep(0.05)
        assert "s1" in ep._served
        await box.q.put(pb.SignalMessage(to="edge-a", sender="edge-b", session="s1", kind="bye"))
        await asyncio.sleep(0.05)
        assert "s1" not in ep._served
        await ep.close()

    asyncio.run(main())

