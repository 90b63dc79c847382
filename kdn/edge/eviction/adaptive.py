"""``adaptive``: the prefix-aware policy's leaves, ordered by recency or by decayed frequency,
whichever miniature simulations of both say wins on the workload seen so far (see
:class:`AdaptivePrefix`)."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import ClassVar

from kdn.edge.eviction.base import EvictionPolicy, Key
from kdn.edge.eviction.prefix import PrefixAware
from kdn.errors import InvalidInput
from kdn.keys import ROOT_KEY

__all__ = ["AdaptivePrefix"]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _sample_hash(key: Key) -> int:
    """A hash of ``key`` that is the same in every process (Python's ``hash`` of bytes and str is
    salted per process): ints through a multiplicative hash, bytes by their first 8 bytes (chunk
    keys are BLAKE2b digests), tuples (the edge's ``EntryId``) by their last field."""
    if isinstance(key, tuple) and key:
        key = key[-1]
    if isinstance(key, int):
        return ((key * _GOLDEN) & _MASK64) >> 32
    if isinstance(key, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(key[:8]), "little")
    return hash(key) & _MASK64


class _Mini:
    """A miniature cache: one policy over the sampled keys, with room for ``cap`` of them, counting
    its useful hits (hits that extend a request's leading run, as the real cache's reader needs)."""

    __slots__ = ("policy", "prev", "prev_useful", "hits")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.prev: Key | None = None
        self.prev_useful = False
        self.hits = 0

    def access(self, key: Key, parent: Key | None, cap: int) -> None:
        p = self.policy
        if key in p:
            p.touch(key)
            useful = parent is None or (self.prev_useful and self.prev == parent)
            self.hits += useful
        else:
            useful = False
            p.insert(key, 1, parent)
            while len(p) > cap:
                victim = p.victim()
                if victim is None:
                    break
                p.remove(victim)
        self.prev, self.prev_useful = key, useful


class AdaptivePrefix(PrefixAware):
    """Prefix-aware eviction (:class:`PrefixAware`: leaves first, superseded and dead chunks
    first, a ghost of evicted keys) whose order among the leaves is chosen from the workload:
    ``recency`` (the least recently used leaf: LRU that never breaks a chain, at or above LRU on
    every trace measured) or ``frequency`` (decayed frequency with a long half-life, which wins
    where chunks come back after recency would have dropped them: 1.7x LRU at 1% on the Mooncake
    trace) and loses where reuse is soon and one-off (0.8x on a chat-shaped trace).

    Both orders are kept over the same forest all the time, so a switch changes only which leaf
    goes next and never drops a chain. The choice is measured on the side, as SHARDS-style
    miniature simulations do (Waldspurger et al., "Cache Modeling and Optimization using
    Miniature Simulations", USENIX ATC '17):

    * **sample**: 1 in ``sample`` keys, by a process-independent hash of the key; a request's
      sampled chunks form a *thinned chain* (each one's parent is the nearest sampled chunk before
      it in the same read), so prefix structure survives sampling;
    * **two miniature caches**, one per order (the frequency one's half-life scaled by the sample
      rate, as it counts accesses), each with room for ``resident / sample`` keys, replay the
      sampled accesses and count their useful hits;
    * **decisions at the pace of reuse**: the miniatures' hits are compared once per *period*,
      twice the median reuse distance of the sampled keys (in accesses; ``period`` fixes it), at
      least ``min_period`` accesses: a choice shows in the hit rate only one reuse distance after
      it is made, so deciding faster than that follows noise. Scores are decayed by half each
      period;
    * **a switch needs evidence**: the other order's decayed hits must beat the current one's by
      ``margin`` and by ``z`` standard deviations of the difference of two Poisson counts
      (``z * sqrt(a + b)``); the policy starts as ``recency``.

    Costs per access: the two heaps' pushes, plus the two miniatures' work and a reuse-distance
    record on 1 in ``sample`` accesses. ``history`` keeps the order after each of the last 1,024
    periods.
    """

    name: ClassVar[str] = "adaptive"

    def __init__(
        self,
        *,
        half_life: float = 11_000.0,
        sample: int = 4,
        margin: float = 0.02,
        z: float = 2.0,
        period: int | None = None,
        min_period: int = 2_000,
        **kw: object,
    ) -> None:
        kw.pop("order", None)
        kw.pop("keep_both", None)
        super().__init__(half_life=half_life, order="recency", keep_both=True, **kw)  # type: ignore[arg-type]
        if sample < 1 or margin < 0 or z < 0 or min_period < 1 or (period is not None and period < 1):
            raise InvalidInput(
                f"adaptive policy: sample, min_period and period must be >= 1 and margin, z >= 0, got {sample}, {min_period}, {period}, {margin}, {z}"
            )
        self._sample = sample
        self._margin = margin
        self._z = z
        self._period = period
        self._min_period = min_period
        supersede = self._supersede
        self._minis = (
            _Mini(PrefixAware(half_life=half_life / sample, supersede=supersede, order="score")),
            _Mini(PrefixAware(half_life=half_life / sample, supersede=supersede, order="recency")),
        )
        self._scores = [0.0, 0.0]  # decayed useful hits of the frequency and the recency miniature
        self._accesses = 0  # since the last decision
        self._due = period if period is not None else min_period  # accesses between decisions now
        self._seen_at: OrderedDict[Key, int] = OrderedDict()  # sampled key -> its last access number
        self._distances: deque[int] = deque(maxlen=512)  # recent reuse distances of sampled keys
        self._n = 0  # accesses so far
        self._prev: Key | None = None  # the previous access, and the nearest sampled key of its read
        self._run_sampled: Key | None = None
        self.history: deque[str] = deque(maxlen=1024)

    @property
    def regime(self) -> str:
        """The order in force: ``recency`` or ``frequency``."""
        return "recency" if self.order == "recency" else "frequency"

    def period(self) -> int:
        """Accesses between two decisions now."""
        if self._period is not None:
            return self._period
        d = sorted(self._distances)
        median = d[len(d) // 2] if d else 0
        return max(self._min_period, 2 * median)

    def _seen(self, key: Key, parent: Key | None) -> None:
        if parent is None or parent == ROOT_KEY or parent != self._prev:
            self._run_sampled = None  # a new read starts (or the stream jumped): no sampled ancestor
        self._n += 1
        if _sample_hash(key) % self._sample == 0:
            cap = max(4, len(self._nodes) // self._sample)
            for mini in self._minis:
                mini.access(key, self._run_sampled, cap)
            self._run_sampled = key
            seen = self._seen_at
            last = seen.pop(key, None)
            if last is not None:
                self._distances.append(self._n - last)
            seen[key] = self._n
            if len(seen) > 4 * max(len(self._nodes), 256):
                seen.popitem(last=False)  # keys not seen for that long have no reuse to measure here
        self._prev = key
        self._accesses += 1
        if self._accesses >= self._due:
            self._adapt()

    def _adapt(self) -> None:
        freq, rec = self._minis
        self._scores = [0.5 * self._scores[0] + freq.hits, 0.5 * self._scores[1] + rec.hits]
        freq.hits = rec.hits = 0
        f, r = self._scores
        noise = self._z * math.sqrt(f + r)
        if self.order == "recency" and f > r * (1.0 + self._margin) + noise:
            self.order = "score"
        elif self.order == "score" and r > f * (1.0 + self._margin) + noise:
            self.order = "recency"
        self.history.append(self.regime)
        self._accesses = 0
        self._due = self.period()

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self._nodes:
            self.touch(key)
            return
        self._seen(key, parent)
        super().insert(key, size, parent)

    def touch(self, key: Key) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        self._seen(key, node.parent)
        super().touch(key)
