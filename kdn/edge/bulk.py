"""The edge's end of the bulk byte path (:mod:`kdn.wire.bulk`): tickets, a TCP listener, and the
Fetch/Put requests it serves with the same node, auth and checks as the gRPC servicer.

A Fetch answer is the stored container sent with one ``sendall`` of a view of the stored bytes:
the container is already its own wire form (sections with their checksums), so nothing is framed
or encoded per fetch. A Put is received with ``recv_into`` a buffer of the declared size after the
token, the size bound and the edge's Put budget said yes, then checked and stored like a gRPC Put.

Tickets: ``OpenBulk`` (gRPC, any valid token) grants a random 32-byte ticket that stands for the
caller's token; a connection presents it once; every request on it is then checked against that
token and the request's tenant (:meth:`kdn.wire.auth.TokenAuth.check`). Tickets are accepted for
new connections for ``ttl_s``; at most ``max_tickets`` are outstanding (the oldest go first).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections import OrderedDict
from typing import Any, Protocol

import grpc

from kdn.errors import InvalidInput, KdnError, Unauthorized
from kdn.proto import kdn_pb2 as pb
from kdn.wire import bulk as wb
from kdn.wire.auth import TokenAuth
from kdn.wire.convert import FetchSpec, parse_keys, parse_namespace, parse_put_header
from kdn.wire.errors import status_for, status_value

log = logging.getLogger(__name__)


class BulkHost(Protocol):
    """What the listener needs of its :class:`~kdn.edge.server.EdgeServer`."""

    config: Any  # EdgeConfig
    node: Any  # EdgeNode, once started
    auth: TokenAuth
    put_budget: Any  # PutBudget


class BulkListener:
    """Serves :mod:`kdn.wire.bulk` for one :class:`~kdn.edge.server.EdgeServer`."""

    def __init__(self, server: BulkHost, host: str, port: int = 0, *, ttl_s: float = 600.0,
                 max_tickets: int = 4096) -> None:
        self._s = server
        self.host = host
        self.port = port
        self.ttl_s = ttl_s
        self._max_tickets = max_tickets
        self._tickets: OrderedDict[bytes, tuple[str | None, float]] = OrderedDict()
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    # -- tickets -------------------------------------------------------------------------------

    def grant(self, token: str | None) -> bytes:
        now = time.monotonic()
        while self._tickets and (len(self._tickets) >= self._max_tickets or next(iter(self._tickets.values()))[1] < now):
            self._tickets.popitem(last=False)
        ticket = secrets.token_bytes(wb.TICKET_BYTES)
        self._tickets[ticket] = (token, now + self.ttl_s)
        return ticket

    def _redeem(self, ticket: bytes) -> str | None:
        entry = self._tickets.get(ticket)
        if entry is None or entry[1] < time.monotonic():
            raise Unauthorized("unknown or expired bulk ticket: ask OpenBulk again")
        return entry[0]

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> int:
        host = self.host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, self.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accept = asyncio.get_running_loop().create_task(self._accept_loop())
        return self.port

    async def stop(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
            await asyncio.gather(self._accept, return_exceptions=True)
            self._accept = None
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and friends: say so, pause, go on
                log.warning("%s: bulk accept failed: %s", self._s.config.node_id, exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    # -- one connection ------------------------------------------------------------------------

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            hello = bytearray(wb.HELLO.size)
            await wb.recv_exactly(loop, sock, memoryview(hello))
            try:
                token = self._redeem(wb.parse_hello(bytes(hello)))
            except KdnError as exc:
                await self._refuse(loop, sock, "OpenBulk", exc)
                return
            await loop.sock_sendall(sock, wb.answer(0))
            head = bytearray(wb.REQUEST.size)
            while True:
                try:
                    await wb.recv_exactly(loop, sock, memoryview(head))
                except ConnectionError:
                    return  # the client closed between requests: the normal end
                op, length = wb.REQUEST.unpack(head)
                if op not in (wb.FETCH, wb.PUT) or length > wb.MAX_REQUEST:
                    await self._refuse(loop, sock, "bulk", InvalidInput(f"bad bulk request (op {op}, {length} bytes)"))
                    return
                body = bytearray(length)
                await wb.recv_exactly(loop, sock, memoryview(body))
                if op == wb.FETCH:
                    await self._fetch(loop, sock, bytes(body), token)
                elif not await self._put(loop, sock, bytes(body), token):
                    return  # the payload was not read: the stream cannot go on
        except (ConnectionError, OSError):
            return
        finally:
            sock.close()

    async def _refuse(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, rpc: str, exc: BaseException) -> None:
        code, message = status_for(exc)
        if not isinstance(exc, KdnError):
            log.error("%s: bulk %s crashed", self._s.config.node_id, rpc, exc_info=exc)
        if self._s.node is not None:
            self._s.node.metrics.refused.labels(rpc, code.name).inc()
        await loop.sock_sendall(sock, wb.answer(status_value(code) or status_value(grpc.StatusCode.UNKNOWN), message))

    async def _fetch(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, body: bytes, token: str | None) -> None:
        t0 = time.perf_counter()
        node = self._s.node
        assert node is not None
        try:
            try:
                request = pb.FetchRequest.FromString(body)
            except Exception as exc:  # protobuf's DecodeError and friends
                raise InvalidInput(f"malformed FetchRequest: {type(exc).__name__}") from exc
            ns = parse_namespace(request.namespace)
            self._s.auth.check(token, ns.tenant)
            spec = FetchSpec.from_proto(request, ns)
            next_keys = parse_keys(request.next_keys, limit=self._s.config.max_chain_keys)
            data, source = await node.fetch_bytes(spec, token=token, next_keys=next_keys)
        except Exception as exc:
            await self._refuse(loop, sock, "Fetch", exc)
            return
        view = memoryview(data)
        try:
            await loop.sock_sendall(sock, wb.answer(0, source, len(view)))
            await loop.sock_sendall(sock, view)  # the stored bytes themselves: no framing, no copy here
        finally:
            view.release()
        node.metrics.bytes_out.labels("bulk").inc(len(data))
        node.metrics.latency.labels("Fetch", source).observe(time.perf_counter() - t0)

    async def _put(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, body: bytes, token: str | None) -> bool:
        """False when the payload was refused unread (the connection must close)."""
        node = self._s.node
        assert node is not None
        c = self._s.config
        try:
            try:
                msg = pb.PutHeader.FromString(body)
            except Exception as exc:
                raise InvalidInput(f"malformed PutHeader: {type(exc).__name__}") from exc
            header = parse_put_header(
                pb.PutChunk(header=msg), limit=c.max_artifact_bytes,
                authorize=lambda ns: self._s.auth.check(token, ns.tenant),
            )
            if not header.total_size:
                raise InvalidInput("a bulk Put must declare total_size")
        except Exception as exc:
            await self._refuse(loop, sock, "Put", exc)
            return False
        with self._s.put_budget.lease() as reserve:
            try:
                reserve(header.total_size)  # the edge's bound on bytes held by Puts in flight
            except Exception as exc:
                await self._refuse(loop, sock, "Put", exc)
                return False
            await loop.sock_sendall(sock, wb.answer(0))  # go ahead
            data = bytearray(header.total_size)
            await wb.recv_exactly(loop, sock, memoryview(data))
            try:  # the store verifies every checksum before it keeps a byte
                await node.put(data, namespace=header.namespace, fingerprint=header.fingerprint, key=header.key)
            except Exception as exc:
                await self._refuse(loop, sock, "Put", exc)
                return True
            del data
        await loop.sock_sendall(sock, wb.answer(0))
        return True
