"""Cluster membership kept inside Ray: one named, detached registry actor.

Origins and edges register ``(role, node_id) -> address`` when their gRPC server is ready and
refresh it while alive; edges read the current edge list from it to build their overlay, and
clients read it to find an edge. An entry that has not been refreshed within ``ttl_s`` is treated
as gone, so a killed edge drops out even if nobody deregisters it.

Resource and actor names here are the contract with ``deploy/`` (a test checks they agree).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

RESOURCE_HEAD = "kdn_head"
RESOURCE_ORIGIN = "kdn_origin"
RESOURCE_EDGE = "kdn_edge"
RAY_NAMESPACE = "kdn"
REGISTRY_ACTOR = "kdn-registry"
DEFAULT_TTL_S = 15.0


@dataclass(frozen=True, slots=True)
class Member:
    role: str  # "origin" | "edge"
    node_id: str
    address: str
    metrics_address: str = ""
    updated_unix: float = 0.0
    expires: bool = True


class Registry:
    """Plain class; :func:`registry_actor` wraps it as a Ray actor. Holds no torch, no pickle-y state."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._members: dict[tuple[str, str], Member] = {}

    def register(self, role: str, node_id: str, address: str, metrics_address: str = "", expires: bool = True) -> None:
        """``expires=False`` for members that do not heartbeat (they stay until deregistered)."""
        self._members[(role, node_id)] = Member(role, node_id, address, metrics_address, time.time(), expires)

    def deregister(self, role: str, node_id: str) -> None:
        self._members.pop((role, node_id), None)

    def members(self, role: str | None = None) -> list[dict]:
        now = time.time()
        return [
            {"role": m.role, "node_id": m.node_id, "address": m.address, "metrics_address": m.metrics_address,
             "age_s": round(now - m.updated_unix, 3)}
            for m in sorted(self._members.values(), key=lambda m: (m.role, m.node_id))
            if (role is None or m.role == role) and (not m.expires or now - m.updated_unix <= self._ttl_s)
        ]

    def ping(self) -> bool:
        return True


def get_or_create_registry(ttl_s: float = DEFAULT_TTL_S):
    """The cluster's registry actor handle (created detached on the head on first use)."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_restarts=-1)(Registry)
    opts: dict = dict(name=REGISTRY_ACTOR, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True)
    head = {RESOURCE_HEAD: 0.001} if _has_resource(RESOURCE_HEAD) else {}
    return actor_cls.options(resources=head, **opts).remote(ttl_s)


def get_registry():
    import ray

    return ray.get_actor(REGISTRY_ACTOR, namespace=RAY_NAMESPACE)


def _has_resource(name: str) -> bool:
    import ray

    return ray.cluster_resources().get(name, 0) > 0
