"""One simulation run: a workload, a topology, one placement policy.

The run is assembled from parts that each own one idea: :mod:`kdn.simulator.cost` (the pure cost
model and the fetch-or-recompute rule), :mod:`kdn.simulator.context` (the state a policy may
change and the only operations that change it), :mod:`kdn.simulator.delivery` (the policies),
:mod:`kdn.simulator.tally` (the statistics, fed one frozen plan record per request). The engine
imports the policies and nothing below imports the engine, so there is no import cycle.

Per request (at the GPU pool of edge ``e``): the policy lists *segments*, contiguous runs of the
request's chunk chain in the order they extend its cached prefix (e.g. the local edge's leading
run, then what the owner edge holds, then what the origin holds), each with the predicted time its
data is ready at ``e``. Using the first ``m`` segments costs ``max(ready) - now`` plus prefill of
the tokens after them; the rule picks the ``m`` with the smallest predicted TTFT
(``decision: auto``, :meth:`CostModel.best_prefix`), so a fetch is used only when it is predicted
to be faster than recomputing.
Predictions are what the links say given the transfers committed so far: on a fifo link they are
final; on a fair link (the default) a transfer that joins later slows the ones already there, and
the figures a request reports (TTFT, fetch time) are put right once its flows have left the link
(:meth:`Context.settle`), so what is reported is what the shared link did.

Simplifications, stated: a lookup's answer (who holds what) is known without a round trip (a
directory or digest of each edge's keys); fetched segments arrive in parallel and prefill starts
when the last one has arrived, or, with ``params.layer_pipelining`` (a client that prefills layer
by layer behind the fetch, as KDN's vLLM connector does), layer ``l`` starts once its part of the
last segment is in (:meth:`CostModel.overlap`); caches are updated when the request arrives
(pull-through and write-back fill at once, as if coalesced); GPU pools queue (FIFO over
``gpu_replicas_per_edge`` replicas per edge) only when that is set, else they are unlimited; the origins
are replicas of one store (a chunk published at one is at all), each edge uses its nearest.
"""

from __future__ import annotations

import time
from typing import Any

from kdn.simulator.context import Context
from kdn.simulator.core import EventLoop
from kdn.simulator.cost import CostModel
from kdn.simulator.delivery import POLICIES, Policy
from kdn.simulator.routing import ROUTING_POLICIES
from kdn.simulator.presets import Presets
from kdn.simulator.scenario import Scenario
from kdn.simulator.tally import MONTH_S, PolicyResult, Tally
from kdn.simulator.topology import Topology
from kdn.simulator.workload import Requests

__all__ = ["PolicyResult", "Simulation", "run_policy"]


class Simulation:
    """One run: builds the pieces, hands the policy its :class:`Context`, runs the loop, and
    turns the :class:`Tally` into a :class:`PolicyResult`. It holds no per-request logic."""

    def __init__(self, sc: Scenario, topo: Topology, reqs: Requests, presets: Presets, policy: str) -> None:
        self.sc = sc
        self.topo = topo
        self.reqs = reqs
        self.policy_name = policy
        self.cost = CostModel.build(sc, topo, presets, reqs.block_tokens)
        self.loop = EventLoop()
        skip = int(sc.warmup_fraction * len(reqs))
        self.counted_from = float(reqs.t[skip]) if 0 < skip < len(reqs) else float("-inf")
        self.tally = Tally(self.counted_from)
        self.ctx = Context(sc, topo, reqs, self.cost, self.loop, self.tally)
        self.policy: Policy = {**POLICIES, **ROUTING_POLICIES}[policy](self.ctx)

    def run(self, progress: Any = None) -> PolicyResult:
        t0 = time.perf_counter()
        self.policy.start()
        self.loop.run(self.reqs.t, self.policy.serve, progress=progress)
        self.ctx.settle()
        wall = time.perf_counter() - t0
        sc = self.sc
        counted_s = self.reqs.duration_s - max(0.0, self.counted_from)  # edge storage over the counted time only
        edge_cost = (
            self.topo.n_edges * sc.cache.edge_cache_gb * sc.prices.edge_gb_month * counted_s / MONTH_S
            if self.policy.uses_edges
            else 0.0
        )
        return self.tally.result(
            self.policy_name,
            wall_s=wall,
            events=self.loop.events,
            block_tokens=self.cost.block_tokens,
            gpus_per_replica=self.cost.gpus_per_replica,
            gpu_price=self.cost.gpu_price,
            wan_per_gb=sc.prices.wan_per_gb,
            edge_storage_usd=edge_cost,
        )


def run_policy(sc: Scenario, topo: Topology, reqs: Requests, presets: Presets, policy: str, progress: Any = None) -> PolicyResult:
    return Simulation(sc, topo, reqs, presets, policy).run(progress)
