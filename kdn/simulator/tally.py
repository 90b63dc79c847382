"""What a run did, counted: each served request's :class:`Plan` and each committed transfer go
into one :class:`Tally`, which turns them into a :class:`PolicyResult` at the end.

A :class:`Plan` is the frozen record of one request: where it ran, how many of its chunks each
tier supplied (the local edge, peer edges, the origin), how many the origin could have supplied,
and when the edge part of its data was ready. The rest of the request follows from it: the chunks
it recomputed are ``blocks - covered``; its TTFT parts (the wait for its data and a GPU replica,
then prefill and the first token) are added with it by :meth:`Tally.add`.

Bytes are counted per transfer (:meth:`Tally.moved`), not per plan, because some transfers belong
to no request (a popularity push) and because sums of floats depend on their order: counting them
in the order they are committed keeps every figure identical from run to run.

Warm-up: requests arriving before ``counted_from`` (and transfers committed before it) are run,
so caches fill, but not counted; every figure covers the rest of the run only.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = ["GB", "MONTH_S", "Plan", "PolicyResult", "Tally"]

GB = 1e9
MONTH_S = 30 * 86_400.0


class Plan(NamedTuple):
    """What one request did (immutable; a tuple, so a million of them cost little)."""

    edge: int  # the edge whose GPUs served it
    arrival: float
    tokens: int  # input tokens
    blocks: int  # chunks in its chain
    looked_up_local: int  # leading chunks the local edge held at lookup (used or not)
    local: int  # chunks reused from the local edge
    peer: int  # chunks reused from other edges
    origin: int  # chunks fetched from the origin
    origin_offered: int  # chunks the origin held after the edges' part (fetched or not)
    edge_ready: float  # when the edges' part is at the GPUs (``arrival`` when there is none)

    @property
    def covered(self) -> int:
        """Leading chunks reused in all; the rest are recomputed."""
        return self.local + self.peer + self.origin


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
    fetch: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))  # seconds, per request: the wait for its reused data
    fetch_p50_s: float = 0.0
    fetch_p90_s: float = 0.0

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures (no per-request arrays)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("ttft", "fetch")}
        out["events_per_s"] = self.events_per_s
        return out


class Tally:
    """Running sums of one run. Fed only through :meth:`add` and :meth:`moved`."""

    __slots__ = (
        "ttft", "blocks", "tokens", "lookup_local", "served_local", "served_peer", "served_origin",
        "recomputed", "wan_bytes", "net_bytes", "gpu_s", "gpu_s_saved", "fetch_chosen", "recompute_chosen",
        "counted_from", "fetch",
    )

    def __init__(self, counted_from: float = float("-inf")) -> None:
        self.counted_from = counted_from  # simulated time the statistics start (end of the warm-up)
        self.ttft: list[float] = []  # seconds, per request, in arrival order
        self.fetch: list[float] = []  # seconds from arrival to the reused data at the GPUs, per request
        self.blocks = self.tokens = self.recomputed = 0  # chunks requested, input tokens, chunks recomputed
        self.lookup_local = self.served_local = self.served_peer = self.served_origin = 0  # chunks, by tier
        self.fetch_chosen = self.recompute_chosen = 0  # requests
        self.wan_bytes = self.net_bytes = 0.0
        self.gpu_s = self.gpu_s_saved = 0.0

    def add(self, plan: Plan, start: float, serve_s: float, full_s: float, fetch_s: float = 0.0) -> int:
        """Count a served request: its data was at the GPUs ``fetch_s`` after it arrived, its
        prefill started at ``start`` and took ``serve_s`` GPU seconds, where recomputing
        everything would have taken ``full_s``. Returns its index (for :meth:`fix`), -1 if it
        is not counted (warm-up)."""
        if plan.arrival < self.counted_from:
            return -1
        covered = plan.local + plan.peer + plan.origin
        self.lookup_local += plan.looked_up_local
        self.served_local += plan.local
        self.served_peer += plan.peer
        self.served_origin += plan.origin
        self.blocks += plan.blocks
        self.recomputed += plan.blocks - covered
        self.ttft.append(start - plan.arrival + serve_s)
        self.fetch.append(fetch_s)
        self.gpu_s += serve_s
        self.gpu_s_saved += full_s - serve_s
        self.tokens += plan.tokens
        if plan.origin_offered:
            if plan.origin:
                self.fetch_chosen += 1
            else:
                self.recompute_chosen += 1
        return len(self.ttft) - 1

    def fix(self, k: int, ttft_s: float, fetch_s: float) -> None:
        """Request ``k``'s TTFT and fetch time as its transfers really went (flows that joined
        its links later slowed them)."""
        self.ttft[k] = ttft_s
        self.fetch[k] = fetch_s

    def moved(self, nbytes: float, wan: bool, now: float) -> None:
        """Count a transfer committed at ``now``."""
        if now < self.counted_from:
            return
        self.net_bytes += nbytes
        if wan:
            self.wan_bytes += nbytes

    def result(
        self, policy: str, *, wall_s: float, events: int, block_tokens: int, gpus_per_replica: int,
        gpu_price: float, wan_per_gb: float, edge_storage_usd: float,
    ) -> PolicyResult:
        ttft = np.asarray(self.ttft)
        fetch = np.asarray(self.fetch)
        n = len(ttft)
        blocks = max(self.blocks, 1)
        p50, p90, p99 = (float(x) for x in np.percentile(ttft, [50, 90, 99])) if n else (0.0, 0.0, 0.0)
        breakdown = {
            "wan": self.wan_bytes / GB * wan_per_gb,
            "gpu": self.gpu_s * gpus_per_replica / 3600.0 * gpu_price,
            "edge_storage": edge_storage_usd,
        }
        served_edge = self.served_local + self.served_peer
        return PolicyResult(
            policy=policy,
            requests=n,
            wall_s=wall_s,
            events=events,
            ttft_p50_s=p50,
            ttft_p90_s=p90,
            ttft_p99_s=p99,
            ttft_mean_s=float(ttft.mean()) if n else 0.0,
            hit_ratio=served_edge / blocks,
            hit_ratio_local=self.served_local / blocks,
            hit_ratio_peer=self.served_peer / blocks,
            origin_ratio=self.served_origin / blocks,
            recompute_ratio=self.recomputed / blocks,
            prefix_token_hit_ratio=served_edge * block_tokens / max(self.tokens, 1),
            lookup_hit_ratio_local=self.lookup_local / blocks,
            wan_bytes=self.wan_bytes,
            network_bytes=self.net_bytes,
            gpu_s=self.gpu_s * gpus_per_replica,
            gpu_s_saved=self.gpu_s_saved * gpus_per_replica,
            cost_usd=sum(breakdown.values()),
            cost_breakdown=breakdown,
            fetch_chosen=self.fetch_chosen,
            recompute_chosen=self.recompute_chosen,
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            ttft=ttft,
            fetch=fetch,
            fetch_p50_s=float(np.percentile(fetch, 50)) if n else 0.0,
            fetch_p90_s=float(np.percentile(fetch, 90)) if n else 0.0,
        )
