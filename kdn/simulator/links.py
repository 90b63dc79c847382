"""Egress links: each site has one, shared by the transfers it sends, in one of two modes.

``fair`` (:class:`FairLinks`, the default): processor sharing, as TCP flows share a bottleneck:
``k`` flows on a link each get ``bandwidth / k``, and a flow's finish time changes whenever
another flow joins or leaves its link. Kept exactly with a virtual clock (virtual time runs at
``bandwidth / k``; a flow leaves when the virtual time reaches its join's virtual time plus its
bytes), advanced in time order over joins and departures. A committed flow that has not joined
yet (its request is still travelling to the source, or it is opening a connection) waits in a
pending heap until the link's clock reaches its join time, so flows committed out of time order
(requests from different distances) still join in time order.

A flow's figure is final only once the link's clock has passed its departure with every flow that
can join before it: the caller advances a link (:meth:`FairLinks.advance`) only to times no later
join can precede (the event loop's now: every join is at or after the request that makes it), and
:meth:`FairLinks.settle` runs a link to the end. Each committed flow carries a :class:`Flow`
record: ``predicted`` (the finish given the flows committed so far and no later ones, what the
fetch-or-recompute rule is told) and ``finish`` (the real one, set when the flow leaves).

``fifo`` (:class:`Links`): transfers are served first come first served, in commit order. A
transfer ready at ``ready`` on a link busy until ``busy`` starts at ``max(ready, busy)`` and holds
the link for ``nbytes / bandwidth`` (the Lindley recursion of a FIFO queue): later transfers never
change an earlier one's finish, so ``predicted`` and ``finish`` are equal at commit.

Both take the transfer's round-trip time and congestion window (:mod:`kdn.simulator.tcp`). A cold
connection starts one RTT later (the handshake). On a fair link a flow in slow start sends less
than its share: the time its window wastes (:meth:`~kdn.simulator.tcp.TcpModel.slow_start`'s
rounds less the time their bytes would take at its share, the share of the flows on the link and
of all those committed to start on it) passes before it takes its share with all its bytes. So every byte goes through the processor sharing (the
link's capacity is conserved), the other flows have the link meanwhile, and a flow alone on its
link finishes exactly as the one-connection model says. On a fifo link the rounds are added to
the link's serialisation time. With ``rtt = 0`` (or an infinite window) both reduce to bytes over
bandwidth.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kdn.simulator.tcp import TcpModel

__all__ = ["FairLinks", "Flow", "LINK_MODES", "Links", "make_links"]

INF = float("inf")
LINK_MODES = ("fifo", "fair")


class Flow:
    """One committed transfer: ``predicted`` when its last byte leaves the link given the flows
    committed before it and no later ones; ``finish`` when it really does (None until known);
    ``rate`` the share it was given when it started (what its window grows against)."""

    __slots__ = ("predicted", "finish", "rate", "start", "nbytes", "rtt", "cwnd", "join", "seq")

    def __init__(self, predicted: float, rate: float, finish: float | None = None) -> None:
        self.predicted = predicted
        self.finish = finish
        self.rate = rate
        self.start = 0.0  # when its first byte could leave (after the handshake)
        self.nbytes = 0.0
        self.rtt = 0.0
        self.cwnd = INF
        self.join = 0.0  # when it takes its share of the link (after the time its window wasted)
        self.seq = 0

    @property
    def delay(self) -> float:
        """Seconds later than predicted it finished (0 until it is known)."""
        return 0.0 if self.finish is None else self.finish - self.predicted

    def __repr__(self) -> str:
        return f"Flow(predicted={self.predicted}, finish={self.finish})"


class Links:
    """FIFO links (see the module docstring)."""

    __slots__ = ("busy", "bw", "sent_bytes", "tcp", "last")

    def __init__(self, bandwidth_Bps: Sequence[float], tcp: TcpModel | None = None) -> None:
        self.bw = [float(b) for b in bandwidth_Bps]
        self.busy = [0.0] * len(self.bw)
        self.sent_bytes = [0.0] * len(self.bw)
        self.tcp = tcp if tcp is not None else TcpModel()
        self.last: Flow | None = None  # the last committed transfer's record

    def finish(self, site: int, ready: float, nbytes: float, rtt: float = 0.0, cwnd: float = INF, cold: bool = False) -> float:
        """When the last byte would leave ``site``'s link, without taking the link."""
        if cold:
            ready += rtt
        b = self.busy[site]
        start = b if b > ready else ready
        if rtt <= 0.0 or cwnd == INF:
            return start + nbytes / self.bw[site]
        return start + self.tcp.rounds_s(nbytes, rtt, self.bw[site], cwnd)

    def commit(
        self, site: int, ready: float, nbytes: float, rtt: float = 0.0, cwnd: float = INF, cold: bool = False, predict: bool = True
    ) -> float:
        """Queue the transfer on the link; returns when its last byte leaves (final: a FIFO link
        never delays a transfer already queued; ``predict`` changes nothing here)."""
        if cold:
            ready += rtt
        b = self.busy[site]
        start = b if b > ready else ready
        ser = nbytes / self.bw[site]
        self.busy[site] = start + ser
        self.sent_bytes[site] += nbytes
        end = start + ser if rtt <= 0.0 or cwnd == INF else start + self.tcp.rounds_s(nbytes, rtt, self.bw[site], cwnd)
        self.last = Flow(end, self.bw[site], end)
        return end

    def advance(self, site: int, t: float) -> None:
        """Nothing to do: a FIFO link's figures are final at commit."""

    def settle(self, site: int | None = None) -> None:
        """Nothing to do (see :meth:`advance`)."""


