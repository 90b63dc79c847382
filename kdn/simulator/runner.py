"""Load a scenario, build its topology and workload once, run policies over it.

This is what the CLI and the tuner call; it holds no state between calls.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdn.errors import ConfigError
from kdn.simulator.engine import run_policy
from kdn.simulator.geo import CityIndex
from kdn.simulator.presets import Presets, load_presets
from kdn.simulator.scenario import Scenario, load_scenario
from kdn.simulator.tally import PolicyResult
from kdn.simulator.topology import Topology, build_topology
from kdn.simulator.workload import Requests, build_workload

__all__ = ["Prepared", "SimulationReport", "prepare", "simulate", "cache_sweep", "with_overrides"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A scenario ready to run: validated, with its topology and request stream built once."""

    scenario: Scenario
    topology: Topology
    requests: Requests
    presets: Presets
    setup_s: float


@dataclass(frozen=True, slots=True)
class SimulationReport:
    """Every policy's figures over one prepared scenario."""

    scenario: Scenario
    requests: int
    unique_chunks: int
    setup_s: float
    results: tuple[PolicyResult, ...]

    @property
    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.results)


def prepare(path: str | Path, *, limit: int | None = None) -> Prepared:
    """Validate the scenario (all errors before any work), then build topology and workload."""
    t0 = time.perf_counter()
    cities = CityIndex.default()
    presets = load_presets()
    sc = load_scenario(path, cities=cities, presets=presets)
    try:
        topo = build_topology(sc, cities)
        reqs = build_workload(sc, topo)
    except MemoryError as exc:  # numpy refuses an allocation larger than the machine: say which input asked for it
        raise ConfigError(f"scenario {path}: its topology and workload do not fit in memory (workload.requests, topology edges)") from exc
    if limit is not None:
        reqs = reqs.head(limit)
    return Prepared(sc, topo, reqs, presets, time.perf_counter() - t0)


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", unit_scale=True, disable=not enabled, leave=False, mininterval=0.5)


def simulate(p: Prepared, *, policies: Iterable[str] | None = None, progress: bool = True) -> SimulationReport:
    results = []
    for name in policies or p.scenario.policies:
        with _bar(len(p.requests), name, progress) as bar:
            results.append(run_policy(p.scenario, p.topology, p.requests, p.presets, name, progress=bar.update))
    return SimulationReport(p.scenario, len(p.requests), p.requests.unique_chunks(), p.setup_s, tuple(results))


def with_overrides(sc: Scenario, **kw: Any) -> Scenario:
    """A copy of ``sc`` with ``cache.*``, ``codecs.*`` or ``params.*`` fields replaced
    (``edge_cache_gb=..., long_haul=..., replicas=...``). Values must already be valid."""
    groups = {"cache": sc.cache, "codecs": sc.codecs, "params": sc.params}
    update: dict[str, Any] = {}
    for key, value in kw.items():
        for gname, group in groups.items():
            if key in type(group).model_fields:
                update[gname] = update.get(gname, group).model_copy(update={key: value})
                break
        else:
            raise KeyError(f"no overridable field {key!r}")
    return sc.model_copy(update=update)


def cache_sweep(p: Prepared, sizes_gb: Iterable[float], *, policies: Iterable[str], progress: bool = True) -> dict[str, list[tuple[float, float]]]:
    """Hit ratio at each edge cache size, per policy: ``{policy: [(gb, hit_ratio), ...]}``."""
    reqs = p.requests
    if p.scenario.report.cache_sweep_requests is not None:
        reqs = reqs.head(p.scenario.report.cache_sweep_requests)
    sizes = list(sizes_gb)
    pols = [x for x in policies if x != "origin_only"]
    out: dict[str, list[tuple[float, float]]] = {x: [] for x in pols}
    with _bar(len(sizes) * len(pols) * len(reqs), "cache sweep", progress) as bar:
        for gb in sizes:
            sc = with_overrides(p.scenario, edge_cache_gb=gb)
            for name in pols:
                r = run_policy(sc, p.topology, reqs, p.presets, name, progress=bar.update)
                out[name].append((gb, r.hit_ratio))
    return out
