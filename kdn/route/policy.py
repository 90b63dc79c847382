"""Routing policies: which host serves a request. One small interface, one registry.

A policy sees one :class:`Candidate` per host that may serve (healthy, vLLM): its name, its
in-flight requests, the edge's :class:`~kdn.route.score.Holdings` for the request and the
:class:`~kdn.route.score.Estimate` of its TTFT, and returns the index of the one to use.

``round_robin``     each host in turn, whatever it holds (needs no Lookup).
``prefix_overlap``  the host holding the longest leading run of the chain on the host itself
                    (engine cache, edge memory or disk): llm-d's precise prefix scorer; equal
                    runs go to the host with fewer requests in flight.
``cost``            the least expected TTFT (:func:`kdn.route.score.estimate`: queue, prefill at
                    the host's measured rate, fetch from wherever the overlay holds the chain at
                    the measured link rate, or recompute).

Ties spread: scores within ``tie_s`` (or a relative ``tie_fraction``) of the best are equal, and
equal candidates go to the one with fewer requests in flight, then in turn (a cursor that moves on
at each pick), so identical scores in multi-turn chat or an idle fleet never pile onto one host.
A policy keeps no state but that cursor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Sequence

from kdn.errors import InvalidInput
from kdn.route.score import Estimate, Holdings

__all__ = ["Candidate", "CostScore", "Policy", "POLICIES", "make_policy"]


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    in_flight: int
    holdings: Holdings
    estimate: Estimate


class Policy(ABC):
    name: ClassVar[str]
    needs_lookup: ClassVar[bool] = True

    def __init__(self, *, tie_s: float, tie_fraction: float) -> None:
        self.tie_s = tie_s
        self.tie_fraction = tie_fraction
        self._cursor = 0

    @abstractmethod
    def choose(self, candidates: Sequence[Candidate]) -> int:
        """The index in ``candidates`` (non-empty) of the host to use."""

    def _spread(self, candidates: Sequence[Candidate], tied: Sequence[int]) -> int:
        """Among ``tied`` indices: fewest in flight, then the next one after the cursor."""
        fewest = min(candidates[i].in_flight for i in tied)
        pool = [i for i in tied if candidates[i].in_flight == fewest]
        self._cursor += 1
        return pool[self._cursor % len(pool)]


class RoundRobin(Policy):
    name: ClassVar[str] = "round_robin"
    needs_lookup: ClassVar[bool] = False

    def choose(self, candidates: Sequence[Candidate]) -> int:
        self._cursor += 1
        return self._cursor % len(candidates)


class PrefixOverlap(Policy):
    name: ClassVar[str] = "prefix_overlap"

    def choose(self, candidates: Sequence[Candidate]) -> int:
        best = max(c.estimate.local_tokens for c in candidates)
        return self._spread(candidates, [i for i, c in enumerate(candidates) if c.estimate.local_tokens == best])


class CostScore(Policy):
    name: ClassVar[str] = "cost"

    def choose(self, candidates: Sequence[Candidate]) -> int:
        best = min(c.estimate.ttft_s for c in candidates)
        slack = max(self.tie_s, self.tie_fraction * best)
        return self._spread(candidates, [i for i, c in enumerate(candidates) if c.estimate.ttft_s <= best + slack])


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (RoundRobin, PrefixOverlap, CostScore)}


def make_policy(name: str, **kw: float) -> Policy:
    try:
        return POLICIES[name](**kw)
    except KeyError:
        raise InvalidInput(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}") from None
