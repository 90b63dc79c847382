"""The edge's end of the bulk byte path (:mod:`kdn.wire.bulk`): tickets, a TCP listener, and the
Fetch/Put requests it serves with the same node, auth and checks as the gRPC servicer.

A Fetch answer is the stored container sent with one ``sendall`` of a view of the stored bytes:
the container is already its own wire form (sections with their checksums), so nothing is framed
or encoded per fetch. An SHM request (a client on this host) is answered with the name of a
shared-memory segment holding the container (:class:`kdn.edge.shm.ShmPool`, the same pool and the
same checks as a gRPC Fetch with ``shm``); an edge without a pool, or with no room in it, sends
the bytes as for a Fetch. A Put is received with ``recv_into`` a buffer of the declared size after the
token, the size bound and the edge's Put budget said yes, then checked and stored like a gRPC Put
(the store keeps that buffer itself: one copy per byte on the edge, the socket's).

Tickets: ``OpenBulk`` (gRPC, any valid token) grants a random 32-byte ticket that stands for the
caller's token; a connection presents it once; every request on it is then checked against that
token and the request's tenant (:meth:`kdn.wire.auth.TokenAuth.check`). Tickets are accepted for
new connections for ``ttl_s``; at most ``max_tickets`` are outstanding (the oldest go first).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Protocol

import grpc

from kdn.errors import InvalidInput, KdnError, Unauthorized, Unavailable
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
    shm: Any  # ShmPool | None


class BulkListener:
    """Serves :mod:`kdn.wire.bulk` for one :class:`~kdn.edge.server.EdgeServer`."""

    def __init__(self, server: BulkHost, host: str, port: int = 0, *, ttl_s: float = 600.0,
                 max_tickets: int = 4096, max_connections: int = 256) -> None:
        self._s = server
        self.host = host
        self.port = port
        self.ttl_s = ttl_s
        self._max_tickets = max_tickets
        self._tickets: OrderedDict[bytes, tuple[str | None, float]] = OrderedDict()
        self.max_connections = max_connections
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accept: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._put_buffers = wb.BufferPool(max_idle_bytes=256 << 20)  # for Puts of keys already held

    # -- tickets -------------------------------------------------------------------------------

    def grant(self, token: str | None) -> bytes:
        now = time.monotonic()
        ticket = secrets.token_bytes(wb.TICKET_BYTES)
        with self._lock:
            while self._tickets and (
                len(self._tickets) >= self._max_tickets or next(iter(self._tickets.values()))[1] < now
            ):
                self._tickets.popitem(last=False)
            self._tickets[ticket] = (token, now + self.ttl_s)
        return ticket

    def _redeem(self, ticket: bytes) -> str | None:
        with self._lock:
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
        self._loop = asyncio.get_running_loop()
        self._accept = self._loop.create_task(self._accept_loop())
        return self.port

    async def stop(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
            await asyncio.gather(self._accept, return_exceptions=True)
            self._accept = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:  # wakes the threads blocked in recv/send
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for t in threads:
            # the threads may be waiting for this loop (a fetch in flight): wait without blocking it
            while t.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)

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
            with self._lock:
                if len(self._threads) >= self.max_connections:
                    conn.close()  # the client falls back to gRPC
                    continue
                conn.setblocking(True)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t = threading.Thread(target=self._serve, args=(conn,), name="kdn-bulk", daemon=True)
                self._conns.add(conn)
                self._threads.add(t)
            t.start()

    # -- one connection, on its own thread ------------------------------------------------------
    #
    # Parsing, auth and the bytes' send/receive run here (the socket calls release the GIL, so
    # several connections move bytes at once, beside the event loop); the node's coroutines and
    # the Put budget run on the edge's event loop (:meth:`_on_loop`).

    def _on_loop(self, coro: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _serve(self, sock: socket.socket) -> None:
        try:
            hello = _recv_exactly(sock, wb.HELLO.size)
            try:
                token = self._redeem(wb.parse_hello(bytes(hello)))
            except KdnError as exc:
                self._refuse(sock, "OpenBulk", exc)
                return
            sock.sendall(wb.answer(0))
            while True:
                try:
                    head = _recv_exactly(sock, wb.REQUEST.size)
                except ConnectionError:
                    return  # the client closed between requests: the normal end
                op, length = wb.REQUEST.unpack(head)
                if op not in (wb.FETCH, wb.PUT, wb.SHM) or length > wb.MAX_REQUEST:
                    self._refuse(sock, "bulk", InvalidInput(f"bad bulk request (op {op}, {length} bytes)"))
                    return
                body = bytes(_recv_exactly(sock, length))
                if op != wb.PUT:
                    self._fetch(sock, body, token, shm=op == wb.SHM)
                elif not self._put(sock, body, token):
                    return  # the payload was not read: the stream cannot go on
        except (OSError, RuntimeError, concurrent.futures.CancelledError):
            return  # connection reset, or the edge is stopping (its loop gone)
        finally:
            _close_gently(sock)
            with self._lock:
                self._conns.discard(sock)
                self._threads.discard(threading.current_thread())

    def _refuse(self, sock: socket.socket, rpc: str, exc: BaseException) -> None:
        code, message = status_for(exc)
        if not isinstance(exc, KdnError):
            log.error("%s: bulk %s crashed", self._s.config.node_id, rpc, exc_info=exc)
        if self._s.node is not None:
            self._s.node.metrics.refused.labels(rpc, code.name).inc()
        sock.sendall(wb.answer(status_value(code) or status_value(grpc.StatusCode.UNKNOWN), message))

    def _fetch(self, sock: socket.socket, body: bytes, token: str | None, *, shm: bool = False) -> None:
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
            assert self._loop is not None
            held = node.fetch_held(spec, self._loop, token=token, next_keys=next_keys)
            data, source = held if held is not None else \
                self._on_loop(node.fetch_bytes(spec, token=token, next_keys=next_keys))
        except Exception as exc:
            self._refuse(sock, "Fetch", exc)
            return
        pool = self._s.shm if shm else None
        if pool is not None:
            try:
                name = pool.publish(ns.tenant, spec.key, data)  # written once per key, then reused
            except Unavailable as exc:  # no room in shared memory: send the bytes instead
                log.info("%s: shm refused (%s); sending the bytes", self._s.config.node_id, exc)
            else:
                sock.sendall(wb.answer(0, name, len(data), flags=wb.SHM_ANSWER))
                node.metrics.bytes_out.labels("shm").inc(len(data))
                node.metrics.latency.labels("Fetch", source).observe(time.perf_counter() - t0)
                return
        view = memoryview(data)
        try:
            # the answer's head and the stored bytes themselves in one system call: no framing, no copy
            _send_all(sock, [memoryview(wb.answer(0, source, len(view))), view])
        finally:
            view.release()
        node.metrics.bytes_out.labels("bulk").inc(len(data))
        node.metrics.latency.labels("Fetch", source).observe(time.perf_counter() - t0)

    def _put(self, sock: socket.socket, body: bytes, token: str | None) -> bool:
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
            self._on_loop(self._reserve(header.total_size))  # the edge's bound on bytes held by Puts
        except Exception as exc:
            self._refuse(sock, "Put", exc)
            return False
        n = header.total_size
        # A key the tenant already holds stores nothing new (the store verifies the bytes and keeps
        # its copy): they land in a reused buffer, not in fresh memory, whose zeroing and page
        # faults were half of the edge's work on a 32 MiB Put. A new key's buffer is kept by the
        # store as it is (take): one copy per byte on the edge, the socket's.
        held = node.store.contains(header.key, tenant=header.namespace.tenant)
        buf = self._put_buffers.take(n) if held else bytearray(n)
        try:
            sock.sendall(wb.answer(0))  # go ahead
            data = memoryview(buf)[:n] if held else buf
            _recv_into(sock, data)
            try:  # the store verifies every checksum before it keeps a byte
                self._on_loop(node.put(data, namespace=header.namespace, fingerprint=header.fingerprint, key=header.key,
                                       take=not held))  # held: copied if it went in the meantime
            except Exception as exc:
                self._refuse(sock, "Put", exc)
                return True
            finally:
                del data
        finally:
            if held:
                self._put_buffers.give(buf)
            del buf
            self._on_loop(self._release(n))
        sock.sendall(wb.answer(0))
        return True

    async def _reserve(self, n: int) -> None:
        self._s.put_budget.take(n)

    async def _release(self, n: int) -> None:
        self._s.put_budget.give(n)


def _close_gently(sock: socket.socket, *, drain: int = 1 << 20, wait_s: float = 0.5) -> None:
    """Close so that a refusal just sent arrives: a socket closed with unread input resets the
    connection, and the peer may lose the answer. Stop sending, read and drop what the peer still
    sends (at most ``drain`` bytes, ``wait_s`` seconds), then close."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(wait_s)
        left = drain
        while left > 0 and sock.recv(min(left, 65536)):
            left -= 65536
    except OSError:
        pass
    finally:
        sock.close()


def _send_all(sock: socket.socket, parts: list[memoryview]) -> None:
    """``sendall`` of several buffers with ``sendmsg`` (gathered: one call where the socket takes them)."""
    parts = [p for p in parts if len(p)]
    while parts:
        n = sock.sendmsg(parts[:512])
        while n:
            if n >= len(parts[0]):
                n -= len(parts.pop(0))
            else:
                parts[0] = parts[0][n:]
                n = 0


def _recv_into(sock: socket.socket, view: bytearray | memoryview) -> None:
    """Fill ``view`` from ``sock``; ``ConnectionError`` if the peer closes first."""
    target = memoryview(view)
    got, n = 0, len(target)
    while got < n:
        k = sock.recv_into(target[got:])
        if not k:
            raise ConnectionResetError("peer closed the bulk connection")
        got += k


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    """The next ``n`` bytes, in a new buffer; ``ConnectionError`` if the peer closes first."""
    buf = bytearray(n)
    _recv_into(sock, buf)
    return buf
