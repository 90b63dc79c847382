"""The bulk byte path: artifact bytes over the edge's bulk TCP listener (:mod:`kdn.wire.bulk`).

:class:`BulkPath` is negotiated over gRPC (``OpenBulk``: a port and a ticket standing for the
caller's token), its connections are renewed before the ticket expires, and answers are received
into reused buffers from :attr:`BulkPath.buffers` (or, for :meth:`BulkPath.fetch_into`, straight
into the reader's destination). An edge that does not offer the path (TLS, switched off, a port of
0, a refused ``OpenBulk``) is asked once. A connection that fails before its first byte rests the
path for its back-off (the call goes over gRPC meanwhile), and so does a hello the edge refuses
(a full listener, or a ticket it forgot and refused again after one renewal:
:class:`kdn.wire.bulk.HelloRefused`). Every method answers None/False where the caller should use
gRPC instead; nothing is ever half-sent on another path.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Awaitable, Callable, Iterator, Sequence

from kdn.artifact import ArtifactReader
from kdn.errors import KdnError, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.transport.base import Backoff, FetchStats, deadline, is_loopback
from kdn.wire.bulk import LAND_MIN_BYTES, BufferPool, BulkClient, BulkProtocolError
from kdn.wire.convert import BulkOffer, FetchSpec, fetch_request_bytes, put_header_bytes

log = logging.getLogger(__name__)
_RENEW_EARLY_S = 30.0  # a ticket is renewed this long before the edge would forget it


class BulkPath:
    """The bulk connections to one edge. ``offer(timeout=...)`` asks the edge for a ticket
    (``OpenBulk``). Use inside one event loop."""

    def __init__(self, address: str, offer: Callable[..., Awaitable[BulkOffer]], *,
                 buffers: BufferPool | None = None, backoff_s: float = 5.0,
                 on_offer: Callable[[BulkOffer], None] | None = None, local: bool = True) -> None:
        """``local``: connect over the edge's same-host socket when it offers one and ``address``
        is loopback (False: always TCP, the path a client on another host takes)."""
        self.address = address
        self.local = local
        self.on_offer = on_offer  # told every offer the edge makes (the shared-memory path sizes itself)
        self.offered = True  # False once the edge said it does not offer the path
        self.buffers = buffers or BufferPool()
        self.land_min_bytes = LAND_MIN_BYTES  # answers this large are received in place by fetch_into
        self.backoff = Backoff(backoff_s)
        self.client: BulkClient | None = None
        self.expires = 0.0  # time.monotonic() at which the ticket is renewed
        self._offer = offer

    async def connect(self, timeout: float) -> BulkClient | None:
        """The bulk connections, negotiated on first use and renewed before the ticket expires;
        None while the path is not offered or rests after a failure."""
        if not self.offered or self.backoff.resting():
            return None
        if self.client is not None and time.monotonic() < self.expires:
            return self.client
        try:
            offer = await self._offer(timeout=timeout)
        except Unavailable:
            raise
        except KdnError as exc:  # the edge refuses the RPC (the token)
            log.debug("%s: no bulk path (%s); streaming over gRPC", self.address, exc)
            self.offered = False
            return None
        if not offer.port:
            self.offered = False
            return None
        if self.on_offer is not None:
            self.on_offer(offer)
        if self.client is not None:
            self.client.close()
        host = self.address.rsplit(":", 1)[0] if not self.address.startswith("unix:") else "127.0.0.1"

        async def renew() -> bytes:
            """A fresh ticket when the edge forgot ours: once, then the call falls back to gRPC."""
            again = await self._offer(timeout=timeout)
            if again.port != offer.port or again.local_socket != offer.local_socket:
                raise Unavailable(f"{self.address}: the bulk listener moved")
            self.expires = time.monotonic() + max(0.0, again.ttl_s - _RENEW_EARLY_S)
            return again.ticket

        # a client on the edge's host (a loopback address) connects over the edge's local socket
        local = offer.local_socket if self.local and is_loopback(self.address) else ""
        self.client = BulkClient(host, offer.port, offer.ticket, peer=self.address, renew=renew, local=local)
        self.expires = time.monotonic() + max(0.0, offer.ttl_s - _RENEW_EARLY_S)
        return self.client

    def broke(self, exc: BaseException) -> None:
        """A connection failed: the path rests for its back-off."""
        log.info("%s: bulk byte path failed (%s); gRPC for %.0f s", self.address, exc, self.backoff.seconds)
        self.backoff.rest()
        if self.client is not None:
            self.client.close()
            self.client = None

    async def fetch(self, spec: FetchSpec, next_keys: Sequence[ChunkKey], *, shm: bool,
                    timeout: float) -> tuple[bytearray | None, int, str] | None:
        """:meth:`kdn.wire.bulk.BulkClient.fetch` of ``spec``: ``(buffer, size, source)``, or with
        ``shm`` possibly ``(None, size, segment name)``; None when the path is not usable (nothing
        was received: the call goes over gRPC). Give the buffer back with :meth:`lent`."""
        client = await self.connect(timeout)
        if client is None:
            return None
        request = fetch_request_bytes(spec, next_keys, shm=shm)
        try:
            async with deadline(timeout, f"Fetch from {self.address}"):
                return await client.fetch(request, self.buffers, shm=shm)
        except (OSError, BulkProtocolError) as exc:
            self.broke(exc)
            return None

    @contextlib.contextmanager
    def lent(self, buf: bytearray, size: int) -> Iterator[memoryview]:
        """The first ``size`` bytes of a received ``buf``, given back to :attr:`buffers` afterwards."""
        view = memoryview(buf)[:size]
        try:
            yield view
        finally:
            view.release()
            self.buffers.give(buf)

    async def fetch_into(self, spec: FetchSpec, reader: ArtifactReader, next_keys: Sequence[ChunkKey], *,
                         timeout: float) -> FetchStats | None:
        """``spec``'s container received in place (:meth:`kdn.wire.bulk.BulkClient.fetch_into`): raw
        KV straight into the reader's destination. None when the path is not usable and nothing
        reached the reader; ``Unavailable`` when the connection broke mid-answer."""
        client = await self.connect(timeout)
        if client is None:
            return None
        request = fetch_request_bytes(spec, next_keys, shm=False)
        before = reader.received
        try:
            async with deadline(timeout, f"Fetch from {self.address}"):
                size, _source, reader_s = await client.fetch_into(request, reader, self.buffers, self.land_min_bytes)
        except (OSError, BulkProtocolError) as exc:
            self.broke(exc)
            if reader.received != before:
                # part of the container is in the reader: it cannot start over on another path
                raise Unavailable(f"Fetch from {self.address}: bulk connection broke mid-answer ({exc})") from exc
            return None
        return FetchStats("bulk", size, reader_s)

    async def put(self, data: bytes, *, key: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace,
                  timeout: float) -> bool:
        """True when the container was stored over the bulk path; False: send it over gRPC."""
        client = await self.connect(timeout)
        if client is None:
            return False
        header = put_header_bytes(data, key=key, fingerprint=fingerprint, namespace=namespace)
        try:
            async with deadline(timeout, f"Put to {self.address}"):
                await client.put(header, data)
            return True
        except (OSError, BulkProtocolError) as exc:
            self.broke(exc)  # the Put did not land
            return False

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
