"""The edge's end of the bulk byte path (:mod:`kdn.wire.bulk`): tickets, a TCP listener (and on
Linux an abstract Unix socket beside it, for clients on the edge's host: the same protocol, the
same bounds, its name in the ``OpenBulk`` answer), and the Fetch/Put requests it frames over the
edge's front (:class:`kdn.edge.front.EdgeFront`), as the gRPC servicer does: the same parsing,
auth, checks and refusals; only the framing is this path's.

A Fetch answer is the stored container sent with one ``sendall`` of a view of the stored bytes:
the container is already its own wire form (sections with their checksums), so nothing is framed
or encoded per fetch. An SHM request (a client on this host) is answered with the name of a
shared-memory segment holding the container (:class:`kdn.edge.shm.ShmPool`, the same pool and the
same checks as a gRPC Fetch with ``shm``); an edge without a pool, or with no room in it, sends
the bytes as for a Fetch. A Put's payload is received with ``recv_into`` a buffer of the declared
size whose memory is not touched before the bytes land in it (so it costs what has arrived, not
what was declared), after the token and the size bound said yes; it is received in steps, each
reserved from the edge's Put budget before it is received (a step is at most as large as what
arrived before it, and at least 1 MiB), then the whole is checked and stored like a gRPC Put (the
store keeps that buffer itself: one copy per byte on the edge, the socket's). So a Put that
declares much and sends little holds little, and only while it sends.

Tickets: ``OpenBulk`` (gRPC, any valid token) grants a random 32-byte ticket that stands for the
caller's token; a connection presents it once; every request on it is then checked against that
token and the request's tenant (:meth:`kdn.wire.auth.TokenAuth.check`). Tickets are accepted for
new connections for ``ttl_s``; each token has its own table of at most
``EdgeConfig.bulk_tickets_per_token`` (its oldest go first), so one tenant's ``OpenBulk`` calls
never evict another's ticket (with auth off, one table of :data:`OPEN_TICKETS`).

Bounds on every connection (``EdgeConfig.bulk_*``): a connection waits for its hello on the
event loop, with no thread, for at most ``bulk_timeout_s``, and at most ``bulk_max_pending``
wait at once (a new one past it closes the oldest: a client sends its hello as it connects);
a hello that is accepted gets a thread of its own, at most ``bulk_max_connections`` in all and
``bulk_max_connections_per_token`` per token (past them the hello is refused and the client
uses gRPC). On a connection, a request must follow within ``bulk_idle_s`` (checked every
``bulk_timeout_s``); every receive and send that makes no progress for ``bulk_timeout_s``
closes it, and a request, a payload or an answer must also move at :data:`MIN_RATE` or faster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections import Counter, OrderedDict
from typing import Any

from kdn.edge.accept import Accepted, listen
from kdn.edge.front import EdgeFront, Refusal
from kdn.errors import KdnError, StorageFull, Unauthorized, Unavailable, InvalidInput
from kdn.wire import bulk as wb
from kdn.wire.convert import parse_bulk_put, parse_fetch

log = logging.getLogger(__name__)

OPEN_TICKETS = 4096
"""Tickets outstanding with auth off (one table: there are no tokens to tell apart)."""
MIN_RATE = 1 << 20
"""Bytes per second a request, a payload or an answer must move at, at least."""
SEND_BUFFER_BYTES = 4 << 20
"""The send buffer a same-host bulk connection (loopback, or the local socket) asks the kernel for
(capped at ``net.core.wmem_max``), from the first answer on. Starting from the default 16 KiB, a
1 MiB answer crossed loopback in many small steps, each a wake-up on both sides: a plain Python
sender spent ~340 us of CPU per 1 MiB and ~240 with this (its receiver ~620 and ~580); the edge's
answers cost ~10% less CPU in a noisy A/B. A connection from another host keeps autotuning: a
fixed size (and a stock ``wmem_max`` of 208 KiB) would cap a long link's window."""
_FIRST_STEP = 1 << 20  # a Put's first reserved and received step; each next one doubles ...
_MAX_STEP = 16 << 20  # ... up to this


