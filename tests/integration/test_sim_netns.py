"""The simulator's transfer model against real TCP (issue 15): two network namespaces, a
tbf-shaped 100 Mbit/s link and a delay line (:mod:`kdn.simulator.netlab`); 2 MB and 20 MB at
~0 and 100 ms RTT, cold and warm connections, one and two transfers at once. Each measured time
must be within 10% of what the simulator's link (processor sharing) and TCP models predict.

The sender uses BBR, this machine's default congestion control: it shares a link between flows
as the model does (CUBIC with a deep queue lets one of two flows run ahead by up to 20%, see
BENCHMARKS.md). A case off by more than 10% is measured again (median of five)
before it counts as a failure: the machine is shared, and one run can be preempted.

Two cases are known to fall outside 10% and are held to 40% instead: two 2 MB transfers at once
at near-zero RTT, cold or warm. A transfer lasts 0.17 s alone, and one connection gets ahead
before the other's catches up (measured e.g. 0.23 s and 0.39 s cold, 0.28 s and 0.33 s warm, for
0.33 s and 0.33 s predicted). Fair sharing is a property of many round trips; at ~0 RTT and 2 MB
there are too few. At 100 ms RTT, or with 20 MB, the two flows finish within a few % of each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kdn.simulator import netlab

pytestmark = [pytest.mark.integration, pytest.mark.netns]

RATE_MBIT = 100.0
TOLERANCE = 0.10
LOOSE = {netlab.Case(2_000_000, 0.0, warm, 2): 0.40 for warm in (False, True)}  # see the module docstring

def _why_not() -> str | None:
    why = netlab.available()
    ccs = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
    if why is None and "bbr" not in (ccs.read_text().split() if ccs.exists() else []):
        why = "the bbr congestion control is not available"
    return why


def _off(measured: tuple[float, ...], predicted: tuple[float, ...]) -> float:
    return max(abs(m / p - 1.0) for m, p in zip(measured, predicted))


@pytest.mark.timeout(400)
def test_transfer_model_within_ten_percent_of_real_tcp() -> None:
    why = _why_not()  # probed here, not at collection: it starts a namespace
    if why is not None:
        pytest.skip(f"network namespace lab unavailable: {why}")
    cases = netlab.default_cases()
    measured, facts = netlab.run_lab(cases, rate_mbit=RATE_MBIT, repeats=1, cc="bbr")
    assert facts["congestion_control"] == "bbr"
    by_case = {m.case: m.seconds for m in measured}

    def tol(c: netlab.Case) -> float:
        return LOOSE.get(c, TOLERANCE)

    retry = [c for c in cases if _off(by_case[c], netlab.predict(c, RATE_MBIT)) > tol(c)]
    if retry:
        again, _ = netlab.run_lab(retry, rate_mbit=RATE_MBIT, repeats=5, cc="bbr")
        by_case.update({m.case: m.seconds for m in again})
    bad = [(c.label, by_case[c], netlab.predict(c, RATE_MBIT)) for c in cases if _off(by_case[c], netlab.predict(c, RATE_MBIT)) > tol(c)]
    assert not bad, "measured vs predicted seconds off by more than allowed: " + "; ".join(
        f"{label}: {[round(x, 3) for x in m]} vs {[round(x, 3) for x in p]}" for label, m, p in bad
    )
    # the old model (FIFO links, always-warm connections) fails the same check: slow start on a
    # cold long-haul connection, and two transfers sharing the link
    cold_2mb = netlab.Case(2_000_000, 0.1, False, 1)
    old = netlab.predict(netlab.Case(2_000_000, 0.1, True, 1), RATE_MBIT)
    assert _off(by_case[cold_2mb], old) > 0.5
    two = netlab.Case(20_000_000, 0.0, False, 2)
    assert _off(by_case[two], netlab.predict(two, RATE_MBIT, mode="fifo")) > 0.3
