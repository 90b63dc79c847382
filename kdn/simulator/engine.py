"""One simulation run: a workload, a topology, one placement policy; the per-request cost model,
the fetch-or-recompute rule, and the statistics.

Per request (at the GPU pool of edge ``e``): the policy lists *segments*, contiguous runs of the
request's chunk chain in the order they extend its cached prefix (e.g. the local edge's leading
run, then what the owner edge holds, then what the origin holds), each with the predicted time its
data is ready at ``e``. Using the first ``m`` segments costs ``max(ready) - now`` plus prefill of
the tokens after them; :meth:`Simulation.decide` picks the ``m`` with the smallest predicted TTFT
(``decision: auto``), so a fetch is used only when it is predicted to be faster than recomputing.
Predictions are exact: links are FIFO (:mod:`kdn.simulator.links`) and nothing else is committed
between the prediction and the commit.

Simplifications, stated: a lookup's answer (who holds what) is known without a round trip (a
directory or digest of each edge's keys); fetched segments arrive in parallel and prefill starts
when the last one has arrived (no layer pipelining); caches are updated when the request arrives
(pull-through and write-back fill at once, as if coalesced); GPU pools queue (FIFO over
``gpu_replicas_per_edge`` replicas per edge) only when that is set, else they are unlimited; the origins
are replicas of one store (a chunk published at one is at all), each edge uses its nearest.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kdn.edge.eviction import make_policy
from kdn.simulator.cache import BoundedCache
from kdn.simulator.core import EventLoop
from kdn.simulator.links import Links
from kdn.simulator.presets import Presets
from kdn.simulator.scenario import Scenario
from kdn.simulator.topology import Topology
from kdn.simulator.workload import TAIL_BASE, Requests

__all__ = ["PolicyResult", "Simulation", "run_policy"]

GB = 1e9
MONTH_S = 30 * 86_400.0


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """Figures of one policy's run. ``ttft`` (seconds, per request) is kept for plots."""

    policy: str
    requests: int
    wall_s: float
    events: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    hit_ratio: float  # chunks served from an edge (local or peer) / all chunks requested
    hit_ratio_local: float
    hit_ratio_peer: float
    origin_ratio: float  # chunks fetched from the origin / all chunks
    recompute_ratio: float  # chunks recomputed / all chunks
    prefix_token_hit_ratio: float  # tokens served from edges / all input tokens
    lookup_hit_ratio_local: float  # chunks the local edge held at lookup (used or not)
    wan_bytes: float
    network_bytes: float
    gpu_s: float  # GPU-seconds of prefill + first token (x gpus_per_replica)
    gpu_s_saved: float
    cost_usd: float
    cost_breakdown: dict[str, float]
    fetch_chosen: int  # requests that had something to fetch and fetched it
    recompute_chosen: int  # requests that had something to fetch and recomputed instead
    peak_rss_mb: float
    ttft: np.ndarray = field(repr=False)

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures (no per-request arrays)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "ttft"}
        out["events_per_s"] = self.events_per_s
        return out


