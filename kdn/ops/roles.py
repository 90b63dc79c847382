"""KDN's roles as Ray actors, placed by the nodes' custom resources.

- one origin actor per ``kdn_origin`` node (:class:`kdn.origin.ray_origin.OriginActor`: the origin gRPC
  server, its store and its model);
- one :class:`EdgeActor` per ``kdn_edge`` node: an :class:`kdn.edge.server.EdgeServer` on its own
  event loop thread, registered in the cluster registry (:mod:`kdn.ops.registry`) and refreshed there
  by a heartbeat, with its overlay membership read back from the registry.

Actors are detached, named by role and index (``kdn-edge-0`` ...) and restarted by Ray when their
process dies (``max_restarts=-1``). A restarted edge keeps its node id and disk directory, so it
rejoins the overlay under the same id, takes its keys back, and finds its disk tier again.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

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


class EdgeActor:
    """Hosts one EdgeServer inside a Ray actor process, on its own event-loop thread.

    ``registered=True`` (what `kdn up` places): the edge heartbeats into the cluster registry and
    reads its overlay members back from it. ``registered=False``: a lone edge whose peers come
    from its config (what `kdn demo` runs).
    """

    def __init__(self, config: dict[str, Any], registered: bool = True) -> None:
        from kdn.edge.config import EdgeConfig
        from kdn.edge.overlay import Member

        self._config = EdgeConfig.build(config)
        self._members: list[Member] = []
        self._gauges: dict[str, Any] = {}
        self._registry = get_registry() if registered else None
        if self._registry is not None:
            self._refresh_members()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="kdn-edge", daemon=True)
        self._thread.start()
        if not self._ready.wait(120) or self._error is not None:
            raise RuntimeError(f"edge {self._config.node_id} did not start: {self._error!r}")
        if self._registry is not None:
            self._register()
            threading.Thread(target=self._heartbeat, name="kdn-edge-heartbeat", daemon=True).start()

    # -- membership ----------------------------------------------------------------------------

    def _refresh_members(self) -> None:
        import ray

        from kdn.edge.overlay import Member

        entries = ray.get(self._registry.members.remote("edge"), timeout=10)
        self._members = [Member(e["node_id"], e["address"], 1.0) for e in entries]

    def _provider(self):
        return list(self._members)

    def _register(self) -> None:
        import ray

        metrics = f"{self._config.metrics_host}:{self._server.metrics_port}" if self._server.metrics_port else ""
        ray.get(self._registry.register.remote("edge", self._config.node_id, self._server.address, metrics), timeout=10)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._register()
                self._refresh_members()
                self._export_ray_metrics()
            except Exception:  # registry briefly unavailable: keep serving, try again next beat
                continue

    def _export_ray_metrics(self) -> None:
        """Mirror the edge's counters into Ray's metrics, so they appear where Ray's own do
        (Ray's Prometheus endpoint / dashboard), tagged by role and node id."""
        from ray.util.metrics import Gauge

        if self._loop is None or self._server is None or self._server.node is None:
            return
        counters, _ = asyncio.run_coroutine_threadsafe(self._server.node.stats(), self._loop).result(timeout=5)
        for name, value in counters.items():
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(f"kdn_edge_{name}", description=f"KDN edge {name}",
                                                   tag_keys=("role", "node_id"))
            gauge.set(float(value), tags={"role": "edge", "node_id": self._config.node_id})

    # -- server thread -------------------------------------------------------------------------

    def _serve(self) -> None:
        from kdn.edge.server import EdgeServer

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        members = self._provider if self._registry is not None else None
        try:
            self._server = EdgeServer(self._config, members=members)
            self._loop.run_until_complete(self._server.start())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()  # until stop() stops it

    # -- actor API -----------------------------------------------------------------------------

    def address(self) -> str:
        return self._server.address

    def info(self) -> dict[str, Any]:
        return {
            "node_id": self._config.node_id,
            "address": self._server.address,
            "metrics_address": f"{self._config.metrics_host}:{self._server.metrics_port}" if self._server.metrics_port else "",
            "pid": os.getpid(),
        }

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        """Stop serving (graceful), deregister, and end the server thread."""
        self._stop.set()
        if self._registry is not None:
            import ray

            ray.get(self._registry.deregister.remote("edge", self._config.node_id), timeout=10)
        if self._loop is not None and self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace=0.5), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


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
        ).remote(ecfg))
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
