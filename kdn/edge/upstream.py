"""Where an edge gets what it does not hold: peers and the origin, behind one small interface.

``Upstream`` is the interface (fetch / lookup / document / close). Implementations:

- :class:`PeerUpstream` / :class:`OriginUpstream` (both :class:`GrpcUpstream`) — a peer edge
  (``EdgeService``) or the origin (``OriginService``) over gRPC: thin adapters over
  :mod:`kdn.wire` (requests from :mod:`kdn.wire.convert`, Fetch frames read by
  :mod:`kdn.wire.calls`, status codes turned into :mod:`kdn.errors` by
  :func:`kdn.wire.errors.rpc_errors`), with a deadline on every call. A peer built with a
  ``credential`` (the cluster key's one-use edge tokens, :class:`kdn.wire.auth.EdgeKey`) sends a
  fresh token per call, bound to that peer and the request's tenant, and never a bearer token of
  this edge's own: what a peer receives is good for nothing else.

Trust in what a peer returns: peers are edges the cluster vouches for (configured by the operator,
or announced through signalling, which only edges can do: :mod:`kdn.wire.signal`) and every
request to them is authenticated with the cluster key; what they return is verified like any
upstream's bytes (:meth:`kdn.edge.node.EdgeNode._admit`). A tenant can put KV only under its own
namespace, which no other tenant's keys reach, so a peer's store holds for a tenant only what
that tenant or the origin put there.
The in-memory doubles of unit tests (a dict origin, an in-process peer) are in
:mod:`kdn.testing.upstream`.

:class:`SingleFlight` coalesces concurrent requests: any number of concurrent ``do(key, fn)`` for
one key run ``fn`` once and all get its result (or its exception).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any, Awaitable, Callable, Generic, Hashable, Sequence, TypeVar


from kdn.errors import InvalidInput, NotFound
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.wire.calls import collect_fetch, fetch_method
from kdn.wire.channel import aio_channel, auth_metadata
from kdn.wire.convert import FetchSpec, chain_keys, document_request, lookup_request
from kdn.wire import health
from kdn.wire.errors import rpc_errors
from kdn.wire.service import service_stub
from kdn.wire.tls import TlsFiles

__all__ = [
    "FORWARDED_HEADER", "FetchSpec", "GrpcUpstream", "OriginUpstream",
    "PeerUpstream", "SingleFlight", "Upstream", "origin_upstream", "peer_upstream",
]

K = TypeVar("K", bound=Hashable)

FORWARDED_HEADER = "kdn-forwarded"
"""Metadata on a Fetch one edge sends to an owner to fetch on its behalf (never forwarded again)."""
V = TypeVar("V")


class Upstream(ABC):
    """A source of artifacts an edge can ask on a miss."""

    name: str  # node id, or "origin"
    kind: str  # "peer" | "origin"

    @abstractmethod
    async def fetch(self, spec: FetchSpec, *, token: str | None = None) -> bytes:
        """The artifact's container bytes (not yet verified by the caller). NotFound if absent."""

    async def lookup(
        self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None = None
    ) -> int:
        """How many leading ``keys`` this upstream holds (peers: from their own store only)."""
        return 0

    async def document(
        self, document: str, *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None = None
    ) -> list[ChunkKey]:
        """Chunk keys of an origin document, in order."""
        raise NotFound(f"{self.name} does not know documents")

    async def emphasize(
        self, document: str, emphasis: str, *, fingerprint: ModelFingerprint, namespace: Namespace,
        token: str | None = None,
    ) -> tuple[list[ChunkKey], str]:
        """Keys and variant id of a steered variant of an origin document (``emphasis``:
        :class:`kdn.steer.Emphasis` as JSON), computed by the origin when it is not stored yet."""
        raise NotFound(f"{self.name} does not compute steered variants")

    async def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# Request coalescing


class SingleFlight(Generic[K, V]):
    """Concurrent calls for one key share one execution.

    Invariant: while a call for ``key`` is in flight, further calls for ``key`` do not start
    ``fn``; they wait for the running one and get its result or exception. The running call is a
    task of its own, so a cancelled waiter (a client that went away) does not cancel it for the
    others.
    """

    def __init__(self) -> None:
        self._inflight: dict[K, asyncio.Task[V]] = {}
        self.started = 0
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._inflight)

    def in_flight(self, key: K) -> bool:
        return key in self._inflight

    async def do(self, key: K, fn: Callable[[], Awaitable[V]]) -> tuple[V, bool]:
        """Run ``fn`` once per concurrent burst for ``key``; returns (result, shared)."""
        task = self._inflight.get(key)
        shared = task is not None
        if task is None:
            self.started += 1
            task = asyncio.ensure_future(fn())
            self._inflight[key] = task
            task.add_done_callback(lambda t, k=key: self._forget(k, t))
        else:
            self.coalesced += 1
        return await asyncio.shield(task), shared

    def _forget(self, key: K, task: asyncio.Task[V]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # mark retrieved: waiters got it, or nobody was left to care


# ---------------------------------------------------------------------------------------------
# gRPC


class GrpcUpstream(Upstream):
    """A peer edge or the origin over gRPC. One channel, reused; deadlines on every call."""

    def __init__(
        self,
        name: str,
        address: str,
        *,
        kind: str = "peer",
        tls: TlsFiles | None = None,
        token: str | None = None,
        fetch_deadline_s: float,
        call_deadline_s: float,
        max_message: int,
        max_artifact: int,
        channel: Any = None,
        credential: Callable[[str], str] | None = None,
    ) -> None:
        """The deadlines and size bounds come from the edge's config (:func:`peer_upstream`,
        :func:`origin_upstream`). ``channel`` replaces the socket to ``address`` (an in-process
        channel in unit tests). ``credential``: ``tenant -> token`` minted per call (edge tokens);
        it wins over ``token``."""
        if kind not in ("peer", "origin"):
            raise InvalidInput(f"upstream kind must be peer or origin, got {kind!r}")
        self.name, self.address, self.kind = name, address, kind
        self._token = token
        self._credential = credential
        self._fetch_deadline = fetch_deadline_s
        self._call_deadline = call_deadline_s
        self._max_artifact = max_artifact
        self._channel = channel if channel is not None else aio_channel(address, tls=tls, max_message=max_message)
        self._stub = service_stub(self._channel, "EdgeService" if kind == "peer" else "OriginService")
        self._peer = f"{kind} {name}"
        # Fetch answers are read as frames (kdn.wire.calls): zero-copy views, joined once
        self._fetch = fetch_method(self._channel, "EdgeService" if kind == "peer" else "OriginService")

    def _md(self, token: str | None, tenant: str) -> tuple[tuple[str, str], ...]:
        if self._credential is not None:
            return auth_metadata(self._credential(tenant))
        return auth_metadata(self._token if self._token is not None else token)

    async def fetch(self, spec: FetchSpec, *, token: str | None = None) -> bytes:
        md = self._md(token, spec.namespace.tenant)
        if self.kind == "peer" and not spec.local_only:
            md = (*md, (FORWARDED_HEADER, "1"))
        with rpc_errors(self._peer):
            call = self._fetch(spec.to_proto(), timeout=self._fetch_deadline, metadata=md)
            fetched = await collect_fetch(call, peer=self.name, limit=self._max_artifact)
        return fetched.data

    async def lookup(
        self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None = None
    ) -> int:
        req = lookup_request(keys, fingerprint=fingerprint, namespace=namespace, local_only=True)
        with rpc_errors(self._peer):
            resp = await self._stub.Lookup(req, timeout=self._call_deadline, metadata=self._md(token, namespace.tenant))
        return min(int(resp.available), len(keys))

    async def document(
        self, document: str, *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None = None
    ) -> list[ChunkKey]:
        if self.kind != "origin":
            return await super().document(document, fingerprint=fingerprint, namespace=namespace, token=token)
        req = document_request(document, fingerprint=fingerprint, namespace=namespace)
        with rpc_errors(self._peer):
            resp = await self._stub.Document(req, timeout=self._call_deadline,
                                             metadata=self._md(token, namespace.tenant))
        return chain_keys(resp.keys)

    async def emphasize(
        self, document: str, emphasis: str, *, fingerprint: ModelFingerprint, namespace: Namespace,
        token: str | None = None,
    ) -> tuple[list[ChunkKey], str]:
        if self.kind != "origin":
            return await super().emphasize(document, emphasis, fingerprint=fingerprint, namespace=namespace, token=token)
        req = document_request(document, fingerprint=fingerprint, namespace=namespace, emphasis=emphasis)
        with rpc_errors(self._peer):  # the origin computes: the compute deadline, not a lookup's
            resp = await self._stub.Document(req, timeout=self._fetch_deadline,
                                             metadata=self._md(token, namespace.tenant))
        return chain_keys(resp.keys), resp.steer_variant

    async def healthy(self) -> bool:
        return await health.healthy(self._channel, timeout=min(1.0, self._call_deadline))

    async def close(self) -> None:
        await self._channel.close(grace=None)


class PeerUpstream(GrpcUpstream):
    """Another edge's ``EdgeService``."""

    def __init__(self, name: str, address: str, **kw: object) -> None:
        super().__init__(name, address, kind="peer", **kw)  # type: ignore[arg-type]


def peer_upstream(config: Any, edge_key: Any, member: Any) -> PeerUpstream:
    """gRPC to the edge ``member`` as ``config`` (an ``EdgeConfig``) says: with a cluster key
    (``edge_key``), one-use edge tokens per request, never the config's ``upstream_token``."""
    c = config
    return PeerUpstream(
        member.node_id, member.address, tls=c.upstream_tls, token=None if edge_key else c.upstream_token,
        fetch_deadline_s=c.peer_deadline_s * 4, call_deadline_s=c.peer_deadline_s,
        max_message=c.max_message_bytes, max_artifact=c.max_artifact_bytes,
        credential=edge_key.credential(member.node_id) if edge_key else None,
    )


class OriginUpstream(GrpcUpstream):
    """The origin's ``OriginService``."""

    def __init__(self, address: str, **kw: object) -> None:
        super().__init__("origin", address, kind="origin", **kw)  # type: ignore[arg-type]


def origin_upstream(config: Any, *, address: str | None = None, channel: Any = None) -> OriginUpstream:
    """gRPC to the origin as ``config`` (an ``EdgeConfig``) says: at ``address`` (default: its
    ``origin``), or over ``channel`` (an in-process one in tests) instead of a socket."""
    c = config
    return OriginUpstream(
        address or c.origin, tls=c.upstream_tls, token=c.upstream_token,
        fetch_deadline_s=c.fetch_deadline_s, call_deadline_s=c.admin_deadline_s,
        max_message=c.max_message_bytes, max_artifact=c.max_artifact_bytes, channel=channel,
    )
