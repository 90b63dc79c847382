"""Edge ↔ edge over WebRTC data channels (aiortc), for edges that cannot dial each other (NAT).

One :class:`RtcEndpoint` per edge. It long-polls its mailbox on the signalling service
(:mod:`kdn.wire.signal`, served by the origin) and:

- **dials** (:meth:`RtcEndpoint.connect`): a peer connection with one ordered, reliable data
  channel; the offer (SDP with every gathered ICE candidate: host, server-reflexive from STUN,
  relayed from TURN) goes to the peer's mailbox, the answer comes back through ours. ICE then
  picks a direct path where the NATs allow it and the TURN relay where they do not;
- **answers** offers addressed to it, and serves the requests that arrive on the channel with
  an :class:`RtcHandler` (the edge's own Lookup/Fetch logic, :mod:`kdn.edge.rtc`).

Who is on the other end: the signalling service lets each edge act only as itself (edge tokens,
:mod:`kdn.wire.signal`), so an offer's sender is the node that sent it, and a dialer takes an
answer only from the node it dialled (an answer naming another sender is dropped). The SDP
carries each side's DTLS fingerprint, so the channel runs to that node and no other.

Answering is bounded: at most ``max_answers`` connections answered at once (an offer past it is
dropped) and ``max_answers_per_peer`` per peer (past it, an offer is dropped while that peer has
connections still opening, and otherwise closes its oldest one: a restarted dialer gets
through); a connection whose channel has not opened ``connect_timeout_s`` after the offer
(half-open: the dialer went away, or never meant it) is closed. A dropped offer costs no socket.
So a flood of offers holds at most ``max_answers`` connections, each for a bounded time unless
its channel opens.

Requests and answers on the channel (one message each; ``!BI`` = kind, request id)::

    LOOKUP / FETCH  u16 token length, token (utf-8), u8 flags, a LookupRequest / FetchRequest
                    (flags: FORWARDED, a miss fetched on another edge's behalf; LINK_CODEC, a raw
                    container may come in the answering edge's lossless link codec)
    LOOKUP_OK       a LookupResponse
    HEAD            u64 total size, source (utf-8)      then DATA pieces, then END
    DATA            up to PIECE bytes of the artifact container
    ERROR           u32 gRPC status value, message — the handler's refusal (:meth:`RtcHandler.refuse`;
                    the edge's front decides it with the same mapping as gRPC, kdn.wire.errors)

The bearer token travels with every request and the answering edge checks it against the
request's tenant exactly as its gRPC servicer does: a data channel is not a way around auth.
Artifact bytes are the container's bytes as stored; the receiving edge verifies every checksum
(as for any upstream) before it keeps or serves them. A sender waits while the channel's
``bufferedAmount`` is above :data:`HIGH_WATER` (back-pressure), so a large artifact never sits
in memory twice on the way out. Every length is bounded before it is trusted.

aiortc is an optional dependency (the ``webrtc`` extra): importing this module does not need
it; :func:`require_aiortc` says plainly what to install when WebRTC is configured without it.
TURN credentials are held in :class:`IceServer` with ``repr=False``: they never reach a log line.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence

from kdn.errors import ConfigError, InvalidInput, KdnError, MessageTooLarge, Unavailable
from kdn.proto import kdn_pb2 as pb
from kdn.wire.errors import error_from_status
from kdn.wire.signal import SignalClient

__all__ = [
    "IceServer", "RtcClient", "RtcEndpoint", "RtcHandler", "PIECE", "HIGH_WATER", "require_aiortc", "FLAG_FORWARDED",
    "FLAG_LINK_CODEC",
]

log = logging.getLogger(__name__)

LOOKUP, FETCH, LOOKUP_OK, HEAD, DATA, END, ERROR = 1, 2, 11, 12, 13, 14, 15
_HDR = struct.Struct("!BI")
PIECE = 60 << 10  # data bytes per message (aiortc's SCTP takes up to 64 KiB per message)
HIGH_WATER = 1 << 20  # bytes queued on a channel before the sender waits
LOW_WATER = 256 << 10
MAX_REQUEST = 256 << 10  # a Lookup of 4096 keys is ~140 KiB
FLAG_FORWARDED = 1
FLAG_LINK_CODEC = 2
CHANNEL_LABEL = "kdn/1"


def require_aiortc() -> Any:
    """The aiortc module, or a ConfigError that says how to get it."""
    try:
        import aiortc
    except ImportError as exc:  # pragma: no cover - exercised by the unit test with aiortc hidden
        raise ConfigError(
            "WebRTC (rtc_signal in the edge config) needs the aiortc package: pip install 'kdn[webrtc]'"
        ) from exc
    return aiortc


@dataclass(frozen=True, slots=True)
class IceServer:
    """One STUN or TURN server. ``credential`` never appears in a repr, a log line or an error."""

    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for u in self.urls:
            if not u.startswith(("stun:", "turn:", "turns:")):
                raise ConfigError(f"ICE server URL must start with stun:, turn: or turns:, got {u.split('?')[0][:60]!r}")
            if u.startswith("turn") and (not self.username or not self.credential):
                raise ConfigError(f"TURN server {u.split('?')[0]} needs a username and a credential")

    def to_aiortc(self) -> Any:
        aiortc = require_aiortc()
        return aiortc.RTCIceServer(urls=list(self.urls), username=self.username, credential=self.credential)


class RtcHandler(Protocol):
    """What the answering side serves (the edge's Lookup/Fetch logic, auth included), and what a
    failed request is answered with: ``refuse(rpc, exc)`` -> (gRPC status value, message), the
    handler's decision (the edge's front counts it); the channel only frames it as ERROR."""

    async def lookup(self, request: pb.LookupRequest, token: str | None) -> pb.LookupResponse: ...

    async def fetch(
        self, request: pb.FetchRequest, token: str | None, *, forwarded: bool, link_codec: bool = False
    ) -> tuple[bytes, str]: ...

    def refuse(self, rpc: str, exc: BaseException) -> tuple[int, str]: ...


def _request(kind: int, rid: int, token: str | None, flags: int, body: bytes) -> bytes:
    tok = (token or "").encode()
    return _HDR.pack(kind, rid) + struct.pack("!H", len(tok)) + tok + bytes([flags]) + body


def _parse_request(msg: bytes) -> tuple[int, int, str | None, int, bytes]:
    if len(msg) < _HDR.size + 3:
        raise InvalidInput("data channel request shorter than its header")
    if len(msg) > MAX_REQUEST:
        raise MessageTooLarge(f"data channel request of {len(msg)} bytes (limit {MAX_REQUEST})")
    kind, rid = _HDR.unpack_from(msg)
    (n,) = struct.unpack_from("!H", msg, _HDR.size)
    at = _HDR.size + 2
    if at + n + 1 > len(msg):
        raise InvalidInput("data channel request: token runs past the message")
    token = msg[at : at + n].decode("utf-8", "replace") or None
    flags = msg[at + n]
    return kind, rid, token, flags, msg[at + n + 1 :]


class _Sender:
    """Sends on a data channel, waiting while too much is queued (``bufferedAmount``)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self._low = asyncio.Event()
        channel.bufferedAmountLowThreshold = LOW_WATER
        channel.on("bufferedamountlow", self._low.set)

    async def send(self, msg: bytes) -> None:
        while self.channel.bufferedAmount > HIGH_WATER:
            if self.channel.readyState != "open":
                raise Unavailable("data channel closed while sending")
            self._low.clear()
            try:
                await asyncio.wait_for(self._low.wait(), 5.0)
            except asyncio.TimeoutError:
                pass  # re-check: the event may have fired between the test and clear
        if self.channel.readyState != "open":
            raise Unavailable("data channel closed while sending")
        self.channel.send(msg)


