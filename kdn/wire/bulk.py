"""The bulk byte path: artifact bytes over a plain TCP stream beside gRPC, received into reused buffers.

gRPC stays the control plane (Lookup, Prefetch, Hint, Stats, health, auth). Its Python receive
path copies every message into a fresh ``bytes`` and tops out near 0.8 GB/s on this class of
machine, so payload bytes may take this path instead. A client asks the edge over gRPC
(``EdgeService.OpenBulk``, authenticated with its bearer token like any call) for a *ticket* and
the port of the edge's bulk listener; it opens TCP connections to that port (same host as the gRPC
address), presents the ticket once per connection, and then sends requests on it, one at a time
per connection (a client keeps a small pool of connections for concurrency). Every request is
authorized again against the ticket's token and the request's tenant, exactly as the gRPC call
would be; the bytes are the stored artifact container, whose checksums the client verifies
before it uses a byte (:class:`kdn.artifact.ArtifactReader`).

Where the bytes are copied, per payload byte (the figure ``benchmarks/edge.py`` documents):

1. edge: one ``sendall`` of the stored container (a ``memoryview`` of the bytes in the memory
   tier: no framing, no per-fetch encoding — the container is already the wire form);
2. client: one ``recv_into`` the bytes' destination. With :meth:`BulkClient.fetch_into` (what
   the inference client uses) a raw KV section is received straight into its place in the
   prefix KV and hashed there, in cache, before the reader hands it out; header, lengths,
   checksums and compressed sections land in the reader's small scratch buffer. With
   :meth:`BulkClient.fetch` the container lands in a buffer from :class:`BufferPool`
   (allocated once, reused; no per-fetch allocation, no joins) and decoding copies it out.

Wire format (all integers little-endian)::

    hello     client -> edge   b"KDNB" | u8 version (1) | 32-byte ticket
    request   client -> edge   u8 op | u32 length | that many bytes of a protobuf message
                               FETCH (1): kdn.v1.FetchRequest
                               PUT (2):   kdn.v1.PutHeader; after the edge's go-ahead,
                                          exactly PutHeader.total_size bytes of container
                               SHM (3):   kdn.v1.FetchRequest, from a client on the edge's host
    answer    edge -> client   u8 status | u8 flags | u16 text length | u64 size | text | payload

``status`` 0 is success (``text`` is the serving tier for a FETCH, ``size`` the container's
length, and ``size`` bytes of payload follow). An SHM request is answered like a FETCH, except
that an edge with a shared-memory pool writes the container into a segment
(:class:`kdn.edge.shm.ShmPool`) and answers with flag ``SHM_ANSWER``: ``text`` is then the
segment's name, ``size`` its length, and no payload follows. That is the same-host path's control
round trip on a raw socket (~0.1 ms) instead of a gRPC call (~1.3 ms for a 32 MiB artifact here);
the bytes are read where they lie in the client's cached mapping. A non-zero ``status`` is a
gRPC status code and ``text`` the message that
:func:`kdn.wire.errors.status_for` would put on the gRPC call, turned back into the same
:mod:`kdn.errors` exception by :func:`kdn.wire.errors.error_from_status`. The hello and a PUT's
header get an answer with size 0 first (the go-ahead). A malformed frame closes the connection.
A refused hello is :class:`HelloRefused` at the client: a ticket the edge no longer knows is
renewed once (``OpenBulk`` again), and a refusal after that, or of another kind (a full
listener), sends the caller to gRPC.

The listener is plain TCP: an edge that serves gRPC over TLS does not offer it (the client then
streams over gRPC), so bytes never travel in the clear where the operator asked for TLS.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections import defaultdict
from typing import Awaitable, Callable, Protocol

from kdn.errors import ArtifactCorrupt, InvalidInput, KdnError, Unauthorized
from kdn.wire.errors import error_from_status

MAGIC = b"KDNB"
VERSION = 1
TICKET_BYTES = 32
HELLO = struct.Struct(f"<4sB{TICKET_BYTES}s")
REQUEST = struct.Struct("<BI")
ANSWER = struct.Struct("<BBHQ")
FETCH, PUT, SHM = 1, 2, 3
SHM_ANSWER = 0x01  # answer flag: text names a shared-memory segment, no payload follows
MAX_REQUEST = 1 << 20  # a FetchRequest with a long next_keys list is a few KiB
MAX_TEXT = 4096
LAND_MIN_BYTES = 256 << 10
"""Containers at least this large are received in place (:meth:`BulkClient.fetch_into`); smaller
ones whole into a pooled buffer, then fed. Measured on 1 MiB containers of 16 sections, 8 in
flight: in place 3,449 req/s, whole then fed 2,757 (measured when each section took its own receive)."""


def local_peer_ok(sock: socket.socket, name: str) -> bool:
    """Whether the connected abstract Unix socket ``sock`` was accepted by the process that the
    edge's local socket ``name`` (``"@kdn-bulk-<pid>-<random>"``) says holds it (``SO_PEERCRED``).
    False also when it is not connected (a full backlog lets a non-blocking connect look done)
    or the peer's id is not visible here (another pid namespace): the caller then takes TCP."""
    try:
        pid = int(name[1:].split("-")[2])
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (IndexError, ValueError, OSError):
        return False
    return struct.unpack("3i", creds)[0] == pid


