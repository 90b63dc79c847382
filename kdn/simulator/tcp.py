"""Per-connection TCP: how long ``n`` bytes take over a path of round-trip time ``rtt`` whose
bottleneck gives the flow ``rate`` bytes/s, starting from congestion window ``cwnd``.

The model (slow start with an initial window, the window doubling once per round trip, rate
limited once it fills the pipe; Linux's defaults: 10 segments of 1448 bytes):

* a cold connection pays one RTT for the handshake before the request can go out;
* the request and the first byte's return cost one RTT;
* then, round by round, the sender sends a window (``w`` bytes) and waits one RTT for its ACKs,
  and the window doubles, until a window covers the bandwidth-delay product ``rate x rtt``; from
  there on the rest flows at ``rate``. The last round sends what is left at ``rate``.

So ``duration = handshake + rtt + rounds x rtt + tail / rate``. With ``rtt -> 0`` it is
``n / rate``. Parallel streams each start with their own initial window: ``streams`` connections
behave as one with ``streams`` times the window.

Restart after idle follows Linux for the configured congestion control
(:attr:`TcpModel.congestion_control`): ``cubic`` (and any loss-based one: ``tcp_cwnd_restart``
with ``tcp_slow_start_after_idle``) halves the window once per retransmission timeout the
connection sat idle beyond the first, never below the initial window; the RTO of a settled
connection is its RTT plus Linux's 200 ms floor on the variance term. ``bbr`` keeps its window (it
paces at its bandwidth estimate from the first packet after idle).

:class:`Connections` is the pool of connections each (source, destination) pair holds, as a
client's connection pool does: a transfer takes an idle connection (the one with the largest
window), and a connection that is busy, opening or carrying another transfer, is never handed to a
second one: that transfer opens its own (cold). A connection is busy until the last byte of its
transfer is at the client, known once the source's link has run past it
(:class:`kdn.simulator.links.Flow`).

Checked against real Linux TCP in network namespaces (a tbf-shaped 100 Mbit/s link and a delay
line, :mod:`kdn.simulator.netlab`), end to end through the engine's reported fetch times
(``tests/integration/test_sim_netns.py``; figures in ``benchmarks/results/sim_netns.json``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

__all__ = ["CONGESTION_CONTROLS", "MSS", "IW_SEGMENTS", "TcpModel", "Connections"]

MSS = 1448  # bytes of payload per segment (1500 MTU, IPv4, TCP timestamps)
IW_SEGMENTS = 10  # RFC 6928 initial window
MIN_RTO_S = 0.2  # Linux's floor on the RTO's variance term (TCP_RTO_MIN)
CONGESTION_CONTROLS = ("cubic", "bbr")


@dataclass(frozen=True, slots=True)
class TcpModel:
    """The per-connection model's constants (see the module docstring)."""

    mss: int = MSS
    iw_segments: int = IW_SEGMENTS
    streams: int = 1  # parallel connections per transfer
    congestion_control: str = "cubic"  # what restart after idle does (see the module docstring)

    def __post_init__(self) -> None:
        if self.congestion_control not in CONGESTION_CONTROLS:
            raise ValueError(f"unknown congestion control {self.congestion_control!r}; known: {', '.join(CONGESTION_CONTROLS)}")

    @property
    def initial_window(self) -> float:
        return float(self.mss * self.iw_segments * self.streams)

    def transfer_s(self, nbytes: float, rtt: float, rate: float, cwnd: float | None = None, *, cold: bool = False) -> float:
        """Seconds from issuing the request to the last byte at the receiver (see the module
        docstring); ``cwnd`` None: the initial window."""
        return (rtt if cold else 0.0) + rtt + self.rounds_s(nbytes, rtt, rate, cwnd)

    def rounds_s(self, nbytes: float, rtt: float, rate: float, cwnd: float | None = None) -> float:
        """Seconds from the first byte sent to the last byte sent (the transfer without its
        request/handshake round trips)."""
        return self._rounds(nbytes, rtt, rate, cwnd)[0]

    def slow_start(self, nbytes: float, rtt: float, rate: float, cwnd: float | None = None) -> tuple[float, float]:
        """``(seconds, bytes)`` of the window-limited rounds before the flow can send at ``rate``:
        ``rounds_s = seconds + (nbytes - bytes) / rate``."""
        r = self._rounds(nbytes, rtt, rate, cwnd)
        return r[2], r[3]

    def window_after(self, nbytes: float, rtt: float, rate: float, cwnd: float | None = None) -> float:
        """The congestion window after sending ``nbytes``."""
        return self._rounds(nbytes, rtt, rate, cwnd)[1]

    def _rounds(self, nbytes: float, rtt: float, rate: float, cwnd: float | None) -> tuple[float, float, float, float]:
        w = self.initial_window if cwnd is None else (cwnd if cwnd > self.mss else float(self.mss))
        return _rounds(float(nbytes), rtt, rate, float(w))

    def rto_s(self, rtt: float) -> float:
        """The retransmission timeout of a connection that has settled at round-trip time ``rtt``."""
        return rtt + MIN_RTO_S

    def restart_window(self, cwnd: float, idle_s: float, rtt: float) -> float:
        """The window a pooled connection starts its next transfer with after ``idle_s`` idle:
        Linux's ``tcp_cwnd_restart`` for ``cubic`` (halved for each RTO elapsed beyond the first,
        down to the initial window), unchanged for ``bbr``."""
        if self.congestion_control == "bbr" or cwnd == float("inf"):
            return cwnd
        rto = self.rto_s(rtt)
        if idle_s <= rto:
            return cwnd
        floor = min(self.initial_window, cwnd)
        halvings = math.ceil(idle_s / rto) - 1
        if halvings > 60:
            return floor
        return max(cwnd / 2.0**halvings, floor)


