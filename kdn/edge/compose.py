"""How an edge is put together from its :class:`~kdn.edge.config.EdgeConfig`: :func:`compose_edge`.

Both the served edge (:class:`kdn.edge.server.EdgeServer`, once its port is bound) and the
in-process one of the tests (:class:`kdn.testing.InProcessEdge`) are built here, so the
parts they serve (node, overlay, upstreams, operator hints, shared memory, the front) are the
same parts wired the same way. The caller brings what depends on where the edge runs: the store
(built from the config, or one of its own), its address, its token table, and any overrides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kdn.edge.budget import PutBudget
from kdn.edge.clock import Clock
from kdn.edge.config import EdgeConfig
from kdn.edge.front import EdgeFront
from kdn.edge.metrics import EdgeMetrics
from kdn.edge.node import EdgeNode
from kdn.edge.operator_hints import HintService
from kdn.edge.overlay import Member, MembershipProvider, Overlay, file_members, static_members
from kdn.edge.shm import ShmPool
from kdn.edge.store import TieredStore
from kdn.edge.upstream import Upstream, origin_upstream, peer_upstream
from kdn.wire.auth import TokenAuth

if TYPE_CHECKING:
    from kdn.edge.rtc import EdgeRtc

__all__ = ["ComposedEdge", "FROM_CONFIG", "compose_edge"]

FROM_CONFIG: Any = object()
"""The default of :func:`compose_edge`'s ``origin`` and ``hints_dir``: what the config says."""


@dataclass(slots=True)
class ComposedEdge:
    """The parts of one edge, wired: serve ``front``; start and stop ``node`` (and ``rtc``)."""

    node: EdgeNode
    front: EdgeFront
    hints: HintService
    rtc: "EdgeRtc | None"


def _origin(config: EdgeConfig) -> Upstream | None:
    return origin_upstream(config) if config.origin else None


def _members(config: EdgeConfig) -> MembershipProvider | Sequence[Member]:
    c = config
    if c.peers_file:
        return file_members(c.peers_file, c.peer_weights)
    return static_members(c.peers, c.peer_weights)


def compose_edge(
    config: EdgeConfig,
    *,
    address: str,
    auth: TokenAuth,
    clock: Clock,
    store: TieredStore | None = None,
    node: EdgeNode | None = None,
    members: MembershipProvider | Sequence[Member] | None = None,
    connect: Callable[[Member], Upstream] | None = None,
    origin: Upstream | None = FROM_CONFIG,
    hints_dir: str | None = FROM_CONFIG,
    shm: bool = True,
) -> ComposedEdge:
    """One edge from ``config``, reachable at ``address``, checking tokens with ``auth``.

    ``store``: the tiers the node keeps (required unless ``node`` is given). ``node``: serve that
    node (one of an in-memory overlay, with its peers) instead of composing one. ``members``: the
    overlay's provider (default: ``peers_file``, else the static ``peers``). ``connect``: how a
    peer is reached (default: gRPC, or WebRTC where ``rtc_signal`` is set). ``origin``: the
    upstream of last resort (default: ``origin`` of the config, None when it names none).
    ``hints_dir``: where operator schedules persist (default: ``disk_dir``). ``shm``: offer
    shared memory when the config does.
    """
    c = config
    rtc: "EdgeRtc | None" = None
    if node is None:
        assert store is not None, "compose_edge needs a store or a node"
        metrics = EdgeMetrics(c.node_id)
        provider: Any = members if members is not None else _members(c)
        dial = connect or (lambda member: peer_upstream(c, auth.edges, member))
        if c.rtc_signal:  # edges behind NAT: discovery at the origin, WebRTC where gRPC cannot dial
            from kdn.edge.rtc import EdgeRtc

            rtc = EdgeRtc(c, auth, metrics, provider if callable(provider) else list(provider))
            provider = rtc.members
            dial = connect or rtc.connect
        overlay = Overlay(
            Member(c.node_id, address, c.weight), provider, replicas=c.replicas, backoff_s=c.peer_backoff_s,
            clock=clock,
        )
        node = EdgeNode(
            c, store=store, overlay=overlay, connect=dial, origin=_origin(c) if origin is FROM_CONFIG else origin,
            metrics=metrics, clock=clock,
        )
        node.address = address
    hints = HintService(node, disk_dir=c.disk_dir if hints_dir is FROM_CONFIG else hints_dir, clock=clock)
    node.scheduler = hints
    pool = None
    if shm and c.shm:
        pool = ShmPool(c.node_id, directory=c.shm_dir, max_segments=c.shm_max_segments, max_bytes=c.shm_max_bytes)
    front = EdgeFront(node, auth=auth, put_budget=PutBudget(c.put_buffer_bytes), hints=hints, shm=pool)
    return ComposedEdge(node, front, hints, rtc)
