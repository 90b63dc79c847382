"""Transfers: per-connection TCP (initial window, slow start, restart after idle as each
congestion control does it, pooled connections, parallel streams) and links that share fairly
(processor sharing, finish times recomputed as flows join and leave) or queue (FIFO), and the
figures the engine reports for transfers that share a link. The real-TCP check of the same
figures is tests/integration/test_sim_netns.py."""

from __future__ import annotations

import random

import pytest

from kdn.simulator.links import FairLinks, Links, make_links
from kdn.simulator.tcp import Connections, TcpModel

C = 12_070_000.0  # bytes/s: 100 Mbit/s of payload
IW = 14_480.0


def test_slow_start_rounds_by_hand() -> None:
    tcp = TcpModel()
    assert tcp.initial_window == IW
    # 2 MB at 100 ms: windows 14.5K, 29K, ..., 927K (7 rounds, 1.853 MB sent), then 147 KB at C
    sent = sum(IW * 2**k for k in range(7))
    assert tcp.rounds_s(2e6, 0.1, C) == pytest.approx(0.7 + (2e6 - sent) / C)
    assert tcp.transfer_s(2e6, 0.1, C, cold=True) == pytest.approx(0.2 + 0.7 + (2e6 - sent) / C)
    assert tcp.rounds_s(2e6, 0.0, C) == pytest.approx(2e6 / C)  # no RTT: bytes over rate
    assert tcp.rounds_s(2e6, 0.1, C, float("inf")) == pytest.approx(2e6 / C)  # a full window
    # a window already past the bandwidth-delay product stays there
    assert tcp.window_after(20e6, 0.1, C) >= C * 0.1
    # parallel streams: each brings its own initial window, so fewer rounds
    assert TcpModel(streams=4).rounds_s(2e6, 0.1, C) < tcp.rounds_s(2e6, 0.1, C) - 0.15


def test_pooled_connection_is_warm_until_idle() -> None:
    tcp = TcpModel()
    pool = Connections(tcp, "pooled")
    cold, w = pool.state(0, 1, 0.0, 0.1)
    assert cold and w == IW
    pool.done(0, 1, 20e6, 0.1, C, w, end=3.0)
    full = tcp.window_after(20e6, 0.1, C)
    cold, w = pool.state(0, 1, 3.1, 0.1)  # 0.1 s idle: warm, full window
    assert not cold and w == full >= C * 0.1
    assert pool.state(1, 0, 3.1, 0.1) == (True, IW)  # the other direction is its own connection
    assert Connections(tcp, "cold").state(0, 1, 0.0, 0.1) == (True, IW)
    assert Connections(tcp, "warm").state(0, 1, 0.0, 0.1) == (False, float("inf"))
    with pytest.raises(ValueError, match="unknown connection mode"):
        Connections(tcp, "hot")


@pytest.mark.parametrize("idle, halvings", [(0.25, 0), (0.31, 1), (0.61, 2), (1.0, 3), (2.0, 6)])
def test_cubic_halves_the_window_per_rto_idle(idle: float, halvings: int) -> None:
    # Linux tcp_cwnd_restart: RTO = RTT + 200 ms (0.3 s at 100 ms); once idle past it, the window
    # is halved for each further RTO elapsed, never below the initial window
    tcp = TcpModel(congestion_control="cubic")
    assert tcp.rto_s(0.1) == pytest.approx(0.3)
    w = 2e6
    assert tcp.restart_window(w, idle, 0.1) == pytest.approx(max(w / 2**halvings, IW))
    assert tcp.restart_window(w, 60.0, 0.1) == IW


def test_bbr_keeps_its_window_after_idle() -> None:
    tcp = TcpModel(congestion_control="bbr")
    assert tcp.restart_window(2e6, 5.0, 0.1) == 2e6
    with pytest.raises(ValueError, match="congestion control"):
        TcpModel(congestion_control="vegas")


def test_a_busy_or_opening_connection_is_not_handed_to_a_second_transfer() -> None:
    tcp = TcpModel()
    pool = Connections(tcp, "pooled")
    links = FairLinks([C], tcp)
    cold_a, w_a, conn_a = pool.take(0, 1, 0.05, 0.1, 0.0)  # opening: a handshake first
    assert cold_a
    links.commit(0, 0.05, 2e6, 0.1, w_a, cold_a)
    pool.hold(conn_a, 2e6, 0.1, C, w_a, links.last)
    cold_b, w_b, conn_b = pool.take(0, 1, 0.05, 0.1, 0.0)  # asked at the same moment: its own
    assert cold_b and conn_b is not conn_a
    links.commit(0, 0.05, 2e6, 0.1, w_b, cold_b)
    pool.hold(conn_b, 2e6, 0.1, C, w_b, links.last)
    links.settle(0)
    assert links.last is not None and links.last.finish is not None
    later = links.last.finish + 0.05 + 0.01  # both in at the client: either can be reused, warm
    cold_c, w_c, conn_c = pool.take(0, 1, later + 0.05, 0.1, later)
    assert not cold_c and conn_c in (conn_a, conn_b) and w_c > IW