@functools.lru_cache(maxsize=1 << 16)
def _rounds(nbytes: float, rtt: float, rate: float, w: float) -> tuple[float, float, float, float]:
    """``(seconds of the rounds, window after, seconds window-limited, bytes sent then)`` of
    ``nbytes`` from window ``w`` (see the module docstring). Sizes, RTTs and rates repeat: cached."""
    bdp = rate * rtt
    t = 0.0
    sent = 0.0
    while w < bdp and sent + w < nbytes:
        sent += w
        t += rtt
        w *= 2.0
    if w >= bdp:  # the pipe is full: the rest at the link's rate
        return t + (nbytes - sent) / rate, max(w, bdp), t, sent
    return t + (nbytes - sent) / rate, w, t, sent  # the last, partial round


class Connections:
    """The connection pool of each (source, destination) pair (see the module docstring).

    ``mode``: ``pooled`` (reuse idle connections, restart after idle, open a new one when none is
    idle), ``cold`` (a new connection per transfer), ``warm`` (always warm: windows at the
    bandwidth-delay product, no handshake; the old model)."""

    __slots__ = ("model", "mode", "_pool")

    def __init__(self, model: TcpModel, mode: str) -> None:
        if mode not in ("pooled", "cold", "warm"):
            raise ValueError(f"unknown connection mode {mode!r}")
        self.model = model
        self.mode = mode
        # (src, dst) -> connections: [window after its last transfer, that transfer's Flow (None
        # once it has left), one-way latency, when its last byte was sent, (bytes, rtt, window
        # it started with)]
        self._pool: dict[tuple[int, int], list[list]] = {}

    def _idle(self, src: int, dst: int, now: float) -> list | None:
        """The idle connection of the pair with the largest window at ``now`` (client side)."""
        conns = self._pool.get((src, dst))
        if not conns:
            return None
        best = None
        for c in conns:
            flow = c[1]
            if flow is not None:
                if flow.finish is None or flow.finish + c[2] > now:
                    continue  # still carrying its transfer (or opening)
                nbytes, rtt, cwnd = c[4]
                c[0] = self.model.window_after(nbytes, rtt, flow.rate, cwnd)  # the share it really had
                c[3] = flow.finish
                c[1] = None
            if best is None or c[0] > best[0]:
                best = c
        return best

    def state(self, src: int, dst: int, start: float, rtt: float, now: float | None = None) -> tuple[bool, float]:
        """``(cold, cwnd)`` for a transfer from ``src`` to ``dst`` asked for at ``now`` (client
        side; default ``start``) whose first byte leaves ``src`` at ``start``."""
        if self.mode == "warm":
            return False, float("inf")
        if self.mode == "cold":
            return True, self.model.initial_window
        c = self._idle(src, dst, start if now is None else now)
        if c is None:
            return True, self.model.initial_window
        return False, self.model.restart_window(c[0], start - c[3], rtt)

    def take(self, src: int, dst: int, start: float, rtt: float, now: float | None = None) -> tuple[bool, float, list | None]:
        """:meth:`state`, and the connection it describes, now busy (None: not pooled);
        :meth:`hold` says what it carries."""
        if self.mode != "pooled":
            cold, cwnd = self.state(src, dst, start, rtt, now)
            return cold, cwnd, None
        c = self._idle(src, dst, start if now is None else now)
        if c is None:
            c = [0.0, None, rtt / 2.0, 0.0, None]
            self._pool.setdefault((src, dst), []).append(c)
            return True, self.model.initial_window, c
        cwnd = self.model.restart_window(c[0], start - c[3], rtt)
        return False, cwnd, c

    def hold(self, conn: list | None, nbytes: float, rtt: float, rate: float, cwnd: float, flow: object) -> None:
        """``conn`` (from :meth:`take`) carries ``nbytes`` from window ``cwnd`` at ``rate`` as
        ``flow`` (a :class:`kdn.simulator.links.Flow`): busy until it is in."""
        if conn is not None:
            conn[0] = self.model.window_after(nbytes, rtt, rate, cwnd)
            conn[1] = flow
            conn[2] = rtt / 2.0
            conn[4] = (nbytes, rtt, cwnd)

    def done(self, src: int, dst: int, nbytes: float, rtt: float, rate: float, cwnd: float, end: float) -> None:
        """A transfer of ``nbytes`` that started with ``cwnd`` ended at ``end`` (the last byte
        sent, final): pool its connection idle from then, with the window it grew to."""
        if self.mode == "pooled":
            self._pool[(src, dst)] = [[self.model.window_after(nbytes, rtt, rate, cwnd), None, rtt / 2.0, end, (nbytes, rtt, cwnd)]]
