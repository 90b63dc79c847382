"""WebRTC signalling through the cluster's own gRPC: ``SignalService``, served by the origin.

Edges behind NAT cannot be dialled, but they can all dial the origin. So the origin keeps, for
the WebRTC transport (:mod:`kdn.wire.rtc`), two small things and nothing else:

- **who is there**: each edge announces ``(node_id, address, weight)`` every few seconds with a
  time to live; ``Announce`` answers with every live announcement, which is how edges behind NAT
  discover each other (the edge turns it into overlay members, :mod:`kdn.edge.rtc`);
- **a mailbox per announced node**: ``Send`` drops an offer / answer / bye into the recipient's
  box, ``Receive`` long-polls one's own box. An offer carries the whole SDP with every ICE
  candidate gathered (aiortc gathers before it answers), so no trickle messages are needed.

Who may call (:class:`SignalServicer`): only edges. Every call carries an edge token minted with
the cluster key (:class:`kdn.wire.auth.EdgeKey`, receiver :data:`~kdn.wire.auth.SIGNAL_NODE`);
the node it names is the caller, and a caller may announce only itself, send only as itself and
drain only its own mailbox. No tenant token, not even a ``*`` one, grants any of it: a tenant can
neither announce an address (which edges would dial), nor overwrite another node's, nor read or
fill a mailbox. So every member an edge learns here was announced by an edge, and the sender of
every offer and answer is the node that sent it. A server without a cluster key but with tokens
refuses every call; one with neither (a lab, a unit test) binds nothing.

Bounds (every one a clear error, nothing kept past them): SDP size, messages waiting per box
(the oldest is dropped), node id length, the long-poll wait, announcements alive. The sender of a
message must be announced; a mailbox holds only session descriptions.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import grpc

from kdn.errors import InvalidInput, MessageTooLarge, NotFound, Unauthorized
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pbg
from kdn.wire.auth import SIGNAL_NODE, SIGNAL_SCOPE, EdgeKey, TokenAuth
from kdn.wire.channel import aio_channel, auth_metadata, bearer_token
from kdn.wire.errors import rpc_errors
from kdn.wire.service import Servicer, rpc
from kdn.wire.tls import TlsFiles

__all__ = ["SignalBoard", "SignalClient", "SignalServicer", "MAX_SDP", "MAX_WAITING", "KINDS"]

MAX_SDP = 64 << 10  # an SDP with a few dozen candidates is ~2-4 KiB
MAX_WAITING = 64  # messages waiting in one mailbox
MAX_NODES = 4096
MAX_WAIT_S = 25.0
MAX_TTL_S = 600.0
KINDS = ("offer", "answer", "bye")


@dataclass(slots=True)
class _Entry:
    announcement: pb.Announcement
    expires: float
    box: deque[pb.SignalMessage]
    ready: asyncio.Event


class SignalBoard:
    """Announcements and mailboxes, in memory (a restarted origin is re-announced within a TTL)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._nodes: dict[str, _Entry] = {}
        self.dropped = 0

    def _expire(self) -> None:
        now = self._clock()
        for nid in [n for n, e in self._nodes.items() if e.expires < now]:
            self._nodes.pop(nid).ready.set()  # wakes a poller of a forgotten node

    @staticmethod
    def _check_id(node_id: str, what: str) -> None:
        if not node_id or len(node_id) > 128:
            raise InvalidInput(f"{what} must be a node id of 1-128 characters, got {node_id[:40]!r}")

    def announce(self, ann: pb.Announcement) -> list[pb.Announcement]:
        self._check_id(ann.node_id, "node_id")
        if len(ann.address) > 300:
            raise InvalidInput("address longer than 300 characters")
        if not 0 < ann.ttl_s <= MAX_TTL_S:
            raise InvalidInput(f"ttl_s must be in (0, {MAX_TTL_S:g}], got {ann.ttl_s}")
        self._expire()
        entry = self._nodes.get(ann.node_id)
        if entry is None:
            if len(self._nodes) >= MAX_NODES:
                raise MessageTooLarge(f"{MAX_NODES} nodes announced already")
            entry = self._nodes[ann.node_id] = _Entry(pb.Announcement(), 0.0, deque(maxlen=MAX_WAITING), asyncio.Event())
        entry.announcement = pb.Announcement(
            node_id=ann.node_id, address=ann.address, weight=ann.weight or 1.0, ttl_s=ann.ttl_s
        )
        entry.expires = self._clock() + ann.ttl_s
        return [e.announcement for e in self._nodes.values()]

    def send(self, msg: pb.SignalMessage) -> None:
        self._check_id(msg.to, "to")
        self._check_id(msg.sender, "sender")
        if msg.kind not in KINDS:
            raise InvalidInput(f"kind must be one of {', '.join(KINDS)}, got {msg.kind[:20]!r}")
        if len(msg.sdp) > MAX_SDP:
            raise MessageTooLarge(f"SDP of {len(msg.sdp)} bytes (limit {MAX_SDP})")
        if not msg.session or len(msg.session) > 64:
            raise InvalidInput("session must be 1-64 characters")
        self._expire()
        if msg.sender not in self._nodes:
            raise NotFound(f"sender {msg.sender!r} has not announced itself")
        entry = self._nodes.get(msg.to)
        if entry is None:
            raise NotFound(f"no node {msg.to!r} is announced")
        if len(entry.box) == entry.box.maxlen:
            self.dropped += 1  # the oldest goes: its dialer has long given up
        entry.box.append(pb.SignalMessage(to=msg.to, sender=msg.sender, session=msg.session, kind=msg.kind, sdp=msg.sdp))
        entry.ready.set()

    async def receive(self, node_id: str, wait_s: float) -> list[pb.SignalMessage]:
        self._check_id(node_id, "node_id")
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise InvalidInput(f"wait_s must be in [0, {MAX_WAIT_S:g}], got {wait_s}")
        self._expire()
        entry = self._nodes.get(node_id)
        if entry is None:
            raise NotFound(f"no node {node_id!r} is announced")
        if not entry.box and wait_s > 0:
            entry.ready.clear()
            try:
                await asyncio.wait_for(entry.ready.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        out = list(entry.box)
        entry.box.clear()
        return out


class SignalServicer(Servicer, pbg.SignalServiceServicer):
    """``SignalService`` over a :class:`SignalBoard`, for edges only (see the module docstring).

    ``edges``: the server's cluster key, with receiver :data:`~kdn.wire.auth.SIGNAL_NODE`."""

    def __init__(self, board: SignalBoard, auth: TokenAuth, label: str = "signal", *,
                 edges: EdgeKey | None = None) -> None:
        if edges is not None and edges.node_id != SIGNAL_NODE:
            raise ValueError(f"the signalling service checks tokens sent to {SIGNAL_NODE!r}, not {edges.node_id!r}")
        self.board = board
        self._auth = auth
        self._edges = edges
        self._label = label

    @property
    def auth(self) -> TokenAuth:
        return self._auth

    @property
    def label(self) -> str:
        return self._label

    def _caller(self, context: grpc.aio.ServicerContext, claimed: str, what: str) -> None:
        """Refuse unless the caller is an edge acting as ``claimed`` (``what`` names the field)."""
        token = bearer_token(context.invocation_metadata())
        if self._edges is not None:
            node = self._edges.verify(token, SIGNAL_SCOPE)
            if node != claimed:
                raise Unauthorized(f"this edge token is node {node[:40]!r}'s; {what} {claimed[:40]!r} is another node")
        elif self._auth.enabled:
            raise Unauthorized("signalling is for edges: set cluster_key on the origin and on every edge")

    @rpc
    async def Announce(self, request: pb.Announcement, context: grpc.aio.ServicerContext) -> pb.Members:
        self._caller(context, request.node_id, "node_id")
        return pb.Members(members=self.board.announce(request))

    @rpc
    async def Send(self, request: pb.SignalMessage, context: grpc.aio.ServicerContext) -> pb.SignalAck:
        self._caller(context, request.sender, "sender")
        self.board.send(request)
        return pb.SignalAck()

    @rpc
    async def Receive(self, request: pb.SignalPoll, context: grpc.aio.ServicerContext) -> pb.SignalBatch:
        self._caller(context, request.node_id, "node_id")
        return pb.SignalBatch(messages=await self.board.receive(request.node_id, request.wait_s))


class SignalClient:
    """The edge's side of ``SignalService``: one channel, a deadline on every call. With ``edge``
    (this node's cluster key) every call carries a fresh edge token; else ``token``, if any."""

    def __init__(
        self, address: str, *, token: str | None = None, tls: TlsFiles | None = None, deadline_s: float = 5.0,
        channel: grpc.aio.Channel | None = None, edge: EdgeKey | None = None,
    ) -> None:
        self.address = address
        self._token = token
        self._edge = edge
        self._deadline = deadline_s
        self._channel = channel if channel is not None else aio_channel(address, tls=tls)
        self._stub = pbg.SignalServiceStub(self._channel)
        self._peer = f"signal {address}"

    @property
    def _md(self) -> tuple[tuple[str, str], ...]:
        if self._edge is not None:
            return auth_metadata(self._edge.mint(SIGNAL_NODE, SIGNAL_SCOPE))
        return auth_metadata(self._token)

    async def announce(self, node_id: str, address: str, *, weight: float = 1.0, ttl_s: float = 15.0) -> list[pb.Announcement]:
        with rpc_errors(self._peer):
            resp = await self._stub.Announce(
                pb.Announcement(node_id=node_id, address=address, weight=weight, ttl_s=ttl_s),
                timeout=self._deadline, metadata=self._md,
            )
        return list(resp.members)

    async def send(self, to: str, sender: str, session: str, kind: str, sdp: str = "") -> None:
        with rpc_errors(self._peer):
            await self._stub.Send(
                pb.SignalMessage(to=to, sender=sender, session=session, kind=kind, sdp=sdp),
                timeout=self._deadline, metadata=self._md,
            )

    async def receive(self, node_id: str, wait_s: float = 10.0) -> list[pb.SignalMessage]:
        with rpc_errors(self._peer):
            resp = await self._stub.Receive(
                pb.SignalPoll(node_id=node_id, wait_s=wait_s), timeout=wait_s + self._deadline, metadata=self._md
            )
        return list(resp.messages)

    async def close(self) -> None:
        await self._channel.close(grace=None)
