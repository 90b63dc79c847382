"""What the simulator reports against real TCP: two network namespaces, a tbf-shaped 100 Mbit/s
link and a delay line (:mod:`kdn.simulator.netlab`); 2 and 20 MiB, ~0 and 100 ms RTT, two and
four transfers at once on the link, on new connections, on pooled warm ones and on pooled ones
after 1 s idle, under cubic and under bbr. What is compared is the fetch time the engine reports
for the same requests (:func:`kdn.simulator.netlab.reported`: a one-origin, one-edge scenario run
through ``run_policy``, the figure ``kdn simulate`` prints), rank by rank with the measured
transfers (fastest with fastest), for every case:

* the last transfer of each case (when the link has carried all of them: its capacity) within
  10% of reported;
* no transfer more than 10% slower than reported;
* every transfer within 10% where the real link shares fairly: bbr at 100 ms RTT.

Where it does not, a transfer can finish well before its fair share says, and the simulator's
processor sharing, which gives flows alike the same finish, cannot say which one: the shaper's
queue is FIFO (this kernel has no sfq, fq or fq_codel to put under tbf), and at sub-millisecond
RTT, or with cubic at any RTT, one flow of several gets ahead (measured: the first of four
2 MiB transfers done at 0.42 s where the four together take 0.70 s; ``sim_netns`` in
benchmarks/results). The shaper's queue is a deep drop-free one (16 MB) for bbr, two
bandwidth-delay products for cubic (a loss-based sender needs losses to converge at all; see
:func:`kdn.simulator.netlab._tbf`). A case off by more than allowed is measured again (median of
three) before it counts as a failure: the machine is shared, and one run can be preempted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kdn.simulator import netlab

# minutes of shaped transfers per congestion control, and sensitive to a busy CPU: out of the
# default run (`pytest -m "slow and netns"`; `python benchmarks/simulator.py --netns` records it)
pytestmark = [pytest.mark.integration, pytest.mark.netns, pytest.mark.slow]

RATE_MBIT = 100.0
TOLERANCE = 0.10
QUEUE = {"bbr": "deep", "cubic": "bdp"}


def _why_not(cc: str) -> str | None:
    why = netlab.available()
    ccs = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
    if why is None and cc not in (ccs.read_text().split() if ccs.exists() else []):
        why = f"the {cc} congestion control is not available"
    return why


def _off(measured: tuple[float, ...], reported: tuple[float, ...]) -> float:
    return max(abs(r / m - 1.0) for m, r in zip(measured, reported))


def _fails(c: netlab.Case, cc: str, measured: tuple[float, ...], reported: tuple[float, ...]) -> str | None:
    """Why ``measured`` is not what ``reported`` says for case ``c`` (None: it is)."""
    if abs(reported[-1] / measured[-1] - 1.0) > TOLERANCE:
        return "the last transfer (the link's capacity)"
    if any(m > r * (1.0 + TOLERANCE) for m, r in zip(measured, reported)):
        return "a transfer slower than reported"
    if cc == "bbr" and c.rtt_s >= 0.05 and _off(measured, reported) > TOLERANCE:
        return "a transfer on a fairly shared link"
    return None


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cc", ["cubic", "bbr"])
def test_reported_fetch_times_match_real_tcp(cc: str) -> None:
    why = _why_not(cc)  # probed here, not at collection: it starts a namespace
    if why is not None:
        pytest.skip(f"network namespace lab unavailable: {why}")
    cases = netlab.default_cases()
    reported = {c: netlab.reported(c, RATE_MBIT, cc) for c in cases}
    measured, facts = netlab.run_lab(cases, rate_mbit=RATE_MBIT, repeats=1, cc=cc, queue=QUEUE[cc], timeout_s=600)
    assert facts["congestion_control"] == cc
    by_case = {m.case: m.seconds for m in measured}
    retry = [c for c in cases if _fails(c, cc, by_case[c], reported[c])]
    if retry:
        again, _ = netlab.run_lab(retry, rate_mbit=RATE_MBIT, repeats=3, cc=cc, queue=QUEUE[cc], timeout_s=600)
        by_case.update({m.case: m.seconds for m in again})
    bad = [(c.label, why, by_case[c], reported[c]) for c in cases if (why := _fails(c, cc, by_case[c], reported[c]))]
    assert not bad, f"{cc}: measured vs reported seconds: " + "; ".join(
        f"{label}: {why} off by more than 10%: {[round(x, 3) for x in m]} vs {[round(x, 3) for x in r]}" for label, why, m, r in bad
    )