def _path_of(pc: Any) -> str:
    """"relayed" when the selected ICE pair uses a TURN relay on either end, else "direct"."""
    try:
        conn = pc.sctp.transport.transport._connection  # aiortc keeps the aioice Connection here
        pair = next(iter(conn._nominated.values()))
        kinds = (pair.local_candidate.type, pair.remote_candidate.type)
    except Exception:  # noqa: BLE001 - private aiortc/aioice attributes: unknown rather than wrong
        return "unknown"
    return "relayed" if "relay" in kinds else "direct"


class RtcClient:
    """A connected data channel to one peer, dialled by us: Lookup and Fetch, many at once."""

    def __init__(self, peer: str, pc: Any, channel: Any, setup_s: float) -> None:
        self.peer = peer
        self.pc = pc
        self.channel = channel
        self.setup_s = setup_s
        self.path = _path_of(pc)
        self.bytes_in = 0
        self._sender = _Sender(channel)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Queue[tuple[int, bytes]]] = {}
        channel.on("message", self._on_message)
        channel.on("close", self._on_close)

    @property
    def open(self) -> bool:
        return self.channel.readyState == "open" and self.pc.connectionState not in ("failed", "closed")

    def _on_message(self, msg: bytes | str) -> None:
        if isinstance(msg, str) or len(msg) < _HDR.size:
            return
        kind, rid = _HDR.unpack_from(msg)
        q = self._waiting.get(rid)
        if q is not None:
            q.put_nowait((kind, msg[_HDR.size :]))

    def _on_close(self) -> None:
        for q in self._waiting.values():
            q.put_nowait((ERROR, struct.pack("!I", 14) + b"data channel closed"))  # 14 = UNAVAILABLE

    async def _call(self, kind: int, token: str | None, flags: int, body: bytes) -> tuple[int, asyncio.Queue[tuple[int, bytes]]]:
        if not self.open:
            raise Unavailable(f"data channel to {self.peer} is closed")
        rid = next(self._ids)
        q: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self._waiting[rid] = q
        await self._sender.send(_request(kind, rid, token, flags, body))
        return rid, q

    def _error(self, payload: bytes) -> KdnError:
        if len(payload) < 4:
            return Unavailable(f"malformed error from {self.peer}")
        (code,) = struct.unpack_from("!I", payload)
        return error_from_status(code, payload[4:].decode("utf-8", "replace"), peer=f"rtc {self.peer}")

    async def lookup(self, request: pb.LookupRequest, *, token: str | None, timeout_s: float) -> pb.LookupResponse:
        rid, q = await self._call(LOOKUP, token, 0, request.SerializeToString())
        try:
            kind, payload = await asyncio.wait_for(q.get(), timeout_s)
        except asyncio.TimeoutError as exc:
            raise Unavailable(f"rtc {self.peer}: Lookup timed out after {timeout_s:g} s") from exc
        finally:
            self._waiting.pop(rid, None)
        if kind == ERROR:
            raise self._error(payload)
        if kind != LOOKUP_OK:
            raise Unavailable(f"rtc {self.peer}: unexpected answer kind {kind} to Lookup")
        return pb.LookupResponse.FromString(payload)

    async def fetch(
        self, request: pb.FetchRequest, *, token: str | None, timeout_s: float, limit: int, forwarded: bool = False,
        link_codec: bool = False,
    ) -> tuple[bytes, str]:
        """The artifact's container bytes (unverified: the caller verifies) and the peer's source.
        ``link_codec``: a raw container may come in the peer's lossless link codec instead."""
        flags = (FLAG_FORWARDED if forwarded else 0) | (FLAG_LINK_CODEC if link_codec else 0)
        rid, q = await self._call(FETCH, token, flags, request.SerializeToString())
        deadline = time.monotonic() + timeout_s
        buf: bytearray | None = None
        source = ""
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    kind, payload = await asyncio.wait_for(q.get(), max(left, 0.001))
                except asyncio.TimeoutError as exc:
                    raise Unavailable(f"rtc {self.peer}: Fetch timed out after {timeout_s:g} s") from exc
                if kind == ERROR:
                    raise self._error(payload)
                if kind == HEAD:
                    if len(payload) < 8:
                        raise Unavailable(f"rtc {self.peer}: malformed HEAD")
                    (total,) = struct.unpack_from("!Q", payload)
                    if total > limit:
                        raise MessageTooLarge(f"rtc {self.peer}: artifact of {total} bytes (limit {limit})")
                    buf = bytearray()
                    expected = total
                    source = payload[8:].decode("utf-8", "replace")
                elif kind == DATA:
                    if buf is None or len(buf) + len(payload) > expected:
                        raise Unavailable(f"rtc {self.peer}: more bytes than announced")
                    buf += payload
                elif kind == END:
                    if buf is None or len(buf) != expected:
                        raise Unavailable(f"rtc {self.peer}: stream ended short ({0 if buf is None else len(buf)} bytes)")
                    self.bytes_in += len(buf)
                    return bytes(buf), source
                else:
                    raise Unavailable(f"rtc {self.peer}: unexpected answer kind {kind} to Fetch")
        finally:
            self._waiting.pop(rid, None)

    async def close(self) -> None:
        await self.pc.close()


