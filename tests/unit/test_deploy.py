"""deploy/ files parse, and their node types and resources agree with the code's constants."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kdn.ops.cluster import ClusterConfig
from kdn.errors import ConfigError
from kdn.ops.registry import RESOURCE_EDGE, RESOURCE_HEAD, RESOURCE_ORIGIN

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_ray_launcher_config_has_origin_and_edge_node_types():
    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    types = cfg["available_node_types"]
    assert types["origin"]["resources"] == {RESOURCE_ORIGIN: 1}
    assert types["edge"]["resources"] == {RESOURCE_EDGE: 1}
    assert types[cfg["head_node_type"]]["resources"] == {RESOURCE_HEAD: 1}
    assert RESOURCE_HEAD in " ".join(cfg["head_start_ray_commands"])


def _ray_start_resources(group: dict) -> dict:
    # KubeRay passes rayStartParams.resources through a shell: '"{\"kdn_edge\": 1}"'
    raw = group["rayStartParams"]["resources"]
    return json.loads(json.loads(raw))


def test_kuberay_manifest_groups_match_resources():
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text()))
    (cluster,) = [d for d in docs if d and d.get("kind") == "RayCluster"]
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"origin", "edge"}
    assert _ray_start_resources(groups["origin"]) == {RESOURCE_ORIGIN: 1}
    assert _ray_start_resources(groups["edge"]) == {RESOURCE_EDGE: 1}
    assert _ray_start_resources(cluster["spec"]["headGroupSpec"]) == {RESOURCE_HEAD: 1}


def test_dockerfile_has_cpu_default_and_cuda_build_arg():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "ARG BASE=python:3.11-slim" in text
    assert "FROM ${BASE}" in text
    assert "COPY kdn kdn" in text  # one import root: every role lives under kdn/


def test_standalone_edge_guide_uses_real_flags():
    text = (DEPLOY / "standalone-edge.md").read_text()
    assert "kdn edge" in text and "--origin" in text and "--peers" in text


def test_cluster_config_refuses_unknown_key_and_zero_edges(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("edge_nodes: 2\nflux_capacitor: 1\n")
    try:
        ClusterConfig.from_file(bad)
    except ConfigError as exc:
        assert "flux_capacitor" in str(exc)
    else:
        raise AssertionError("unknown key accepted")
    try:
        ClusterConfig.build(edge_nodes=0)
    except ConfigError as exc:
        assert "edge_nodes" in str(exc)
    else:
        raise AssertionError("zero edges accepted")
