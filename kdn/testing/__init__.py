"""Test doubles and fixtures, in one public home: what unit tests (ours and a user's) stand in for a part.

- :mod:`~kdn.testing.edge` — :func:`make_chain` (small real artifact containers: random KV, real
  keys), :class:`InMemoryOverlay` (N real edge nodes wired to each other without sockets),
  :class:`InProcessEdge` (one real edge behind its real servicer on an in-process gRPC channel),
  :class:`FakeServicerContext`;
- :mod:`~kdn.testing.upstream` — :class:`InMemoryUpstream` (a dict origin) and
  :class:`NodeUpstream` (an in-process peer);
- :mod:`~kdn.testing.transport` — :class:`MemoryEdgeTransport`: an edge in a dict for a host's
  client, with fault injection;
- :class:`FakeClock` (from :mod:`kdn.edge.clock`): time that moves only when told to.

Nothing a user runs imports this package (``tests/unit/test_layering.py`` checks it): a double
stands in for a part only in tests.
"""

from kdn.edge.clock import FakeClock
from kdn.testing.edge import (
    DEFAULT_FP, Aborted, Chain, FakeServicerContext, InMemoryOverlay, InProcessEdge, make_chain, origin_with, reseal,
)  # fmt: skip
from kdn.testing.transport import MemoryEdgeTransport
from kdn.testing.upstream import InMemoryUpstream, NodeUpstream

__all__ = [
    "DEFAULT_FP", "Aborted", "Chain", "FakeClock", "FakeServicerContext", "InMemoryOverlay", "InMemoryUpstream",
    "InProcessEdge", "MemoryEdgeTransport", "NodeUpstream", "make_chain", "origin_with", "reseal",
]  # fmt: skip