@dataclass(slots=True, eq=False)
class _Answered:
    """A peer connection this endpoint answered: whose, and whether its channel opened."""

    peer: str
    pc: Any
    opened: bool = False
    timer: asyncio.TimerHandle | None = None


class RtcEndpoint:
    """This edge's WebRTC side: dials peers, answers offers, serves requests with ``handler``.

    ``on_connect(peer, path, setup_s, role)`` is told of every connection once ICE and the channel
    are up (the edge's metrics)."""

    def __init__(
        self,
        node_id: str,
        signal: SignalClient,
        *,
        ice_servers: Sequence[IceServer] = (),
        handler: RtcHandler | None = None,
        connect_timeout_s: float = 10.0,
        relay_only: bool = False,
        relay_after_s: float = 1.5,
        on_connect: Callable[[str, str, float, str], None] | None = None,
        on_served: Callable[[str, int], None] | None = None,
        max_answers: int = 64,
        max_answers_per_peer: int = 4,
        on_offer: Callable[[str], None] | None = None,
    ) -> None:
        require_aiortc()
        self.node_id = node_id
        self.signal = signal
        self.ice_servers = tuple(ice_servers)
        self.handler = handler
        self.connect_timeout_s = connect_timeout_s
        self.relay_only = relay_only
        self.relay_after_s = relay_after_s
        self._on_connect = on_connect or (lambda *a: None)
        self._on_served = on_served or (lambda *a: None)
        self._on_offer = on_offer or (lambda outcome: None)  # "answered" | "dropped"
        self.max_answers = max_answers
        self.max_answers_per_peer = max_answers_per_peer
        self._clients: dict[str, RtcClient] = {}
        self._dialing: dict[str, asyncio.Future[RtcClient]] = {}
        self._answers: dict[str, tuple[str, asyncio.Future[str]]] = {}  # session -> (peer dialled, its answer)
        self._served: dict[str, _Answered] = {}  # session -> connection we answered, oldest first
        self._paths: dict[str, str] = {}  # session -> path of a connection we answered
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._failed: dict[str, tuple[float, str]] = {}  # peer -> (when a dial failed, why)
        self.retry_after_s = connect_timeout_s  # a peer that failed is not dialled again before this

    def __repr__(self) -> str:
        return f"RtcEndpoint({self.node_id!r}, {len(self.ice_servers)} ICE servers)"  # never the credentials

    def _config(self, relay: bool) -> Any:
        aiortc = require_aiortc()
        policy = aiortc.RTCIceTransportPolicy.RELAY if relay else aiortc.RTCIceTransportPolicy.ALL
        return aiortc.RTCConfiguration(iceServers=[s.to_aiortc() for s in self.ice_servers], iceTransportPolicy=policy)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.ensure_future(self._receive_loop())

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for a in self._served.values():
            if a.timer is not None:
                a.timer.cancel()
        pcs = [c.pc for c in self._clients.values()] + [a.pc for a in self._served.values()]
        self._clients.clear()
        self._served.clear()
        await asyncio.gather(*(pc.close() for pc in pcs), return_exceptions=True)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _receive_loop(self) -> None:
        backoff = 0.2
        while True:
            try:
                msgs = await self.signal.receive(self.node_id, wait_s=10.0)
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except KdnError as exc:  # not announced yet, signalling down: try again soon
                log.debug("%s: signal receive: %s", self.node_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            for m in msgs:
                if m.kind == "answer":
                    waiting = self._answers.get(m.session)
                    if waiting is not None and waiting[0] == m.sender and not waiting[1].done():
                        waiting[1].set_result(m.sdp)  # only the node dialled answers its session
                elif m.kind == "offer":
                    self._take_offer(m)
                elif m.kind == "bye":
                    served = self._served.get(m.session)
                    if served is not None and served.peer == m.sender:
                        self._forget(m.session, served)

    # -- dialling --------------------------------------------------------------------------------

    async def connect(self, peer: str) -> RtcClient:
        """A connected client to ``peer`` (reused while open); Unavailable if not up in time."""
        c = self._clients.get(peer)
        if c is not None and c.open:
            return c
        failed = self._failed.get(peer)
        if failed is not None and time.monotonic() - failed[0] < self.retry_after_s:
            raise Unavailable(f"WebRTC to {peer}: failed {time.monotonic() - failed[0]:.1f} s ago ({failed[1]})")
        fut = self._dialing.get(peer)
        if fut is None:
            fut = asyncio.ensure_future(self._dial(peer))
            self._dialing[peer] = fut
            fut.add_done_callback(lambda f, p=peer: self._dialing.pop(p, None))
        return await asyncio.shield(fut)

    @property
    def has_turn(self) -> bool:
        return any(u.startswith("turn") for srv in self.ice_servers for u in srv.urls)

    async def _dial(self, peer: str) -> RtcClient:
        """Every candidate first; when a TURN server is configured and no path is up after
        ``relay_after_s``, a second attempt with relay candidates only on both ends (the session
        id tells the answerer) runs beside it, and the first channel to open wins (the other
        attempt is closed, its peer told "bye"). In this project's NAT lab, with aiortc 1.16 and
        coturn 4.6.1, relayed pairs completed only in relay-only sessions, never among host and
        server-reflexive pairs; a direct path opens in ~0.55 s, before the relay attempt starts."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.connect_timeout_s
        plan = [(self.relay_only, 0.0)]
        if not self.relay_only and self.has_turn:
            plan.append((True, min(self.relay_after_s, self.connect_timeout_s / 2)))

        async def attempt(relay: bool, delay: float) -> tuple[Any, Any]:
            if delay:
                await asyncio.sleep(delay)
            return await self._attempt(peer, relay, max(deadline - time.monotonic(), 0.001))

        tasks = [asyncio.ensure_future(attempt(relay, delay)) for relay, delay in plan]
        won: tuple[Any, Any] | None = None
        why = ""
        pending = set(tasks)
        try:
            while pending and won is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in tasks:  # in plan order: with two up at once, the first attempt wins
                    if t not in done:
                        continue
                    exc = t.exception()
                    if exc is None:
                        if won is None:
                            won = t.result()
                        else:
                            self._spawn(t.result()[0].close())
                    elif isinstance(exc, (asyncio.TimeoutError, KdnError, ValueError)):
                        why = f"timed out after {self.connect_timeout_s:.3g} s" if isinstance(exc, asyncio.TimeoutError) \
                            else str(exc)
                        if isinstance(exc, KdnError) and not isinstance(exc, Unavailable):  # NotFound: nobody to ask
                            pending = set()
                    else:
                        raise exc
        finally:
            running = [t for t in tasks if not t.done()]
            for t in running:
                t.cancel()  # a cancelled attempt closes its connection and says "bye"
            await asyncio.gather(*running, return_exceptions=True)
        if won is None:
            self._failed[peer] = (time.monotonic(), why)
            raise Unavailable(f"WebRTC to {peer}: no connection ({why})")
        pc, channel = won
        client = RtcClient(peer, pc, channel, time.perf_counter() - t0)
        self._failed.pop(peer, None)
        old = self._clients.get(peer)
        self._clients[peer] = client
        if old is not None:
            self._spawn(old.close())
        self._on_connect(peer, client.path, client.setup_s, "dial")
        return client

    async def _attempt(self, peer: str, relay: bool, timeout_s: float) -> tuple[Any, Any]:
        aiortc = require_aiortc()
        pc = aiortc.RTCPeerConnection(configuration=self._config(relay))
        session = secrets.token_hex(8) + ("r" if relay else "")
        opened = asyncio.get_running_loop().create_future()
        channel = pc.createDataChannel(CHANNEL_LABEL, ordered=True)
        channel.on("open", lambda: opened.done() or opened.set_result(None))
        answer = asyncio.get_running_loop().create_future()
        self._answers[session] = (peer, answer)

        async def handshake() -> None:
            await pc.setLocalDescription(await pc.createOffer())  # gathers every candidate
            await self.signal.send(peer, self.node_id, session, "offer", pc.localDescription.sdp)
            sdp = await answer
            await pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=sdp, type="answer"))
            await opened

        try:
            await asyncio.wait_for(handshake(), timeout_s)
        except BaseException:
            await pc.close()
            try:
                await self.signal.send(peer, self.node_id, session, "bye")
            except KdnError:
                pass
            raise
        finally:
            self._answers.pop(session, None)
        return pc, channel

    # -- answering -------------------------------------------------------------------------------

    def _take_offer(self, offer: Any) -> None:
        """Answer ``offer`` within the bounds (module docstring), or drop it."""
        if self.handler is None:
            return
        old = self._served.get(offer.session)
        if old is not None:
            if old.peer != offer.sender:
                self._on_offer("dropped")  # a session id another peer holds
                return
            self._forget(offer.session, old)  # the same dialer offering again
        mine = [(s, a) for s, a in self._served.items() if a.peer == offer.sender]
        if len(mine) >= self.max_answers_per_peer:
            if not all(a.opened for _, a in mine):
                self._on_offer("dropped")  # it has offers in the air already: a flood, not a redial
                return
            self._forget(*mine[0])  # a redial: that peer's oldest connection makes room
        elif len(self._served) >= self.max_answers:
            self._on_offer("dropped")
            log.debug("%s: %d WebRTC connections answered already; dropped an offer from %s", self.node_id,
                      len(self._served), offer.sender[:40])
            return
        aiortc = require_aiortc()
        pc = aiortc.RTCPeerConnection(configuration=self._config(self.relay_only or offer.session.endswith("r")))
        served = self._served[offer.session] = _Answered(offer.sender, pc)
        self._on_offer("answered")
        served.timer = asyncio.get_running_loop().call_later(
            self.connect_timeout_s, self._half_open, offer.session, served)
        self._spawn(self._answer(offer, served))

    def _half_open(self, session: str, served: "_Answered") -> None:
        if not served.opened and self._served.get(session) is served:
            log.info("%s: WebRTC connection answered to %s did not open in %.3g s; closed", self.node_id,
                     served.peer[:40], self.connect_timeout_s)
            self._forget(session, served)

    def _forget(self, session: str, served: "_Answered") -> None:
        """Close an answered connection and stop counting it."""
        if self._served.get(session) is served:
            del self._served[session]
            self._paths.pop(session, None)
        if served.timer is not None:
            served.timer.cancel()
        self._spawn(served.pc.close())

    async def _answer(self, offer: Any, served: "_Answered") -> None:
        aiortc = require_aiortc()
        t0 = time.perf_counter()
        peer, session, pc = offer.sender, offer.session, served.pc

        @pc.on("datachannel")
        def on_channel(channel: Any) -> None:
            sender = _Sender(channel)

            @channel.on("message")
            def on_message(msg: bytes | str) -> None:
                if isinstance(msg, bytes):
                    assert self.handler is not None
                    self._spawn(serve_request(self.handler, peer, sender, msg,
                                              lambda n: self._on_served(self._paths.get(session, "unknown"), n)))

            def opened() -> None:
                served.opened = True
                path = _path_of(pc)
                self._paths[session] = path
                self._on_connect(peer, path, time.perf_counter() - t0, "answer")

            if channel.readyState == "open":
                opened()
            else:
                channel.on("open", opened)

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState in ("failed", "closed"):
                self._forget(session, served)

        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=offer.sdp, type="offer"))
                await pc.setLocalDescription(await pc.createAnswer())
            await self.signal.send(peer, self.node_id, session, "answer", pc.localDescription.sdp)
        except (KdnError, ValueError, TimeoutError) as exc:
            log.info("%s: cannot answer %s's offer: %s", self.node_id, peer[:40], exc or "timed out")
            self._forget(session, served)


async def serve_request(
    handler: RtcHandler, peer: str, sender: _Sender, msg: bytes, served: Callable[[int], None],
) -> None:
    """Answer one request that arrived on a channel answered for ``peer``: LOOKUP_OK, or HEAD, DATA
    pieces and END (then ``served(nbytes)``), or ERROR with the handler's refusal."""
    rid = 0
    rpc = "rtc"
    try:
        kind, rid, token, flags, body = _parse_request(msg)
        if kind == LOOKUP:
            rpc = "Lookup"
            resp = await handler.lookup(_message(pb.LookupRequest, body, peer), token)
            await sender.send(_HDR.pack(LOOKUP_OK, rid) + resp.SerializeToString())
        elif kind == FETCH:
            rpc = "Fetch"
            data, source = await handler.fetch(
                _message(pb.FetchRequest, body, peer), token, forwarded=bool(flags & FLAG_FORWARDED),
                link_codec=bool(flags & FLAG_LINK_CODEC),
            )
            await sender.send(_HDR.pack(HEAD, rid) + struct.pack("!Q", len(data)) + source.encode())
            view = memoryview(data)
            for at in range(0, len(view), PIECE):
                await sender.send(_HDR.pack(DATA, rid) + view[at : at + PIECE].tobytes())
            await sender.send(_HDR.pack(END, rid))
            served(len(data))
        else:
            raise InvalidInput(f"unknown data channel request kind {kind}")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes an answer
        if isinstance(exc, Unavailable) and "data channel closed" in str(exc):
            return  # nobody is left to answer
        status, message = handler.refuse(rpc, exc)
        try:
            await sender.send(_HDR.pack(ERROR, rid) + struct.pack("!I", status) + message.encode()[:4096])
        except Exception:  # noqa: BLE001 - the channel went away: nobody is left to tell
            pass


def _message(cls: Any, body: bytes, peer: str) -> Any:
    from google.protobuf.message import DecodeError

    try:
        return cls.FromString(body)
    except DecodeError as exc:
        raise InvalidInput(f"malformed request from {peer}: {exc}") from exc
