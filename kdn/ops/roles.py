"""KDN's roles as Ray actors, placed by the nodes' custom resources.

- one origin actor per ``kdn_origin`` node (:class:`kdn.origin.ray_origin.OriginActor`: the origin gRPC
  server, its store and its model);
- one edge actor per ``kdn_edge`` node (:class:`kdn.edge.ray_edge.EdgeActor`: an
  :class:`kdn.edge.server.EdgeServer` on its own event loop thread), handed the cluster registry
  (:mod:`kdn.ops.registry`) and the heartbeat interval, so it registers there, refreshes its entry
  every :data:`HEARTBEAT_S` and reads its overlay membership back.

Actors are detached, named by role and index (``kdn-edge-0`` ...) and restarted by Ray when their
process dies (``max_restarts=-1``). A restarted edge keeps its node id and disk directory, so it
rejoins the overlay under the same id, takes its keys back, and finds its disk tier again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kdn.edge.ray_edge import EdgeActor
from kdn.ops.registry import (
    DEFAULT_TTL_S,
    RAY_NAMESPACE,
    RESOURCE_EDGE,
    RESOURCE_ORIGIN,
    get_or_create_registry,
    get_registry,
)

ROLE_PREFIX = "kdn-"
HEARTBEAT_S = DEFAULT_TTL_S / 5


def deploy_roles(config: Any, *, progress=print) -> tuple[list[dict], list[dict]]:
    """Place the registry, origin(s) and edges on the connected cluster; returns their endpoints."""
    import ray

    registry = get_or_create_registry()
    ray.get(registry.ping.remote(), timeout=config.wait_s)
    state_dir = Path(config.state_dir)
    bind = config.bind_host
    # Joining a running cluster adds roles under fresh ids, so its `kdn down` removes only them.
    taken = {e["node_id"] for e in ray.get(registry.members.remote("origin"), timeout=10)}
    free_origins = (i for i in range(10_000) if f"origin-{i}" not in taken)
    origins = [place_origin(config, next(free_origins), registry, progress=progress)
               for _ in range(max(config.origin_nodes, 1 if config.address is None else 0))]
    origin_address = origins[0]["address"] if origins else _registered_origin(registry)

    edges = []
    actors = []
    taken = {e["node_id"] for e in ray.get(registry.members.remote("edge"), timeout=10)}
    free_ids = (f"edge-{i}" for i in range(10_000) if f"edge-{i}" not in taken)
    for _ in range(config.edge_nodes):
        node_id = next(free_ids)
        progress(f"placing {node_id}")
        ecfg = dict(
            node_id=node_id, listen=f"{bind}:0", origin=origin_address,
            memory_bytes=config.edge_memory_bytes, disk_dir=str(state_dir / "edges" / node_id),
            disk_bytes=config.edge_disk_bytes, replicas=config.replicas, metrics_port=0,
        )
        actors.append(ray.remote(EdgeActor).options(
            name=f"{ROLE_PREFIX}{node_id}", namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
            resources={RESOURCE_EDGE: 1}, num_cpus=0, max_restarts=-1, max_task_retries=3,
        ).remote(ecfg, get_registry, HEARTBEAT_S))
    for actor in actors:
        edges.append(ray.get(actor.info.remote(), timeout=config.wait_s))
    return origins, edges


def place_origin(config: Any, index: int, registry: Any = None, *, progress=print) -> dict:
    """Start (or find) origin ``index`` on a ``kdn_origin`` node and register its address."""
    import ray

    from kdn.origin.config import OriginConfig
    from kdn.origin.ray_origin import OriginActor

    from kdn.wire.channel import free_port

    registry = registry or get_registry()
    node_id = f"origin-{index}"
    progress(f"placing {node_id} (model {config.model})")
    # A fixed port keeps the origin's address stable across restarts: edges hold it in their config.
    known = {e["node_id"]: e["address"] for e in ray.get(registry.members.remote("origin"), timeout=10)}
    port = int(known[node_id].rpartition(":")[2]) if node_id in known else free_port()
    ocfg = OriginConfig.build(
        node_id=node_id, store_dir=str(Path(config.state_dir) / "origin-store"), models=[config.model],
        codecs=[config.codec], listen=f"{config.bind_host}:{port}", workers=1,
    )
    actor = ray.remote(OriginActor).options(
        name=f"{ROLE_PREFIX}{node_id}", namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
        resources={RESOURCE_ORIGIN: 1}, num_cpus=0, max_restarts=-1,
    ).remote(ocfg.model_dump())
    address = ray.get(actor.address.remote(), timeout=config.wait_s)
    ray.get(registry.register.remote("origin", node_id, address, "", False), timeout=10)
    return {"node_id": node_id, "address": address}


def _registered_origin(registry: Any) -> str | None:
    import ray

    entries = ray.get(registry.members.remote("origin"), timeout=10)
    return entries[0]["address"] if entries else None


def kill_roles(node_ids: list[str]) -> list[str]:
    """Kill the KDN actors of these node ids (and deregister them); other actors are left alone."""
    import ray

    registry = get_registry()
    killed = []
    for node_id in node_ids:
        try:
            ray.kill(ray.get_actor(f"{ROLE_PREFIX}{node_id}", namespace=RAY_NAMESPACE), no_restart=True)
        except ValueError:  # no such actor (already gone)
            continue
        role = "origin" if node_id.startswith("origin-") else "edge"
        ray.get(registry.deregister.remote(role, node_id), timeout=10)
        killed.append(node_id)
    return killed
