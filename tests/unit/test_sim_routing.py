"""Routing policies in the simulator (``kdn.simulator.routing``): the region's edges are the
choices; ``prefix_route`` follows the longest cached run, ``kv_route`` prices every edge with
``kdn route``'s own scorer, so it also leaves a holder whose GPUs are queued."""

from __future__ import annotations

from typing import Any

import pytest

from kdn.simulator.engine import Simulation, run_policy
from kdn.simulator.geo import CityIndex
from kdn.simulator.presets import load_presets
from tests.unit.test_sim_engine import make


@pytest.fixture(scope="module")
def cities() -> CityIndex:
    return CityIndex.default()


@pytest.fixture(scope="module")
def presets():  # type: ignore[no-untyped-def]
    return load_presets()


def chain_at(sim: Simulation, i: int) -> list[int]:
    return sim.ctx.chain(i)


def test_candidates_are_the_region_edges_nearest_first(cities: CityIndex, presets: Any) -> None:
    p = make(cities, presets)
    sim = Simulation(p.scenario, p.topology, p.requests, presets, "kv_route")
    sim.policy.start()
    ny = [e for e in range(p.topology.n_edges) if p.topology.region_names[p.topology.edge_region[e]] == "ny"]
    la = [e for e in range(p.topology.n_edges) if e not in ny]
    assert len(ny) == 2 and len(la) == 1
    assert sim.policy.candidates[ny[0]] == [ny[0], ny[1]] and sim.policy.candidates[la[0]] == la


@pytest.mark.parametrize("policy", ["prefix_route", "kv_route"])
def test_a_request_goes_to_the_sibling_that_holds_its_chain(cities: CityIndex, presets: Any, policy: str) -> None:
    p = make(cities, presets)
    sim = Simulation(p.scenario, p.topology, p.requests, presets, policy)
    sim.policy.start()
    i = next(j for j in range(len(p.requests)) if len(sim.policy.candidates[int(p.requests.edge[j])]) > 1)
    keys, e, n_in = chain_at(sim, i), int(p.requests.edge[i]), int(p.requests.input_tokens[i])
    sibling = next(c for c in sim.policy.candidates[e] if c != e)
    stored = sim.ctx.cost.stored
    parent = None
    for k in keys:
        sim.policy.caches[sibling].access(k, stored, parent)
        parent = k
    c, h = sim.policy.pick(0.0, e, n_in, keys)
    assert (c, h) == (sibling, len(keys))
    # nothing held anywhere: the requester's own edge (no detour for nothing)
    empty = Simulation(p.scenario, p.topology, p.requests, presets, policy)
    empty.policy.start()
    assert empty.policy.pick(0.0, e, n_in, keys)[0] == e


def test_kv_route_leaves_a_holder_whose_gpus_are_busy(cities: CityIndex, presets: Any) -> None:
    p = make(cities, presets, gpu_replicas_per_edge=1)
    sim = Simulation(p.scenario, p.topology, p.requests, presets, "kv_route")
    sim.policy.start()
    i = next(j for j in range(len(p.requests)) if len(sim.policy.candidates[int(p.requests.edge[j])]) > 1
             and len(chain_at(sim, j)) >= 2)
    keys, e, n_in = chain_at(sim, i), int(p.requests.edge[i]), int(p.requests.input_tokens[i])
    holder = next(c for c in sim.policy.candidates[e] if c != e)
    parent = None
    for k in keys:
        sim.policy.caches[holder].access(k, sim.ctx.cost.stored, parent)
        parent = k
    assert sim.policy.pick(0.0, e, n_in, keys)[0] == holder
    full = sim.ctx.cost.serve_s(0, n_in)
    sim.ctx.gpus.run(holder, 0.0, 10 * full)  # the holder's only GPU is busy for ten full prefills
    assert sim.policy.pick(0.0, e, n_in, keys)[0] == e


def test_routing_runs_beside_the_placement_policies(cities: CityIndex, presets: Any) -> None:
    p = make(cities, presets, workload__requests=1500)
    res = {name: run_policy(p.scenario, p.topology, p.requests, presets, name)
           for name in ("nearest_edge", "prefix_route", "kv_route")}
    assert all(r.requests == 1500 for r in res.values())
    # the region's other edge adds cache hits that the requester's own edge alone does not have
    assert res["prefix_route"].hit_ratio > res["nearest_edge"].hit_ratio
    assert res["kv_route"].hit_ratio > res["nearest_edge"].hit_ratio
    assert res["prefix_route"].ttft_p90_s <= res["nearest_edge"].ttft_p90_s * 1.001
    assert res["kv_route"].ttft_p90_s <= res["nearest_edge"].ttft_p90_s * 1.001