class Simulation:
    """State of one run. Policies (``kdn.simulator.delivery``) drive it through the helpers below."""

    def __init__(self, sc: Scenario, topo: Topology, reqs: Requests, presets: Presets, policy: str) -> None:
        from kdn.simulator.delivery import POLICIES

        self.sc = sc
        self.topo = topo
        self.reqs = reqs
        self.policy_name = policy
        model = presets.models[sc.model]
        gpu = presets.gpus[sc.gpu]
        self.gpu_price = sc.prices.gpu_per_hour if sc.prices.gpu_per_hour is not None else gpu.usd_per_hour
        B = reqs.block_tokens
        self.B = B
        raw_block = model.kv_bytes_per_token * B
        self.raw_block = raw_block
        link_codecs = [presets.codecs[sc.codecs.metro], presets.codecs[sc.codecs.regional], presets.codecs[sc.codecs.long_haul]]
        self.wire = [raw_block * c.ratio for c in link_codecs]  # bytes on the wire per chunk, by link class
        self.dec = [c.decode_s(raw_block) for c in link_codecs]  # receiver decode s per chunk
        storage = presets.codecs[sc.cache.storage_codec]
        self.stored = max(1, int(raw_block * storage.ratio))  # bytes a chunk takes in an edge cache
        self.local_s = self.stored / topo.local_read_Bps + storage.decode_s(raw_block)
        tp = sc.gpus_per_replica
        self.tp = tp
        flops = gpu.flops_per_s * tp
        self.pa = 2.0 * model.params / flops
        self.pb = 4.0 * model.layers * model.q_heads * model.head_dim / flops
        self.first_token_s = model.params * model.dtype_bytes / (gpu.hbm_tbps * 1e12 * tp)
        self.decision = sc.params.decision
        pool = sc.gpu_replicas_per_edge
        # per edge, when each GPU replica is next free; None: unlimited GPUs, no queueing
        self.gpu_free: list[list[float]] | None = None if pool is None else [[0.0] * pool for _ in range(topo.n_edges)]
        self.loop = EventLoop()
        self.links = Links(topo.uplink_Bps)
        self.lat: list[list[float]] = topo.latency_s.tolist()
        self.cls: list[list[int]] = topo.link_class.tolist()
        self.is_wan: list[list[bool]] = (topo.distance_km > 1.0).tolist()
        self.nearest_origin: list[int] = topo.nearest_origin.tolist()
        self.capacity = int(sc.cache.edge_cache_gb * GB)
        self.caches: list[BoundedCache] = []
        self.resident: list = []  # live key views of the caches: `key in view` without a method call
        self.published: set[int] = set()
        self.preloaded = reqs.origin_preloaded
        # per-request inputs as Python lists (cheap indexing in the hot loop)
        self.r_edge: list[int] = reqs.edge.tolist()
        self.r_tokens: list[int] = reqs.input_tokens.tolist()
        self.r_off: list[int] = reqs.key_off.tolist()
        self.keys = reqs.keys
        # statistics
        self.ttft: list[float] = []
        self.blocks = 0
        self.tokens = 0
        self.lookup_local = 0
        self.served_local = 0
        self.served_peer = 0
        self.served_origin = 0
        self.recomputed = 0
        self.wan_bytes = 0.0
        self.net_bytes = 0.0
        self.gpu_s = 0.0
        self.gpu_s_saved = 0.0
        self.fetch_chosen = 0
        self.recompute_chosen = 0
        self.policy = POLICIES[policy](self)

    # -- helpers the policies use ------------------------------------------------------------------

    def make_caches(self, *, whole_chains: bool = True) -> None:
        """One byte-budget cache per edge, driven by the scenario's ``kdn.edge.eviction`` policy.
        ``whole_chains=False``: an edge holds scattered chunks of each chain (consistent hashing),
        so the prefix-aware policy must not treat a chunk whose parent lives elsewhere as dead."""
        name = self.sc.cache.eviction
        kw = {"track_orphans": False} if (name == "prefix" and not whole_chains) else {}
        self.caches = [BoundedCache(self.capacity, make_policy(name, **kw)) for _ in range(self.topo.n_edges)]
        self.resident = [c.keys() for c in self.caches]

    def chain(self, i: int) -> list[int]:
        """Request ``i``'s chunk keys, in chain order."""
        off = self.r_off
        return self.keys[off[i] : off[i + 1]].tolist()

    def at_origin(self, key: int) -> bool:
        return (self.preloaded and key < TAIL_BASE) or key in self.published

    def prefill_s(self, start: int, n: int) -> float:
        """GPU seconds to prefill ``n`` tokens after ``start`` cached ones."""
        return self.pa * n + self.pb * (n * start + 0.5 * n * n) if n > 0 else 0.0

    def fetch_ready(self, src: int, e: int, nblocks: int, now: float, commit: bool) -> float:
        """When ``nblocks`` chunks from site ``src`` are decoded at edge ``e``'s GPUs: request
        latency, FIFO wait and serialisation on ``src``'s link, propagation, decode."""
        lat = self.lat[e][src]
        c = self.cls[e][src]
        nbytes = nblocks * self.wire[c]
        if commit:
            end = self.links.commit(src, now + lat, nbytes)
            self.net_bytes += nbytes
            if self.is_wan[e][src]:
                self.wan_bytes += nbytes
        else:
            end = self.links.finish(src, now + lat, nbytes)
        return end + lat + nblocks * self.dec[c]

    def send(self, e: int, dst: int, nblocks: int, now: float) -> None:
        """Edge ``e`` uploads ``nblocks`` chunks to site ``dst`` (publish / fill): takes ``e``'s link."""
        if nblocks <= 0 or dst == e:
            return
        c = self.cls[e][dst]
        nbytes = nblocks * self.wire[c]
        self.links.commit(e, now, nbytes)
        self.net_bytes += nbytes
        if self.is_wan[e][dst]:
            self.wan_bytes += nbytes

    def gpu_start(self, e: int) -> float:
        """When the earliest-free GPU replica of edge ``e`` is free (-inf: unlimited pool)."""
        if self.gpu_free is None:
            return float("-inf")
        return min(self.gpu_free[e])

    def decide(self, now: float, e: int, n_in: int, ready: list[float], sizes: list[int]) -> int:
        """How many leading segments to use (0 = recompute everything). ``ready[j]`` is when
        segment ``j`` (``sizes[j]`` chunks) would be at edge ``e``'s GPUs; prefill starts once the
        data is there and a GPU replica is free (FIFO)."""
        B = self.B
        if self.decision == "recompute" or not sizes:
            return 0
        if self.decision == "fetch":
            return len(sizes)
        free = self.gpu_start(e)
        best_m = 0
        best = (free if free > now else now) + self.prefill_s(0, n_in)
        t_ready = now
        cov = 0
        for m in range(len(sizes)):
            if ready[m] > t_ready:
                t_ready = ready[m]
            cov += sizes[m]
            total = (t_ready if t_ready > free else free) + self.prefill_s(cov * B, n_in - cov * B)
            if total < best:
                best = total
                best_m = m + 1
        return best_m

    def finish(self, now: float, e: int, n_in: int, covered: int, t_ready: float, had_remote: bool, fetched_remote: bool) -> None:
        """Record a served request: ``covered`` leading chunks reused, their data at the GPUs at
        ``t_ready``; prefill runs on edge ``e``'s earliest-free GPU replica."""
        start = covered * self.B
        pf = self.prefill_s(start, n_in - start) + self.first_token_s
        if self.gpu_free is not None:
            free = self.gpu_free[e]
            k = free.index(min(free))
            if free[k] > t_ready:
                t_ready = free[k]
            free[k] = t_ready + pf
        self.ttft.append(t_ready - now + pf)
        self.gpu_s += pf
        self.gpu_s_saved += self.prefill_s(0, n_in) + self.first_token_s - pf
        self.tokens += n_in
        if had_remote:
            if fetched_remote:
                self.fetch_chosen += 1
            else:
                self.recompute_chosen += 1

    def publish(self, e: int, keys: list[int], now: float) -> None:
        """GPUs of edge ``e`` computed ``keys``: upload the ones the origin lacks."""
        if not self.sc.params.publish_to_origin or not keys:
            return
        pub = self.published
        pre = self.preloaded
        new = [k for k in keys if not ((pre and k < TAIL_BASE) or k in pub)]
        if new:
            pub.update(new)
            self.send(e, self.nearest_origin[e], len(new), now)

    # -- running ------------------------------------------------------------------------------------

    def run(self, progress: Any = None) -> PolicyResult:
        t0 = time.perf_counter()
        self.policy.start()
        serve = self.policy.serve
        self.loop.run(self.reqs.t, serve, progress=progress)
        wall = time.perf_counter() - t0
        return self._result(wall)

    def _result(self, wall: float) -> PolicyResult:
        ttft = np.asarray(self.ttft)
        n = len(ttft)
        blocks = max(self.blocks, 1)
        p50, p90, p99 = (float(x) for x in np.percentile(ttft, [50, 90, 99])) if n else (0.0, 0.0, 0.0)
        edge_cost = (
            self.topo.n_edges * self.sc.cache.edge_cache_gb * self.sc.prices.edge_gb_month * self.reqs.duration_s / MONTH_S
            if self.policy.uses_edges
            else 0.0
        )
        breakdown = {
            "wan": self.wan_bytes / GB * self.sc.prices.wan_per_gb,
            "gpu": self.gpu_s * self.tp / 3600.0 * self.gpu_price,
            "edge_storage": edge_cost,
        }
        served_edge = self.served_local + self.served_peer
        return PolicyResult(
            policy=self.policy_name,
            requests=n,
            wall_s=wall,
            events=self.loop.events,
            ttft_p50_s=p50,
            ttft_p90_s=p90,
            ttft_p99_s=p99,
            ttft_mean_s=float(ttft.mean()) if n else 0.0,
            hit_ratio=served_edge / blocks,
            hit_ratio_local=self.served_local / blocks,
            hit_ratio_peer=self.served_peer / blocks,
            origin_ratio=self.served_origin / blocks,
            recompute_ratio=self.recomputed / blocks,
            prefix_token_hit_ratio=served_edge * self.B / max(self.tokens, 1),
            lookup_hit_ratio_local=self.lookup_local / blocks,
            wan_bytes=self.wan_bytes,
            network_bytes=self.net_bytes,
            gpu_s=self.gpu_s * self.tp,
            gpu_s_saved=self.gpu_s_saved * self.tp,
            cost_usd=sum(breakdown.values()),
            cost_breakdown=breakdown,
            fetch_chosen=self.fetch_chosen,
            recompute_chosen=self.recompute_chosen,
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            ttft=ttft,
        )


def run_policy(sc: Scenario, topo: Topology, reqs: Requests, presets: Presets, policy: str, progress: Any = None) -> PolicyResult:
    return Simulation(sc, topo, reqs, presets, policy).run(progress)
