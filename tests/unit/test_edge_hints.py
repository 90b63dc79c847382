"""Cron parsing and next-fire times (UTC), and the hint scheduler: due actions, persistence."""

from __future__ import annotations

import asyncio
import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from kdn.edge.clock import FakeClock, MonotonicClock
from kdn.edge.cron import CronSchedule, parse_cron
from kdn.edge.schedules import HintScheduler
from kdn.errors import ConfigError, InvalidInput


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=timezone.utc)


# ---------------------------------------------------------------------------------------------
# cron


@pytest.mark.parametrize(
    "expr, after, expected",
    [
        ("0 8 * * *", utc(2026, 3, 1, 7, 59), utc(2026, 3, 1, 8, 0)),
        ("0 8 * * *", utc(2026, 3, 1, 8, 0), utc(2026, 3, 2, 8, 0)),  # strictly after
        ("0 8 * * *", utc(2026, 3, 1, 8, 0, 30), utc(2026, 3, 2, 8, 0)),
        ("0 8 * * *", utc(2026, 12, 31, 9, 0), utc(2027, 1, 1, 8, 0)),  # year wrap
        ("*/15 * * * 1-5", utc(2026, 11, 27, 23, 50), utc(2026, 11, 30, 0, 0)),  # Fri night -> Mon
        ("*/15 * * * 1-5", utc(2026, 11, 30, 10, 7), utc(2026, 11, 30, 10, 15)),
        ("*/15 * * * 1-5", utc(2026, 11, 30, 23, 45), utc(2026, 12, 1, 0, 0)),
        ("30 2 29 2 *", utc(2025, 1, 1), utc(2028, 2, 29, 2, 30)),  # next leap day
        ("0 0 31 * *", utc(2026, 4, 1), utc(2026, 5, 31, 0, 0)),  # skips 30-day April
        ("0 12 1,15 * *", utc(2026, 1, 15, 12, 0), utc(2026, 2, 1, 12, 0)),
        ("5-10/2 3 * * *", utc(2026, 6, 1, 3, 7), utc(2026, 6, 1, 3, 9)),
        ("5/20 * * * *", utc(2026, 6, 1, 3, 46), utc(2026, 6, 1, 4, 5)),
        ("0 0 * * 0", utc(2026, 11, 30), utc(2026, 12, 6)),  # Sunday as 0
        ("0 0 * * 7", utc(2026, 11, 30), utc(2026, 12, 6)),  # and as 7
        ("0 9 * jan,jul mon", utc(2026, 2, 1), utc(2026, 7, 6, 9, 0)),
        # both day fields restricted: either matches (Vixie cron)
        ("0 0 13 * fri", utc(2026, 11, 1), utc(2026, 11, 6)),
        ("0 0 13 * fri", utc(2026, 11, 6), utc(2026, 11, 13)),
        # day-of-month is '*'-led: both must match
        ("0 0 */10 * mon", utc(2026, 11, 1), utc(2026, 12, 21)),  # days 1,11,21,31 AND Monday
        ("@daily", utc(2026, 1, 1, 0, 0), utc(2026, 1, 2)),
        ("@hourly", utc(2026, 1, 1, 5, 59), utc(2026, 1, 1, 6, 0)),
        ("@monthly", utc(2026, 1, 31), utc(2026, 2, 1)),
        ("@weekly", utc(2026, 11, 30), utc(2026, 12, 6)),
        ("@yearly", utc(2026, 1, 1), utc(2027, 1, 1)),
    ],
)
def test_next_fire(expr: str, after: datetime, expected: datetime) -> None:
    got = parse_cron(expr).next_fire(after)
    assert got == expected
    assert got.tzinfo is not None and got.utcoffset() == timedelta(0)


def test_naive_and_other_timezone_inputs_are_read_as_utc() -> None:
    c = parse_cron("0 8 * * *")
    assert c.next_fire(datetime(2026, 3, 1, 7, 0)) == utc(2026, 3, 1, 8, 0)
    plus2 = timezone(timedelta(hours=2))
    assert c.next_fire(datetime(2026, 3, 1, 9, 30, tzinfo=plus2)) == utc(2026, 3, 1, 8, 0)  # 07:30 UTC


