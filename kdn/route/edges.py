"""What the router asks a host's edge: where each leading chunk of a chain is, and its counters.

:class:`EdgeView` is the router's whole view of an edge: ``locate`` (one ``Lookup``; the edge
answers from its own tiers, then asks the overlay's owners and the origin for the rest, and names
the tier of every available key: ``memory``, ``disk``, ``peer``, ``origin``) and ``counters`` (one
``Stats``: the node's counters, from which link rates are measured). :class:`GrpcEdgeView` speaks
``EdgeService`` over gRPC through :mod:`kdn.wire` (so its errors are :mod:`kdn.errors`); a
``channel`` replaces the socket (an in-process edge in tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

from kdn.errors import Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.wire.channel import aio_channel
from kdn.wire.client_calls import EdgeCalls
from kdn.wire.tls import TlsFiles

__all__ = ["EdgeView", "GrpcEdgeView"]

_TIERS = {"memory", "disk", "peer", "origin"}


class EdgeView(ABC):
    name: str = "edge"

    @abstractmethod
    async def locate(self, fingerprint: ModelFingerprint, namespace: Namespace, keys: Sequence[ChunkKey], *,
                     token: str | None, timeout: float) -> list[str]:
        """The tier of each leading available key of the chain ``keys`` (as many as are available)."""

    @abstractmethod
    async def counters(self, *, timeout: float) -> dict[str, float]:
        """The edge's node-wide counters (``Stats``)."""

    async def close(self) -> None:
        return None


class GrpcEdgeView(EdgeView):
    """``Lookup`` and ``Stats`` on one edge over gRPC (create and use it inside one event loop).

    ``token``: the router's own bearer token for the edge (an operator's ``*`` token lets Stats
    answer node-wide; it is also used for Lookups when the request brings none)."""

    def __init__(self, address: str, *, token: str | None = None, tls: TlsFiles | None = None, channel: Any = None) -> None:
        self.name = address
        self.address = address
        self.token = token
        self._channel = channel if channel is not None else aio_channel(address, tls=tls)
        self._calls = EdgeCalls(self._channel, address, token=token)

    async def locate(self, fingerprint: ModelFingerprint, namespace: Namespace, keys: Sequence[ChunkKey], *,
                     token: str | None, timeout: float) -> list[str]:
        if not keys:
            return []
        n, named = await self._calls.locate(keys, fingerprint, namespace, timeout=timeout, token=token or self.token)
        tiers = [tier if tier in _TIERS else "origin" for tier in named]
        if len(tiers) < n:  # an edge that counts without naming: the slowest tier
            tiers += ["origin"] * (n - len(tiers))
        return tiers

    async def counters(self, *, timeout: float) -> dict[str, float]:
        stats = await self._calls.stats(timeout=timeout)
        if "tenant_entries" in stats.counters and not any(k.startswith("kdn_edge_") for k in stats.counters):
            raise Unavailable(f"edge {self.address} answers Stats for a tenant only: give the router an operator "
                              "token ('*') for node-wide counters")
        return stats.counters

    async def close(self) -> None:
        try:
            await self._channel.close()
        except Exception:  # closing is best effort
            pass
