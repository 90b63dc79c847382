"""The router's cost model: a request's expected time to first token on one host, from what the
host's edge holds of its chain and how fast that host and its links are. Pure: no I/O, no clock.

A request's prompt is ``tokens`` long; its chain is its full chunks, then the tail pieces after
the last chunk the edge holds (:func:`kdn.keys.piece_keys`). One host's edge answered a Lookup with
a *tier* for each leading available chunk and piece (:class:`Holdings`): ``engine`` (the host's
engine computed it moments ago and keeps it in its own KV cache: the router's record of what it
sent where), ``memory`` / ``disk`` (the edge's own tiers), ``peer`` (another edge of the overlay),
``origin``. The estimate (:func:`estimate`) is::

    ttft = queue + fetch(first j artifacts) + (tokens - loaded(j)) x prefill_s_per_token

where ``queue`` is the work already sent to the host and not yet answered (its prefill tokens at
the host's rate, its predicted fetches, one per-request overhead each) plus this request's own
overhead, and ``fetch`` adds each artifact's bytes over its tier's measured link rate plus the
host's measured cost of taking a byte in (``load_s_per_byte``: the engine's side of a load, the
same from every tier; nothing for KV already in the engine). ``j`` is chosen to minimise the sum: an artifact is used only when fetching it (and all
before it: reuse is a prefix) is cheaper than recomputing its tokens, so a slow origin over a thin
link is priced as the recompute it would lose to. vLLM computes a prompt's last token itself, so
at most ``tokens - 1`` are loaded.

Invariants: the estimate is monotone in every cost (more queue, a slower link or a slower prefill
never lowers it); a host that holds nothing is priced as a full prefill behind its queue; an
unknown tier is priced as a recompute (never as free).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["TIERS", "LOCAL_TIERS", "Holdings", "HostCost", "RequestShape", "Estimate", "estimate"]

TIERS = ("engine", "memory", "disk", "peer", "origin")
LOCAL_TIERS = frozenset({"engine", "memory", "disk"})
"""Tiers on the host itself: what a prefix-overlap router counts as held."""


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the router knows of one request before choosing: its prompt's length and geometry."""

    tokens: int  # prompt tokens
    chunk_tokens: int  # tokens per chunk
    piece_tokens: int  # tokens per tail piece
    kv_bytes_per_token: int  # bytes of KV one token costs to move (K and V, every layer)


@dataclass(frozen=True, slots=True)
class Holdings:
    """One host's view of a request's chain: the tier of each leading available chunk, then of
    each leading available tail piece after them (pieces only extend the chunks)."""

    chunks: tuple[str, ...] = ()
    pieces: tuple[str, ...] = ()
    error: str = ""  # why the edge could not be asked ("" when it answered)

    def segments(self, shape: RequestShape) -> list[tuple[str, int]]:
        """``(tier, tokens)`` of each available artifact, in chain order."""
        return [(t, shape.chunk_tokens) for t in self.chunks] + [(t, shape.piece_tokens) for t in self.pieces]

    def local_tokens(self, shape: RequestShape) -> int:
        """Tokens of the leading run held on the host itself (engine, edge memory or disk)."""
        n = 0
        for tier, tokens in self.segments(shape):
            if tier not in LOCAL_TIERS:
                break
            n += tokens
        return min(n, shape.tokens)


@dataclass(frozen=True, slots=True)
class HostCost:
    """One host's measured rates and present load."""

    prefill_s_per_token: float  # seconds one prompt token of prefill costs this host
    link_bytes_per_s: Mapping[str, float]  # tier -> bytes/s at which KV from it reaches the engine
    queued_tokens: float = 0.0  # prefill tokens of the requests sent to the host and not yet answered
    queued_fetch_s: float = 0.0  # their predicted link seconds (their load time is queued_load_bytes x load)
    queued_requests: int = 0  # how many they are
    overhead_s: float = 0.0  # per-request cost that does not grow with tokens (scheduling, first step)
    wait_s: float = 0.0  # seconds before the host can start on it, where known directly (a simulated GPU queue)
    load_s_per_byte: float = 0.0  # the engine's cost of taking in one byte of KV from its edge, beyond the link
    queued_load_bytes: float = 0.0  # bytes of KV the queued requests load from the edge


