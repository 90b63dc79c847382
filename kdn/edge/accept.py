"""Listening sockets the edge serves without gRPC (bulk, ``/metrics``): bind, and accept with a bound.

:func:`listen` binds a non-blocking TCP socket. :class:`Accepted` accepts on it forever, each
connection served by a task of its own; past ``cap`` connections still being served, the oldest
is cancelled (a live client has sent by then: the one that waits longest is the one that stalls)
and its socket closed before the next is taken. An accept that fails (EMFILE and friends) is
logged and retried after a pause, never the end of the loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import OrderedDict
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

__all__ = ["Accepted", "listen"]


def listen(host: str | None, port: int, *, backlog: int = 128) -> socket.socket:
    """A bound, listening, non-blocking TCP socket (``port`` 0: any free one); OSError when it cannot bind."""
    family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class Accepted:
    """Connections accepted and not yet through, oldest first, at most ``cap`` of them."""

    def __init__(self, cap: int, *, what: str) -> None:
        self.cap = cap
        self.what = what
        self.tasks: OrderedDict[socket.socket, asyncio.Task[None]] = OrderedDict()
        self.evicted = 0  # connections cancelled to make room

    def __len__(self) -> int:
        return len(self.tasks)

    async def forever(self, sock: socket.socket, serve: Callable[[socket.socket], Awaitable[None]]) -> None:
        """Accept on ``sock`` until cancelled; ``serve(conn)`` runs as a task and calls :meth:`done`."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and friends: say so, pause, go on
                log.warning("%s accept failed: %s", self.what, exc)
                await asyncio.sleep(0.1)
                continue
            self.tasks[conn] = loop.create_task(serve(conn))  # type: ignore[arg-type]
            if len(self.tasks) > self.cap:
                while len(self.tasks) > self.cap:
                    _, oldest = self.tasks.popitem(last=False)
                    oldest.cancel()
                    self.evicted += 1
                await asyncio.sleep(0)  # they close their sockets before the next one is taken

    def done(self, conn: socket.socket) -> None:
        """``conn``'s task is through with it (or handed it on): it no longer counts against the cap."""
        if self.tasks.get(conn) is asyncio.current_task():
            del self.tasks[conn]
