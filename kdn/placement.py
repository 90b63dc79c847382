"""Which edges own a chunk key: a weighted consistent-hash ring, R distinct replicas, bounded load.

Why a ring and not rendezvous (HRW) hashing: HRW costs O(N) hashes per lookup, so a Python lookup
over 100 edges is ~100x slower than the ring's one binary search, and the goal is >= 500k lookups
per second; a batched ring lookup is one ``numpy.searchsorted``. The ring's drawbacks are handled
by construction: enough virtual nodes per unit of weight (default 1000) that a joining node takes
within a few percent of its fair ``1/(N+1)`` share, and keys only ever move *to* the joining node;
weights are honoured by giving a node ``round(vnodes * weight)`` points.

Hash points are 64-bit unsigned integers. Chunk keys (:data:`kdn.keys.ChunkKey`, 32-byte BLAKE2b
digests) are already uniform, so a 32-byte ``bytes`` key's first 8 bytes (big-endian) *are* its
point, no rehash. Any other key (other lengths, ``str``) is hashed with BLAKE2b-64. Virtual node
points are BLAKE2b-64 of ``node_id \\0 index``. Nothing uses Python's ``hash()``, so every process
on every machine computes the same owners for the same membership, whatever ``PYTHONHASHSEED``.

:class:`BoundedLoadPlacement` adds consistent hashing with bounded loads (Mirrokni, Thorup,
Zadimoghaddam, SODA'18): each node may hold at most ``ceil(c * (assigned + 1) * w / W)`` keys
(weight ``w`` of total ``W``); a key goes to the first node along its preference list that has room.

Neither class is thread-safe; membership changes rebuild the ring (O(points log points)).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kdn.errors import InvalidInput
from kdn.keys import KEY_BYTES

__all__ = ["BoundedLoadPlacement", "Node", "Placement", "bounded_capacity", "key_point"]

DEFAULT_VNODES = 1000


@dataclass(frozen=True, slots=True)
class Node:
    """A member of the overlay. ``weight`` scales its share of keys; addresses are the caller's."""

    node_id: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise InvalidInput(f"node_id must be a non-empty string, got {self.node_id!r}")
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight > 0):
            raise InvalidInput(f"node weight must be a finite number > 0, got {self.weight!r}")


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def key_point(key: bytes | str) -> int:
    """The key's point on the ring (uint64): a chunk key's first 8 bytes, else BLAKE2b-64."""
    if isinstance(key, str):
        return _h64(key.encode())
    if isinstance(key, (bytes, bytearray, memoryview)):
        key = bytes(key)
        return int.from_bytes(key[:8], "big") if len(key) == KEY_BYTES else _h64(key)
    raise InvalidInput(f"placement keys are bytes or str, got {type(key).__name__}")


def _points_of(keys: Sequence[bytes | str]) -> np.ndarray:
    """Ring points of ``keys`` as a uint64 array, shape (len(keys),)."""
    if keys and all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
        return np.frombuffer(b"".join(k[:8] for k in keys), dtype=">u8").astype(np.uint64)
    return np.fromiter((key_point(k) for k in keys), dtype=np.uint64, count=len(keys))


