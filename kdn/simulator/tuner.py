"""Search deployment knobs (policy, replicas, edge cache size, codec per link class, prefetch depth)
and report the Pareto front of cost vs p90 TTFT, with a recommended configuration.

The grid is the product of the scenario's ``tune`` lists; knobs a policy ignores (replicas outside
``consistent_hash``, prefetch depth outside ``hint_prefetch``; ``hint_prefetch`` with depth 0 is
``nearest_edge``) are collapsed, lossy codecs are
dropped unless ``allow_lossy``. A grid larger than ``max_configs`` is sampled with the scenario's
seed (same seed, same sample). Recommendation: the cheapest configuration whose p90 TTFT meets
``p90_target_s``; without a target, the Pareto point nearest the ideal corner once cost and p90 are
each scaled to [0, 1] over the front.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kdn.simulator.engine import run_policy
from kdn.simulator.runner import Prepared, with_overrides
from kdn.simulator.tally import PolicyResult

__all__ = ["TuneConfig", "TunePoint", "TuneResult", "grid", "pareto_front", "tune"]


@dataclass(frozen=True, slots=True)
class TuneConfig:
    """One point of the grid: a policy and the knobs it uses."""

    policy: str
    replicas: int
    edge_cache_gb: float
    regional_codec: str
    long_haul_codec: str
    prefetch_depth: int

    def label(self) -> str:
        parts = [self.policy, f"{self.edge_cache_gb:g}GB", f"{self.regional_codec}/{self.long_haul_codec}"]
        if self.policy == "consistent_hash":
            parts.append(f"R={self.replicas}")
        if self.policy == "hint_prefetch":
            parts.append(f"depth={self.prefetch_depth}")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class TunePoint:
    config: TuneConfig
    cost_usd: float
    ttft_p90_s: float
    ttft_p50_s: float
    hit_ratio: float
    wan_bytes: float
    min_agreement: float


@dataclass(frozen=True, slots=True)
class TuneResult:
    points: tuple[TunePoint, ...]
    front: tuple[TunePoint, ...]
    recommended: TunePoint
    rule: str
    grid_size: int
    requests: int


def grid(p: Prepared) -> list[TuneConfig]:
    t = p.scenario.tune
    codecs = p.presets.codecs
    reg = [c for c in t.regional_codec if t.allow_lossy or not codecs[c].lossy] or ["raw"]
    lh = [c for c in t.long_haul_codec if t.allow_lossy or not codecs[c].lossy] or ["raw"]
    seen: set[TuneConfig] = set()
    out: list[TuneConfig] = []
    for pol, r, gb, rc, lc, d in itertools.product(t.policies, t.replicas or [1], t.edge_cache_gb, reg, lh, t.prefetch_depth or [0]):
        if pol == "hint_prefetch" and d == 0:
            pol = "nearest_edge"  # prefetching nothing is plain pull-through
        cfg = TuneConfig(
            policy=pol,
            replicas=max(1, r) if pol == "consistent_hash" else p.scenario.params.replicas,
            edge_cache_gb=float(gb) if pol != "origin_only" else 0.0,
            regional_codec=rc,
            long_haul_codec=lc,
            prefetch_depth=d if pol == "hint_prefetch" else p.scenario.params.prefetch_depth,
        )
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


def pareto_front(points: list[TunePoint]) -> list[TunePoint]:
    """Points no other point beats on both cost and p90 (ties kept once), sorted by cost."""
    pts = sorted(points, key=lambda q: (q.cost_usd, q.ttft_p90_s, q.config.label()))
    front: list[TunePoint] = []
    best_p90 = float("inf")
    for q in pts:
        if q.ttft_p90_s < best_p90:
            front.append(q)
            best_p90 = q.ttft_p90_s
    return front


def _recommend(front: list[TunePoint], target: float | None) -> tuple[TunePoint, str]:
    if target is not None:
        ok = [q for q in front if q.ttft_p90_s <= target]
        if ok:
            return min(ok, key=lambda q: q.cost_usd), f"cheapest with p90 TTFT <= {target:g} s"
        return min(front, key=lambda q: q.ttft_p90_s), f"no configuration meets p90 <= {target:g} s: the fastest"
    c = np.array([q.cost_usd for q in front])
    l = np.array([q.ttft_p90_s for q in front])
    cn = (c - c.min()) / (np.ptp(c) or 1.0)
    ln = (l - l.min()) / (np.ptp(l) or 1.0)
    k = int(np.argmin(np.hypot(cn, ln)))
    return front[k], "knee of the Pareto front (nearest the ideal corner, cost and p90 scaled to [0, 1])"


def tune(p: Prepared, *, progress: Callable[[int], None] | None = None, on_config: Callable[[int, int], None] | None = None) -> TuneResult:
    sc = p.scenario
    configs = grid(p)
    size = len(configs)
    if size > sc.tune.max_configs:
        rng = np.random.default_rng(sc.seed)
        idx = sorted(rng.choice(size, size=sc.tune.max_configs, replace=False).tolist())
        configs = [configs[i] for i in idx]
    reqs = p.requests.head(sc.tune.requests) if sc.tune.requests else p.requests
    codecs = p.presets.codecs
    points = []
    for n, cfg in enumerate(configs):
        if on_config is not None:
            on_config(n, len(configs))
        variant = with_overrides(
            sc,
            edge_cache_gb=cfg.edge_cache_gb,
            regional=cfg.regional_codec,
            long_haul=cfg.long_haul_codec,
            replicas=cfg.replicas,
            prefetch_depth=cfg.prefetch_depth,
        )
        r: PolicyResult = run_policy(variant, p.topology, reqs, p.presets, cfg.policy, progress=progress)
        agreement = min(codecs[c].agreement for c in (sc.codecs.metro, cfg.regional_codec, cfg.long_haul_codec))
        points.append(TunePoint(cfg, r.cost_usd, r.ttft_p90_s, r.ttft_p50_s, r.hit_ratio, r.wan_bytes, agreement))
    front = pareto_front(points)
    rec, rule = _recommend(front, sc.tune.p90_target_s)
    return TuneResult(tuple(points), tuple(front), rec, rule, size, len(reqs))
