"""How an inference host talks to its edge: one small interface and its gRPC transport.

- :mod:`~kdn.transport.base` — :class:`EdgeTransport` (``lookup``, ``fetch``, ``put``,
  ``fetch_into``), :class:`FetchStats` and what the transports share (deadlines, back-off);
- :mod:`~kdn.transport.grpc` — :class:`GrpcEdgeTransport`: ``EdgeService`` over gRPC and the
  choice of a byte path per fetch, one module per byte path: :mod:`~kdn.transport.bulk` (the
  bulk TCP listener) and :mod:`~kdn.transport.shm` (shared memory on the edge's host);
- :mod:`~kdn.transport.failover` — :class:`FailoverEdgeTransport`: edges in preference order.

The in-memory transport of unit tests is :class:`kdn.testing.MemoryEdgeTransport`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kdn.transport.base import Backoff, EdgeTransport, FetchStats, is_loopback
from kdn.transport.failover import FailoverEdgeTransport
from kdn.transport.grpc import GrpcEdgeTransport
from kdn.wire.tls import TlsFiles

__all__ = [
    "Backoff", "EdgeTransport", "FailoverEdgeTransport", "FetchStats", "GrpcEdgeTransport",
    "is_loopback", "connect",
]


def connect(addresses: Sequence[str], *, token: str | None, shm: Callable[[str], bool], bulk: bool,
            tls: TlsFiles | None, backoff_s: float) -> EdgeTransport:
    """One :class:`GrpcEdgeTransport` per address (``shm(address)``: ask it for shared memory),
    wrapped in a :class:`FailoverEdgeTransport` (``backoff_s``) when there are several."""
    edges: list[EdgeTransport] = [GrpcEdgeTransport(a, token=token, shm=shm(a), bulk=bulk, tls=tls) for a in addresses]
    return edges[0] if len(edges) == 1 else FailoverEdgeTransport(edges, backoff_s=backoff_s)