class FairLinks:
    """Processor-sharing links (see the module docstring)."""

    __slots__ = ("bw", "sent_bytes", "tcp", "_flows", "_pending", "_vt", "_t", "_seq", "last")

    def __init__(self, bandwidth_Bps: Sequence[float], tcp: TcpModel | None = None) -> None:
        self.bw = [float(b) for b in bandwidth_Bps]
        self.sent_bytes = [0.0] * len(self.bw)
        self.tcp = tcp if tcp is not None else TcpModel()
        n = len(self.bw)
        self._flows: list[list[tuple[float, int, Flow]]] = [[] for _ in range(n)]  # heap of (virtual finish, seq, flow)
        self._pending: list[list[tuple[float, int, Flow]]] = [[] for _ in range(n)]  # heap of (join time, seq, flow)
        self._vt = [0.0] * n  # virtual time: bytes served to each flow on the link so far
        self._t = [0.0] * n  # real time the link's clock has been advanced to
        self._seq = 0
        self.last: Flow | None = None  # the last committed flow's record

    def advance(self, site: int, t: float) -> None:
        """Run ``site``'s link to time ``t``: joins and departures up to ``t``, in time order.
        The caller promises that no flow committed later starts before ``t``."""
        t0 = self._t[site]
        if t <= t0:
            return
        flows = self._flows[site]
        pending = self._pending[site]
        if not flows and not pending:
            self._t[site] = t
            return
        vt = self._vt[site]
        bw = self.bw[site]
        while flows or pending:
            k = len(flows)
            dep = t0 + (flows[0][0] - vt) * k / bw if k else INF
            join = pending[0][0] if pending else INF
            if dep <= join:
                if dep > t:
                    break
                vt = flows[0][0]
                t0 = dep
                heapq.heappop(flows)[2].finish = dep
            else:
                if join > t:
                    break
                if k:
                    vt += (join - t0) * bw / k
                t0 = join
                _, seq, flow = heapq.heappop(pending)
                heapq.heappush(flows, (vt + flow.nbytes, seq, flow))
        if t == INF:  # settled: nothing is left on the link; its clock stays at the last departure
            t = t0
        elif flows:
            vt += (t - t0) * bw / len(flows)
        self._vt[site] = vt
        self._t[site] = t

    def settle(self, site: int | None = None) -> None:
        """Run ``site``'s link (every link if None) until every flow on it has left: every
        :attr:`Flow.finish` is then known."""
        for s in range(len(self.bw)) if site is None else (site,):
            self.advance(s, INF)

    def _new(self, site: int, ready: float, nbytes: float, rtt: float, cwnd: float, cold: bool) -> Flow:
        f = Flow(0.0, self.bw[site])
        f.start = (ready + rtt if cold else ready)
        if f.start < self._t[site]:
            f.start = self._t[site]
        f.nbytes = nbytes
        f.rtt = rtt
        f.cwnd = cwnd
        f.join = f.start
        return f

    def _joins(self, site: int, new: Flow) -> list[tuple[float, float, Flow]]:
        """``(join, rate, flow)`` of every flow not yet on ``site``'s link and of ``new``: a flow
        wastes, before it takes its share, the slow-start time its window held it below its
        share of the link, the share of the flows on the link and all those committed to start
        on it (one share for all of them, so flows alike start alike and keep their order)."""
        pending = self._pending[site]
        bw = self.bw[site]
        tcp = self.tcp
        if not pending:
            if new.rtt <= 0.0 or new.cwnd == INF:
                return [(new.start, bw, new)]
            rate = bw / (len(self._flows[site]) + 1)
            t_ss, sent = tcp.slow_start(new.nbytes, new.rtt, rate, new.cwnd)
            return [(new.start + t_ss - sent / rate, rate, new)]
        flows = [p[2] for p in pending]
        flows.append(new)
        rate = bw / (len(self._flows[site]) + len(flows))
        out = []
        for f in flows:
            if f.rtt <= 0.0 or f.cwnd == INF:
                out.append((f.start, bw, f))
                continue
            t_ss, sent = tcp.slow_start(f.nbytes, f.rtt, rate, f.cwnd)
            out.append((f.start + t_ss - sent / rate, rate, f))
        return out

    def _predict(self, site: int, joins: list[tuple[float, float, Flow]], target: Flow) -> float:
        """When ``target`` would leave, given the flows on the link, ``joins`` and no later ones
        (processor sharing run forward on a copy of the link's state)."""
        flows = self._flows[site]
        bw = self.bw[site]
        t0 = self._t[site]
        if not flows and len(joins) == 1:
            return joins[0][0] + target.nbytes / bw
        act = [(v, s) for v, s, _ in flows]  # a heap already, as a copy
        order = sorted((j, -1 if f is target else f.seq, f.nbytes) for j, _, f in joins)
        vt = self._vt[site]
        i = 0
        nj = len(order)
        while True:
            k = len(act)
            dep = t0 + (act[0][0] - vt) * k / bw if k else INF
            nxt = order[i][0] if i < nj else INF
            if dep <= nxt:
                vt = act[0][0]
                t0 = dep
                if heapq.heappop(act)[1] == -1:
                    return dep
            else:
                if k:
                    vt += (nxt - t0) * bw / k
                t0 = nxt
                _, s, n = order[i]
                i += 1
                heapq.heappush(act, (vt + n, s))

    def finish(self, site: int, ready: float, nbytes: float, rtt: float = 0.0, cwnd: float = INF, cold: bool = False) -> float:
        """When the last byte would leave ``site``'s link given the flows committed so far (and
        no later ones), without taking the link."""
        new = self._new(site, ready, nbytes, rtt, cwnd, cold)
        return self._predict(site, self._joins(site, new), new)

    def commit(
        self, site: int, ready: float, nbytes: float, rtt: float = 0.0, cwnd: float = INF, cold: bool = False, predict: bool = True
    ) -> float:
        """Add the transfer to the link's flows; returns its predicted finish (what :meth:`finish`
        said just before; NaN with ``predict=False``, for a transfer no one waits on). Its record
        is :attr:`last`; later flows can still delay it."""
        new = self._new(site, ready, nbytes, rtt, cwnd, cold)
        joins = self._joins(site, new)
        new.predicted = self._predict(site, joins, new) if predict else float("nan")
        self._seq += 1
        new.seq = self._seq
        if len(joins) == 1:
            j, rate, f = joins[0]
            f.join = j
            f.rate = rate
            self._pending[site] = [(j, f.seq, f)]
        else:
            pending = []
            for j, rate, f in joins:
                f.join = j
                f.rate = rate
                pending.append((j, f.seq, f))
            heapq.heapify(pending)
            self._pending[site] = pending
        self.sent_bytes[site] += nbytes
        self.last = new
        return new.predicted


def make_links(mode: str, bandwidth_Bps: Sequence[float], tcp: TcpModel | None = None) -> Links | FairLinks:
    if mode == "fifo":
        return Links(bandwidth_Bps, tcp)
    if mode == "fair":
        return FairLinks(bandwidth_Bps, tcp)
    raise ValueError(f"unknown link mode {mode!r}; known: {', '.join(LINK_MODES)}")
