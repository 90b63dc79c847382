"""Egress links: each site has one, shared by the transfers it sends, in one of two modes.

``fifo`` (:class:`Links`): transfers are served first come first served. A transfer that becomes
ready at ``ready`` on a link busy until ``busy`` starts at ``max(ready, busy)`` and holds the link
for ``nbytes / bandwidth``; that is the Lindley recursion of a FIFO queue, so a transfer's finish
time is known the moment it is committed and needs no event.

``fair`` (:class:`FairLinks`): processor sharing, as TCP flows share a bottleneck: ``k`` active
transfers each get ``bandwidth / k``. Kept exactly with a virtual clock (each flow's virtual finish
is its join time's virtual time plus its bytes; virtual time runs at ``bandwidth / k``), and a new
transfer's finish, given the flows already on the link and no later ones, is in closed form:
``join + (nbytes + sum(min(left_i, nbytes))) / bandwidth``. A finish is fixed when the transfer is
committed; a later transfer slows the flows it joins in the link's own accounting (they leave it
later, so the link stays busy longer for whoever comes next), not in figures already reported.

Both take the transfer's round-trip time and congestion window (:mod:`kdn.simulator.tcp`): the
last byte is sent ``rounds_s(nbytes, rtt, rate, cwnd)`` after the start, where ``rate`` is the
link (fifo) or the flow's fair share at its start (fair); a cold connection starts one RTT later
(the handshake). With ``rtt = 0`` (or an infinite window) both reduce to bytes over bandwidth.

Predicting (``finish``) and committing (``commit``) give the same number as long as nothing else is
committed in between, which is what lets the fetch-or-recompute rule use exact predictions.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kdn.simulator.tcp import TcpModel

__all__ = ["FairLinks", "LINK_MODES", "Links", "make_links"]

INF = float("inf")
LINK_MODES = ("fifo", "fair")


class Links:
    """FIFO links (see the module docstring)."""

    __slots__ = ("busy", "bw", "sent_bytes", "tcp")

    def __init__(self, bandwidth_Bps: Sequence[float], tcp: TcpModel | None = None) -> None:
        self.bw = [float(b) for b in bandwidth_Bps]
        self.busy = [0.0] * len(self.bw)
        self.sent_bytes = [0.0] * len(self.bw)
        self.tcp = tcp if tcp is not None else TcpModel()

    def finish(self, site: int, ready: float, nbytes: float, rtt: float = 0.0, cwnd: float = INF, cold: bool = False) -> float:
        """When the last byte would leave ``site``'s link, without taking the link."""
        if cold:
            ready += rtt
        b = self.busy[site]
        start = b if b > ready else ready
        if rtt <= 0.0 or cwnd == INF:
            return start + nbytes / self.bw[site]
        return start + self.tcp.rounds_s(nbytes, rtt, self.bw[site], cwnd)

    def commit(self, site: int, ready: float, nbytes: float, rtt: float = 0.0, cwnd: float = INF, cold: bool = False) -> float:
        """Queue the transfer on the link; returns when its last byte leaves."""
        if cold:
            ready += rtt
        b = self.busy[site]
        start = b if b > ready else ready
        ser = nbytes / self.bw[site]
        self.busy[site] = start + ser
        self.sent_bytes[site] += nbytes
        if rtt <= 0.0 or cwnd == INF:
            return start + ser
        return start + self.tcp.rounds_s(nbytes, rtt, self.bw[site], cwnd)


