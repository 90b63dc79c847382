"""Eviction and admission policies for the edge's cache tiers, behind one small interface.

A policy only *orders* keys; it never holds bytes. The tier that owns the bytes (the edge's tiered
store, :class:`BoundedCache` here, the simulator's edges) tells the policy what became resident
(:meth:`EvictionPolicy.insert`), what was hit (:meth:`~EvictionPolicy.touch`) and what left
(:meth:`~EvictionPolicy.remove`), and asks it for the next key to evict
(:meth:`~EvictionPolicy.victim`), which it then removes itself. Keys are any hashable value:
``ChunkKey`` bytes in the edge, ints in the simulator and the trace replay.

Invariants every policy keeps:

* ``victim()`` never returns a key for which ``skip(key)`` is true (pinned keys), and never a key
  that is not resident; it returns ``None`` only when no resident key is evictable.
* ``victim()`` does not remove the key: the caller calls ``remove(key)`` once it has dropped it.
  Calling ``victim()`` twice without a ``remove`` returns the same key (queue-based policies may
  reorder their queues in between, which is not observable through the interface).
* Every operation is O(1) or O(log n) amortised, with n the number of resident keys, as long as
  few keys are pinned (a pinned key costs at most a constant per ``victim`` call that passes it).

Policies (registry :data:`POLICIES`, factory :func:`make_policy`):

``lru``     the baseline.
``s3fifo``  S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO with reinsertion,
            and a ghost FIFO of recently evicted keys.
``sieve``   SIEVE (Zhang et al., NSDI'24): one FIFO, a visited bit and a moving hand.
``prefix``  prefix-aware, for chained KV chunks (see :class:`PrefixAware`): evicts only leaves of the
            cached prefix forest, by frequency with dynamic aging, so a chunk is never dropped while
            chunks that depend on it stay, and shared roots survive.

:class:`Belady` (the offline optimum, which needs the future access sequence) is exported but not
registered, since no online cache can construct it.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kdn.errors import InvalidInput
from kdn.keys import ROOT_KEY

__all__ = [
    "POLICIES",
    "Belady",
    "BoundedCache",
    "CacheStats",
    "EvictionPolicy",
    "LRU",
    "PrefixAware",
    "S3FIFO",
    "Sieve",
    "make_policy",
]

Key = Hashable
SkipFn = Callable[[Any], bool]


class EvictionPolicy(ABC):
    """Orders resident keys for eviction. One instance per cache tier; not thread-safe."""

    name: ClassVar[str]

    @abstractmethod
    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        """``key`` became resident. ``parent`` is the previous chunk of its chain (None for a root)."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """A hit on resident ``key``. Unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """``key`` left the cache for any reason (evicted, deleted, expired, demoted). Idempotent."""

    @abstractmethod
    def victim(self, skip: SkipFn | None = None) -> Key | None:
        """The next key to evict, without removing it; keys with ``skip(key)`` true are passed over."""

    def admit(self, key: Key, size: int, parent: Key | None = None) -> bool:
        """Admission control: may ``key`` be inserted at all? The default admits everything."""
        return True

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


# --------------------------------------------------------------------------------------------------
# LRU


