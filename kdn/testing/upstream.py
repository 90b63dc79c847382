"""The edge's upstreams as unit tests need them: no sockets.

- :class:`InMemoryUpstream` — a dict of artifacts with a fetch counter, latency and an on/off
  switch: the fake origin of unit tests (httpx ``MockTransport`` style);
- :class:`NodeUpstream` — another in-process :class:`kdn.edge.node.EdgeNode` called directly: the
  in-memory peer transport, so overlay, coalescing and prefetch logic run without sockets.
"""

from __future__ import annotations

import asyncio
from typing import Mapping, Protocol, Sequence

from kdn.edge.upstream import FetchSpec, Upstream
from kdn.errors import NotFound, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace

__all__ = ["InMemoryUpstream", "NodeUpstream"]


class InMemoryUpstream(Upstream):
    """Artifacts in a dict: a fake origin. ``fetches`` counts calls; ``up=False`` makes it Unavailable."""

    def __init__(
        self,
        artifacts: Mapping[bytes, bytes] | None = None,
        *,
        name: str = "origin",
        kind: str = "origin",
        delay_s: float = 0.0,
        documents: Mapping[str, Sequence[ChunkKey]] | None = None,
        tenants: Mapping[bytes, str] | None = None,
    ) -> None:
        self.name, self.kind = name, kind
        self.artifacts: dict[bytes, bytes] = dict(artifacts or {})
        self.tenants: dict[bytes, str] = dict(tenants or {})  # key -> owning tenant (absent = any)
        self.documents: dict[str, list[ChunkKey]] = {d: list(ks) for d, ks in (documents or {}).items()}
        self.delay_s = delay_s
        self.up = True
        self.fetches = 0
        self.fetched: list[ChunkKey] = []

    def _check_up(self) -> None:
        if not self.up:
            raise Unavailable(f"{self.kind} {self.name} is down")

    async def fetch(self, spec: FetchSpec, *, token: str | None = None) -> bytes:
        self._check_up()
        self.fetches += 1
        self.fetched.append(spec.key)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self._check_up()
        data = self.artifacts.get(bytes(spec.key))
        owner = self.tenants.get(bytes(spec.key), spec.namespace.tenant)
        if data is None or owner != spec.namespace.tenant:
            raise NotFound(f"{self.name} has no artifact {bytes(spec.key).hex()[:16]}")
        return data

    async def lookup(
        self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None = None
    ) -> int:
        self._check_up()
        n = 0
        for k in keys:
            if bytes(k) not in self.artifacts:
                break
            n += 1
        return n

    async def document(
        self, document: str, *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None = None
    ) -> list[ChunkKey]:
        self._check_up()
        if document not in self.documents:
            raise NotFound(f"no document {document!r}")
        return list(self.documents[document])

    async def emphasize(
        self, document: str, emphasis: str, *, fingerprint: ModelFingerprint, namespace: Namespace,
        token: str | None = None,
    ) -> tuple[list[ChunkKey], str]:
        """The fake: ``documents[document + "#steer"]``, variant id = the emphasis' digest; every call
        is recorded in ``emphasized``."""
        import hashlib

        self._check_up()
        self.emphasized = getattr(self, "emphasized", []) + [(document, emphasis)]
        keys = self.documents.get(document + "#steer")
        if keys is None:
            raise NotFound(f"no document {document!r}")
        return list(keys), hashlib.blake2b(emphasis.encode(), digest_size=32).hexdigest()

    async def healthy(self) -> bool:
        return self.up


class _PeerNode(Protocol):
    """What :class:`NodeUpstream` needs of an :class:`kdn.edge.node.EdgeNode`."""

    async def fetch_bytes(
        self, spec: FetchSpec, *, token: str | None = None, forwarded: bool = False
    ) -> tuple[bytes, str]: ...

    async def lookup_local(self, keys: Sequence[ChunkKey], *, tenant: str) -> list[str]: ...


class NodeUpstream(Upstream):
    """Another in-process edge node as a peer: the in-memory peer transport. ``up=False`` = killed."""

    kind = "peer"

    def __init__(self, name: str, node: _PeerNode) -> None:
        self.name = name
        self.node = node
        self.up = True
        self.fetches = 0

    async def fetch(self, spec: FetchSpec, *, token: str | None = None) -> bytes:
        if not self.up:
            raise Unavailable(f"peer {self.name} is down")
        self.fetches += 1
        data, _source = await self.node.fetch_bytes(spec, token=token, forwarded=not spec.local_only)
        return data

    async def lookup(
        self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None = None
    ) -> int:
        if not self.up:
            raise Unavailable(f"peer {self.name} is down")
        return len(await self.node.lookup_local(keys, tenant=namespace.tenant))

    async def healthy(self) -> bool:
        return self.up
