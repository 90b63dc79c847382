"""kdn.edge.ray_edge.EdgeActor, handed the registry as kdn.ops.roles hands it, on a real local Ray:
registers, heartbeats, exports Ray metrics, deregisters."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray

    from kdn.ops.registry import RAY_NAMESPACE, RESOURCE_EDGE, RESOURCE_HEAD
    from kdn.procs import start_local_ray

    start_local_ray(num_cpus=2, resources={RESOURCE_EDGE: 1, RESOURCE_HEAD: 1}, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR", namespace=RAY_NAMESPACE,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield ray
    ray.shutdown()


def test_registered_edge_actor_lifecycle(ray_local):
    ray = ray_local
    from kdn.edge.admin import EdgeClient
    from kdn.edge.ray_edge import EdgeActor
    from kdn.ops.registry import RESOURCE_EDGE, get_or_create_registry, get_registry
    from kdn.ops.roles import HEARTBEAT_S

    registry = get_or_create_registry()
    actor = ray.remote(EdgeActor).options(resources={RESOURCE_EDGE: 1}, num_cpus=0).remote(
        {"node_id": "e0", "listen": "127.0.0.1:0"}, get_registry, HEARTBEAT_S)
    info = ray.get(actor.info.remote(), timeout=120)
    (member,) = ray.get(registry.members.remote("edge"))
    assert (member["node_id"], member["address"]) == ("e0", info["address"])

    time.sleep(HEARTBEAT_S + 1)  # one heartbeat: re-registered, membership read back, counters exported
    (member,) = ray.get(registry.members.remote("edge"))
    assert member["age_s"] < HEARTBEAT_S + 1
    ray.get(actor._export_ray_metrics.remote(), timeout=30)  # Ray's metrics API accepts our gauges

    with EdgeClient(info["address"]) as client:  # it serves gRPC
        assert client.stats().counters["peers"] == 0

    ray.get(actor.stop.remote(), timeout=60)
    assert ray.get(registry.members.remote("edge")) == []
    ray.kill(actor)
