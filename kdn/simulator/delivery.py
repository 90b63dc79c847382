"""Placement policies: where KV lives and where a request looks for it. One small interface
(:class:`Policy`: ``start`` schedules the policy's own events, ``serve(i)`` handles request ``i``
at the loop's current time), one registry (:data:`POLICIES`).

``origin_only``      no edges: fetch from the nearest origin or recompute.
``nearest_edge``     pull-through cache at every edge: the GPU pool's local edge, then the origin.
``consistent_hash``  each chunk has ``replicas`` owner edges in the requester's hash group
                     (``kdn.placement``); the nearest owner is asked, filled on a miss.
``popularity_push``  ``nearest_edge`` plus, every ``push_interval_s``, the origin pushes the
                     ``push_top_k`` most requested chunks of the last interval to every edge.
``hint_prefetch``    ``nearest_edge`` plus, on each hint (``workload.hint_coverage``), the hinted
                     context's first ``prefetch_depth`` chunks are pushed to its edge ahead of time.

A policy receives a :class:`~kdn.simulator.context.Context` (the clock, the cost model, the links,
the origin, the GPU pools) and never the run itself. Serving a request is: find the leading run
the edges hold, let :meth:`Context.choose` apply the fetch-or-recompute rule (the same for every
policy), hand the frozen :class:`~kdn.simulator.tally.Plan` of what serves it to
:meth:`Context.finish`, then update the caches and publish what was computed.

The edge's own code under simulated time: ``popularity_push`` fires its pushes from the edge's
own cron scheduler (:class:`kdn.edge.schedules.HintScheduler`) running on the event loop's clock
(:attr:`kdn.simulator.core.EventLoop.clock`) whenever ``push_interval_s`` is a cron period (a
whole number of minutes that divides an hour, or of hours that divides a day — the default 600 s
is ``*/10 * * * *``); any other interval falls back to a fixed-period loop event, which fires at the
same times cron would if it could express the period. ``hint_prefetch`` does not run the edge's
:class:`kdn.edge.prefetch.Prefetcher`: that is an asyncio queue drained by worker tasks, which
would need an asyncio event loop on simulated time, and its bounded queue (256 jobs, drops when
full) and two workers would change what the simulator models (an instantaneous push of each
hint's chunks over the origin's FIFO link). The hints themselves are one-shot instants
(``Requests.hint_t``), which a cron schedule cannot express.
"""

from __future__ import annotations

import hashlib
import heapq
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from kdn.edge.schedules import HintScheduler
from kdn.simulator.context import Context
from kdn.simulator.tally import Plan

__all__ = ["NearestEdge", "POLICIES", "Policy"]


class Policy(ABC):
    name: ClassVar[str]
    uses_edges: ClassVar[bool] = True

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def start(self) -> None:
        """Set up state and schedule the policy's own events (called once before the run)."""

    @abstractmethod
    def serve(self, i: int) -> None:
        """Serve request ``i`` at ``ctx.loop.now``."""


class OriginOnly(Policy):
    name: ClassVar[str] = "origin_only"
    uses_edges: ClassVar[bool] = False

    def serve(self, i: int) -> None:
        ctx = self.ctx
        now, e, n_in, keys = ctx.request(i)
        _, k, take = ctx.choose(now, e, n_in, keys, 0, now)
        plan = Plan(e, now, n_in, len(keys), looked_up_local=0, local=0, peer=0, origin=k if take else 0,
                    origin_offered=k, edge_ready=now)
        ctx.finish(plan)
        ctx.origin.publish(e, keys[plan.covered :], now)


class NearestEdge(Policy):
    """Pull-through: local edge's leading run, then the origin's; the local edge keeps the chain."""

    name: ClassVar[str] = "nearest_edge"

    def start(self) -> None:
        self.caches = self.ctx.make_caches()
        self.resident = [c.keys() for c in self.caches]  # live key views: `key in view` without a call

    def serve(self, i: int) -> None:
        ctx = self.ctx
        now, e, n_in, keys = ctx.request(i)
        resident = self.resident[e]
        h = 0
        for key in keys:
            if key in resident:
                h += 1
            else:
                break
        t_local = now + h * ctx.cost.local_s
        use, k2, take = ctx.choose(now, e, n_in, keys, h, t_local)
        plan = Plan(e, now, n_in, len(keys), looked_up_local=h, local=h if use else 0, peer=0, origin=k2 if take else 0,
                    origin_offered=k2, edge_ready=t_local if use else now)
        self.keep(e, keys, plan, now)
        self.after_serve(keys)

    def keep(self, e: int, keys: list[int], plan: Plan, now: float) -> None:
        """Finish ``plan``: edge ``e``'s cache keeps the whole chain; the part the origin sent is published."""
        ctx = self.ctx
        ctx.finish(plan)
        access = self.caches[e].access
        stored = ctx.cost.stored
        parent = None
        for key in keys:
            access(key, stored, parent)
            parent = key
        ctx.origin.publish(e, keys[plan.covered :], now)

    def after_serve(self, keys: list[int]) -> None:
        """Hook for subclasses (popularity counting)."""

    def push_to(self, e: int, keys: list[int], parents: list[int | None], now: float) -> None:
        """The origin pushes the leading run of ``keys`` it holds to edge ``e``'s cache."""
        ctx = self.ctx
        cache = self.caches[e]
        has = ctx.origin.has
        missing = []
        for key, par in zip(keys, parents):
            if not has(key):
                break
            if key not in cache:
                missing.append((key, par))
        if not missing:
            return
        ctx.net.fetch_ready(ctx.origin.nearest[e], e, len(missing), now, True)
        stored = ctx.cost.stored
        for key, par in missing:
            cache.access(key, stored, par)