def test_next_fire_agrees_with_brute_force() -> None:
    rng = random.Random(4)

    def field(lo: int, hi: int) -> str:
        kind = rng.randrange(5)
        a, b = sorted(rng.sample(range(lo, hi + 1), 2))
        return ["*", f"{a}", f"{a}-{b}", f"*/{rng.randint(2, 7)}", f"{a},{b}"][kind]

    start = utc(2026, 2, 20, 13, 17)
    window = 60 * 24 * 45  # 45 days of minutes
    for _ in range(25):
        expr = " ".join([field(0, 59), field(0, 23), field(1, 31), "*", field(0, 6)])
        try:
            c = parse_cron(expr)
        except InvalidInput:
            continue
        expected = None
        t = start.replace(second=0) + timedelta(minutes=1)
        for _ in range(window):
            if c.matches(t):
                expected = t
                break
            t += timedelta(minutes=1)
        got = c.next_fire(start)
        if expected is None:
            assert got is not None and got > start + timedelta(minutes=window), expr
        else:
            assert got == expected, expr


@pytest.mark.parametrize(
    "expr, field",
    [
        ("60 * * * *", "minute"),
        ("* 24 * * *", "hour"),
        ("* * 0 * *", "day-of-month"),
        ("* * 32 * *", "day-of-month"),
        ("* * * 13 *", "month"),
        ("* * * foo *", "month"),
        ("* * * * 8", "day-of-week"),
        ("*/0 * * * *", "minute"),
        ("5-1 * * * *", "minute"),
        ("1,,2 * * * *", "minute"),
        ("-1 * * * *", "minute"),
        ("* * * * mon-", "day-of-week"),
        ("x * * * *", "minute"),
        ("* ** * * *", "hour"),
        ("0 0 30 2 *", "never fires"),
    ],
)
def test_bad_cron_names_the_field(expr: str, field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        CronSchedule.parse(expr)


@pytest.mark.parametrize("expr", ["", "* * * *", "* * * * * *", "@often"])
def test_wrong_field_count_is_refused(expr: str) -> None:
    with pytest.raises(InvalidInput, match="expected 5"):
        parse_cron(expr)


# ---------------------------------------------------------------------------------------------
# scheduler


def test_due_returns_fired_actions_once_and_moves_on() -> None:
    clock = FakeClock(utc(2026, 3, 2, 7, 0))  # a Monday
    sched = HintScheduler(clock)
    ran: list[str] = []
    sched.add("morning", "0 8 * * *", lambda: ran.append("morning"))
    sched.add("quarter", "*/15 * * * 1-5", lambda: ran.append("quarter"))
    assert sched.next_wakeup() == utc(2026, 3, 2, 7, 15)
    assert sched.due() == []
    clock.advance(15 * 60)
    due = sched.due()
    assert [d.schedule_id for d in due] == ["quarter"] and due[0].fire_time == utc(2026, 3, 2, 7, 15)
    for d in due:
        d()
    assert sched.due() == []  # not again for the same instant
    clock.advance(45 * 60)  # 08:00: both
    for d in sched.due():
        d()
    assert ran == ["quarter", "quarter", "morning"]  # soonest pending fire time first (07:30 < 08:00)
    info = {i.schedule_id: i for i in sched.list()}
    assert info["morning"].next_fire == utc(2026, 3, 3, 8, 0) and info["morning"].runs == 1
    assert info["quarter"].next_fire == utc(2026, 3, 2, 8, 15) and info["quarter"].runs == 2


def test_missed_fires_run_once() -> None:
    clock = FakeClock(utc(2026, 3, 2, 7, 0))
    sched = HintScheduler(clock)
    sched.add("m", "*/5 * * * *", lambda: None)
    clock.advance(3600 * 5)
    assert len(sched.due()) == 1
    assert sched.get("m").next_fire == utc(2026, 3, 2, 12, 5)  # type: ignore[union-attr]


def test_cancel_replace_and_validation() -> None:
    sched = HintScheduler(FakeClock(utc(2026, 3, 2, 7, 0)))
    sched.add("a", "0 8 * * *", lambda: None)
    sched.add("a", "0 9 * * *", lambda: None)  # replaces
    assert [i.cron for i in sched.list()] == ["0 9 * * *"]
    assert sched.cancel("a") and not sched.cancel("a")
    assert sched.list() == [] and sched.next_wakeup() is None
    with pytest.raises(InvalidInput, match="hour"):
        sched.add("b", "0 25 * * *", lambda: None)
    with pytest.raises(InvalidInput, match="schedule id"):
        sched.add("../x", "0 8 * * *", lambda: None)
    with pytest.raises(InvalidInput, match="unknown hint action"):
        sched.add("c", "0 8 * * *", "prefetch")
    with pytest.raises(InvalidInput, match="callable"):
        sched.add("d", "0 8 * * *", 42)  # type: ignore[arg-type]
    small = HintScheduler(FakeClock(), max_schedules=1)
    small.add("x", "@daily", lambda: None)
    with pytest.raises(InvalidInput, match="too many"):
        small.add("y", "@daily", lambda: None)


def test_run_due_awaits_async_actions_and_isolates_failures() -> None:
    clock = FakeClock(utc(2026, 3, 2, 7, 59))
    sched = HintScheduler(clock)
    ran: list[str] = []

    async def prefetch() -> int:
        await asyncio.sleep(0)
        ran.append("async")
        return 3

    def boom() -> None:
        raise RuntimeError("origin down")

    sched.add("a", "0 8 * * *", prefetch)
    sched.add("b", "0 8 * * *", boom)
    sched.add("c", "0 8 * * *", lambda: ran.append("sync"))
    clock.advance(60)
    results = asyncio.run(sched.run_due())
    assert ran == ["async", "sync"]
    assert results["a"] is None and results["c"] is None and isinstance(results["b"], RuntimeError)


def test_named_schedules_survive_restart(tmp_path: Path) -> None:
    path = tmp_path / "edge" / "hints.json"
    clock = FakeClock(utc(2026, 3, 2, 7, 0))
    calls: list[dict] = []
    actions = {"prefetch": lambda params: calls.append(dict(params))}
    sched = HintScheduler(clock, path=path, actions=actions)
    sched.add("manual", "0 8 * * 1-5", "prefetch", params={"tenant": "acme", "document": "manual.md"})
    sched.add("inmem", "0 8 * * *", lambda: None)  # a callable: not persisted
    doc = json.loads(path.read_text())
    assert [r["id"] for r in doc["schedules"]] == ["manual"]

    # restart before 08:00; the edge is down over 08:00 and comes back at 08:30
    clock.advance(90 * 60)
    again = HintScheduler(clock, path=path, actions=actions)
    assert [i.schedule_id for i in again.list()] == ["manual"]
    info = again.get("manual")
    assert info is not None and info.persistent and info.bound and info.next_fire == utc(2026, 3, 2, 8, 0)
    for d in again.due():
        d()
    assert calls == [{"tenant": "acme", "document": "manual.md"}]
    assert HintScheduler(clock, path=path, actions=actions).get("manual").next_fire == utc(2026, 3, 3, 8, 0)  # type: ignore[union-attr]
    # cancel is persisted too
    again.cancel("manual")
    assert HintScheduler(clock, path=path, actions=actions).list() == []


def test_unknown_action_on_restart_is_kept_but_not_run(tmp_path: Path) -> None:
    path = tmp_path / "hints.json"
    clock = FakeClock(utc(2026, 3, 2, 7, 0))
    HintScheduler(clock, path=path, actions={"warm": lambda p: None}).add("w", "0 8 * * *", "warm")
    clock.advance(3 * 3600)
    other = HintScheduler(clock, path=path)
    assert other.due() == [] and other.next_wakeup() is None
    (info,) = other.list()
    assert not info.bound and info.action == "warm"
    other.add("x", "@daily", lambda: None)  # an in-memory add does not rewrite the file
    assert [r["id"] for r in json.loads(path.read_text())["schedules"]] == ["w"]


def test_bad_schedules_file_is_a_clear_config_error(tmp_path: Path) -> None:
    path = tmp_path / "hints.json"
    for body in ("{not json", '{"schedules": 3}', '{"schedules": [{"id": "a", "cron": "99 * * * *", '
                 '"action": "x", "next_fire": "2026-01-01T00:00:00+00:00"}]}', '{"version": 99, "schedules": []}'):
        path.write_text(body)
        with pytest.raises(ConfigError, match="hints.json"):
            HintScheduler(FakeClock(), path=path, actions={"x": lambda p: None})
    # a killed writer's temporary is ignored and swept
    path.unlink()
    tmp = tmp_path / ".hints.json.123.tmp"
    tmp.write_text("{partial")
    assert HintScheduler(FakeClock(), path=path).list() == []
    assert not tmp.exists()


def test_params_must_be_json() -> None:
    sched = HintScheduler(FakeClock(), actions={"p": lambda params: None})
    with pytest.raises(InvalidInput, match="JSON"):
        sched.add("a", "@daily", "p", params={"x": object()})
    with pytest.raises(InvalidInput, match="exceed"):
        sched.add("a", "@daily", "p", params={"x": "y" * 70_000})


def test_real_clock_works_too() -> None:
    sched = HintScheduler(MonotonicClock())
    info = sched.add("a", "* * * * *", lambda: None)
    now = datetime.now(timezone.utc)
    assert now < info.next_fire <= now + timedelta(minutes=1)