def test_fifo_link_with_tcp() -> None:
    links = Links([C])
    tcp = TcpModel()
    first = links.commit(0, 0.0, 2e6, 0.1, IW, cold=True)
    assert first == pytest.approx(0.1 + tcp.rounds_s(2e6, 0.1, C))  # handshake, then the rounds
    second = links.commit(0, 0.0, 2e6, 0.1, IW, cold=True)
    assert second == pytest.approx(0.1 + 2e6 / C + tcp.rounds_s(2e6, 0.1, C))  # waits for the link only


def test_fair_link_two_at_once_share() -> None:
    fair = FairLinks([C])
    assert fair.commit(0, 0.0, 20e6) == pytest.approx(20e6 / C)  # alone so far
    a = fair.last
    second = fair.commit(0, 0.0, 20e6)
    b = fair.last
    assert second == pytest.approx(40e6 / C)  # the later flow's figure, given the first
    fair.settle(0)
    assert a is not None and b is not None
    assert a.finish == pytest.approx(40e6 / C) and b.finish == pytest.approx(40e6 / C)  # the first was slowed
    assert a.delay == pytest.approx(20e6 / C)
    fifo = Links([C])
    assert fifo.commit(0, 0.0, 20e6) == pytest.approx(20e6 / C)  # FIFO: one after the other


def _fluid(flows: list[tuple[float, float]], bw: float, dt: float = 1e-5) -> list[float]:
    """Processor sharing by small time steps: the reference for the virtual-clock link."""
    left = [n for _, n in flows]
    done = [float("nan")] * len(flows)
    t = 0.0
    while any(d != d for d in done):
        active = [i for i, (s, _) in enumerate(flows) if s <= t and done[i] != done[i]]
        for i in active:
            left[i] -= bw * dt / len(active)
            if left[i] <= 0:
                done[i] = t + dt
        t += dt
    return done


@pytest.mark.parametrize("seed", range(5))
def test_fair_link_departures_match_a_fluid_model(seed: int) -> None:
    rng = random.Random(seed)
    flows = sorted((rng.uniform(0, 0.05), rng.uniform(0.001, 0.02) * 1000) for _ in range(6))
    fair = FairLinks([1000.0])
    made = []
    for start, n in sorted(flows, key=lambda f: -f[0]):  # committed out of time order
        fair.commit(0, start, n)
        made.append((start, n, fair.last))
    fair.settle(0)
    ref = _fluid(flows, 1000.0)
    got = {(start, n): f.finish for start, n, f in made}
    for i, flow in enumerate(flows):
        assert got[flow] == pytest.approx(ref[i], abs=2e-4)


def test_prediction_equals_commit() -> None:
    for mode in ("fifo", "fair"):
        links = make_links(mode, [C, C])
        links.commit(0, 0.0, 5e6, 0.05, IW, True)
        p = links.finish(0, 0.1, 3e6, 0.05, 1e6, False)
        assert links.commit(0, 0.1, 3e6, 0.05, 1e6, False) == p
        assert links.finish(1, 0.0, 1e6) == pytest.approx(1e6 / C)  # other sites untouched
    with pytest.raises(ValueError, match="unknown link mode"):
        make_links("lifo", [C])


def test_fair_link_does_not_hold_an_earlier_transfer_behind_a_later_one() -> None:
    # requests reach an origin's link out of order (each from its own distance): one ready at
    # 1.0 s is committed first, then one ready at 0.0 s. The second has the link to itself
    # until 1.0 s, then shares it.
    fair = FairLinks([C])
    fair.finish(0, 1.0, 1e6)  # a prediction changes nothing for what comes later
    fair.commit(0, 1.0, 1e6)
    assert fair.commit(0, 0.0, 1e6) == pytest.approx(1e6 / C)
    busy = FairLinks([C])
    busy.commit(0, 0.0, 10e6)
    busy.advance(0, 0.2)
    assert busy.commit(0, 0.2, 1e6) == pytest.approx(0.2 + 2e6 / C, rel=1e-6)


