"""Measured rates of one host: how fast it prefills and how fast KV reaches it from each tier.

Nothing here is a configured constant: every figure starts from a stated prior and is replaced by
measurements as they come, with exponential forgetting so a host that slows down (or a link that
fills) is seen within a few observations.

- :class:`PrefillFit`: ``ttft - fetches = overhead x requests + s_per_token x tokens`` over the
  requests ahead of one and itself, fitted by exponentially weighted least squares over the
  router's own observations: the first
  byte of every streamed answer, and the calibration probes the router sends a host when it joins
  (prompts of a few lengths of fresh tokens, ``max_tokens: 1``, KDN switched off for them).
- :class:`LinkRates`: bytes per second per tier, from the deltas of an edge's own counters
  (``Stats``: ``kdn_edge_bytes_in{source}`` over ``kdn_edge_rpc_seconds{rpc=Fetch,source}`` for
  peers and the origin; bytes served from its memory and disk tiers over the Fetch seconds of
  those hits). A Fetch's seconds include the edge's verification and the stream to the engine: the
  rate is what a fetch from that tier costs the engine, not the raw link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["PrefillFit", "LinkRates", "link_samples"]


class PrefillFit:
    """Least squares of ``y = overhead x m + rate x x`` (``m`` requests whose ``x`` prefill tokens
    stood between sending one request and its first token), forgetting factor ``decay`` per
    observation."""

    def __init__(self, prior_s_per_token: float, *, decay: float = 0.9, min_rate: float = 1e-7) -> None:
        self.prior = prior_s_per_token
        self.decay = decay
        self.min_rate = min_rate
        self.n = 0
        self._mm = self._mx = self._xx = self._my = self._xy = 0.0
        self._fit: tuple[float, float] | None = None

    def observe(self, x: float, y: float, m: float = 1.0) -> None:
        """One request: ``x`` tokens of prefill ahead of and including it, ``m`` requests (it and
        those ahead), ``y`` seconds they took (its first byte after sending, less the predicted
        fetches)."""
        if not (x > 0 and m >= 1 and math.isfinite(x) and math.isfinite(y) and y >= 0):
            return
        d = self.decay
        self._mm = d * self._mm + m * m
        self._mx = d * self._mx + m * x
        self._xx = d * self._xx + x * x
        self._my = d * self._my + m * y
        self._xy = d * self._xy + x * y
        self.n += 1
        self._fit = None

    @property
    def s_per_token(self) -> float:
        return self.prior if self.n == 0 else self._solve()[0]

    @property
    def overhead_s(self) -> float:
        return 0.0 if self.n == 0 else self._solve()[1]

    def _solve(self) -> tuple[float, float]:
        if self._fit is None:
            mm, mx, xx, my, xy = self._mm, self._mx, self._xx, self._my, self._xy
            det = mm * xx - mx * mx
            fit = None
            if self.n >= 2 and det > 1e-9 * mm * xx:
                rate = (mm * xy - mx * my) / det
                over = (xx * my - mx * xy) / det
                if rate > self.min_rate and over >= 0:
                    fit = (rate, over)
            # one distinct size seen (or a fit with a negative part): the line through the origin
            self._fit = fit or (max(self.min_rate, xy / xx if xx > 0 else self.prior), 0.0)
        return self._fit

    def as_dict(self) -> dict[str, float]:
        return {"s_per_token": self.s_per_token, "overhead_s": self.overhead_s, "observations": float(self.n)}


def link_samples(prev: Mapping[str, float], cur: Mapping[str, float]) -> dict[str, tuple[float, float]]:
    """``tier -> (bytes, seconds)`` moved between two ``Stats`` answers of one edge (node scope)."""

    def d(name: str) -> float:
        return max(0.0, cur.get(name, 0.0) - prev.get(name, 0.0))

    def seconds(source: str) -> float:
        return d(f"kdn_edge_rpc_seconds_sum{{rpc=Fetch,source={source}}}")

    out: dict[str, tuple[float, float]] = {}
    upstream = 0.0
    for tier in ("peer", "origin"):
        b = d(f"kdn_edge_bytes_in_total{{source={tier}}}")
        upstream += b
        out[tier] = (b, seconds(tier))
    sent = sum(d(k) for k in cur if k.startswith("kdn_edge_bytes_out_total"))
    local = max(0.0, sent - upstream)
    hits = {t: d(f"kdn_edge_hits_total{{tier={t}}}") for t in ("memory", "disk")}
    n_hits = sum(hits.values())
    for tier in ("memory", "disk"):
        share = local * hits[tier] / n_hits if n_hits else 0.0
        out[tier] = (share, seconds(tier))
    return out


@dataclass(slots=True)
class LinkRates:
    """Bytes per second per tier, each an exponential moving average of measured intervals."""

    prior: Mapping[str, float]
    weight: float = 0.5  # of each new interval
    min_bytes: float = 256 * 1024  # intervals that moved less say nothing
    measured: dict[str, float] = field(default_factory=dict)
    intervals: dict[str, int] = field(default_factory=dict)

    def observe(self, samples: Mapping[str, tuple[float, float]]) -> None:
        for tier, (b, s) in samples.items():
            if b < self.min_bytes or s <= 1e-6:
                continue
            rate = b / s
            old = self.measured.get(tier)
            self.measured[tier] = rate if old is None else (1 - self.weight) * old + self.weight * rate
            self.intervals[tier] = self.intervals.get(tier, 0) + 1

    def rates(self) -> dict[str, float]:
        out = dict(self.prior)
        out.update(self.measured)
        return out

    def as_dict(self) -> dict[str, object]:
        return {"bytes_per_s": self.rates(), "measured": sorted(self.measured), "intervals": dict(self.intervals)}