class FairLinks:
    """Processor-sharing links (see the module docstring)."""

    __slots__ = ("bw", "sent_bytes", "tcp", "_flows", "_vt", "_t", "_seq", "left_at", "extra")

    def __init__(self, bandwidth_Bps: Sequence[float], tcp: TcpModel | None = None, *, record: bool = False) -> None:
        self.bw = [float(b) for b in bandwidth_Bps]
        self.sent_bytes = [0.0] * len(self.bw)
        self.tcp = tcp if tcp is not None else TcpModel()
        n = len(self.bw)
        self._flows: list[list[tuple[float, int, float]]] = [[] for _ in range(n)]  # heap of (virtual finish, flow id, joined)
        self._vt = [0.0] * n  # virtual time (bytes served per flow so far)
        self._t = [0.0] * n  # real time the virtual clock was last advanced to
        self._seq = 0
        # with ``record``: flow id -> real time its last byte left, as later flows made it (not
        # the figure returned at commit); ``settle`` completes it
        self.left_at: dict[int, float] | None = {} if record else None
        self.extra: dict[int, float] | None = {} if record else None  # flow id -> its window-limited seconds

    def _advance(self, site: int, t: float) -> None:
        flows = self._flows[site]
        t0 = self._t[site]
        if t <= t0:
            return
        vt = self._vt[site]
        bw = self.bw[site]
        left_at = self.left_at
        while flows:
            k = len(flows)
            dt = (flows[0][0] - vt) * k / bw  # until the smallest flow is done
            if t0 + dt > t:
                vt += (t - t0) * bw / k
                break
            t0 += dt
            vt, fid, _ = heapq.heappop(flows)
            if left_at is not None:
                left_at[fid] = t0
        self._vt[site] = vt
        self._t[site] = t

    def settle(self, site: int) -> None:
        """Run ``site``'s link until every flow on it has left (fills :attr:`left_at`)."""
        self._advance(site, INF)

    def _finish(self, site: int, ready: float, nbytes: float, rtt: float, cwnd: float, cold: bool) -> tuple[float, float]:
        """``(end of its share of the link's bytes, extra seconds its window held it back)``."""
        if cold:
            ready += rtt
        self._advance(site, ready)
        # Requests reach a link out of order (each comes from its own distance), so ``ready`` may
        # lie before the link's clock. Such a transfer starts at its own ``ready`` and shares the
        # link only with the flows that had joined by then (with what they have left now: a
        # slight underestimate of their bytes); flows that joined later are not counted.
        flows = self._flows[site]
        vt = self._vt[site]
        bw = self.bw[site]
        shared = nbytes
        sharing = 0
        for v, _, joined in flows:
            if joined <= ready:
                left = v - vt
                shared += left if left < nbytes else nbytes
                sharing += 1
        end = ready + shared / bw
        if rtt > 0.0 and cwnd != INF:
            share = bw / (sharing + 1)
            return end, self.tcp.rounds_s(nbytes, rtt, share, cwnd) - nbytes / share  # rounds spent window-limited
        return end, 0.0

    def finish(self, site: int, ready: float, nbytes: float, rtt: float = 0.0, cwnd: float = INF, cold: bool = False) -> float:
        """When the last byte would leave ``site``'s link, without taking the link."""
        end, extra = self._finish(site, ready, nbytes, rtt, cwnd, cold)
        return end + extra

    def commit(self, site: int, ready: float, nbytes: float, rtt: float = 0.0, cwnd: float = INF, cold: bool = False) -> float:
        """Add the transfer to the link's flows; returns when its last byte leaves (given the
        flows on the link now; its id is ``self.last_id``)."""
        end, extra = self._finish(site, ready, nbytes, rtt, cwnd, cold)
        self._seq += 1
        heapq.heappush(self._flows[site], (self._vt[site] + nbytes, self._seq, ready + rtt if cold else ready))
        self.sent_bytes[site] += nbytes
        if self.extra is not None:
            self.extra[self._seq] = extra
        return end + extra

    @property
    def last_id(self) -> int:
        """The id of the last committed flow (a key of :attr:`left_at`)."""
        return self._seq


def make_links(mode: str, bandwidth_Bps: Sequence[float], tcp: TcpModel | None = None) -> Links | FairLinks:
    if mode == "fifo":
        return Links(bandwidth_Bps, tcp)
    if mode == "fair":
        return FairLinks(bandwidth_Bps, tcp)
    raise ValueError(f"unknown link mode {mode!r}; known: {', '.join(LINK_MODES)}")
