"""The edge on a Ray cluster: an :class:`~kdn.edge.server.EdgeServer` as a Ray actor.

:class:`EdgeActor` runs one EdgeServer on its own event-loop thread inside an actor process. Ops
places it (:mod:`kdn.ops.roles`: name, resources, restarts) and hands it what the cluster's
membership needs, so the edge never imports ops:

- ``registry``: a callable, run in the actor process, that returns the registry actor's handle
  (its ``register``, ``deregister`` and ``members`` methods, called as Ray actor methods);
- ``heartbeat_s``: how often the edge re-registers itself and reads its overlay members back.

With neither, the edge stands alone and its peers come from its config.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable

__all__ = ["EdgeActor"]


class EdgeActor:
    """Hosts one EdgeServer inside a Ray actor process, on its own event-loop thread.

    Registered (``registry`` and ``heartbeat_s`` given; what `kdn up` places): the edge heartbeats
    into the cluster registry and reads its overlay members back from it. Unregistered (neither):
    a lone edge whose peers come from its config (what `kdn demo` runs).
    """

    def __init__(
        self, config: dict[str, Any], registry: Callable[[], Any] | None = None, heartbeat_s: float | None = None
    ) -> None:
        from kdn.edge.config import EdgeConfig
        from kdn.edge.overlay import Member

        if (registry is None) != (heartbeat_s is None):
            raise ValueError("a registered edge needs both registry and heartbeat_s; a lone edge neither")
        self._config = EdgeConfig.build(config)
        self._members: list[Member] = []
        self._gauges: dict[str, Any] = {}
        self._heartbeat_s = heartbeat_s
        self._registry = registry() if registry is not None else None
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
        while not self._stop.wait(self._heartbeat_s):
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