class Lander(Protocol):
    """What :meth:`BulkClient.fetch_into` receives into (:class:`kdn.artifact.ArtifactReader`)."""

    def landing(self) -> list[memoryview]: ...

    def landed(self) -> object: ...


class BulkProtocolError(KdnError):
    """The other side broke the bulk framing (the connection is closed)."""


class HelloRefused(BulkProtocolError):
    """The edge refused a new connection's hello (``cause``: its error, e.g. an unknown ticket
    that a renewed one did not cure, or a full listener). The path is unusable for now: callers
    that fall back on ``BulkProtocolError`` fall back to gRPC."""

    def __init__(self, cause: KdnError) -> None:
        super().__init__(f"bulk connection refused: {cause}")
        self.cause = cause


def answer(status: int, text: str = "", size: int = 0, flags: int = 0) -> bytes:
    raw = text.encode()[:MAX_TEXT]
    return ANSWER.pack(status, flags, len(raw), size) + raw


async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``ConnectionError`` if the peer closes first."""
    got, n = 0, len(view)
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if not k:
            raise ConnectionResetError("peer closed the bulk connection")
        got += k


_IOV_MAX = 512  # buffers per recvmsg_into call (Linux allows 1024)


async def recv_views(loop: asyncio.AbstractEventLoop, sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in ``views``, in order, from the non-blocking ``sock``: one ``recvmsg_into``
    scatters what has arrived across as many of them as it covers (a section landing in a token
    range of a prefix is one run per head: one system call, not one per head)."""
    left = [v for v in views if len(v)]
    i = 0
    while i < len(left):
        try:
            n = sock.recvmsg_into(left[i : i + _IOV_MAX])[0]
        except (BlockingIOError, InterruptedError):
            await _readable(loop, sock)
            continue
        if not n:
            raise ConnectionResetError("peer closed the bulk connection")
        while n:
            if n >= len(left[i]):
                n -= len(left[i])
                i += 1
            else:
                left[i] = left[i][n:]
                n = 0


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(fd)


async def recv_answer(loop: asyncio.AbstractEventLoop, sock: socket.socket, head: bytearray) -> tuple[int, str, int]:
    """One answer's ``(status, text, size)`` (its payload, if any, is still in the socket)."""
    status, _flags, text, size = await recv_answer_flags(loop, sock, head)
    return status, text, size


async def recv_answer_flags(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, head: bytearray
) -> tuple[int, int, str, int]:
    """One answer's ``(status, flags, text, size)`` (its payload, if any, is still in the socket)."""
    await recv_exactly(loop, sock, memoryview(head))
    status, flags, tlen, size = ANSWER.unpack(head)
    if tlen > MAX_TEXT:
        raise BulkProtocolError("bulk answer text too long")
    text = b""
    if tlen:
        raw = bytearray(tlen)
        await recv_exactly(loop, sock, memoryview(raw))
        text = bytes(raw)
    return status, flags, text.decode(errors="replace"), size


