"""Transfers (issue 15): per-connection TCP (initial window, slow start, restart after idle,
pooled connections, parallel streams) and links that share fairly (processor sharing) or queue
(FIFO). The real-TCP check of the same model is tests/integration/test_sim_netns.py."""

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
    cold, w = pool.state(0, 1, 3.1, 0.1)  # 0.1 s idle: warm, full window
    assert not cold and w >= C * 0.1
    cold, w = pool.state(0, 1, 5.0, 0.1)  # 2 s idle > RTO: restart from the initial window
    assert not cold and w == IW
    assert pool.state(1, 0, 3.1, 0.1) == (True, IW)  # the other direction is its own connection
    assert Connections(tcp, "cold").state(0, 1, 0.0, 0.1) == (True, IW)
    assert Connections(tcp, "warm").state(0, 1, 0.0, 0.1) == (False, float("inf"))
    with pytest.raises(ValueError, match="unknown connection mode"):
        Connections(tcp, "hot")


def test_fifo_link_with_tcp() -> None:
    links = Links([C])
    tcp = TcpModel()
    first = links.commit(0, 0.0, 2e6, 0.1, IW, cold=True)
    assert first == pytest.approx(0.1 + tcp.rounds_s(2e6, 0.1, C))  # handshake, then the rounds
    second = links.commit(0, 0.0, 2e6, 0.1, IW, cold=True)
    assert second == pytest.approx(0.1 + 2e6 / C + tcp.rounds_s(2e6, 0.1, C))  # waits for the link only


def test_fair_link_two_at_once_share() -> None:
    fair = FairLinks([C], record=True)
    fair.commit(0, 0.0, 20e6)
    a = fair.last_id
    second = fair.commit(0, 0.0, 20e6)
    assert second == pytest.approx(40e6 / C)  # the later flow's figure is exact PS
    fair.settle(0)
    assert fair.left_at == {a: pytest.approx(40e6 / C), a + 1: pytest.approx(40e6 / C)}  # both finish together
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
    fair = FairLinks([1000.0], record=True)
    ids = []
    for start, n in flows:
        fair.commit(0, start, n)
        ids.append(fair.last_id)
    fair.settle(0)
    assert fair.left_at is not None
    ref = _fluid(flows, 1000.0)
    for i, fid in enumerate(ids):
        assert fair.left_at[fid] == pytest.approx(ref[i], abs=2e-4)


def test_prediction_equals_commit_and_last_flow_is_exact() -> None:
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
    # 1.0 s is predicted and committed first, then one ready at 0.0 s. The second has the link to
    # itself until 1.0 s and finishes at 1 MB / C, not after the first one's ready time.
    fair = FairLinks([C])
    fair.finish(0, 1.0, 1e6)  # a prediction changes nothing for what comes later
    fair.commit(0, 1.0, 1e6)
    assert fair.commit(0, 0.0, 1e6) == pytest.approx(1e6 / C)
    # a transfer ready while an earlier-joined flow is still on the link shares with it
    busy = FairLinks([C])
    busy.commit(0, 0.0, 10e6)
    busy.commit(0, 0.5, 1e6)  # moves the link's clock to 0.5 s
    assert busy.commit(0, 0.2, 1e6) == pytest.approx(0.2 + 2e6 / C, rel=1e-6)
