"""Overlay membership: who the members are, which are up, and who owns a key.

Members come from a static list or from a provider callable (on a Ray cluster, the registry
actor); :meth:`Overlay.refresh` re-reads the provider. Ownership is :class:`kdn.placement.Placement`
(weighted, R distinct replicas). Health is local knowledge: a member that fails a call is marked
down and skipped — its keys go to the next owners in preference order — until a backoff has
passed; then it is offered again ("half-open"): success marks it up and its keys come back, a new
failure doubles the backoff (capped).

Invariants: ``owners(key)`` is a list of distinct members in the placement's preference order for
that key, with down members left out; this node itself may be among them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from kdn.edge.clock import Clock, MonotonicClock
from kdn.placement import Node, Placement, bounded_capacity


@dataclass(frozen=True, slots=True)
class Member:
    node_id: str
    address: str
    weight: float = 1.0


MembershipProvider = Callable[[], Iterable[Member]]


@dataclass(slots=True)
class _Health:
    down_until: float = 0.0
    failures: int = 0


class Overlay:
    """Membership + health + placement for one edge node (``self_id``)."""

    def __init__(
        self,
        self_member: Member,
        members: Iterable[Member] | MembershipProvider = (),
        *,
        replicas: int,
        backoff_s: float,
        max_backoff_s: float = 60.0,
        clock: Clock | None = None,
    ) -> None:
        """``replicas``: owners per key (``EdgeConfig.replicas``); a peer marked down is offered
        again after ``backoff_s`` (``EdgeConfig.peer_backoff_s``), doubling on each further
        failure up to ``max_backoff_s``."""
        self.self_member = self_member
        self._provider: MembershipProvider | None = members if callable(members) else None
        self._static: tuple[Member, ...] = () if callable(members) else tuple(members)
        self.replicas = replicas
        self._backoff = backoff_s
        self._max_backoff = max_backoff_s
        self._clock = clock or MonotonicClock()
        self._members: dict[str, Member] = {}
        self._health: dict[str, _Health] = {}
        self._placement = Placement([])
        self._sent: dict[str, int] = {}  # requests this node sent to each peer (bounded-load counts)
        self.version = 0
        self.refresh()

    # -- membership ----------------------------------------------------------------------------

    def refresh(self) -> bool:
        """Re-read the membership; returns True when it changed."""
        listed = list(self._provider() if self._provider else self._static)
        members = {m.node_id: m for m in listed}
        members[self.self_member.node_id] = self.self_member
        if members == self._members:
            return False
        self._members = members
        self._placement = Placement([Node(m.node_id, m.weight) for m in members.values()])
        self._health = {nid: self._health.get(nid, _Health()) for nid in members}
        self._sent = {nid: n for nid, n in self._sent.items() if nid in members}
        self.version += 1
        return True

    @property
    def members(self) -> Mapping[str, Member]:
        return dict(self._members)

    @property
    def self_id(self) -> str:
        return self.self_member.node_id

    # -- health --------------------------------------------------------------------------------

    def is_up(self, node_id: str) -> bool:
        h = self._health.get(node_id)
        return h is None or h.down_until <= self._clock.monotonic()

    def down(self) -> list[str]:
        now = self._clock.monotonic()
        return [nid for nid, h in self._health.items() if h.down_until > now]

    def mark_down(self, node_id: str) -> None:
        if node_id == self.self_id or node_id not in self._health:
            return
        h = self._health[node_id]
        h.failures += 1
        h.down_until = self._clock.monotonic() + min(self._max_backoff, self._backoff * 2 ** (h.failures - 1))

    def mark_up(self, node_id: str) -> None:
        h = self._health.get(node_id)
        if h is not None:
            h.failures = 0
            h.down_until = 0.0

    # -- ownership -----------------------------------------------------------------------------

    def owners(self, key: bytes, r: int | None = None) -> list[Member]:
        """Up to ``r`` (default: replicas) live owners of ``key``, in preference order."""
        ids = self._placement.owners(bytes(key), r or self.replicas, exclude=self.down())
        return [self._members[i] for i in ids]

    def peer_owners(self, key: bytes) -> list[Member]:
        return [m for m in self.owners(key) if m.node_id != self.self_id]

    def balanced_peers(self, key: bytes, c: float) -> list[Member]:
        """The key's live peer owners, the one to ask first in front: consistent hashing with
        bounded loads (:func:`kdn.placement.bounded_capacity`) over the requests this node sent.
        The first owner in preference order whose count is under its capacity (``c`` x its
        weighted share of all requests sent to peers so far, plus one) leads; when all are at
        capacity, the least loaded does. Spread keys keep their preferred owner (everyone has
        room), while a hot key's reads move on to its other replicas instead of piling on one.
        Call :meth:`sent` for each request actually sent."""
        peers = self.peer_owners(key)
        if len(peers) < 2:
            return peers
        total = sum(self._sent.values())
        weight = sum(m.weight for nid, m in self._members.items() if nid != self.self_id)
        for i, m in enumerate(peers):
            if self._sent.get(m.node_id, 0) < bounded_capacity(c, total, m.weight, weight):
                return [m, *peers[:i], *peers[i + 1 :]]
        return sorted(peers, key=lambda m: self._sent.get(m.node_id, 0) / m.weight)

    def sent(self, node_id: str) -> None:
        self._sent[node_id] = self._sent.get(node_id, 0) + 1

    def snapshot(self) -> dict[str, object]:
        return {
            "members": {nid: m.address for nid, m in self._members.items()},
            "down": sorted(self.down()),
            "replicas": self.replicas,
            "version": self.version,
        }


def file_members(path: str | Path, weights: Mapping[str, float] | None = None) -> MembershipProvider:
    """A provider that re-reads a peers file on every refresh: JSON ``{"id": "host:port"}`` or
    lines ``id=host:port`` (``#`` comments). A missing or unreadable file keeps the last good list,
    so a half-written file never empties the overlay."""
    p = Path(path)
    last: list[Member] = []

    def read() -> list[Member]:
        nonlocal last
        try:
            text = p.read_text()
        except OSError:
            return last
        try:
            if text.lstrip().startswith("{"):
                mapping = {str(k): str(v) for k, v in json.loads(text).items()}
            else:
                mapping = {}
                for line in text.splitlines():
                    line = line.split("#", 1)[0].strip()
                    if not line:
                        continue
                    node, sep, addr = line.partition("=")
                    if not sep:
                        raise ValueError(f"bad line {line!r}")
                    mapping[node.strip()] = addr.strip()
        except ValueError:
            return last
        last = list(static_members(mapping, weights))
        return last

    return read


def static_members(peers: Mapping[str, str], weights: Mapping[str, float] | None = None) -> Sequence[Member]:
    """Members from the config's ``peers`` mapping (node_id -> host:port)."""
    weights = weights or {}
    return [Member(nid, addr, float(weights.get(nid, 1.0))) for nid, addr in peers.items()]
