"""The origin on a Ray cluster: joining/starting Ray, and the origin server as a Ray actor.

- :func:`ensure_ray`: use the Ray already initialised in this process, join ``address``, or start
  a local single-node cluster that carries ``kdn_origin`` (no dashboard, bounded). Returns whether
  this call started Ray (then the caller shuts it down).
- :func:`start_origin_actor`: place an :class:`~kdn.origin.server.OriginServer` (in-process compute)
  in an actor on a node with ``kdn_origin``; it binds the node's address and reports it.
"""

from __future__ import annotations

import os
from typing import Any

from kdn.origin.config import OriginConfig
from kdn.procs import start_local_ray

__all__ = ["OriginActor", "ensure_ray", "start_origin_actor"]


def ensure_ray(
    *, address: str | None = None, origin_slots: float = 1, num_cpus: int | None = None, temp_dir: str | None = None
) -> bool:
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return True
    start_local_ray(
        num_cpus=num_cpus or max(os.cpu_count() or 1, int(origin_slots)),
        resources={"kdn_origin": origin_slots},
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=temp_dir,
    )
    return True


class OriginActor:
    """An OriginServer living in a Ray actor (in-process compute on that node)."""

    def __init__(self, config: dict[str, Any]) -> None:
        import ray

        from kdn.origin.server import OriginServer

        cfg = OriginConfig.build(config)
        self._server = OriginServer(cfg)
        self._server.start()
        host = cfg.listen.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", ""):
            host = ray.util.get_node_ip_address()
        self._address = f"{host}:{self._server.port}"

    def address(self) -> str:
        return self._address

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict[str, float]:
        return dict(self._server.stats().counters)

    def ingest_text(self, text: str, doc_id: str = "", tenant: str = "default", salt: str = "") -> list[str]:
        from kdn.keys import Namespace

        return [bytes(k).hex() for k in self._server.ingest_text(text, namespace=Namespace(tenant, salt), doc_id=doc_id)]

    def stop(self) -> None:
        self._server.stop()




def start_origin_actor(
    config: OriginConfig, *, name: str | None = None, max_restarts: int = 3, timeout_s: float = 120.0
) -> tuple[Any, str]:
    """Start the origin server as an actor on a ``kdn_origin`` node; returns (actor, address).

    Pass ``listen="0.0.0.0:PORT"`` in ``config`` to be reachable from other nodes (the actor then
    reports the node's IP); a fixed port keeps the address stable across actor restarts.
    """
    import ray

    actor_cls = ray.remote(OriginActor)
    opts: dict[str, Any] = dict(resources={"kdn_origin": 0.01}, num_cpus=0, max_restarts=max_restarts)
    if name:
        opts.update(name=name, get_if_exists=True)
    actor = actor_cls.options(**opts).remote(config.model_dump())
    return actor, ray.get(actor.address.remote(), timeout=timeout_s)
