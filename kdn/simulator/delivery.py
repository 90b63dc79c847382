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

Every policy applies the same fetch-or-recompute rule (:meth:`Simulation.decide`).
"""

from __future__ import annotations

import hashlib
import heapq
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kdn.simulator.workload import TAIL_BASE

if TYPE_CHECKING:
    from kdn.simulator.engine import Simulation

__all__ = ["POLICIES", "Policy"]


class Policy(ABC):
    name: ClassVar[str]
    uses_edges: ClassVar[bool] = True

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def start(self) -> None:
        """Set up state and schedule the policy's own events (called once before the run)."""

    @abstractmethod
    def serve(self, i: int) -> None:
        """Serve request ``i`` at ``sim.loop.now``."""


def _origin_run(sim: Simulation, keys: list[int], start: int) -> int:
    """How many chunks from ``keys[start]`` on the origin holds, leading run."""
    k = 0
    pre = sim.preloaded
    pub = sim.published
    for key in keys[start:] if start else keys:
        if (pre and key < TAIL_BASE) or key in pub:
            k += 1
        else:
            break
    return k


def _settle(
    sim: Simulation, now: float, e: int, n_in: int, nb: int, h: int, covered: int, t: float,
    origin: int, k2: int, take_origin: bool,
) -> int:
    """Commit the origin part of a request's plan (when the decision took it), account the
    request's blocks and finish it. ``h`` blocks came from edges, ``covered`` of them are used,
    ``t`` is when they are ready. Returns the blocks covered in all."""
    if take_origin:
        t2 = sim.fetch_ready(origin, e, k2, now, True)
        if t2 > t:
            t = t2
        covered += k2
        sim.served_origin += k2
    sim.blocks += nb
    sim.recomputed += nb - covered
    sim.finish(now, e, n_in, covered, t, k2 > 0, covered > h)
    return covered


class OriginOnly(Policy):
    name: ClassVar[str] = "origin_only"
    uses_edges: ClassVar[bool] = False

    def serve(self, i: int) -> None:
        sim = self.sim
        now = sim.loop.now
        e = sim.r_edge[i]
        n_in = sim.r_tokens[i]
        keys = sim.chain(i)
        nb = len(keys)
        o = sim.nearest_origin[e]
        k = _origin_run(sim, keys, 0)
        m = sim.decide(now, e, n_in, [sim.fetch_ready(o, e, k, now, False)], [k]) if k else 0
        covered = _settle(sim, now, e, n_in, nb, 0, 0, now, o, k, m > 0)
        sim.publish(e, keys[covered:], now)


class NearestEdge(Policy):
    """Pull-through: local edge's leading run, then the origin's; the local edge keeps the chain."""

    name: ClassVar[str] = "nearest_edge"

    def start(self) -> None:
        self.sim.make_caches()

    def serve(self, i: int) -> None:
        sim = self.sim
        now = sim.loop.now
        e = sim.r_edge[i]
        n_in = sim.r_tokens[i]
        keys = sim.chain(i)
        nb = len(keys)
        cache = sim.caches[e]
        resident = sim.resident[e]
        h = 0
        for key in keys:
            if key in resident:
                h += 1
            else:
                break
        sim.lookup_local += h
        o = sim.nearest_origin[e]
        k2 = _origin_run(sim, keys, h) if h < nb else 0
        ready: list[float] = []
        sizes: list[int] = []
        if h:
            ready.append(now + h * sim.local_s)
            sizes.append(h)
        if k2:
            ready.append(sim.fetch_ready(o, e, k2, now, False))
            sizes.append(k2)
        m = sim.decide(now, e, n_in, ready, sizes)
        t = now
        covered = 0
        if m >= 1 and h:
            t = ready[0]
            covered = h
            sim.served_local += h
        covered = _settle(sim, now, e, n_in, nb, h, covered, t, o, k2, bool(k2) and m == len(sizes))
        access = cache.access
        stored = sim.stored
        parent = None
        for key in keys:
            access(key, stored, parent)
            parent = key
        sim.publish(e, keys[covered:], now)
        self.after_serve(keys)

    def after_serve(self, keys: list[int]) -> None:
        """Hook for subclasses (popularity counting)."""

    def push_to(self, e: int, keys: list[int], parents: list[int | None], now: float) -> None:
        """The origin pushes the leading run of ``keys`` it holds to edge ``e``'s cache."""
        sim = self.sim
        cache = sim.caches[e]
        missing = []
        for key, par in zip(keys, parents):
            if not sim.at_origin(key):
                break
            if key not in cache:
                missing.append((key, par))
        if not missing:
            return
        sim.fetch_ready(sim.nearest_origin[e], e, len(missing), now, True)
        stored = sim.stored
        for key, par in missing:
            cache.access(key, stored, par)


