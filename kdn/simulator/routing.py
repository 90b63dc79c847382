"""Routing policies: which GPU pool of the requester's region serves a request.

The placement policies (:mod:`kdn.simulator.delivery`) serve every request at the edge its
workload names. A routing policy lets the region's front door choose among the region's edges
(``kdn route`` in front of a metro's GPU pools), over ``nearest_edge``'s pull-through caches:

``prefix_route``  the edge whose cache holds the longest leading run of the chain (llm-d's
                  precise prefix scorer); equal runs go to the requester's own edge.
``kv_route``      the least expected TTFT by KDN's router's own scorer
                  (:func:`kdn.route.score.estimate`): the edge's GPU queue, its cache's leading
                  run at the local read rate, then the origin's at the link's predicted rate (or
                  recompute, whichever is cheaper), prefill at the cost model's rate, plus the
                  round trip from the requester's edge; ties spread (:class:`kdn.route.policy.CostScore`).

The detour to another edge of the region (``2 x`` its one-way latency) is added to the time the
edges' part is at the GPUs, so it counts in TTFT; the scorer's prefill rate is the cost model's
over the whole prompt (linear), the simulation itself charges the exact prefill.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kdn.route.policy import Candidate, CostScore
from kdn.route.score import HostCost, Holdings, RequestShape, estimate
from kdn.simulator.delivery import NearestEdge
from kdn.simulator.tally import Plan

__all__ = ["ROUTING_POLICIES", "PrefixRoute", "KvRoute"]

_INSTANT = 1e18  # bytes/s of a transfer the cost model says takes no time


class _Routed(NearestEdge):
    """``nearest_edge`` caches; :meth:`pick` chooses the serving edge among the region's."""

    def start(self) -> None:
        super().start()
        topo = self.ctx.topo
        region = topo.edge_region
        lat = self.ctx.cost.lat
        self.candidates: list[list[int]] = []
        for e in range(topo.n_edges):
            others = [int(o) for o in np.flatnonzero(region == region[e]) if o != e]
            self.candidates.append([e, *sorted(others, key=lambda o: lat[o][e])])

    def held(self, c: int, keys: list[int]) -> int:
        resident = self.resident[c]
        h = 0
        for key in keys:
            if key not in resident:
                break
            h += 1
        return h

    def pick(self, now: float, e: int, n_in: int, keys: list[int]) -> tuple[int, int]:
        """``(serving edge, its leading run)``."""
        raise NotImplementedError

    def serve(self, i: int) -> None:
        ctx = self.ctx
        now, e, n_in, keys = ctx.request(i)
        c, h = self.pick(now, e, n_in, keys)
        detour = 2.0 * ctx.cost.lat[c][e] if c != e else 0.0
        t_local = now + detour + h * ctx.cost.local_s
        use, k2, take = ctx.choose(now, c, n_in, keys, h, t_local)
        plan = Plan(c, now, n_in, len(keys), looked_up_local=h, local=h if use else 0, peer=0, origin=k2 if take else 0,
                    origin_offered=k2, edge_ready=t_local if use else now + detour)
        self.keep(c, keys, plan, now)


class PrefixRoute(_Routed):
    name: ClassVar[str] = "prefix_route"

    def pick(self, now: float, e: int, n_in: int, keys: list[int]) -> tuple[int, int]:
        best, best_h = e, -1
        for c in self.candidates[e]:
            h = self.held(c, keys)
            if h > best_h:
                best, best_h = c, h
        return best, best_h


class KvRoute(_Routed):
    name: ClassVar[str] = "kv_route"

    def start(self) -> None:
        super().start()
        self.policy = CostScore(tie_s=1e-4, tie_fraction=0.0)

    def pick(self, now: float, e: int, n_in: int, keys: list[int]) -> tuple[int, int]:
        ctx = self.ctx
        cost = ctx.cost
        cands = self.candidates[e]
        if len(cands) == 1:
            return e, self.held(e, keys)
        bt = cost.block_tokens
        shape = RequestShape(n_in, bt, bt, max(1, cost.stored // bt))
        r = max(0.0, cost.serve_s(0, n_in) - cost.first_token_s) / max(1, n_in)
        priced: list[Candidate] = []
        runs: list[int] = []
        for c in cands:
            h = self.held(c, keys)
            k2 = ctx.origin.leading_run(keys, h) if h < len(keys) else 0
            links = {"memory": cost.stored / cost.local_s if cost.local_s > 0 else _INSTANT}
            if k2:
                t2 = ctx.net.fetch_ready(ctx.origin.nearest[c], c, k2, now, False) - now
                links["origin"] = k2 * cost.stored / t2 if t2 > 0 else _INSTANT
            wait = max(0.0, ctx.gpus.next_free(c) - now)
            detour = 2.0 * cost.lat[c][e] if c != e else 0.0
            host = HostCost(r, links, overhead_s=cost.first_token_s, wait_s=wait + detour)
            est = estimate(shape, Holdings(("memory",) * h + ("origin",) * k2), host)
            priced.append(Candidate(str(c), 0, Holdings(), est))
            runs.append(h)
        i = self.policy.choose(priced)
        return cands[i], runs[i]


ROUTING_POLICIES = {cls.name: cls for cls in (PrefixRoute, KvRoute)}