class Placement:
    """A weighted consistent-hash ring: ``owners(key, r)`` gives r distinct nodes in preference order.

    Preference order is the order in which distinct nodes' virtual points follow the key's point
    clockwise. ``exclude`` (down nodes) is skipped, so a down node's keys go to each key's next
    owner and come back when it returns, without any other key moving.
    """

    def __init__(self, nodes: Iterable[Node] = (), *, vnodes: int = DEFAULT_VNODES) -> None:
        if not isinstance(vnodes, int) or vnodes < 1:
            raise InvalidInput(f"vnodes must be an int >= 1, got {vnodes!r}")
        self._vnodes = vnodes
        self._nodes: dict[str, Node] = {}
        for node in nodes:
            self._nodes[node.node_id] = node
        self._rebuild()

    # -- membership --------------------------------------------------------------------------------

    @property
    def nodes(self) -> tuple[Node, ...]:
        return tuple(self._nodes.values())

    @property
    def vnodes(self) -> int:
        return self._vnodes

    def add(self, node: Node) -> None:
        """Add ``node``, or change the weight of the member with its id."""
        if not isinstance(node, Node):
            raise InvalidInput(f"expected a Node, got {type(node).__name__}")
        if self._nodes.get(node.node_id) == node:
            return
        self._nodes[node.node_id] = node
        self._rebuild()

    def remove(self, node_id: str) -> None:
        """Remove a member; unknown ids are ignored (marking down twice is harmless)."""
        if self._nodes.pop(node_id, None) is not None:
            self._rebuild()

    def weight(self, node_id: str) -> float:
        return self._nodes[node_id].weight

    @property
    def total_weight(self) -> float:
        return self._total_weight

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def _rebuild(self) -> None:
        ids = sorted(self._nodes)  # node index = position in the sorted ids: deterministic
        self._total_weight = sum(n.weight for n in self._nodes.values())
        self._ids: list[str] = ids
        self._ids_arr = np.array(ids, dtype=object)
        pts: list[int] = []
        own: list[int] = []
        for idx, node_id in enumerate(ids):
            count = max(1, round(self._vnodes * self._nodes[node_id].weight))
            prefix = node_id.encode() + b"\0"
            pts.extend(_h64(prefix + str(i).encode()) for i in range(count))
            own.extend([idx] * count)
        points = np.array(pts, dtype=np.uint64)
        owner = np.array(own, dtype=np.int32)
        order = np.lexsort((owner, points))  # by point, ties by node index: deterministic
        self._points = points[order]  # (P,) uint64, sorted
        self._owner = owner[order]  # (P,) node index of each point
        self._points_list: list[int] = self._points.tolist()  # for bisect on single keys
        self._owner_list: list[int] = self._owner.tolist()
        self._succ: dict[int, np.ndarray] = {}  # r -> (P, min(r, N)) distinct successors, lazily

    # -- lookups -----------------------------------------------------------------------------------

    def _walk(self, point: int) -> Iterator[int]:
        """Distinct node indices in preference order from ``point``."""
        n = len(self._points_list)
        if not n:
            return
        start = bisect_right(self._points_list, point)
        seen: set[int] = set()
        total = len(self._ids)
        owner = self._owner_list
        for j in range(start, start + n):
            idx = owner[j % n] if j >= n else owner[j]
            if idx not in seen:
                seen.add(idx)
                yield idx
                if len(seen) == total:
                    return

    def preference(self, key: bytes | str, *, exclude: Collection[str] = ()) -> Iterator[str]:
        """Every member, once, in ``key``'s preference order, skipping ``exclude`` (lazy)."""
        ids = self._ids
        for idx in self._walk(key_point(key)):
            node_id = ids[idx]
            if node_id not in exclude:
                yield node_id

    def owners(self, key: bytes | str, r: int = 1, *, exclude: Collection[str] = ()) -> list[str]:
        """The first ``r`` distinct non-excluded nodes for ``key`` (fewer if there are not enough)."""
        if r < 1:
            raise InvalidInput(f"r must be >= 1, got {r}")
        if exclude:
            out: list[str] = []
            for node_id in self.preference(key, exclude=exclude):
                out.append(node_id)
                if len(out) == r:
                    break
            return out
        points = self._points_list
        n = len(points)
        if not n:
            return []
        if type(key) is bytes and len(key) == KEY_BYTES:  # fast path for chunk keys
            point = int.from_bytes(key[:8], "big")
        else:
            point = key_point(key)
        i = bisect_right(points, point)
        owner, ids = self._owner_list, self._ids
        if r == 1:
            return [ids[owner[i if i < n else 0]]]
        m = min(r, len(ids))
        found: list[int] = []
        while len(found) < m:
            idx = owner[i % n]
            if idx not in found:
                found.append(idx)
            i += 1
        return [ids[idx] for idx in found]

    def _successors(self, r: int) -> np.ndarray:
        """(P, min(r, N)) int32: for each ring position, the first r distinct node indices."""
        table = self._succ.get(r)
        if table is None:
            n, m = len(self._points_list), min(r, len(self._ids))
            table = np.empty((n, m), dtype=np.int32)
            owner = self._owner_list
            for pos in range(n):
                row: list[int] = []
                j = pos
                while len(row) < m:
                    idx = owner[j % n]
                    if idx not in row:
                        row.append(idx)
                    j += 1
                table[pos] = row
            self._succ[r] = table
        return table

    def owners_batch(self, keys: Sequence[bytes | str], r: int = 1) -> np.ndarray:
        """Owners of many keys at once: an array of node ids, shape (len(keys), min(r, N)).

        Row i equals ``owners(keys[i], r)``. Vectorised (one ``searchsorted``); for r > 1 the first
        call per r after a membership change builds a successor table (O(points * r)).
        """
        if r < 1:
            raise InvalidInput(f"r must be >= 1, got {r}")
        if not self._ids:
            return np.empty((len(keys), 0), dtype=object)
        pts = _points_of(keys)  # (K,) uint64
        pos = np.searchsorted(self._points, pts, side="right")  # (K,)
        pos[pos == len(self._points)] = 0
        if r == 1:
            idx = self._owner[pos][:, None]  # (K, 1)
        else:
            idx = self._successors(r)[pos]  # (K, min(r, N))
        return self._ids_arr[idx]