class PopularityPush(NearestEdge):
    name: ClassVar[str] = "popularity_push"

    def start(self) -> None:
        super().start()
        self.counts: dict[int, int] = {}
        self.parent: dict[int, int | None] = {}
        self.interval = self.sim.sc.params.push_interval_s
        self.top_k = self.sim.sc.params.push_top_k
        self.end = float(self.sim.reqs.t[-1]) if len(self.sim.reqs) else 0.0
        if self.top_k and self.interval <= self.end:
            self.sim.loop.schedule(self.interval, self._push, None, priority=1)

    def after_serve(self, keys: list[int]) -> None:
        counts = self.counts
        parent = self.parent
        prev = None
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
            if key not in parent:
                parent[key] = prev
            prev = key

    def _push(self, _: object) -> None:
        sim = self.sim
        now = sim.loop.now
        hot = [k for k, _ in heapq.nlargest(self.top_k * 4, self.counts.items(), key=lambda kv: (kv[1], -kv[0]))]
        hot = [k for k in hot if sim.at_origin(k)][: self.top_k]
        # parents first, so a pushed chunk's prefix is resident before it
        hot.sort(key=lambda k: self._depth(k))
        parents = [self.parent.get(k) for k in hot]
        for e in range(sim.topo.n_edges):
            self.push_to(e, hot, parents, now)
        self.counts = {}
        if now + self.interval <= self.end:
            sim.loop.schedule(now + self.interval, self._push, None, priority=1)

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
        sim = self.sim
        self.depth = sim.sc.params.prefetch_depth
        if self.depth <= 0:
            return
        for ht, j in zip(sim.reqs.hint_t.tolist(), sim.reqs.hint_req.tolist()):
            sim.loop.schedule(ht, self._hint, j, priority=1)

    def _hint(self, j: int) -> None:
        sim = self.sim
        keys = sim.chain(j)[: self.depth]
        self.push_to(sim.r_edge[j], keys, [None, *keys[:-1]], sim.loop.now)


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

        sim = self.sim
        sim.make_caches(whole_chains=False)
        topo = sim.topo
        reqs = sim.reqs
        r = sim.sc.params.replicas
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

    def serve(self, i: int) -> None:
        sim = self.sim
        now = sim.loop.now
        e = sim.r_edge[i]
        n_in = sim.r_tokens[i]
        keys = sim.chain(i)
        nb = len(keys)
        caches = sim.caches
        resident = sim.resident
        chosen = self.chosen[sim.r_off[i] : sim.r_off[i + 1]].tolist()
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
        sim.lookup_local += local_h
        ready: list[float] = []
        sizes: list[int] = []
        if h:
            t_peer = now
            for o, c in per_owner.items():
                t_o = now + c * sim.local_s if o == e else sim.fetch_ready(o, e, c, now, False)
                if t_o > t_peer:
                    t_peer = t_o
            ready.append(t_peer)
            sizes.append(h)
        oi = sim.nearest_origin[e]
        k2 = _origin_run(sim, keys, h) if h < nb else 0
        if k2:
            ready.append(sim.fetch_ready(oi, e, k2, now, False))
            sizes.append(k2)
        m = sim.decide(now, e, n_in, ready, sizes)
        t = now
        covered = 0
        if m >= 1 and h:
            for o, c in per_owner.items():
                t_o = now + c * sim.local_s if o == e else sim.fetch_ready(o, e, c, now, True)
                if t_o > t:
                    t = t_o
            covered = h
            sim.served_local += local_h
            sim.served_peer += h - local_h
        covered = _settle(sim, now, e, n_in, nb, h, covered, t, oi, k2, bool(k2) and m == len(sizes))
        stored = sim.stored
        parent = None
        uploads: dict[int, int] = {}
        for key, o in zip(keys, chosen):
            if not caches[o].access(key, stored, parent) and o != e:
                uploads[o] = uploads.get(o, 0) + 1
            parent = key
        for o, c in uploads.items():
            sim.send(e, o, c, now)
        sim.publish(e, keys[covered:], now)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (OriginOnly, NearestEdge, ConsistentHash, PopularityPush, HintPrefetch)
}
