"""The simulator's event core, links and cost model: ordering, FIFO queueing (M/M/1), presets."""

from __future__ import annotations

import numpy as np
import pytest

from kdn.errors import InvalidInput
from kdn.simulator.core import ARRIVAL_PRIORITY, EventLoop
from kdn.simulator.geo import great_circle_km
from kdn.simulator.links import Links
from kdn.simulator.presets import load_presets


def test_events_run_in_time_priority_sequence_order() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.schedule(2.0, seen.append, "t2")
    loop.schedule(1.0, seen.append, "t1-late-prio", priority=3)
    loop.schedule(1.0, seen.append, "t1-a", priority=1)
    loop.schedule(1.0, seen.append, "t1-b", priority=1)
    loop.schedule(1.0, seen.append, "t1-after-arrival", priority=ARRIVAL_PRIORITY + 1)
    arrivals = [0.5, 1.0, 3.0]
    loop.run(arrivals, lambda i: seen.append(f"arr{i}"))
    assert seen == ["arr0", "t1-a", "t1-b", "t1-late-prio", "arr1", "t1-after-arrival", "t2", "arr2"]
    assert loop.now == 3.0
    assert loop.events == 8


def test_until_stops_and_past_events_are_refused() -> None:
    loop = EventLoop()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0):
        loop.schedule(t, seen.append, t)
    loop.run(until=2.0)
    assert seen == [1.0, 2.0]
    with pytest.raises(InvalidInput):
        loop.schedule(1.5, seen.append, 0.0)


def test_single_transfer_time_is_size_over_bandwidth_on_an_idle_link() -> None:
    links = Links([1.25e9])  # 10 Gb/s
    assert links.finish(0, 3.0, 1e9) == pytest.approx(3.8)
    assert links.commit(0, 3.0, 1e9) == pytest.approx(3.8)
    # a second transfer ready before the first finished queues behind it
    assert links.commit(0, 3.1, 0.25e9) == pytest.approx(4.0)
    assert links.sent_bytes[0] == pytest.approx(1.25e9)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_fifo_link_queueing_matches_mm1(rho: float) -> None:
    """Poisson arrivals, exponential sizes: mean time in system = 1 / (mu - lambda)."""
    rng = np.random.default_rng(1)
    mu = 100.0  # transfers/s a link serves at the mean size
    lam = rho * mu
    n = 400_000
    arrivals = np.cumsum(rng.exponential(1 / lam, n)).tolist()
    sizes = rng.exponential(1.0, n).tolist()  # bytes; bandwidth mu bytes/s -> mean service 1/mu
    links = Links([mu])
    total = 0.0
    warm = n // 20
    for k, (t, s) in enumerate(zip(arrivals, sizes)):
        end = links.commit(0, t, s)
        if k >= warm:
            total += end - t
    mean = total / (n - warm)
    expected = 1 / (mu - lam)
    assert mean == pytest.approx(expected, rel=0.04)
    # and it is queueing, not just service: the wait alone matches rho / (mu - lambda)
    assert mean - 1 / mu == pytest.approx(rho / (mu - lam), rel=0.06)


def test_great_circle_distance_of_known_city_pairs() -> None:
    # New York - London ~5570 km, Sydney - Tokyo ~7820 km
    km = great_circle_km(np.array([40.7128, -33.8688]), np.array([-74.0060, 151.2093]), np.array([51.5074, 35.6762]), np.array([-0.1278, 139.6503]))
    assert km[0] == pytest.approx(5570, rel=0.01)
    assert km[1] == pytest.approx(7820, rel=0.01)


def test_presets_cost_model() -> None:
    p = load_presets()
    m = p.models["llama-3.1-8b"]
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert p.models["llama-3.1-70b"].kv_bytes_per_token == 327680
    # prefill of a suffix after a cached prefix costs more per token than the same tokens from 0
    assert m.prefill_flops(4096, 512) > m.prefill_flops(0, 512)
    # splitting a prefill at any point costs exactly the same FLOPs as doing it at once
    assert m.prefill_flops(0, 1000) + m.prefill_flops(1000, 3000) == pytest.approx(m.prefill_flops(0, 4000))
    assert p.codecs["raw"].ratio == 1.0 and p.codecs["int8"].lossy and not p.codecs["zstd"].lossy
    assert p.codecs["raw"].decode_s(1e9) == 0.0
    assert p.gpus["h100-sxm"].flops_per_s > p.gpus["a100-80gb"].flops_per_s