class LRU(EvictionPolicy):
    """Least recently used. An ordered dict: oldest first."""

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        for key in self._order:
            if skip is None or not skip(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


# --------------------------------------------------------------------------------------------------
# S3-FIFO


class S3FIFO(EvictionPolicy):
    """S3-FIFO: small FIFO (``small_ratio`` of resident bytes), main FIFO, ghost FIFO.

    New keys enter the small queue, or the main queue when the ghost remembers them. A key leaving
    the small queue moves to main if it was hit there at least ``move_threshold`` times, else it is
    evicted and remembered in the ghost (as many entries as are resident). A key at the head of main
    is reinserted at its tail while its frequency (capped at 3) is positive, decrementing it.
    Pinned keys met at a queue head are moved on (small -> main, main head -> main tail).
    """

    name: ClassVar[str] = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, move_threshold: int = 1, max_freq: int = 3) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise InvalidInput(f"s3fifo small_ratio must be in (0, 1), got {small_ratio}")
        self._small_ratio = small_ratio
        self._move_threshold = move_threshold
        self._max_freq = max_freq
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        self._small_bytes = 0
        self._total_bytes = 0

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self._size:
            self.touch(key)
            return
        self._size[key] = size
        self._freq[key] = 0
        self._total_bytes += size
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += size

    def touch(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None and f < self._max_freq:
            self._freq[key] = f + 1

    def remove(self, key: Key) -> None:
        size = self._size.pop(key, None)
        if size is None:
            return
        del self._freq[key]
        self._total_bytes -= size
        if key in self._small:
            del self._small[key]
            self._small_bytes -= size
            self._ghost[key] = None
            while len(self._ghost) > max(len(self._size), 1):
                self._ghost.popitem(last=False)
        else:
            del self._main[key]

    def _move_small_to_main(self, key: Key) -> None:
        del self._small[key]
        self._small_bytes -= self._size[key]
        self._main[key] = None
        self._freq[key] = 0

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        # Every step either moves a key small -> main (at most n times) or lowers a main key's
        # frequency / passes a pinned one; so (max_freq + 2) * n + 2 steps bound the loop.
        budget = (self._max_freq + 2) * len(self._size) + 2
        for _ in range(budget):
            if self._small and (self._small_bytes > self._small_ratio * self._total_bytes or not self._main):
                key = next(iter(self._small))
                if (skip is not None and skip(key)) or self._freq[key] >= self._move_threshold:
                    self._move_small_to_main(key)
                    continue
                return key
            if not self._main:
                return None
            key = next(iter(self._main))
            if skip is not None and skip(key):
                self._main.move_to_end(key)
                continue
            f = self._freq[key]
            if f > 0:
                self._freq[key] = f - 1
                self._main.move_to_end(key)
                continue
            return key
        return None

    def __len__(self) -> int:
        return len(self._size)

    def __contains__(self, key: object) -> bool:
        return key in self._size


# --------------------------------------------------------------------------------------------------
# SIEVE


class Sieve(EvictionPolicy):
    """SIEVE: a FIFO with a visited bit and a hand that sweeps from the oldest key to the newest.

    Hits only set the bit (no list move). The hand clears set bits as it passes and stops at the
    first unvisited key, which is the victim; when the hand falls off the newest end it wraps to the
    oldest. The list is a doubly linked list over dicts (``_newer``/``_older``).
    """

    name: ClassVar[str] = "sieve"

    def __init__(self) -> None:
        self._visited: dict[Key, bool] = {}
        self._newer: dict[Key, Key | None] = {}
        self._older: dict[Key, Key | None] = {}
        self._oldest: Key | None = None
        self._newest: Key | None = None
        self._hand: Key | None = None

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        if key in self._visited:
            self._visited[key] = True
            return
        self._visited[key] = False
        self._older[key] = self._newest
        self._newer[key] = None
        if self._newest is not None:
            self._newer[self._newest] = key
        else:
            self._oldest = key
        self._newest = key

    def touch(self, key: Key) -> None:
        if key in self._visited:
            self._visited[key] = True

    def remove(self, key: Key) -> None:
        if self._visited.pop(key, None) is None:
            return
        newer = self._newer.pop(key)
        older = self._older.pop(key)
        if self._hand == key:
            self._hand = newer
        if newer is not None:
            self._older[newer] = older
        else:
            self._newest = older
        if older is not None:
            self._newer[older] = newer
        else:
            self._oldest = newer

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        # Two sweeps suffice: the first clears every visited bit it meets.
        hand = self._hand
        for _ in range(2 * len(self._visited) + 1):
            if hand is None:
                hand = self._oldest
                if hand is None:
                    return None
            if skip is not None and skip(hand):
                hand = self._newer[hand]
                continue
            if self._visited[hand]:
                self._visited[hand] = False
                hand = self._newer[hand]
                continue
            self._hand = hand
            return hand
        self._hand = hand
        return None

    def __len__(self) -> int:
        return len(self._visited)

    def __contains__(self, key: object) -> bool:
        return key in self._visited


# --------------------------------------------------------------------------------------------------
# Heap-ordered policies (prefix-aware, Belady)


class _Node:
    """Per-key state of :class:`PrefixAware`."""

    __slots__ = ("parent", "score", "seq", "dead", "fresh")

    def __init__(self, parent: Key | None, score: float) -> None:
        self.parent = parent
        self.fresh = True  # not touched since it was inserted
        self.score = score  # decayed access count, in units of 2**(virtual time at the epoch)
        self.seq = -1  # sequence number of this key's live heap entry; -1 = not in the heap
        self.dead = False  # an ancestor of this key is gone: the key can never be read as a prefix


_RESCALE_AT = 256.0  # rescale scores when the virtual clock is this many half-lives past the epoch


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

    ``parent`` may be ``None`` or :data:`kdn.keys.ROOT_KEY` for a chain's first chunk. Scores count
    accesses, not bytes: chunks of one model are of similar size.

    ``victim`` is O(log n) amortised via a lazy heap of leaves (stale entries dropped on pop, the
    heap rebuilt when it holds more than ``4n`` entries).
    """

    name: ClassVar[str] = "prefix"

    def __init__(
        self,
        *,
        half_life: float = 11_000.0,
        ghost: float = 4.0,
        track_orphans: bool = True,
        reject_orphans: bool = False,
        supersede: bool = True,
    ) -> None:
        if half_life <= 0 or ghost < 0:
            raise InvalidInput(f"prefix policy: half_life must be > 0 and ghost >= 0, got {half_life}, {ghost}")
        self.half_life = half_life
        self._rate = 1.0 / half_life  # half-lives per access
        self._supersede = supersede
        self._newest_kid: dict[Key, Key] = {}  # resident parent -> its most recently inserted child
        self._ghost_factor = ghost
        self._track_orphans = track_orphans
        self._reject_orphans = reject_orphans
        self._nodes: dict[Key, _Node] = {}
        self._kids: dict[Key, set[Key]] = {}  # parent key -> resident children (parent may be absent)
        self._ghost: OrderedDict[Key, float] = OrderedDict()  # evicted key -> score when it left
        self._heap: list[tuple[int, float, int, Key]] = []  # (alive, score, seq, key), leaves only
        self._seq = 0
        self._vclock = 0.0  # virtual time in half-lives since the epoch (the last rescale)

    # -- internals ---------------------------------------------------------------------------------

    def _tick(self) -> float:
        """Advance the clock by one access; return the weight of an access now."""
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
        heapq.heappush(self._heap, (0 if node.dead else 1, node.score, self._seq, key))
        if len(self._heap) > 4 * len(self._nodes) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = [(0 if n.dead else 1, n.score, n.seq, k) for k, n in self._nodes.items() if n.seq >= 0]
        heapq.heapify(heap)
        self._heap = heap

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
        node = _Node(parent, self._ghost.pop(key, 0.0) + w)
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
        heap, nodes = self._heap, self._nodes
        aside = []
        found = None
        while heap:
            _, _, seq, key = heap[0]
            node = nodes.get(key)
            if node is None or node.seq != seq:
                heapq.heappop(heap)
                continue
            if skip is not None and skip(key):
                aside.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        if found is None and nodes:
            # Every evictable leaf is pinned: fall back to the lowest-scored unpinned key anywhere
            # (O(n), only reached when pins cover all leaves).
            best = None
            for k, n in nodes.items():
                if skip is None or not skip(k):
                    rank = (not n.dead, n.score)
                    if best is None or rank < best[0]:
                        best = (rank, k)
            found = None if best is None else best[1]
        return found

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes


class Belady(EvictionPolicy):
    """Belady's offline optimum at block level: evict the key whose next use is farthest away.

    Constructed with the full future access sequence; every ``insert``/``touch`` must follow it in
    order (one call per access), which is how the policy knows "now". Keys never used again go
    first. Not in :data:`POLICIES`: no online cache can build it.
    """

    name: ClassVar[str] = "belady"

    def __init__(self, accesses: Sequence[Key]) -> None:
        self._accesses = accesses
        n = len(accesses)
        nxt = [n] * n  # index of the next access of the same key; n = never again
        last: dict[Key, int] = {}
        for i in range(n - 1, -1, -1):
            k = accesses[i]
            nxt[i] = last.get(k, n)
            last[k] = i
        self._next = nxt
        self._pos = 0
        self._live: dict[Key, int] = {}  # key -> next use index (also its heap entry's identity)
        self._heap: list[tuple[int, Key]] = []  # (-next_use, key)

    def _advance(self, key: Key) -> int:
        i = self._pos
        if i >= len(self._accesses) or self._accesses[i] != key:
            raise InvalidInput(f"belady: access {i} is {key!r}, not the one in the sequence it was given")
        self._pos = i + 1
        return self._next[i]

    def insert(self, key: Key, size: int, parent: Key | None = None) -> None:
        self._set(key, self._advance(key))

    def touch(self, key: Key) -> None:
        nxt = self._advance(key)
        if key in self._live:
            self._set(key, nxt)

    def _set(self, key: Key, nxt: int) -> None:
        self._live[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))
        if len(self._heap) > 4 * len(self._live) + 64:
            self._heap = [(-v, k) for k, v in self._live.items()]
            heapq.heapify(self._heap)

    def remove(self, key: Key) -> None:
        self._live.pop(key, None)

    def victim(self, skip: SkipFn | None = None) -> Key | None:
        heap, live = self._heap, self._live
        aside = []
        found = None
        while heap:
            neg, key = heap[0]
            if live.get(key) != -neg:
                heapq.heappop(heap)
                continue
            if skip is not None and skip(key):
                aside.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live


# --------------------------------------------------------------------------------------------------
# Registry


POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRU, S3FIFO, Sieve, PrefixAware)}


def make_policy(name: str, **kw: Any) -> EvictionPolicy:
    """Build the policy registered as ``name`` with keyword options ``kw``.

    Raises :class:`~kdn.errors.InvalidInput` for an unknown name or options the policy does not take.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidInput(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    try:
        return cls(**kw)
    except TypeError as exc:
        raise InvalidInput(f"bad options for eviction policy {name!r}: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# A byte-budget cache driven by a policy


@dataclass(slots=True)
class CacheStats:
    """Counters of a :class:`BoundedCache` (mutable: they count)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_used: int = 0
    rejected: int = 0  # misses that admission control (or a too-large size) kept out


class BoundedCache:
    """Keys with sizes under a byte budget; ``policy`` decides what is admitted and evicted.

    Used by the eviction benchmark, the simulator and the tests. Holds no values, only sizes.
    ``bytes_used <= capacity_bytes`` after every call unless pinned keys alone exceed the budget.
    """

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy) -> None:
        if capacity_bytes < 0:
            raise InvalidInput(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.stats = CacheStats()
        self._sizes: dict[Key, int] = {}
        self._pinned: set[Key] = set()

    # counters, also reachable as attributes of the cache
    @property
    def hits(self) -> int:
        return self.stats.hits

    @property
    def misses(self) -> int:
        return self.stats.misses

    @property
    def evictions(self) -> int:
        return self.stats.evictions

    @property
    def bytes_used(self) -> int:
        return self.stats.bytes_used

    def access(self, key: Key, size: int, parent: Key | None = None) -> bool:
        """Read ``key``: True on a hit; on a miss, admit and insert it, evicting as needed."""
        if key in self._sizes:
            self.stats.hits += 1
            self.policy.touch(key)
            return True
        self.stats.misses += 1
        if size > self.capacity_bytes or not self.policy.admit(key, size, parent):
            self.stats.rejected += 1
            return False
        self._sizes[key] = size
        self.stats.bytes_used += size
        self.policy.insert(key, size, parent)
        self._shrink()
        return False

    def _shrink(self) -> None:
        skip = self._pinned.__contains__ if self._pinned else None
        while self.stats.bytes_used > self.capacity_bytes:
            key = self.policy.victim(skip)
            if key is None:
                return
            self.remove(key)
            self.stats.evictions += 1

    def remove(self, key: Key) -> bool:
        """Drop ``key`` (not counted as an eviction). False if it was not resident."""
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.stats.bytes_used -= size
        self._pinned.discard(key)
        self.policy.remove(key)
        return True

    def pin(self, key: Key) -> None:
        """Never evict resident ``key`` until :meth:`unpin`."""
        if key in self._sizes:
            self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        self._pinned.discard(key)
        self._shrink()

    def keys(self) -> Iterable[Key]:
        return self._sizes.keys()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes
