"""``adaptive``: LRU or the prefix-aware policy, whichever miniature simulations of both say
wins on the workload seen so far (see :class:`AdaptivePrefix`)."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import ClassVar

from kdn.edge.eviction.base import EvictionPolicy, Key, SkipFn
from kdn.edge.eviction.lru import LRU
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
    """Evicts as LRU or as :class:`PrefixAware` (leaves first, decayed frequency, history,
    superseded and dead chunks first), switching to whichever *miniature simulations* of the two
    say wins on the accesses seen so far. Starts as LRU, so it is never below LRU for long.

    A fixed prefix-aware policy is a bet on the workload: frequency over a long half-life wins
    where chunks come back after recency would have dropped them (1.9x LRU at 1% on the Mooncake
    trace) and loses where reuse is soon and one-off (0.75x on a chat-shaped trace). Comparing the
    real cache against an LRU shadow and moving the half-life (this policy's first design) reacts
    only after the damage: evictions cost hits one reuse distance later, and the transition from
    the wrong setting left it 0.1% below LRU on conversations. So this policy measures *both*
    choices on the side, as SHARDS-style miniature simulations do (Waldspurger et al., "Cache
    Modeling and Optimization using Miniature Simulations", USENIX ATC '17):

    * **sample**: 1 in ``sample`` keys, chosen by a process-independent hash of the key; a request's
      sampled chunks form a *thinned chain* (each one's parent is the nearest sampled chunk before
      it in the same read, followed along the access stream), so prefix structure survives
      sampling, and a system-prompt root shared by every chain is not all-or-nothing;
    * **two miniature caches**, an LRU and a :class:`PrefixAware` (half-life scaled by the sample
      rate, as it counts accesses), each with room for ``resident / sample`` keys, replay the
      sampled accesses and count their useful hits;
    * **per epoch** of ``epoch`` accesses (default: half the resident count, at least 500) the
      hit counts, decayed by half each epoch, decide the regime: prefix-aware once its miniature
      beats LRU's by ``margin`` (and by 4 hits, against noise), back to LRU once it falls below.

    Both regimes keep their state all the time (the prefix forest and scores, and an LRU order of
    the resident keys), so a switch only changes where :meth:`victim` looks. Costs per access: one
    ordered-dict move, plus the two miniatures' work on 1 in ``sample`` accesses. ``history``
    keeps the regime after each of the last 1,024 epochs (``"lru"`` / ``"prefix"``).
    """

    name: ClassVar[str] = "adaptive"

    def __init__(
        self,
        *,
        half_life: float = 11_000.0,
        sample: int = 4,
        margin: float = 0.05,
        epoch: int | None = None,
        **kw: object,
    ) -> None:
        super().__init__(half_life=half_life, **kw)  # type: ignore[arg-type]
        if sample < 1 or margin < 0:
            raise InvalidInput(f"adaptive policy: sample must be >= 1 and margin >= 0, got {sample}, {margin}")
        self._sample = sample
        self._margin = margin
        self._epoch = epoch
        mini_prefix = PrefixAware(half_life=half_life / sample, supersede=self._supersede)
        self._minis = (_Mini(mini_prefix), _Mini(LRU()))
        self._scores = [0.0, 0.0]  # decayed useful hits of the prefix and the LRU miniature
        self._order: OrderedDict[Key, None] = OrderedDict()  # resident keys, least recent first
        self._accesses = 0
        self._prev: Key | None = None  # the previous access, and the nearest sampled key of its read
        self._run_sampled: Key | None = None
        self.regime = "lru"
        self.history: deque[str] = deque(maxlen=1024)

    def _seen(self, key: Key, parent: Key | None) -> None:
        if parent is None or parent == ROOT_KEY or parent != self._prev:
            self._run_sampled = None  # a new read starts (or the stream jumped): no sampled ancestor
        if _sample_hash(key) % self._sample == 0:
            cap = max(4, len(self._nodes) // self._sample)
            for mini in self._minis:
                mini.access(key, self._run_sampled, cap)
            self._run_sampled = key
        self._prev = key
        self._accesses += 1
        if self._accesses >= (self._epoch or max(500, len(self._nodes) // 2)):
            self._adapt()

    def _adapt(self) -> None:
        prefix, lru = self._minis
        self._scores = [0.5 * self._scores[0] + prefix.hits, 0.5 * self._scores[1] + lru.hits]
        prefix.hits = lru.hits = 0
        p, r = self._scores
        if self.regime == "lru" and p > r * (1.0 + self._margin) + 4.0:
            self.regime = "prefix"
        elif self.regime == "prefix" and p < r:
            self.regime = "lru"
        self.history.append(self.regime)
        self._accesses = 0

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self._nodes:
            self.touch(key)
            return
        self._seen(key, parent)
        super().insert(key, size, parent)
        self._order[key] = None

    def touch(self, key: Key) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        self._seen(key, node.parent)
        self._order.move_to_end(key)
        super().touch(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)
        super().remove(key)

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        if self.regime == "prefix":
            return super().victim(skip)
        for key in self._order:
            if skip is None or not skip(key):
                return key
        return None