class BufferPool:
    """Receive buffers kept for reuse, by power-of-two size class: a fetch takes one, the bytes are
    received into it and read where they lie, and it comes back. Pages are touched once, on the
    first use of a buffer, not on every fetch. At most ``max_idle_bytes`` wait idle."""

    def __init__(self, max_idle_bytes: int = 512 << 20, min_size: int = 64 << 10,
                 allocate: Callable[[int], bytearray] = bytearray) -> None:
        """``allocate(size)``: a new buffer when none is idle (default: zeroed)."""
        self.max_idle_bytes = max_idle_bytes
        self.min_size = min_size
        self._allocate = allocate
        self._idle: dict[int, list[bytearray]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0

    def _cls(self, n: int) -> int:
        size = self.min_size
        while size < n:
            size <<= 1
        return size

    def take(self, n: int) -> bytearray:
        size = self._cls(n)
        with self._lock:
            free = self._idle.get(size)
            if free:
                self._idle_bytes -= size
                self.reused += 1
                return free.pop()
            self.allocated += 1
        return self._allocate(size)

    def give(self, buf: bytearray) -> None:
        size = len(buf)
        with self._lock:
            if size != self._cls(size) or self._idle_bytes + size > self.max_idle_bytes:
                return  # not one of ours, or the pool is full: let it go
            self._idle[size].append(buf)
            self._idle_bytes += size

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes


def _raise_for(status: int, text: str, peer: str) -> None:
    if status:
        raise error_from_status(status, text, peer=peer)


class _Lease:
    """One connection checked out for one request (``async with``), and whether it may serve
    the next: kept only if the request left it clean (its answer read whole), closed otherwise
    (a broken or half-read stream is never reused)."""

    __slots__ = ("_client", "sock", "clean")

    def __init__(self, client: "BulkClient") -> None:
        self._client = client
        self.sock: socket.socket = None  # type: ignore[assignment]  # set on entry
        self.clean = False

    async def __aenter__(self) -> "_Lease":
        self.sock = await self._client._take()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.clean:
            self._client._give(self.sock)
        else:
            self.sock.close()


class BulkClient:
    """Connections to one edge's bulk listener, opened with one ticket and kept for reuse.

    Use inside one event loop. A connection serves one request at a time; concurrent fetches open
    more (at most ``max_idle`` are kept when idle). A connection that fails mid-answer is closed,
    never reused. Answers that are errors (``NotFound``…) leave the connection usable."""

    def __init__(self, host: str, port: int, ticket: bytes, *, peer: str = "", max_idle: int = 16,
                 renew: Callable[[], Awaitable[bytes]] | None = None, local: str = "") -> None:
        """``renew()``: a fresh ticket (``OpenBulk`` again), asked once when the edge does not
        know this one any more (it expired, or its table let it go). ``local``: the abstract Unix
        socket the edge offered (``"@name"``), for a client on its host: connections go there
        while it takes them, over TCP once it refused one (the edge restarted, say)."""
        self.host = host.strip("[]")
        self.port = port
        self.ticket = ticket
        self.peer = peer or f"{host}:{port}"
        self.max_idle = max_idle
        self.local = local if local.startswith("@") and len(local) > 1 else ""
        self.local_connections = 0  # connections made over the local socket
        self._idle: list[socket.socket] = []
        self._renew = renew
        self._renewing: asyncio.Lock | None = None
        self.connections = 0
        self.renewed = 0

    async def _connect(self) -> socket.socket:
        """A new connection whose hello was accepted. An unknown ticket is renewed once (one
        renewal however many connections found it unknown at once); any other refusal, or a
        renewed ticket refused again, is :class:`HelloRefused`."""
        ticket = self.ticket
        try:
            return await self._hello(ticket)
        except Unauthorized as exc:
            if self._renew is None:
                raise HelloRefused(exc) from exc
            if self._renewing is None:
                self._renewing = asyncio.Lock()
            async with self._renewing:
                if self.ticket == ticket:  # nobody renewed it meanwhile
                    try:
                        self.ticket = await self._renew()
                    except KdnError as failed:
                        raise HelloRefused(failed) from exc
                    self.renewed += 1
            try:
                return await self._hello(self.ticket)
            except KdnError as again:
                raise HelloRefused(again) from exc
        except KdnError as exc:
            if isinstance(exc, BulkProtocolError):
                raise
            raise HelloRefused(exc) from exc

    async def _open(self) -> socket.socket:
        """A connected socket: the local one while the edge takes it, else TCP."""
        loop = asyncio.get_running_loop()
        if self.local:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, b"\0" + self.local[1:].encode())
                if local_peer_ok(sock, self.local):
                    self.local_connections += 1
                    return sock
            except OSError:
                pass
            # gone (the edge restarted, or this is not its host), full, or another process holds
            # the name: TCP from now on (a renewed offer names the edge's socket again)
            sock.close()
            self.local = ""
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _hello(self, ticket: bytes) -> socket.socket:
        loop = asyncio.get_running_loop()
        sock = await self._open()
        try:
            await loop.sock_sendall(sock, HELLO.pack(MAGIC, VERSION, ticket))
            status, text, _ = await recv_answer(loop, sock, bytearray(ANSWER.size))
            _raise_for(status, text, self.peer)
        except BaseException:
            sock.close()
            raise
        self.connections += 1
        return sock

    async def _take(self) -> socket.socket:
        """An idle connection the edge has not closed (it closes idle ones), else a new one."""
        while self._idle:
            sock = self._idle.pop()
            try:
                sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # EOF, or bytes nobody asked for
            except BlockingIOError:
                return sock  # nothing to read: open and clean
            except OSError:
                pass
            sock.close()
        return await self._connect()

    def _give(self, sock: socket.socket) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(sock)
        else:
            sock.close()

    def _lease(self) -> _Lease:
        """A connection for one request (:class:`_Lease`: ``async with``)."""
        return _Lease(self)

    async def _ask(self, lease: _Lease, op: int, body: bytes) -> tuple[int, str, int]:
        """Send one request; its answer's ``(flags, text, size)`` (a payload, if any, still in the
        socket). A refusal raises the edge's KdnError and leaves the connection clean."""
        await self._send(lease, op, body)
        return await self._answer(lease)

    @staticmethod
    async def _send(lease: _Lease, op: int, body: bytes) -> None:
        # asyncio's sock_sendall sends at once and returns without a turn of the event loop when
        # the socket takes the whole request (a request is small); it waits only when it cannot
        await asyncio.get_running_loop().sock_sendall(lease.sock, REQUEST.pack(op, len(body)) + body)

    async def _answer(self, lease: _Lease) -> tuple[int, str, int]:
        """The answer's ``(flags, text, size)``; a refusal raises and leaves the connection clean.

        Every request yields the event loop once here, between its request and its answer, so
        requests in flight on one loop take turns. An answer that is already there when read
        (common on loopback, and the rule after a shared-memory read-ahead) is received without
        suspending, and a caller could otherwise run request after request while the others'
        answers wait (tests/integration/test_bulk.py: the callers' shares)."""
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        status, flags, text, size = await recv_answer_flags(loop, lease.sock, bytearray(ANSWER.size))
        if status:
            lease.clean = True  # the refusal was the whole answer
            _raise_for(status, text, self.peer)
        return flags, text, size

    @staticmethod
    async def _recv_pooled(sock: socket.socket, size: int, pool: BufferPool) -> bytearray:
        """The next ``size`` bytes, received into a buffer from ``pool`` (given back on failure)."""
        buf = pool.take(size)
        try:
            await recv_exactly(asyncio.get_running_loop(), sock, memoryview(buf)[:size])
        except BaseException:
            pool.give(buf)
            raise
        return buf

    async def fetch(self, request: bytes, pool: BufferPool, *, shm: bool = False) -> tuple[bytearray | None, int, str]:
        """Send one serialized ``FetchRequest``; returns ``(buffer, size, source)``: the container's
        ``size`` bytes at the start of ``buffer``, a buffer from ``pool`` that the caller gives back.
        With ``shm`` (a client on the edge's host) the edge may answer with a shared-memory
        segment instead: then ``(None, size, segment name)``.
        Raises the edge's KdnError, or ``OSError``/``BulkProtocolError`` when the connection broke."""
        async with self._lease() as lease:
            flags, text, size = await self._ask(lease, SHM if shm else FETCH, request)
            return await self._fetched(lease, flags, text, size, pool, shm)

    async def _fetched(self, lease: _Lease, flags: int, text: str, size: int, pool: BufferPool,
                       shm: bool) -> tuple[bytearray | None, int, str]:
        if flags & SHM_ANSWER:
            if not shm:
                raise BulkProtocolError("edge answered a FETCH with a shared-memory segment")
            lease.clean = True
            return None, size, text
        buf = await self._recv_pooled(lease.sock, size, pool)
        lease.clean = True
        return buf, size, text

    async def fetch_shm_ahead(self, request: bytes, pool: BufferPool,
                              meanwhile: Callable[[], None]) -> tuple[bytearray | None, int, str]:
        """:meth:`fetch` with ``shm``, calling ``meanwhile()`` between sending the request and
        reading its answer: the edge answers while this thread works. The request goes out in
        one ``send`` when the socket takes it (a request is small), with no turn of the event
        loop before ``meanwhile`` starts. An exception from ``meanwhile`` propagates and closes
        the connection (its answer unread); a connection that fails before ``meanwhile`` ran
        raises ``OSError`` with ``meanwhile`` not called."""
        async with self._lease() as lease:
            await self._send(lease, SHM, request)
            meanwhile()
            flags, text, size = await self._answer(lease)
            return await self._fetched(lease, flags, text, size, pool, True)

    async def fetch_into(self, request: bytes, reader: Lander, pool: BufferPool,
                         land_min: int = LAND_MIN_BYTES) -> tuple[int, str, float]:
        """Send one serialized ``FetchRequest`` and receive the answer's container straight into
        the places ``reader`` names (:meth:`kdn.artifact.ArtifactReader.landing`): a raw KV
        section lands in its destination, so the socket's copy is the only one. A container
        under ``land_min`` bytes is received whole into a buffer from ``pool`` and fed instead
        (a few receive calls and one copy in cache cost less than three landings per section).
        Returns ``(size, source, seconds spent in the reader)``. Raises the edge's KdnError, the
        reader's (a bad checksum, a container longer or shorter than the answer), or
        ``OSError``/``BulkProtocolError`` when the connection broke; the connection is kept only
        after a complete answer."""
        loop = asyncio.get_running_loop()
        async with self._lease() as lease:
            flags, text, size = await self._ask(lease, FETCH, request)
            if flags:
                raise BulkProtocolError(f"unexpected answer flags {flags:#x} for a FETCH")
            if size < land_min:
                buf = await self._recv_pooled(lease.sock, size, pool)
                lease.clean = True  # the answer is read whole: the connection is clean, whatever the bytes say
                view = memoryview(buf)[:size]
                t0 = time.perf_counter()
                try:
                    reader.feed(view)
                finally:
                    view.release()
                    pool.give(buf)
                return size, text, time.perf_counter() - t0
            left, spent = size, 0.0
            while left:
                views = reader.landing()
                want = sum(len(v) for v in views)
                if not views or want > left:
                    raise ArtifactCorrupt(
                        "bytes after the artifact trailer" if not views
                        else f"artifact truncated: the answer ends {want - left} bytes before its next part"
                    )
                await recv_views(loop, lease.sock, views)
                left -= want
                t0 = time.perf_counter()
                reader.landed()  # verifies what completed, where it landed
                spent += time.perf_counter() - t0
            lease.clean = True
            return size, text, spent

    async def put(self, header: bytes, data: bytes | bytearray | memoryview) -> None:
        """Send one serialized ``PutHeader`` and, after the edge's go-ahead, the container."""
        loop = asyncio.get_running_loop()
        async with self._lease() as lease:
            await self._ask(lease, PUT, header)  # the go-ahead, or the refusal of the header
            await loop.sock_sendall(lease.sock, memoryview(data))
            await self._answer(lease)  # stored, or refused (the answer is read whole either way)
            lease.clean = True

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def parse_hello(raw: bytes) -> bytes:
    magic, version, ticket = HELLO.unpack(raw)
    if magic != MAGIC:
        raise InvalidInput("not a KDN bulk connection (bad magic)")
    if version != VERSION:
        raise InvalidInput(f"bulk protocol version {version} is not supported (this edge speaks {VERSION})")
    return ticket

