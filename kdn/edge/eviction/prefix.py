"""``prefix``: prefix-aware eviction for chained KV chunks (see :class:`PrefixAware`)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any, ClassVar

from kdn.edge.eviction.base import EvictionPolicy, Key, SkipFn, lazy_heap_victim
from kdn.errors import InvalidInput
from kdn.keys import ROOT_KEY

__all__ = ["PrefixAware"]


class _Node:
    """Per-key state of :class:`PrefixAware`."""

    __slots__ = ("parent", "score", "seq", "dead", "fresh", "last")

    def __init__(self, parent: Key | None, score: float, last: int = 0) -> None:
        self.parent = parent
        self.fresh = True  # not touched since it was inserted
        self.score = score  # decayed access count, in units of 2**(virtual time at the epoch)
        self.last = last  # the access count at its last access (-1: superseded, first to go by recency)
        self.seq = -1  # sequence number of this key's live heap entry; -1 = not in the heap
        self.dead = False  # an ancestor of this key is gone: the key can never be read as a prefix


# rescale scores when the virtual clock is this many half-lives past the epoch: weights stay below
# 2**900 (floats reach 2**1023, room for sums), and a short half-life rescales 3.5x less often than at 256
_RESCALE_AT = 900.0


class PrefixAware(EvictionPolicy):
    """Prefix-aware eviction for chained KV chunks.

    A chunk is only useful if every chunk before it in its chain is cached too: a request reads the
    *leading* run of cached chunks. The resident keys form a forest (edge = ``parent`` link), and
    this policy keeps it a forest of intact prefixes:

    * **Leaves first.** Only keys with no resident children are candidates, so a chunk is never
      evicted while a chunk that depends on it stays; chains shrink from their tails, and roots
      shared by many requests (block 0 of every conversation) are the last to go.
    * **Decayed frequency** (LRFU) among the leaves: a key's score is the sum over its accesses of
      ``2 ** -(age of the access / half_life)``, age counted in accesses (inserts + touches); the
      lowest score goes first. A long half-life is LFU, a short one LRU. The default (11,000
      accesses) was tuned on the Mooncake conversation trace, whose reuse distances are mostly
      3k-25k chunk accesses; scale it with a workload's reuse distance (not with the cache size).
      Because a request that reads a chunk also reads its prefix, scores rarely grow down a chain,
      which agrees with leaves-first.
    * **History** of evicted keys (a ghost of up to ``ghost`` resident-counts entries): a key that
      comes back resumes its decayed score, so chunks reused at distances longer than the cache's
      reach are recognised on their second use and kept for the third.
    * **Superseded chunks early** (``supersede=True``): when a chunk gets a new child, its previous
      newest child, if still a leaf never read since insertion, drops to score 0. In a chat, turn
      t's partial last chunk is followed in turn t+1 by a full chunk with a different key; the old
      one is never read again.
    * **Dead chunks first.** A key whose parent is given but not resident (inserted as an orphan, or
      its ancestor was removed from outside, e.g. by a TTL) can never be read as a prefix; it is
      marked dead and evicted before any live key. Set ``track_orphans=False`` for a tier that holds
      only part of each chain (its parents live in another tier), where "parent not here" is normal.
    * **Admission** (``reject_orphans=True``): refuse a key whose parent is given but not resident.
    * **Order among the leaves** (``order``): ``score`` (the decayed frequency above) or
      ``recency`` (the least recently accessed leaf first: LRU that never breaks a chain).
      :attr:`order` may change at any time when both are kept (``keep_both=True``).

    ``parent`` may be ``None`` or :data:`kdn.keys.ROOT_KEY` for a chain's first chunk. Scores count
    accesses, not bytes: chunks of one model are of similar size.

    ``victim`` is O(log n) amortised via a lazy heap of leaves (stale entries dropped on pop, the
    heap rebuilt when it holds more than ``4n`` entries).
    """

    name: ClassVar[str] = "prefix"

    @classmethod
    def for_tier(cls, *, whole_chains: bool = True, **kw: Any) -> "PrefixAware":
        """In a cache that holds only part of each chain, "parent not here" is normal, not an orphan."""
        if not whole_chains:
            kw.setdefault("track_orphans", False)
        return cls(**kw)

    def __init__(
        self,
        *,
        half_life: float = 11_000.0,
        ghost: float = 4.0,
        track_orphans: bool = True,
        reject_orphans: bool = False,
        supersede: bool = True,
        order: str = "score",
        keep_both: bool = False,
    ) -> None:
        if half_life <= 0 or ghost < 0:
            raise InvalidInput(f"prefix policy: half_life must be > 0 and ghost >= 0, got {half_life}, {ghost}")
        if order not in ("score", "recency"):
            raise InvalidInput(f"prefix policy: order must be 'score' or 'recency', got {order!r}")
        self.order = order
        self._by_score = keep_both or order == "score"
        self._by_recency = keep_both or order == "recency"
        self._rheap: list[tuple[int, int, int, Key]] = []  # (alive, last access, seq, key), leaves only
        self._count = 0  # accesses so far
        self.half_life = half_life
        self._rate = 1.0 / half_life  # half-lives per access
        self._supersede = supersede
        self._newest_kid: dict[Key, Key] = {}  # resident parent -> its most recently inserted child
        self._ghost_factor = ghost
        self._track_orphans = track_orphans
        self._reject_orphans = reject_orphans
        self._nodes: dict[Key, _Node] = {}
        self._resident = self._nodes
        self._kids: dict[Key, set[Key]] = {}  # parent key -> resident children (parent may be absent)
        self._ghost: OrderedDict[Key, float] = OrderedDict()  # evicted key -> score when it left
        self._heap: list[tuple[int, float, int, Key]] = []  # (alive, score, seq, key), leaves only
        self._seq = 0
        self._vclock = 0.0  # virtual time in half-lives since the epoch (the last rescale)

    # -- internals ---------------------------------------------------------------------------------

    def _tick(self) -> float:
        """Advance the clock by one access; return the weight of an access now."""
        self._count += 1
        self._vclock += self._rate
        if self._vclock > _RESCALE_AT:
            self._rescale()
        return 2.0**self._vclock

    def _rescale(self) -> None:
        factor = 2.0 ** -self._vclock
        self._vclock = 0.0
        for node in self._nodes.values():
            node.score *= factor
        for key in self._ghost:
            self._ghost[key] *= factor
        self._rebuild_heap()

    def _push(self, key: Key, node: _Node) -> None:
        self._seq += 1
        node.seq = self._seq
        alive = 0 if node.dead else 1
        if self._by_score:
            heapq.heappush(self._heap, (alive, node.score, self._seq, key))
        if self._by_recency:
            heapq.heappush(self._rheap, (alive, node.last, self._seq, key))
        if len(self._heap) + len(self._rheap) > 8 * len(self._nodes) + 128:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        leaves = [(k, n) for k, n in self._nodes.items() if n.seq >= 0]
        heap = [(0 if n.dead else 1, n.score, n.seq, k) for k, n in leaves] if self._by_score else []
        heapq.heapify(heap)
        self._heap = heap
        rheap = [(0 if n.dead else 1, n.last, n.seq, k) for k, n in leaves] if self._by_recency else []
        heapq.heapify(rheap)
        self._rheap = rheap

    def _supersede_sibling(self, parent: Key, key: Key) -> None:
        """``key`` is a new child of ``parent``: the previous newest child, if it is a leaf that was
        never read after its insertion, has most likely been replaced (a conversation's partial last
        chunk is followed, next turn, by the full chunk that starts with the same tokens): evict it
        before other live leaves."""
        prev = self._newest_kid.get(parent)
        self._newest_kid[parent] = key
        pn = self._nodes.get(prev) if prev is not None else None
        if pn is not None and pn.fresh and pn.seq >= 0:
            pn.score = 0.0
            pn.last = -1
            self._push(prev, pn)

    def _set_dead(self, root: Key, dead: bool) -> None:
        """Mark ``root``'s resident subtree dead or alive; re-push its leaves (rare path)."""
        stack = [root]
        while stack:
            key = stack.pop()
            node = self._nodes[key]
            if node.dead != dead:
                node.dead = dead
                if node.seq >= 0:
                    self._push(key, node)
            stack.extend(self._kids.get(key, ()))

    # -- interface ---------------------------------------------------------------------------------

    def admit(self, key: Key, size: int, parent: Key | None = None) -> bool:
        return not (self._reject_orphans and parent not in (None, ROOT_KEY) and parent not in self._nodes)

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self._nodes:
            self.touch(key)
            return
        if parent == ROOT_KEY:  # the fixed root of every chain is never stored: chunk 0 is a root
            parent = None
        w = self._tick()
        node = _Node(parent, self._ghost.pop(key, 0.0) + w, self._count)
        self._nodes[key] = node
        if parent is not None:
            kids = self._kids.get(parent)
            if kids is None:
                self._kids[parent] = {key}
            else:
                kids.add(key)
            pnode = self._nodes.get(parent)
            if pnode is not None:
                pnode.seq = -1  # no longer a leaf: its heap entry goes stale
                if self._supersede:
                    self._supersede_sibling(parent, key)
                node.dead = pnode.dead
            elif self._track_orphans:
                node.dead = True
        kids = self._kids.get(key)
        if not kids:
            self._push(key, node)
        elif not node.dead:
            # Re-inserted above resident children (orphans until now): they are alive again.
            for kid in kids:
                if self._nodes[kid].dead:
                    self._set_dead(kid, False)

    def touch(self, key: Key) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        node.score += self._tick()
        node.last = self._count
        node.fresh = False
        if node.seq >= 0:
            self._push(key, node)

    def remove(self, key: Key) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        if self._ghost_factor > 0:
            self._ghost[key] = node.score
            limit = self._ghost_factor * max(len(self._nodes), 16)
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)
        self._newest_kid.pop(key, None)
        parent = node.parent
        if parent is not None:
            kids = self._kids[parent]
            kids.discard(key)
            if not kids:
                del self._kids[parent]
                pnode = self._nodes.get(parent)
                if pnode is not None:
                    self._push(parent, pnode)  # became a leaf
        if self._track_orphans:
            for kid in self._kids.get(key, ()):
                self._set_dead(kid, True)

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        nodes = self._nodes
        by_recency = self.order == "recency"
        heap = self._rheap if by_recency else self._heap
        found = lazy_heap_victim(heap, lambda e: (n := nodes.get(e[3])) is not None and n.seq == e[2], skip)
        if found is None and nodes:
            # Every evictable leaf is pinned: fall back to the lowest-scored unpinned key anywhere
            # (O(n), only reached when pins cover all leaves).
            best = None
            for k, n in nodes.items():
                if skip is None or not skip(k):
                    rank = (not n.dead, n.last if by_recency else n.score)
                    if best is None or rank < best[0]:
                        best = (rank, k)
            found = None if best is None else best[1]
        return found
