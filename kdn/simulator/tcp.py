"""Per-connection TCP: how long ``n`` bytes take over a path of round-trip time ``rtt`` whose
bottleneck gives the flow ``rate`` bytes/s, starting from congestion window ``cwnd``.

The model (slow start with an initial window, the window doubling once per round trip, rate
limited once it fills the pipe; Linux's defaults: 10 segments of 1448 bytes, restart from the
initial window after an idle period of one retransmission timeout):

* a cold connection pays one RTT for the handshake before the request can go out;
* the request and the first byte's return cost one RTT;
* then, round by round, the sender sends a window (``w`` bytes) and waits one RTT for its ACKs,
  and the window doubles, until a window covers the bandwidth-delay product ``rate x rtt``; from
  there on the rest flows at ``rate``. The last round sends what is left at ``rate``.

So ``duration = handshake + rtt + rounds x rtt + tail / rate``. With ``rtt -> 0`` it is
``n / rate``, the old model. Parallel streams each start with their own initial window:
``streams`` connections behave as one with ``streams`` times the window.

:class:`Connections` holds each (source, destination) pair's pooled connection: its window after
the last transfer and when that ended, so a reused connection is warm unless it sat idle past the
retransmission timeout (then it restarts from the initial window, as Linux does with
``tcp_slow_start_after_idle``). A pooled connection that has sent a transfer at full rate has a
window of at least the bandwidth-delay product.

Checked against real Linux TCP in network namespaces (a tbf-shaped 100 Mbit/s link and a delay
line, :mod:`kdn.simulator.netlab`): 2 MB and 20 MB at ~0 and 100 ms RTT, cold and warm, one and two
at once: within 10% but for two 2 MB transfers at once at ~0 RTT (one flow runs ahead before fair
sharing sets in; held to 40%) (``tests/integration/test_sim_netns.py``; figures in BENCHMARKS.md,
where a loaded run also shows single outliers that the test measures again).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["MSS", "IW_SEGMENTS", "TcpModel", "Connections"]

MSS = 1448  # bytes of payload per segment (1500 MTU, IPv4, TCP timestamps)
IW_SEGMENTS = 10  # RFC 6928 initial window
MIN_RTO_S = 0.2  # Linux's minimum retransmission timeout


@dataclass(frozen=True, slots=True)
class TcpModel:
    """The per-connection model's constants (see the module docstring)."""

    mss: int = MSS
    iw_segments: int = IW_SEGMENTS
    streams: int = 1  # parallel connections per transfer

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

    def window_after(self, nbytes: float, rtt: float, rate: float, cwnd: float | None = None) -> float:
        """The congestion window after sending ``nbytes``."""
        return self._rounds(nbytes, rtt, rate, cwnd)[1]

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 (frozen, few instances): sizes, RTTs, rates repeat
    def _rounds(self, nbytes: float, rtt: float, rate: float, cwnd: float | None) -> tuple[float, float]:
        w = self.initial_window if cwnd is None else max(float(cwnd), float(self.mss))
        bdp = rate * rtt
        t = 0.0
        sent = 0.0
        while w < bdp and sent + w < nbytes:
            sent += w
            t += rtt
            w *= 2.0
        if w >= bdp:  # the pipe is full: the rest at the link's rate
            return t + (nbytes - sent) / rate, max(w, bdp)
        return t + (nbytes - sent) / rate, w  # the last, partial round

    def restart_window(self, cwnd: float, idle_s: float, rtt: float) -> float:
        """The window a pooled connection starts its next transfer with after ``idle_s`` idle."""
        return self.initial_window if idle_s > max(MIN_RTO_S, 2.0 * rtt) else cwnd


class Connections:
    """Pooled connections per (source, destination) pair: window and when they went idle.

    ``mode``: ``pooled`` (reuse, restart after idle), ``cold`` (a new connection per transfer),
    ``warm`` (always warm: windows at the bandwidth-delay product, no handshake; the old model)."""

    __slots__ = ("model", "mode", "_pool")

    def __init__(self, model: TcpModel, mode: str) -> None:
        if mode not in ("pooled", "cold", "warm"):
            raise ValueError(f"unknown connection mode {mode!r}")
        self.model = model
        self.mode = mode
        self._pool: dict[tuple[int, int], tuple[float, float]] = {}  # (src, dst) -> (cwnd, idle since)

    def state(self, src: int, dst: int, start: float, rtt: float) -> tuple[bool, float]:
        """``(cold, cwnd)`` for a transfer from ``src`` to ``dst`` starting at ``start``."""
        if self.mode == "warm":
            return False, float("inf")
        if self.mode == "cold":
            return True, self.model.initial_window
        got = self._pool.get((src, dst))
        if got is None:
            return True, self.model.initial_window
        cwnd, idle_since = got
        return False, self.model.restart_window(cwnd, start - idle_since, rtt)

    def done(self, src: int, dst: int, nbytes: float, rtt: float, rate: float, cwnd: float, end: float) -> None:
        """A transfer of ``nbytes`` that started with ``cwnd`` ended at ``end``: pool the
        connection with the window it grew to."""
        if self.mode == "pooled":
            self._pool[(src, dst)] = (self.model.window_after(nbytes, rtt, rate, cwnd), end)