class BulkListener:
    """Serves :mod:`kdn.wire.bulk` over one edge's front (bounds: the module docstring; their
    values come from the edge's config). Each accepted connection is a :class:`BulkConnection`."""

    def __init__(self, front: EdgeFront, host: str, port: int, *, ttl_s: float = 600.0) -> None:
        c = front.config
        self.front = front
        self.host = host
        self.port = port
        self.ttl_s = ttl_s
        self.timeout_s = float(c.bulk_timeout_s)
        self.idle_s = float(c.bulk_idle_s)
        self.max_connections = int(c.bulk_max_connections)
        self.max_per_token = int(c.bulk_max_connections_per_token)
        self._per_table = int(c.bulk_tickets_per_token)
        self._tickets: dict[bytes, tuple[str | None, float]] = {}  # ticket -> (token, expires)
        self._tables: dict[str | None, OrderedDict[bytes, None]] = {}  # token -> its tickets, oldest first
        self._sock: socket.socket | None = None
        self._local: socket.socket | None = None  # the abstract Unix socket, on Linux
        self.local_name = ""  # its name as offered ("@kdn-bulk-..."), "" when there is none
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accept: asyncio.Task[None] | None = None
        self._accept_local: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._pending = Accepted(int(c.bulk_max_pending), what=f"{front.node_id}: bulk")  # waiting for a hello
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._of_token: Counter[str | None] = Counter()  # connections served, per token
        self._put_buffers = wb.BufferPool(max_idle_bytes=256 << 20, allocate=_unfilled)  # Puts of keys already held

    # -- tickets -------------------------------------------------------------------------------

    def grant(self, token: str | None) -> bytes:
        """A new ticket for ``token``; the token's own oldest go past its table's bound."""
        now = time.monotonic()
        ticket = secrets.token_bytes(wb.TICKET_BYTES)
        key, cap = (token, self._per_table) if self.front.auth.enabled else (None, OPEN_TICKETS)
        with self._lock:
            table = self._tables.setdefault(key, OrderedDict())
            while table and (len(table) >= cap or self._tickets.get(next(iter(table)), (None, 0.0))[1] < now):
                self._tickets.pop(table.popitem(last=False)[0], None)  # the oldest, or one gone already
            table[ticket] = None
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
        sock = self._sock = listen(self.host.strip("[]") or "0.0.0.0", self.port)
        self.port = sock.getsockname()[1]
        self._loop = asyncio.get_running_loop()
        self._accept = self._loop.create_task(self._pending.forever(sock, self._hello))
        self._local = _listen_local()
        if self._local is not None:
            self.local_name = "@" + self._local.getsockname()[1:].decode()
            self._accept_local = self._loop.create_task(self._pending.forever(self._local, self._hello))
        return self.port

    async def stop(self) -> None:
        for task in (self._accept, self._accept_local):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._accept = self._accept_local = None
        for sock in (self._sock, self._local):
            if sock is not None:
                sock.close()
        self._sock = self._local = None
        self.local_name = ""
        waiting = list(self._pending.tasks.values())
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
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

    @property
    def connections(self) -> int:
        """Connections served by a thread now."""
        return len(self._threads)

    @property
    def waiting(self) -> int:
        """Connections waiting for their hello now."""
        return len(self._pending)

    async def _hello(self, conn: socket.socket) -> None:
        """Read and check the hello on the loop; hand an accepted connection to a thread."""
        loop = asyncio.get_running_loop()
        handed = False
        try:
            head = bytearray(wb.HELLO.size)
            async with asyncio.timeout(self.timeout_s):
                await wb.recv_exactly(loop, conn, memoryview(head))
                try:
                    token = self._redeem(wb.parse_hello(bytes(head)))
                    self._admit(token)
                except KdnError as exc:
                    await loop.sock_sendall(conn, _refusal(self.front.refuse("OpenBulk", exc, via="bulk")))
                    conn.shutdown(socket.SHUT_WR)
                    while await loop.sock_recv(conn, 65536):  # what the client still sends, until it closes
                        pass
                    return
            conn.setblocking(True)
            conn.settimeout(self.timeout_s)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if _same_host(conn):  # a fixed buffer turns autotuning off: only where no long link needs it
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            t = threading.Thread(target=BulkConnection(self, conn, token).serve, name="kdn-bulk", daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads.add(t)
            handed = True
            try:
                t.start()
            except RuntimeError:  # no thread to be had: as if full
                handed = False
                with self._lock:
                    self._conns.discard(conn)
                    self._threads.discard(t)
                    self._of_token[token] -= 1
        except (OSError, TimeoutError, asyncio.CancelledError):
            pass  # gone, silent, or evicted: nothing to answer
        finally:
            self._pending.done(conn)
            if not handed:
                conn.close()

    def _admit(self, token: str | None) -> None:
        """Count a connection for ``token``, or refuse it (the client then uses gRPC)."""
        with self._lock:
            if len(self._threads) >= self.max_connections:
                raise Unavailable(f"bulk listener serves {self.max_connections} connections already; use gRPC")
            if self._of_token[token] >= self.max_per_token:
                raise StorageFull(f"this token holds {self.max_per_token} bulk connections already; use gRPC")
            self._of_token[token] += 1

    def _gone(self, sock: socket.socket, token: str | None) -> None:
        """A served connection ended (on its thread)."""
        with self._lock:
            self._conns.discard(sock)
            self._threads.discard(threading.current_thread())
            self._of_token[token] -= 1
            if self._of_token[token] <= 0:
                del self._of_token[token]


class BulkConnection:
    """One accepted connection, served on its own thread: its requests framed over the front.

    Parsing, auth and the bytes' send/receive run here (the socket calls release the GIL, so
    several connections move bytes at once, beside the event loop); the node's coroutines and
    the Put budget run on the edge's event loop (:meth:`_on_loop`)."""

    def __init__(self, listener: BulkListener, sock: socket.socket, token: str | None) -> None:
        assert listener._loop is not None
        self.listener = listener
        self.front = listener.front
        self.sock = sock
        self.token = token
        self.timeout_s = listener.timeout_s
        self._loop = listener._loop

    def _on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def serve(self) -> None:
        sock = self.sock
        try:
            sock.sendall(wb.answer(0))  # the hello was accepted
            while True:
                idle_since = time.monotonic()
                while True:  # the next request may take up to idle_s to come (checked each timeout_s) ...
                    try:
                        first = sock.recv(wb.REQUEST.size)
                        break
                    except TimeoutError:
                        if time.monotonic() - idle_since >= self.listener.idle_s:
                            return
                if not first:
                    return  # the client closed between requests: the normal end
                # ... but once it started, it must move
                rest = _recv_exactly(sock, wb.REQUEST.size - len(first), _deadline(wb.REQUEST.size, self.timeout_s))
                op, length = wb.REQUEST.unpack(first + rest)
                if op not in (wb.FETCH, wb.PUT, wb.SHM) or length > wb.MAX_REQUEST:
                    self.refuse("bulk", InvalidInput(f"bad bulk request (op {op}, {length} bytes)"))
                    return
                body = bytes(_recv_exactly(sock, length, _deadline(length, self.timeout_s)))
                if op != wb.PUT:
                    self.fetch(body, shm=op == wb.SHM)
                elif not self.put(body):
                    return  # the payload was not read whole: the stream cannot go on
        except (OSError, RuntimeError, concurrent.futures.CancelledError):
            return  # connection reset or too slow (TimeoutError), or the edge is stopping (its loop gone)
        finally:
            _close_gently(sock)
            self.listener._gone(sock, self.token)

    def refuse(self, rpc: str, exc: BaseException) -> None:
        """Send the front's refusal of ``exc`` as this path's error answer."""
        self.sock.sendall(_refusal(self.front.refuse(rpc, exc, via="bulk")))

    def fetch(self, body: bytes, *, shm: bool = False) -> None:
        t0 = time.perf_counter()
        front, sock = self.front, self.sock
        try:
            ask = parse_fetch(body, limit=front.config.max_chain_keys, authorize=front.authorizer(self.token))
            data, source = front.fetch_blocking(ask, self.token, self._loop)
        except Exception as exc:
            self.refuse("Fetch", exc)
            return
        name = front.publish(ask.spec.namespace.tenant, ask.spec.key, data) if shm else ""
        if name:
            sock.sendall(wb.answer(0, name, len(data), flags=wb.SHM_ANSWER))
            front.served("shm", len(data), source, t0)
            return
        view = memoryview(data)
        try:
            # the answer's head and the stored bytes themselves in one system call: no framing, no copy
            _send_all(sock, [memoryview(wb.answer(0, source, len(view))), view], _deadline(len(view), self.timeout_s))
        finally:
            view.release()
        front.served("bulk", len(data), source, t0)

    def put(self, body: bytes) -> bool:
        """False when the payload was not read whole (the connection must close)."""
        front, sock = self.front, self.sock
        try:
            header = parse_bulk_put(body, limit=front.config.max_artifact_bytes, authorize=front.authorizer(self.token))
        except Exception as exc:
            self.refuse("Put", exc)
            return False
        n = header.total_size
        # A key the tenant already holds stores nothing new (the store verifies the bytes and keeps
        # its copy): they land in a reused buffer, not in fresh memory, whose page faults were half
        # of the edge's work on a 32 MiB Put. A new key's buffer is kept by the store as it is
        # (take): one copy per byte on the edge, the socket's. Neither is written before the bytes
        # land: its pages come as they do.
        buffers = self.listener._put_buffers
        pooled = buffers.take(n) if front.held(header) else None
        buf = pooled if pooled is not None else _unfilled(n)
        reserved = 0
        try:
            sock.sendall(wb.answer(0))  # go ahead
            deadline = _deadline(n, self.timeout_s)
            got, step = 0, _FIRST_STEP
            while got < n:
                k = min(step, n - got)
                try:
                    self._on_loop(self._reserve(k))  # the edge's bound on bytes held by Puts
                except StorageFull as exc:
                    self.refuse("Put", exc)
                    return False  # the rest of the payload is unread
                reserved += k
                with memoryview(buf) as whole, whole[got : got + k] as part:
                    _recv_into(sock, part, deadline)
                got += k
                step = min(2 * step, _MAX_STEP, max(got, _FIRST_STEP))
            data = memoryview(buf)[:n] if pooled is not None else buf
            try:  # the store verifies every checksum before it keeps a byte
                # a pooled buffer is copied if the key went meanwhile
                self._on_loop(front.put(header, data, take=pooled is None))
            except Exception as exc:
                self.refuse("Put", exc)
                return True
            finally:
                del data
        finally:
            if pooled is not None:
                buffers.give(pooled)
            del buf
            if reserved:
                self._on_loop(self._release(reserved))
        sock.sendall(wb.answer(0))
        return True

    async def _reserve(self, n: int) -> None:
        self.front.put_budget.take(n)

    async def _release(self, n: int) -> None:
        self.front.put_budget.give(n)


def _same_host(conn: socket.socket) -> bool:
    """Whether ``conn`` comes from this host: the local socket, or a loopback address."""
    if conn.family == socket.AF_UNIX:
        return True
    try:
        host = conn.getpeername()[0]
    except OSError:
        return False
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


def _listen_local() -> socket.socket | None:
    """A listening, non-blocking abstract Unix socket with a random name, for clients on this host
    (Linux only; None elsewhere, or when it cannot bind). A request's round trip over it cost a
    client ~17 us of CPU against ~36 us over loopback TCP here. Anyone on the host may connect,
    as to the TCP port: the ticket is what admits a connection. The name carries this process's
    id: a client accepts a connection only from the process the name says
    (:func:`kdn.wire.bulk.local_peer_ok`), so a process that binds the name once this edge is
    gone (names can be read in ``/proc/net/unix``) does not catch the tickets clients present."""
    if not sys.platform.startswith("linux"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0kdn-bulk-{os.getpid()}-{secrets.token_hex(12)}".encode())  # the pid: see local_peer_ok
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        log.info("no same-host bulk socket (%s); clients on this host use TCP", exc)
        return None
    return sock


def _unfilled(n: int) -> bytearray:
    """A bytearray of ``n`` bytes whose contents are not written first (``bytearray(n)`` zeroes
    them, which makes every page resident at once): the caller overwrites all of it before
    anything reads it. Large buffers come from fresh mappings, resident only once written."""
    buf = bytearray()
    if n and _resize(buf, n):
        raise MemoryError(f"cannot allocate a {n}-byte Put buffer")
    return buf


def _bytearray_resize() -> Any:
    import ctypes

    fn = ctypes.pythonapi.PyByteArray_Resize  # the C API's own resize: allocates, writes nothing
    fn.argtypes = [ctypes.py_object, ctypes.c_ssize_t]
    fn.restype = ctypes.c_int
    return fn


_resize = _bytearray_resize()


def _refusal(refused: Refusal) -> bytes:
    """This path's error answer: the refusal's status and message."""
    return wb.answer(refused.status, refused.message)


def _deadline(n: int, timeout_s: float) -> float:
    """When ``n`` bytes must have moved: ``timeout_s`` plus their time at :data:`MIN_RATE`."""
    return time.monotonic() + timeout_s + n / MIN_RATE


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


def _send_all(sock: socket.socket, parts: list[memoryview], deadline: float) -> None:
    """``sendall`` of several buffers with ``sendmsg`` (gathered: one call where the socket takes
    them); ``TimeoutError`` past ``deadline`` (each call is also bounded by the socket's timeout)."""
    parts = [p for p in parts if len(p)]
    while parts:
        n = sock.sendmsg(parts[:512])
        while n:
            if n >= len(parts[0]):
                n -= len(parts.pop(0))
            else:
                parts[0] = parts[0][n:]
                n = 0
        if parts and time.monotonic() > deadline:
            raise TimeoutError("bulk answer not taken in time")


def _recv_into(sock: socket.socket, view: bytearray | memoryview, deadline: float) -> None:
    """Fill ``view`` from ``sock``; ``ConnectionError`` if the peer closes first, ``TimeoutError``
    past ``deadline`` (each call is also bounded by the socket's timeout)."""
    target = memoryview(view)
    got, n = 0, len(target)
    try:
        while got < n:
            k = sock.recv_into(target[got:])
            if not k:
                raise ConnectionResetError("peer closed the bulk connection")
            got += k
            if got < n and time.monotonic() > deadline:
                raise TimeoutError("bulk bytes did not arrive in time")
    finally:
        target.release()


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytearray:
    """The next ``n`` bytes, in a new buffer; ``ConnectionError`` if the peer closes first."""
    buf = bytearray(n)
    _recv_into(sock, buf, deadline)
    return buf
