"""Test support for the edge: small real artifacts and overlays of in-process nodes (no sockets).

:func:`make_chain` encodes a chain of small, real artifact containers (random KV, real keys).
:class:`InMemoryOverlay` wires N :class:`kdn.edge.node.EdgeNode`s to each other through
:class:`kdn.testing.upstream.NodeUpstream` and to one :class:`kdn.testing.upstream.InMemoryUpstream` origin, so
overlay, coalescing and prefetch logic run exactly as in production, minus gRPC.
:class:`InProcessEdge` serves one real node through its real :class:`kdn.edge.server.EdgeServicer`
on a :class:`kdn.wire.inproc.InProcessServer`: clients (the host's ``GrpcEdgeTransport``, the
admin client) talk to it through an in-process channel, every message converted and framed as on
a socket, and its origin can be a real origin servicer on another in-process channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kdn.edge.clock import Clock, FakeClock
from kdn.edge.config import EdgeConfig
from kdn.edge.node import EdgeNode
from kdn.edge.overlay import Member, Overlay
from kdn.edge.upstream import FetchSpec, Upstream
from kdn.testing.upstream import InMemoryUpstream, NodeUpstream
from kdn.artifact import encode_artifact
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, chunk_keys

DEFAULT_FP = ModelFingerprint(bytes(range(32)))


@dataclass(frozen=True, slots=True)
class Chain:
    """A chain of artifacts: ``keys[i]`` is held by ``blobs[i]``."""

    fingerprint: ModelFingerprint
    namespace: Namespace
    keys: list[ChunkKey]
    blobs: list[bytes]

    def spec(self, i: int, **kw: object) -> FetchSpec:
        return FetchSpec(self.keys[i], self.fingerprint, self.namespace, **kw)  # type: ignore[arg-type]

    def by_key(self) -> dict[bytes, bytes]:
        return {bytes(k): b for k, b in zip(self.keys, self.blobs)}


def make_chain(
    n: int,
    *,
    namespace: Namespace = Namespace("default"),
    fingerprint: ModelFingerprint = DEFAULT_FP,
    seed: int = 0,
    shape: tuple[int, int, int, int] = (2, 2, 4, 8),  # (L, H, T, D)
    codec: str = "raw",
) -> Chain:
    """``n`` chained artifacts of random fp16 KV ``(L, 2, H, T, D)``."""
    L, H, T, D = shape
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=n * T)
    keys = chunk_keys(tokens, fingerprint=fingerprint, namespace=namespace, chunk_size=T)
    gen = torch.Generator().manual_seed(seed)
    blobs = []
    parent = ROOT_KEY
    for i, key in enumerate(keys):
        kv = torch.randn((L, 2, H, T, D), generator=gen).to(torch.float16)  # (L, 2, H, T, D)
        blobs.append(encode_artifact(kv, key=key, parent_key=parent, fingerprint=fingerprint, codec=codec, chunk_index=i))
        parent = key
    return Chain(fingerprint, namespace, keys, blobs)


class Aborted(Exception):
    """What :meth:`FakeServicerContext.abort` raises (grpc.aio raises its own AbortError)."""


class FakeServicerContext:
    """Just enough of ``grpc.aio.ServicerContext`` to call a :class:`kdn.edge.server.EdgeServicer`
    method directly: the caller's bearer ``token`` (none: no metadata), and ``code``/``details``
    of the abort, if any (``code`` stays None on success)."""

    def __init__(self, token: str | None = None) -> None:
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self.code: Any = None
        self.details = ""
        self.abort_exception: Aborted | None = None

    def invocation_metadata(self) -> Any:
        return self._md

    async def abort(self, code: Any, details: str) -> None:
        self.code, self.details = code, details
        # as grpc.aio's servicer context does: it keeps the abort exception on the call's state
        self.abort_exception = Aborted(details)
        raise self.abort_exception


class InMemoryOverlay:
    """N edge nodes + one in-memory origin, peers talking through direct calls."""

    def __init__(
        self,
        n: int,
        *,
        origin: InMemoryUpstream | None = None,
        memory_bytes: int = 1 << 24,
        clock: Clock | None = None,
        **config: object,
    ) -> None:
        from kdn.edge.store import build_store

        self.clock = clock or FakeClock()
        self.origin = origin if origin is not None else InMemoryUpstream()
        self.ids = [f"e{i}" for i in range(n)]
        self.links: dict[tuple[str, str], NodeUpstream] = {}
        self.nodes: dict[str, EdgeNode] = {}
        self.down: set[str] = set()
        members = [Member(i, f"mem://{i}") for i in self.ids]
        for nid in self.ids:
            cfg = EdgeConfig.build({"node_id": nid, "memory_bytes": memory_bytes, **config})
            overlay = Overlay(members[self.ids.index(nid)], members, replicas=cfg.replicas,
                              backoff_s=cfg.peer_backoff_s, clock=self.clock)
            node = EdgeNode(
                cfg,
                store=build_store(cfg.model_copy(update={"disk_dir": None}), clock=self.clock),  # memory only
                overlay=overlay,
                connect=lambda m, me=nid: self._link(me, m),
                origin=self.origin,
                clock=self.clock,
            )
            node.address = f"mem://{nid}"
            self.nodes[nid] = node

    def _link(self, src: str, member: Member) -> NodeUpstream:
        link = self.links.get((src, member.node_id))
        if link is None:
            link = NodeUpstream(member.node_id, self.nodes[member.node_id])
            link.up = member.node_id not in self.down
            self.links[(src, member.node_id)] = link
        return link

    def kill(self, node_id: str) -> None:
        """Every link to ``node_id`` fails from now on (as a SIGKILLed process would)."""
        for (_, dst), link in self.links.items():
            if dst == node_id:
                link.up = False
        self.down.add(node_id)

    def revive(self, node_id: str) -> None:
        for (_, dst), link in self.links.items():
            if dst == node_id:
                link.up = True
        self.down.discard(node_id)

    async def start(self) -> None:
        for node in self.nodes.values():
            await node.start()

    async def stop(self) -> None:
        for node in self.nodes.values():
            await node.stop()

    async def __aenter__(self) -> "InMemoryOverlay":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def owners(self, key: bytes) -> list[str]:
        return [m.node_id for m in next(iter(self.nodes.values())).overlay.owners(key)]

    def non_owner(self, key: bytes) -> EdgeNode:
        owners = set(self.owners(key))
        return next(n for nid, n in self.nodes.items() if nid not in owners)


def reseal(blob: bytes, *, header: Any = None, payloads: Any = None) -> bytes:
    """A copy of the container ``blob`` whose header and/or section payloads were changed by
    ``header(h) -> None`` (edits the parsed ``ArtifactHeader`` in place) and ``payloads(list) ->
    list``, with every checksum and the digest recomputed: the bytes pass any integrity check, so
    only a decoder or a header check can refuse them. For tests of what checksums cannot catch."""
    import struct

    import xxhash

    from kdn.artifact import read_header, section_infos

    magic, version, flags, hlen = struct.unpack_from("<4sHHI", blob)
    h = read_header(blob)
    pos = 12 + hlen + 8
    sections = []
    for _ in section_infos(h):
        (n,) = struct.unpack_from("<I", blob, pos)
        sections.append(blob[pos + 4 : pos + 4 + n])
        pos += 4 + n + 8
    if header is not None:
        header(h)
    if payloads is not None:
        sections = payloads(sections)
    hbytes = h.SerializeToString()
    prefix = struct.pack("<4sHHI", magic, version, flags, len(hbytes))
    checks = [struct.pack("<Q", xxhash.xxh3_64_intdigest(prefix + hbytes))]
    out = [prefix, hbytes, checks[0]]
    for payload in sections:
        framed = struct.pack("<I", len(payload)) + payload
        checks.append(struct.pack("<Q", xxhash.xxh3_64_intdigest(framed)))
        out += [framed, checks[-1]]
    out += [b"KDNE", xxhash.xxh3_128_digest(b"".join(checks))]
    return b"".join(out)


def origin_with(chains: Sequence[Chain], **kw: object) -> InMemoryUpstream:
    artifacts: dict[bytes, bytes] = {}
    tenants: dict[bytes, str] = {}
    for c in chains:
        artifacts.update(c.by_key())
        tenants.update({bytes(k): c.namespace.tenant for k in c.keys})
    return InMemoryUpstream(artifacts, tenants=tenants, **kw)  # type: ignore[arg-type]


class InProcessEdge:
    """One real :class:`EdgeNode` behind its real servicer, reachable through :meth:`channel`.

    Composed as :class:`kdn.edge.server.EdgeServer` composes its edge
    (:func:`kdn.edge.compose.compose_edge`), without binding anything: a memory-only store, no
    peers, no shared memory, no metrics port, no bulk byte path. ``node``: serve that node (one
    of an :class:`InMemoryOverlay`, with its peers) instead of a new node without peers::

        edge = InProcessEdge(origin=origin_upstream(EdgeConfig(), address="inproc", channel=origin_server.channel()))
        await edge.start()
        transport = GrpcEdgeTransport("inproc:e0", channel=edge.channel())
    """

    def __init__(
        self, *, origin: Upstream | None = None, clock: Clock | None = None, memory_bytes: int = 1 << 24,
        node: EdgeNode | None = None, **config: object,
    ) -> None:
        from kdn.edge.compose import compose_edge
        from kdn.edge.server import EdgeServicer
        from kdn.edge.store import build_store
        from kdn.wire.auth import TokenAuth
        from kdn.wire.inproc import InProcessServer
        from kdn.wire.service import add_servicer

        self.clock = clock or (node.clock if node is not None else FakeClock())
        if node is not None:  # a node of an InMemoryOverlay: served here, its peers as it has them
            self.config = node.config
        else:
            self.config = EdgeConfig.build({"node_id": "e0", "memory_bytes": memory_bytes, **config})
        self.auth = TokenAuth.from_config(self.config.tokens)
        store = None if node is not None else build_store(self.config.model_copy(update={"disk_dir": None}),
                                                          clock=self.clock)  # memory only
        edge = compose_edge(
            self.config, address=f"inproc://{self.config.node_id}", auth=self.auth, clock=self.clock, store=store,
            node=node, members=(), connect=self._no_peers, origin=origin, hints_dir=None, shm=False,
        )
        self.node, self.front, self.hints = edge.node, edge.front, edge.hints
        self.server = InProcessServer()
        add_servicer(self.server, EdgeServicer(self.front), "EdgeService")  # type: ignore[arg-type]

    @staticmethod
    def _no_peers(member: Member) -> Upstream:
        raise AssertionError(f"an in-process edge has no peers (asked for {member.node_id})")

    def channel(self) -> Any:
        return self.server.channel()

    async def start(self) -> "InProcessEdge":
        await self.node.start()
        return self

    async def stop(self) -> None:
        await self.node.stop()

    async def __aenter__(self) -> "InProcessEdge":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