@pytest.mark.parametrize("rtt", [0.0, 0.1])
@pytest.mark.parametrize("k", [2, 4])
def test_transfers_sharing_a_link_conserve_its_capacity(rtt: float, k: int) -> None:
    # k transfers on one 100 Mbit/s link, cold, together and then staggered: none finishes
    # before k x its bytes could cross the link, and none joining later finishes first
    rng = random.Random(k)
    for gaps in ([0.0] * k, sorted(rng.uniform(0, 0.3) for _ in range(k))):
        fair = FairLinks([C])
        made = []
        for start in gaps:
            fair.commit(0, start, 2e6, rtt, IW, cold=True)
            made.append((start, fair.last))
        fair.settle(0)
        ends = [f.finish for _, f in made]
        assert all(e is not None for e in ends)
        assert max(ends) >= gaps[0] + k * 2e6 / C * (1 - 1e-9)  # the link's payload rate, never 2x it
        for (s1, f1), (s2, f2) in zip(made, made[1:]):
            assert s2 >= s1 and f2.finish >= f1.finish - 1e-9, "a later transfer of equal size finished first"


@pytest.mark.parametrize("rtt", [0.0002, 0.1])
@pytest.mark.parametrize("cc", ["cubic", "bbr"])
def test_reported_fetch_times_of_requests_sharing_a_link(rtt: float, cc: str) -> None:
    # end to end through the engine (kdn simulate's own figures): two 20 MiB fetches from one
    # origin over its 100 Mbit/s link, asked together on new connections, together on pooled
    # warm ones, and one after the other. Each request's reported fetch time (arrival to data)
    # must leave room for both payloads at the link's payload rate, and the later request must
    # not be reported done before the earlier one.
    from kdn.simulator import netlab

    rate = netlab.goodput_Bps(100.0)
    n = 10  # chunks of 2 MiB
    nbytes = n * netlab.BLOCK_BYTES
    both = netlab.simulate_fetches([(0.0, n), (0.0, n)], rtt, 100.0, cc)
    assert min(both) >= 2 * nbytes / rate, f"two transfers at more than the link's rate: {both}"
    warm = netlab.reported(netlab.Case(nbytes, rtt, True, 2), 100.0, cc)
    assert min(warm) >= 2 * nbytes / rate, f"two pooled transfers at more than the link's rate: {warm}"
    for gap in (0.0, 0.001, 0.05, 0.5):
        a, b = netlab.simulate_fetches([(0.0, n), (gap, n)], rtt, 100.0, cc)
        assert gap + b >= a - 1e-9, f"the later request (+{gap} s) was done first: {a} vs {gap + b}"
        assert max(a, gap + b) >= 2 * nbytes / rate


def test_idle_restart_follows_the_scenarios_congestion_control() -> None:
    # through the engine: a pooled connection that carried 4 MiB, then sat idle 1 s, fetches 2 MiB
    # at 100 ms RTT. bbr keeps its window (as warm); cubic has halved it three times (RTO 0.3 s)
    from kdn.simulator import netlab

    def after(cc: str, idle: float) -> float:
        return netlab.reported(netlab.Case(netlab.BLOCK_BYTES, 0.1, True, 1, idle), 100.0, cc)[0]

    assert after("bbr", 1.0) == pytest.approx(after("bbr", 0.0))
    assert after("cubic", 0.0) == pytest.approx(after("bbr", 0.0))
    cubic = after("cubic", 1.0)
    assert after("cubic", 0.0) + 0.1 < cubic < after("cubic", 30.0)  # a few rounds lost, not back to the initial window
    cold = netlab.reported(netlab.Case(netlab.BLOCK_BYTES, 0.1, False, 1), 100.0, "cubic")[0]
    assert cubic < cold - 0.1  # and no handshake


def test_congestion_control_is_checked_in_the_scenario() -> None:
    from kdn.errors import ConfigError
    from kdn.simulator.scenario import NetworkSpec, parse_scenario

    assert NetworkSpec().congestion_control == "cubic"
    with pytest.raises(ConfigError, match="network.congestion_control"):
        parse_scenario({
            "name": "x", "model": "llama-3.1-8b", "gpu": "h100-sxm",
            "topology": {"origins": [{"lat": 0.0, "lon": 0.0}], "regions": [{"name": "a", "lat": 0.0, "lon": 0.0}]},
            "workload": {"kind": "synthetic", "requests": 1, "duration_s": 1.0},
            "network": {"congestion_control": "vegas"},
        })