def cron_every(seconds: float) -> str | None:
    """The cron expression that fires every ``seconds`` from a UTC midnight, if there is one."""
    if seconds <= 0 or not float(seconds).is_integer() or seconds % 60:
        return None
    minutes = int(seconds) // 60
    if 60 % minutes == 0:
        return "0 * * * *" if minutes == 60 else f"*/{minutes} * * * *"
    if minutes % 60 == 0 and 24 % (minutes // 60) == 0:
        hours = minutes // 60
        return "0 0 * * *" if hours == 24 else f"0 */{hours} * * *"
    return None


class PopularityPush(NearestEdge):
    name: ClassVar[str] = "popularity_push"

    def start(self) -> None:
        super().start()
        ctx = self.ctx
        self.counts: dict[int, int] = {}
        self.parent: dict[int, int | None] = {}
        self.interval = ctx.params.push_interval_s
        self.top_k = ctx.params.push_top_k
        self.end = float(ctx.reqs.t[-1]) if len(ctx.reqs) else 0.0
        self.schedule: HintScheduler | None = None
        if not self.top_k:
            return
        cron = cron_every(self.interval)
        if cron is not None:
            # the edge's own scheduler, on the loop's clock: it says when the next push is due
            self.schedule = HintScheduler(ctx.loop.clock)
            self.schedule.add("popularity-push", cron, self._push)
        self._wake_at(self._next_push(ctx.loop.now))

    def _next_push(self, now: float) -> float:
        if self.schedule is None:
            return now + self.interval
        nxt = self.schedule.next_wakeup()
        assert nxt is not None
        return self.ctx.loop.clock.at(nxt)

    def _wake_at(self, t: float) -> None:
        if t <= self.end:
            self.ctx.loop.schedule(t, self._wake, None, priority=1)

    def _wake(self, _: object) -> None:
        now = self.ctx.loop.now
        if self.schedule is None:
            self._push()
        else:
            for action in self.schedule.due():
                action()
        self._wake_at(self._next_push(now))

    def after_serve(self, keys: list[int]) -> None:
        counts = self.counts
        parent = self.parent
        prev = None
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
            if key not in parent:
                parent[key] = prev
            prev = key

    def _push(self) -> None:
        ctx = self.ctx
        now = ctx.loop.now
        has = ctx.origin.has
        hot = [k for k, _ in heapq.nlargest(self.top_k * 4, self.counts.items(), key=lambda kv: (kv[1], -kv[0]))]
        hot = [k for k in hot if has(k)][: self.top_k]
        # parents first, so a pushed chunk's prefix is resident before it
        hot.sort(key=lambda k: self._depth(k))
        parents = [self.parent.get(k) for k in hot]
        for e in range(ctx.topo.n_edges):
            self.push_to(e, hot, parents, now)
        self.counts = {}

    def _depth(self, key: int) -> int:
        d = 0
        p = self.parent.get(key)
        while p is not None and d < 10_000:
            d += 1
            p = self.parent.get(p)
        return d


class HintPrefetch(NearestEdge):
    name: ClassVar[str] = "hint_prefetch"

    def start(self) -> None:
        super().start()
        self.depth = self.ctx.params.prefetch_depth
        if self.depth > 0:
            hints = self.ctx.reqs
            for ht, j in zip(hints.hint_t.tolist(), hints.hint_req.tolist()):
                self.ctx.loop.schedule(ht, self._hint, j, priority=1)

    def _hint(self, j: int) -> None:
        ctx = self.ctx
        keys = ctx.chain(j)[: self.depth]
        self.push_to(ctx.edge_of[j], keys, [None, *keys[:-1]], ctx.loop.now)


class ConsistentHash(Policy):
    """Chunks live on ``replicas`` owners in the requester's hash group; ask the nearest owner.

    Owners come from ``kdn.placement.Placement`` (one ring per hash group, the overlay's own code).
    The simulator's int keys become ring keys as the 32-byte BLAKE2b digest of their little-endian
    bytes (uniform, like real chunk keys). All (group, key) lookups of the workload are done up
    front in one batched call per group, and the owner each request will ask for each of its chunks
    (itself if it is an owner, else the owner with the least latency) is stored aligned with the
    workload's key array, so serving a request does no hashing.
    """

    name: ClassVar[str] = "consistent_hash"
    VNODES: ClassVar[int] = 200  # ring points per edge; 1000 (the overlay's default) only slows set-up

    def start(self) -> None:
        from kdn.placement import Node, Placement

        ctx = self.ctx
        self.caches = ctx.make_caches(whole_chains=False)
        self.resident = [c.keys() for c in self.caches]
        topo = ctx.topo
        reqs = ctx.reqs
        r = ctx.params.replicas
        counts = np.diff(reqs.key_off)
        flat_edge = np.repeat(reqs.edge, counts)  # (K,) requesting edge of each chunk position
        flat_group = topo.edge_group[flat_edge]
        chosen = np.empty(reqs.keys.size, dtype=np.int64)
        lat = topo.latency_s[:, : topo.n_edges]  # (E, E)
        for g, members in enumerate(topo.groups):
            pos = np.flatnonzero(flat_group == g)
            if pos.size == 0:
                continue
            ukeys, inv = np.unique(reqs.keys[pos], return_inverse=True)
            ring = Placement([Node(str(x)) for x in members], vnodes=self.VNODES)
            kb = [hashlib.blake2b(int(k).to_bytes(8, "little", signed=True), digest_size=32).digest() for k in ukeys.tolist()]
            own = ring.owners_batch(kb, r).astype(np.int64)  # (U, min(r, N)) edge ids
            own_pos = own[inv]  # (P, R)
            e = flat_edge[pos]
            d = lat[e[:, None], own_pos]  # (P, R) latency from the requester to each owner
            d[own_pos == e[:, None]] = -1.0  # an owner co-located with the GPUs wins outright
            chosen[pos] = own_pos[np.arange(pos.size), np.argmin(d, axis=1)]
        self.chosen = chosen

    def _owners_ready(self, e: int, per_owner: dict[int, int], now: float, commit: bool) -> float:
        """When the chunks asked of each owner are at edge ``e``'s GPUs, the last of them."""
        fetch_ready = self.ctx.net.fetch_ready
        local_s = self.ctx.cost.local_s
        t = now
        for o, c in per_owner.items():
            t_o = now + c * local_s if o == e else fetch_ready(o, e, c, now, commit)
            if t_o > t:
                t = t_o
        return t

    def serve(self, i: int) -> None:
        ctx = self.ctx
        now, e, n_in, keys = ctx.request(i)
        caches = self.caches
        resident = self.resident
        chosen = self.chosen[ctx.key_off[i] : ctx.key_off[i + 1]].tolist()
        h = 0
        for key, o in zip(keys, chosen):
            if key in resident[o]:
                h += 1
            else:
                break
        per_owner: dict[int, int] = {}
        for o in chosen[:h]:
            per_owner[o] = per_owner.get(o, 0) + 1
        local_h = per_owner.get(e, 0)
        t_edges = self._owners_ready(e, per_owner, now, False) if h else now
        use, k2, take = ctx.choose(now, e, n_in, keys, h, t_edges)
        t = self._owners_ready(e, per_owner, now, True) if use else now
        plan = Plan(e, now, n_in, len(keys), looked_up_local=local_h, local=local_h if use else 0,
                    peer=h - local_h if use else 0, origin=k2 if take else 0, origin_offered=k2, edge_ready=t)
        ctx.finish(plan)
        stored = ctx.cost.stored
        parent = None
        uploads: dict[int, int] = {}
        for key, o in zip(keys, chosen):
            if not caches[o].access(key, stored, parent) and o != e:
                uploads[o] = uploads.get(o, 0) + 1
            parent = key
        for o, c in uploads.items():
            ctx.net.send(e, o, c, now)
        ctx.origin.publish(e, keys[plan.covered :], now)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (OriginOnly, NearestEdge, ConsistentHash, PopularityPush, HintPrefetch)
}