@dataclass(frozen=True, slots=True)
class Estimate:
    """A host's expected TTFT for one request and how it breaks down."""

    ttft_s: float
    queue_s: float
    fetch_s: float  # link time and the engine's load time of the artifacts used
    prefill_s: float
    loaded_tokens: int  # tokens whose KV would be loaded (engine cache, edge, peer or origin)
    prefill_tokens: int  # tokens the host would compute
    fetch_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes moved
    local_tokens: int = 0  # tokens held on the host itself (what prefix-overlap routing counts)
    link_s: float = 0.0  # the link part of ``fetch_s`` (the rest is the engine's load time)

    @property
    def load_bytes(self) -> int:
        """Bytes of KV the engine would take in from its edge (any tier but its own cache)."""
        return sum(self.fetch_bytes.values())

    def as_dict(self) -> dict[str, object]:
        return {"ttft_s": self.ttft_s, "queue_s": self.queue_s, "fetch_s": self.fetch_s, "link_s": self.link_s,
                "prefill_s": self.prefill_s,
                "loaded_tokens": self.loaded_tokens, "prefill_tokens": self.prefill_tokens,
                "fetch_bytes": dict(self.fetch_bytes), "local_tokens": self.local_tokens}


def estimate(shape: RequestShape, holdings: Holdings, host: HostCost) -> Estimate:
    """The expected TTFT of the request on ``host`` given what its edge ``holdings`` are (see the
    module docstring): the best prefix of the available artifacts to load, the rest recomputed."""
    r = max(0.0, host.prefill_s_per_token)
    limit = max(0, shape.tokens - 1)  # the engine computes the last prompt token
    over = max(0.0, host.overhead_s)
    load = max(0.0, host.load_s_per_byte)
    queue_s = (max(0.0, host.queued_tokens) * r + max(0.0, host.queued_fetch_s) + max(0.0, host.queued_load_bytes) * load
               + (max(0, host.queued_requests) + 1) * over + max(0.0, host.wait_s))
    best_j, best_cost = 0, shape.tokens * r
    fetch_s = link_s = 0.0
    loaded = 0
    costs: list[tuple[float, int, float]] = [(0.0, 0, 0.0)]
    for tier, tokens in holdings.segments(shape):
        if loaded >= limit:
            break
        take = min(tokens, limit - loaded)
        rate = host.link_bytes_per_s.get(tier, 0.0)
        if tier == "engine":
            link = taken = 0.0  # already in the engine's KV blocks
        elif rate > 0 and math.isfinite(rate):
            link = take * shape.kv_bytes_per_token / rate
            taken = take * shape.kv_bytes_per_token * load
        else:
            break  # a tier with no usable rate: priced as recompute from here on
        link_s += link
        fetch_s += link + taken
        loaded += take
        costs.append((fetch_s, loaded, link_s))
        cost = fetch_s + (shape.tokens - loaded) * r
        if cost < best_cost:
            best_j, best_cost = len(costs) - 1, cost
    f_s, n_loaded, l_s = costs[best_j]
    moved: dict[str, int] = {}
    at = 0
    for tier, tokens in holdings.segments(shape)[:best_j]:
        take = min(tokens, n_loaded - at)
        at += take
        if tier != "engine":
            moved[tier] = moved.get(tier, 0) + take * shape.kv_bytes_per_token
    prefill_tokens = shape.tokens - n_loaded
    prefill_s = prefill_tokens * r
    return Estimate(queue_s + f_s + prefill_s, queue_s, f_s, prefill_s, n_loaded, prefill_tokens, moved,
                    holdings.local_tokens(shape), l_s)
