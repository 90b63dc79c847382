"""Measured rates of one host: how fast it prefills and how fast KV reaches it from each tier.

Nothing here is a configured constant: every figure starts from a stated prior and is replaced by
measurements as they come, with exponential forgetting so a host that slows down (or a link that
fills) is seen within a few observations.

- :class:`PrefillFit`: ``ttft - link time = overhead x requests + s_per_token x tokens + load x
  bytes`` over the requests ahead of one and itself, fitted by exponentially weighted least
  squares over the router's own observations: the first
  byte of every streamed answer, and the calibration probes the router sends a host when it joins
  (prompts of a few lengths of fresh tokens, ``max_tokens: 1``, KDN switched off for them).
- :class:`LinkRates`: bytes per second per tier, from the deltas of an edge's own counters
  (``Stats``: ``kdn_edge_bytes_in{source}`` over ``kdn_edge_rpc_seconds{rpc=Fetch,source}`` for
  peers and the origin; bytes served from its memory and disk tiers over the Fetch seconds of
  those hits). A Fetch's seconds include the edge's verification and the stream to the engine;
  what the engine then spends taking the bytes in (the connector writing them into its KV blocks)
  the edge cannot see: that is the fit's per-byte ``load`` term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

__all__ = ["PrefillFit", "LinkRates", "link_samples"]


class PrefillFit:
    """Least squares of ``y = overhead x m + rate x x + load x z`` (``m`` requests whose ``x``
    prefill tokens and ``z`` bytes of KV loaded from the edge stood between sending one request and
    its first token), forgetting factor ``decay`` per observation.

    ``load`` is what a byte of KV costs the *engine* to take in (the connector receiving it and
    writing it into its blocks), beyond the link time the edge's counters measure; it starts at 0
    and is fitted only once requests that loaded KV have been observed. All three parts are kept
    non-negative: when the full fit gives one a negative value, the fit without load is tried,
    then the one without overhead, then the line through the origin.

    ``bytes_per_token``: the KV one token takes. Given, a fit that prices taking in one token's KV
    above computing the token is refused like a negative one: the engine writes that KV when it
    computes the token too, so such a ``load`` is delay that came with the loads (a busy machine,
    a queue the other terms missed), not their cost; taken at face value it would price every
    edge hit above a recompute on that host."""

    _Z_SCALE = 1e-6  # bytes are fitted in MB, so the normal equations stay well scaled

    def __init__(self, prior_s_per_token: float, *, decay: float = 0.9, min_rate: float = 1e-7,
                 bytes_per_token: float | None = None) -> None:
        self.prior = prior_s_per_token
        self.decay = decay
        self.min_rate = min_rate
        self.bytes_per_token = bytes_per_token
        self.n = 0
        self._a = np.zeros((3, 3))  # weighted sums of f f^T, f = (m, x, z in MB)
        self._b = np.zeros(3)  # weighted sums of f y
        self._fit: tuple[float, float, float] | None = None

    def observe(self, x: float, y: float, m: float = 1.0, z: float = 0.0) -> None:
        """One request: ``x`` tokens of prefill ahead of and including it, ``m`` requests (it and
        those ahead), ``z`` bytes of KV they loaded from the edge, ``y`` seconds they took (its
        first byte after sending, less the predicted link time of those loads)."""
        if not (x > 0 and m >= 1 and z >= 0 and all(math.isfinite(v) for v in (x, y, z)) and y >= 0):
            return
        f = np.array([m, x, z * self._Z_SCALE])
        self._a = self.decay * self._a + np.outer(f, f)
        self._b = self.decay * self._b + f * y
        self.n += 1
        self._fit = None

    @property
    def s_per_token(self) -> float:
        return self.prior if self.n == 0 else self._solve()[0]

    @property
    def overhead_s(self) -> float:
        return 0.0 if self.n == 0 else self._solve()[1]

    @property
    def load_s_per_byte(self) -> float:
        return 0.0 if self.n == 0 else self._solve()[2]

    def _solve(self) -> tuple[float, float, float]:
        """``(rate, overhead, load)``: the fullest non-negative fit the observations support."""
        if self._fit is None:
            fit = None
            if self.n >= 2:
                # parameter sets in order of preference: (overhead, rate, load), then without load,
                # then without overhead; each needs a well-conditioned system and valid values
                for keep in ((0, 1, 2), (0, 1), (1, 2)):
                    got = self._subset(list(keep))
                    if got is not None:
                        fit = got
                        break
            if fit is None:  # one distinct size seen (or no valid fit): the line through the origin
                xx, xy = float(self._a[1, 1]), float(self._b[1])
                fit = (max(self.min_rate, xy / xx if xx > 0 else self.prior), 0.0, 0.0)
            self._fit = fit
        return self._fit

    def _subset(self, keep: list[int]) -> tuple[float, float, float] | None:
        a = self._a[np.ix_(keep, keep)]
        diag = np.diag(a)
        if np.any(diag <= 0):
            return None
        d = np.sqrt(diag)
        an = a / np.outer(d, d)  # unit diagonal: the condition number says how collinear the parts are
        if np.linalg.cond(an) > 1e6:
            return None
        theta = np.linalg.solve(an, self._b[keep] / d) / d
        full = dict(zip(keep, theta.tolist()))
        over, rate, load = full.get(0, 0.0), full.get(1, 0.0), full.get(2, 0.0) * self._Z_SCALE
        if rate <= self.min_rate or over < 0 or load < 0:
            return None
        if self.bytes_per_token and load * self.bytes_per_token > rate:
            return None  # a token's KV taken in dearer than the token computed: confounded (see above)
        return rate, over, load

    def as_dict(self) -> dict[str, float]:
        return {"s_per_token": self.s_per_token, "overhead_s": self.overhead_s,
                "load_s_per_mb": self.load_s_per_byte * 1e6, "observations": float(self.n)}


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
