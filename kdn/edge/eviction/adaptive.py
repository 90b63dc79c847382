"""``adaptive``: the prefix-aware policy with a half-life that follows the workload (see
:class:`AdaptivePrefix`)."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import ClassVar

from kdn.edge.eviction.base import Key
from kdn.edge.eviction.prefix import PrefixAware
from kdn.keys import ROOT_KEY

__all__ = ["AdaptivePrefix"]


class AdaptivePrefix(PrefixAware):
    """:class:`PrefixAware` (leaves first, decayed frequency, history, superseded and dead chunks
    first) whose half-life adapts to the reuse it observes, so it does not fall below LRU where a
    fixed half-life does.

    The fixed half-life is a bet on the workload's reuse distances: long (frequency) wins when
    chunks come back after the cache would have dropped them by recency, short (recency) wins when
    reuse is soon and one-off. This policy measures the bet: next to the real cache it keeps an
    LRU *shadow* of the same number of keys (keys only, an ordered dict) and counts, per epoch of
    ``epoch`` accesses (default: half the resident count, at least 500), its own useful hits
    (hits that extend a request's leading run) and the useful hits LRU would have had on the same
    accesses. Then it moves the half-life:

    * below LRU in the epoch: 4x shorter (toward recency, where the policy behaves as LRU does on
      chains, leaves first);
    * clearly above LRU (by 2%): 2x longer, back toward the starting half-life (never past it);
      level with LRU: unchanged.

    Below its starting half-life it also stops superseding fresh leaves (a bet on chat-style
    partial chunks that costs hits where reuse is by recency).

    The clock's speed changes, not the scores: accesses after a change weigh ``2 ** (1 /
    half_life)`` times more than the one before, so nothing is rescored. The half-life stays
    within ``[min_half_life, max_half_life]``. Costs one ordered-dict move per access on top of
    :class:`PrefixAware`, plus its rescale of every score (O(entries)) each ``900 * half_life``
    accesses: rare at the starting half-life, every ~14,000 accesses at the shortest.
    """

    name: ClassVar[str] = "adaptive"
    MARGIN: ClassVar[float] = 0.02  # lengthen only when clearly (2%) above LRU

    def __init__(
        self,
        *,
        half_life: float = 11_000.0,
        min_half_life: float = 16.0,
        max_half_life: float = 1e7,
        epoch: int | None = None,
        **kw: object,
    ) -> None:
        super().__init__(half_life=half_life, **kw)  # type: ignore[arg-type]
        self._min_hl = min_half_life
        self._max_hl = max_half_life
        self._epoch = epoch
        self._shadow: OrderedDict[Key, None] = OrderedDict()
        self._hits = 0
        self._shadow_hits = 0
        self._accesses = 0
        self._start_hl = half_life
        self._supersede_default = self._supersede
        self._prev: Key | None = None  # the previous access, and whether it was a useful hit
        self._prev_hit = self._prev_shadow_hit = False
        # the half-life after each of the last 1,024 epochs (for benchmarks and tests; bounded, as an
        # edge runs for months)
        self.history: deque[float] = deque(maxlen=1024)

    def _seen(self, key: Key, hit: bool, parent: Key | None) -> None:
        """Count an access: a *useful* hit is one that extends the leading run of its request
        (its parent was the access before and a useful hit too, or it is a chain's first chunk);
        a hit behind a miss is worth nothing to a prefix read, so it is not counted, for the real
        cache and for the LRU shadow alike."""
        root = parent is None or parent == ROOT_KEY
        shadow = self._shadow
        if key in shadow:
            shadow.move_to_end(key)
            s_useful = root or (self._prev_shadow_hit and self._prev == parent)
            if s_useful:
                self._shadow_hits += 1
        else:
            s_useful = False
            shadow[key] = None
            cap = len(self._nodes) + (0 if hit else 1)
            while len(shadow) > cap:
                shadow.popitem(last=False)
        useful = hit and (root or (self._prev_hit and self._prev == parent))
        if useful:
            self._hits += 1
        self._prev, self._prev_hit, self._prev_shadow_hit = key, useful, s_useful
        self._accesses += 1
        if self._accesses >= (self._epoch or max(500, len(self._nodes) // 2)):
            self._adapt()

    def _adapt(self) -> None:
        ratio = (self._hits + 1.0) / (self._shadow_hits + 1.0)
        # below LRU: toward recency; at or above: back toward the starting half-life
        if ratio < 1.0:
            hl = self.half_life / 4.0
        elif ratio >= 1.0 + self.MARGIN:
            hl = min(self._start_hl, self.half_life * 2.0)
        else:  # level with LRU: stay (no oscillation on recency-shaped workloads)
            hl = self.half_life
        hl = min(self._max_hl, max(self._min_hl, hl))
        self.half_life = hl
        self._rate = 1.0 / hl
        # superseding a fresh leaf is a bet on chat-style partial chunks; off while recency rules
        self._supersede = self._supersede_default and hl >= self._start_hl
        self.history.append(hl)
        self._hits = self._shadow_hits = self._accesses = 0

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self._nodes:
            self.touch(key)
            return
        self._seen(key, False, parent)
        super().insert(key, size, parent)

    def touch(self, key: Key) -> None:
        node = self._nodes.get(key)
        if node is not None:
            self._seen(key, True, node.parent)
        super().touch(key)