def bounded_capacity(c: float, assigned: int, weight: float, total_weight: float) -> int:
    """The bounded-load rule: the most a node of ``weight`` (of ``total_weight``) may hold when
    ``assigned`` items are placed plus one: ``ceil(c * (assigned + 1) * weight / total_weight)``.
    Used for keys by :class:`BoundedLoadPlacement` and for requests by the edge's overlay (a hot
    key's reads spread over its replicas)."""
    return math.ceil(c * (assigned + 1) * weight / total_weight - 1e-9)  # tolerate float noise


class BoundedLoadPlacement:
    """Consistent hashing with bounded loads over a :class:`Placement`.

    ``assign(key)`` gives the key to the first node in its preference list whose load is below its
    capacity ``ceil(c * (assigned + 1) * weight / total_weight)``, so with ``c = 1.05`` no node ever
    holds more than ~1.05x its fair share. Assignments are sticky until ``release``; a node joining
    moves nothing (new keys fill it), a node leaving has its keys re-assigned along their lists.
    """

    def __init__(self, nodes: Iterable[Node] = (), *, c: float = 1.05, vnodes: int = DEFAULT_VNODES) -> None:
        if not (math.isfinite(c) and c >= 1.0):
            raise InvalidInput(f"bounded-load factor c must be >= 1, got {c!r}")
        self.c = c
        self.ring = Placement(nodes, vnodes=vnodes)
        self._where: dict[bytes | str, str] = {}
        self._load: dict[str, int] = {n.node_id: 0 for n in self.ring.nodes}

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.ring.nodes

    @property
    def loads(self) -> dict[str, int]:
        return dict(self._load)

    def capacity(self, node_id: str, assigned: int | None = None) -> int:
        """Most keys ``node_id`` may hold when ``assigned`` keys (default: now) are placed plus one."""
        m = len(self._where) if assigned is None else assigned
        return bounded_capacity(self.c, m, self.ring.weight(node_id), self.ring.total_weight)

    def add(self, node: Node) -> None:
        self.ring.add(node)
        self._load.setdefault(node.node_id, 0)

    def remove(self, node_id: str) -> None:
        """Drop a member and re-assign its keys to their next owners with room."""
        if node_id not in self.ring:
            return
        self.ring.remove(node_id)
        del self._load[node_id]
        moved = [k for k, n in self._where.items() if n == node_id]
        for k in moved:
            del self._where[k]
        for k in moved:
            self.assign(k)

    def owner(self, key: bytes | str) -> str | None:
        return self._where.get(key)

    def assign(self, key: bytes | str) -> str:
        """The node holding ``key``, placing it first if needed. Raises if there are no nodes."""
        where = self._where.get(key)
        if where is not None:
            return where
        if not len(self.ring):
            raise InvalidInput("no nodes to assign keys to")
        scale = self.c * (len(self._where) + 1) / self.ring.total_weight
        weight, load = self.ring.weight, self._load
        for node_id in self.ring.preference(key):
            if load[node_id] < math.ceil(scale * weight(node_id) - 1e-9):
                self._where[key] = node_id
                self._load[node_id] += 1
                return node_id
        raise AssertionError("bounded load: capacities sum to >= c * (m + 1), some node has room")

    def release(self, key: bytes | str) -> None:
        node_id = self._where.pop(key, None)
        if node_id is not None:
            self._load[node_id] -= 1

    def __len__(self) -> int:
        return len(self._where)
