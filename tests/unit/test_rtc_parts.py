"""WebRTC pieces without sockets: ICE config and its secret, the signalling board's bounds, the
data-channel request parser, the gRPC-or-WebRTC choice, and the missing-extra error."""

from __future__ import annotations

import asyncio
import logging
import struct
import sys

import pytest

from kdn.errors import ConfigError, InvalidInput, MessageTooLarge, NotFound
from kdn.proto import kdn_pb2 as pb
from kdn.wire import rtc
from kdn.wire.signal import MAX_SDP, MAX_WAITING, SignalBoard

SECRET = "s3cr3t-turn-credential"


def _config(**kw):
    from kdn.edge.config import EdgeConfig

    return EdgeConfig(rtc_signal="203.0.113.10:50051", rtc_ice_servers=[
        {"urls": ["stun:203.0.113.10:3478"]},
        {"urls": ["turn:203.0.113.10:3478?transport=udp"], "username": "kdn", "credential": SECRET},
    ], **kw)


def test_turn_credentials_never_appear_in_reprs_dumps_or_logs(caplog):
    from kdn.edge.rtc import ice_servers

    cfg = _config()
    servers = ice_servers(cfg)
    assert servers[1].credential == SECRET  # handed to aiortc, and only there
    caplog.set_level(logging.DEBUG)
    logging.getLogger("kdn.test").info("config %r servers %r %s", cfg, servers, servers)
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), repr(servers), caplog.text):
        assert SECRET not in text


@pytest.mark.parametrize("server,why", [
    ({"urls": ["http://x:3478"]}, "must start with"),
    ({"urls": ["turn:x:3478"]}, "needs a username and a credential"),
    ({"urls": []}, "urls"),
])
def test_bad_ice_servers_are_refused_naming_the_field(server, why):
    from kdn.edge.config import EdgeConfig

    with pytest.raises(ConfigError, match=why):
        EdgeConfig.build({"rtc_ice_servers": [server]})


def test_bad_rtc_settings_are_refused():
    from kdn.edge.config import EdgeConfig

    with pytest.raises(ConfigError, match="rtc_mode"):
        EdgeConfig.build({"rtc_mode": "sometimes"})
    with pytest.raises(ConfigError, match="rtc_signal"):
        EdgeConfig.build({"rtc_signal": "no-port"})
    with pytest.raises(ConfigError, match="rtc_link_codec must be lossless"):
        EdgeConfig.build({"rtc_link_codec": "int8"})
    with pytest.raises(ConfigError, match="rtc_link_codec"):
        EdgeConfig.build({"rtc_link_codec": "brotli"})
    assert EdgeConfig.build({"rtc_link_codec": "raw"}).rtc_link_codec == ""  # raw: as stored
    assert EdgeConfig.build({"rtc_link_codec": "zstd"}).rtc_link_codec == "zstd:3"  # the spec, level named
    assert EdgeConfig.build({}).rtc_link_codec == "zstd:1"


def test_webrtc_without_aiortc_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiortc", None)  # import aiortc -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'kdn\[webrtc\]'"):
        rtc.require_aiortc()


def test_signal_board_bounds_every_input():
    now = [0.0]
    board = SignalBoard(clock=lambda: now[0])

    async def main():
        board.announce(pb.Announcement(node_id="a", address="10.0.0.1:1", ttl_s=10))
        board.announce(pb.Announcement(node_id="b", address="10.0.0.2:1", ttl_s=10))
        with pytest.raises(InvalidInput, match="kind"):
            board.send(pb.SignalMessage(to="b", sender="a", session="s", kind="candy"))
        with pytest.raises(MessageTooLarge):
            board.send(pb.SignalMessage(to="b", sender="a", session="s", kind="offer", sdp="x" * (MAX_SDP + 1)))
        with pytest.raises(NotFound):
            board.send(pb.SignalMessage(to="nobody", sender="a", session="s", kind="offer"))
        with pytest.raises(NotFound):  # the sender must have announced itself
            board.send(pb.SignalMessage(to="b", sender="ghost", session="s", kind="offer"))
        with pytest.raises(InvalidInput, match="ttl_s"):
            board.announce(pb.Announcement(node_id="c", ttl_s=0))
        with pytest.raises(InvalidInput, match="wait_s"):
            await board.receive("b", 3600)
        for i in range(MAX_WAITING + 5):  # a full mailbox drops its oldest
            board.send(pb.SignalMessage(to="b", sender="a", session=f"s{i}", kind="offer", sdp="v=0"))
        got = await board.receive("b", 0)
        assert len(got) == MAX_WAITING and got[0].session == "s5" and board.dropped == 5
        # a long poll answers as soon as a message arrives
        waiter = asyncio.ensure_future(board.receive("b", 5))
        await asyncio.sleep(0.01)
        board.send(pb.SignalMessage(to="b", sender="a", session="late", kind="answer", sdp="v=0"))
        assert [m.session for m in await asyncio.wait_for(waiter, 1)] == ["late"]
        now[0] = 11.0  # announcements expire
        assert [a.node_id for a in board.announce(pb.Announcement(node_id="a", ttl_s=10))] == ["a"]

    asyncio.run(main())


def test_data_channel_requests_are_bounded_before_they_are_parsed():
    with pytest.raises(InvalidInput):
        rtc._parse_request(b"\x01")
    with pytest.raises(InvalidInput, match="token runs past"):
        rtc._parse_request(struct.pack("!BIH", rtc.FETCH, 1, 500) + b"abc")
    with pytest.raises(MessageTooLarge):
        rtc._parse_request(b"\x02" + b"\0" * rtc.MAX_REQUEST)
    msg = rtc._request(rtc.FETCH, 7, "tok", rtc.FLAG_FORWARDED, b"body")
    assert rtc._parse_request(msg) == (rtc.FETCH, 7, "tok", rtc.FLAG_FORWARDED, b"body")


