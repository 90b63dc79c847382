"""Paired comparisons of methods scored on the same prompts: intervals and exact McNemar tests.

- :func:`wilson` — the Wilson score interval of a proportion (95% by default);
- :func:`mean_ci` — a mean with a normal-approximation interval (for per-prompt KL);
- :func:`mcnemar` — the exact (binomial) McNemar test of two methods' right/wrong on the same
  prompts: under the null each discordant prompt is equally likely to favour either method, so the
  two-sided p-value is ``min(1, 2 · P[Bin(b + c, 1/2) <= min(b, c)])``;
- :func:`sign_test` — the same exact test for paired measurements (per-prompt KL): each prompt
  counts for the method with the lower value, ties for neither.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` of ``successes / n``; ``(0, 1)`` for ``n == 0``."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_ci(values: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean and a normal-approximation interval."""
    if not values:
        return 0.0, 0.0, 0.0
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, m, m
    half = z * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


@dataclass(frozen=True, slots=True)
class McNemar:
    """``a_only``: prompts only the first method got right; ``b_only``: only the second."""

    n: int
    a_only: int
    b_only: int
    p_value: float


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> McNemar:
    """Exact two-sided McNemar test of paired outcomes ``a[i]``, ``b[i]`` (same prompt ``i``)."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes differ in length ({len(a)} vs {len(b)})")
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    return _binomial(len(a), a_only, b_only)


def sign_test(a: Sequence[float], b: Sequence[float]) -> McNemar:
    """Exact two-sided sign test of paired values ``a[i]``, ``b[i]``: ``a_only`` counts the
    prompts where ``a`` is lower, ``b_only`` where ``b`` is; equal values count for neither."""
    if len(a) != len(b):
        raise ValueError(f"paired values differ in length ({len(a)} vs {len(b)})")
    return _binomial(len(a), sum(1 for x, y in zip(a, b) if x < y), sum(1 for x, y in zip(a, b) if y < x))


def _binomial(n: int, a_only: int, b_only: int) -> McNemar:
    d = a_only + b_only
    if d == 0:
        return McNemar(n, 0, 0, 1.0)
    k = min(a_only, b_only)
    tail = sum(math.comb(d, i) for i in range(k + 1)) / 2 ** d
    return McNemar(n, a_only, b_only, min(1.0, 2 * tail))