class _Up:
    def __init__(self, name, healthy, delay=0.0):
        self.name, self.address, self._healthy, self._delay = name, "10.0.0.2:1", healthy, delay
        self.fetched = 0

    async def healthy(self):
        await asyncio.sleep(self._delay)
        return self._healthy

    async def fetch(self, spec, *, token=None):
        self.fetched += 1
        return b"data"

    async def close(self):
        pass


@pytest.mark.parametrize("grpc_ok,delay,expect", [(True, 0.0, "grpc"), (False, 0.0, "rtc"), (True, 5.0, "rtc")])
def test_a_peer_is_dialled_over_grpc_when_it_answers_in_time_else_webrtc(grpc_ok, delay, expect):
    from kdn.edge.metrics import EdgeMetrics
    from kdn.edge.rtc import AutoPeerUpstream

    g, r = _Up("b", grpc_ok, delay), _Up("b", True)
    up = AutoPeerUpstream(g, r, EdgeMetrics("a"), probe_s=0.05)  # type: ignore[arg-type]
    assert asyncio.run(up.fetch(None)) == b"data"  # type: ignore[arg-type]
    assert up.path == expect and (g.fetched, r.fetched) == ((1, 0) if expect == "grpc" else (0, 1))


def test_the_path_is_rechecked_in_the_background_and_at_once_after_a_failure():
    from kdn.edge.metrics import EdgeMetrics
    from kdn.edge.rtc import AutoPeerUpstream

    async def main():
        g, r = _Up("b", False), _Up("b", True)
        up = AutoPeerUpstream(g, r, EdgeMetrics("a"), probe_s=0.05, recheck_s=0.0)  # type: ignore[arg-type]
        await up.fetch(None)  # type: ignore[arg-type]
        assert up.path == "rtc"
        g._healthy = True  # the peer became dialable
        await up.fetch(None)  # type: ignore[arg-type]
        assert r.fetched == 2  # this request kept the known path; the probe ran beside it
        await asyncio.sleep(0.01)
        assert up.path == "grpc"
        g._healthy = False
        assert await up.healthy() is True and up.path == "rtc"  # after a failure: probed at once
        await up.close()

    asyncio.run(main())


class _FakePc:
    connectionState = "connected"

    def __init__(self, relay: bool) -> None:
        self.relay = relay
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class _FakeChannel:
    readyState = "open"

    def on(self, *_a: object) -> None:
        pass


def _racing_endpoint(monkeypatch, outcomes: dict[bool, tuple[float, object]]):
    """An RtcEndpoint with a TURN server whose attempts (relay-only or not) finish after the given
    delay with the given result: "up", or an exception to raise. Records starts and cancels."""
    pytest.importorskip("aiortc")
    log: list[str] = []
    ep = rtc.RtcEndpoint("a", signal=None, ice_servers=[rtc.IceServer(("turn:203.0.113.10:3478",), "u", "c")],
                         connect_timeout_s=2.0, relay_after_s=0.2)

    async def attempt(peer: str, relay: bool, timeout_s: float):
        name = "relay" if relay else "all"
        log.append(f"start {name}")
        delay, result = outcomes[relay]
        try:
            await asyncio.sleep(min(delay, timeout_s))
        except asyncio.CancelledError:
            log.append(f"cancel {name}")
            raise
        if delay > timeout_s:
            raise asyncio.TimeoutError
        if isinstance(result, BaseException):
            raise result
        return _FakePc(relay), _FakeChannel()

    monkeypatch.setattr(ep, "_attempt", attempt)
    return ep, log


def test_a_direct_path_wins_before_the_relay_attempt_starts(monkeypatch):
    ep, log = _racing_endpoint(monkeypatch, {False: (0.05, "up"), True: (0.05, "up")})
    client = asyncio.run(ep._dial("b"))
    assert not client.pc.relay and log == ["start all"]  # the relay attempt was still waiting its turn


def test_no_direct_path_the_relay_attempt_beside_it_wins_and_the_first_is_closed(monkeypatch):
    ep, log = _racing_endpoint(monkeypatch, {False: (60.0, "up"), True: (0.05, "up")})
    client, took = asyncio.run(asyncio.wait_for(_timed_dial(ep), 5))
    assert client.pc.relay and took < 1.0  # relay_after_s + the relayed setup, not the direct attempt's timeout
    assert log == ["start all", "start relay", "cancel all"]


async def _timed_dial(ep):
    import time

    t0 = time.monotonic()
    client = await ep._dial("b")
    return client, time.monotonic() - t0


def test_both_attempts_failing_is_unavailable_with_the_reason_and_not_retried_at_once(monkeypatch):
    ep, log = _racing_endpoint(monkeypatch, {False: (60.0, "up"), True: (60.0, "up")})
    with pytest.raises(rtc.Unavailable, match="no connection"):
        asyncio.run(ep._dial("b"))
    assert "b" in ep._failed
    with pytest.raises(rtc.Unavailable, match="failed .* ago"):
        asyncio.run(ep.connect("b"))


def test_a_peer_nobody_knows_stops_both_attempts(monkeypatch):
    ep, log = _racing_endpoint(monkeypatch, {False: (0.3, NotFound("no such node")), True: (60.0, "up")})
    with pytest.raises(rtc.Unavailable, match="no such node"):
        asyncio.run(asyncio.wait_for(ep._dial("b"), 2.0))
    assert log == ["start all", "start relay", "cancel relay"]
