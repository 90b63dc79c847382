"""The operator's schedule: cron expressions and the scheduler that fires hint actions (no networking).

Operators know when a document is hot ("the policy manual, every weekday at 08:00"); a schedule
turns that into a prefetch (or any other hint action) shortly before it is needed.

**Cron expressions** (:class:`CronSchedule`) are the classic five fields, evaluated in UTC::

    minute  hour  day-of-month  month  day-of-week
    0-59    0-23  1-31          1-12   0-7 (0 and 7 are Sunday)

Each field is ``*``, a value, a range ``a-b``, a step ``*/n``, ``a-b/n`` or ``a/n`` (from ``a`` to
the field's end), or a comma-separated list of those. Months and weekdays also take English
three-letter names (``jan``, ``mon-fri``). ``@hourly``, ``@daily``/``@midnight``, ``@weekly``,
``@monthly`` and ``@yearly``/``@annually`` are accepted. As in Vixie cron, when both day fields
are restricted (neither starts with ``*``) a day matches if *either* matches; otherwise both must.
A malformed expression raises :class:`~kdn.errors.InvalidInput` naming the field; one that can
never fire ("0 0 30 2 *") is refused too.

**The scheduler** (:class:`HintScheduler`) holds schedules ``id -> (cron, action)`` and, asked
:meth:`~HintScheduler.due` at some instant, returns the actions whose fire time has come and moves
each schedule to its next fire time after that instant. A schedule that missed several fire times
(the edge was down, the loop stalled) runs once, not once per missed time. It never sleeps or
spawns anything itself: the edge's event loop asks :meth:`~HintScheduler.next_wakeup`, sleeps, and
runs what :meth:`~HintScheduler.due` returns (or calls :meth:`~HintScheduler.run_due`).

An action is either a plain or async callable taking no arguments (kept in memory only: code is
not persisted, since that would need pickle), or the *name* of an action registered with the
scheduler plus JSON parameters; named schedules are saved to a JSON file (atomically: temp file,
fsync, rename) when the scheduler has a ``path``, and restored — with their pending fire time, so
a fire missed while the edge was down runs right after restart — when it is reopened.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from kdn.edge.clock import Clock, MonotonicClock
from kdn.errors import ConfigError, InvalidInput, KdnError

__all__ = ["CronSchedule", "DueAction", "HintScheduler", "ScheduleInfo", "parse_cron"]

log = logging.getLogger(__name__)

Action = Callable[[], Any]
"""A zero-argument callable; if it returns an awaitable, :meth:`HintScheduler.run_due` awaits it."""
NamedAction = Callable[[Mapping[str, Any]], Any]
"""A registered action: called with the schedule's JSON parameters."""

_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_FILE_VERSION = 1
_MAX_PARAMS_BYTES = 64 * 1024
_SEARCH_YEARS = 29  # the Gregorian weekday/leap pattern repeats within 28 years

_MONTHS = {m: i for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split(), start=1)}
_WEEKDAYS = {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}
_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# name, lowest, highest, names
_FIELDS: tuple[tuple[str, int, int, Mapping[str, int]], ...] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day-of-month", 1, 31, {}),
    ("month", 1, 12, _MONTHS),
    ("day-of-week", 0, 7, _WEEKDAYS),
)


# ------------------------------------------------------------------------------------------------
# cron expressions


@dataclass(frozen=True, slots=True)
class CronSchedule:
    """A parsed cron expression (UTC). Build with :meth:`parse`."""

    expr: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday ... 6 = Saturday
    days_restricted: bool  # the day-of-month field does not start with "*"
    weekdays_restricted: bool

    @classmethod
    def parse(cls, expr: str) -> "CronSchedule":
        if not isinstance(expr, str):
            raise InvalidInput(f"cron expression must be a string, got {type(expr).__name__}")
        text = expr.strip()
        text = _MACROS.get(text.lower(), text)
        parts = text.split()
        if len(parts) != 5:
            raise InvalidInput(
                f"cron expression {expr!r} has {len(parts)} fields; expected 5: "
                "minute hour day-of-month month day-of-week"
            )
        sets = [_parse_field(expr, part, *spec) for part, spec in zip(parts, _FIELDS)]
        weekdays = frozenset(d % 7 for d in sets[4])
        sched = cls(
            expr=expr.strip(),
            minutes=tuple(sorted(sets[0])),
            hours=tuple(sorted(sets[1])),
            days=frozenset(sets[2]),
            months=frozenset(sets[3]),
            weekdays=weekdays,
            days_restricted=not parts[2].startswith("*"),
            weekdays_restricted=not parts[4].startswith("*"),
        )
        if sched.next_fire(datetime(2000, 1, 1, tzinfo=timezone.utc)) is None:
            raise InvalidInput(
                f"cron expression {expr!r} never fires: no day-of-month {sorted(sched.days)} "
                f"exists in month {sorted(sched.months)}"
            )
        return sched

    def _day_ok(self, day: datetime) -> bool:
        dom = day.day in self.days
        dow = (day.weekday() + 1) % 7 in self.weekdays  # Python: Monday = 0; cron: Sunday = 0
        if self.days_restricted and self.weekdays_restricted:
            return dom or dow
        return dom and dow

    def matches(self, when: datetime) -> bool:
        """Does the minute containing ``when`` (UTC) fire?"""
        t = _as_utc(when)
        return (
            t.month in self.months and self._day_ok(t) and t.hour in self.hours and t.minute in self.minutes
        )

    def next_fire(self, after: datetime) -> datetime | None:
        """The first fire time strictly after ``after`` (aware UTC, whole minute), or None if the
        expression never fires (only possible for expressions :meth:`parse` refuses)."""
        t = _as_utc(after).replace(second=0, microsecond=0) + timedelta(minutes=1)
        limit = t.year + _SEARCH_YEARS
        while t.year < limit:
            if t.month not in self.months:
                t = _first_of_next_month(t)
                continue
            if not self._day_ok(t):
                t = (t + timedelta(days=1)).replace(hour=0, minute=0)
                continue
            if t.hour not in self.hours:
                nxt = _next_in(self.hours, t.hour)
                if nxt is None:
                    t = (t + timedelta(days=1)).replace(hour=0, minute=0)
                else:
                    t = t.replace(hour=nxt, minute=0)
                continue
            if t.minute not in self.minutes:
                nxt = _next_in(self.minutes, t.minute)
                if nxt is None:
                    t = t.replace(minute=0) + timedelta(hours=1)
                else:
                    t = t.replace(minute=nxt)
                continue
            return t
        return None

    def __str__(self) -> str:
        return self.expr


def parse_cron(expr: str) -> CronSchedule:
    """Shorthand for :meth:`CronSchedule.parse`."""
    return CronSchedule.parse(expr)


def _parse_field(expr: str, text: str, name: str, lo: int, hi: int, names: Mapping[str, int]) -> set[int]:
    def bad(why: str) -> InvalidInput:
        return InvalidInput(f"cron expression {expr!r}: {name} field {text!r}: {why}")

    def value(token: str) -> int:
        token_l = token.lower()
        if token_l in names:
            return names[token_l]
        if not token.isdigit() or not token.isascii():
            raise bad(f"{token!r} is not a number" + (f" or a name ({', '.join(names)})" if names else ""))
        v = int(token)
        if not lo <= v <= hi:
            raise bad(f"{v} is out of range {lo}-{hi}")
        return v

    out: set[int] = set()
    for item in text.split(","):
        if not item:
            raise bad("empty list item")
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or not step_text.isascii() or int(step_text) == 0:
                raise bad(f"step {step_text!r} must be a positive integer")
            step = int(step_text)
        if base == "*":
            start, end = lo, hi
        elif "-" in base:
            a, _, b = base.partition("-")
            start, end = value(a), value(b)
            if start > end:
                raise bad(f"range {base!r} runs backwards")
        else:
            start = value(base)
            end = hi if slash else start
        out.update(range(start, end + 1, step))
    return out


def _next_in(sorted_values: tuple[int, ...], current: int) -> int | None:
    for v in sorted_values:
        if v > current:
            return v
    return None


def _first_of_next_month(t: datetime) -> datetime:
    if t.month == 12:
        return t.replace(year=t.year + 1, month=1, day=1, hour=0, minute=0)
    return t.replace(month=t.month + 1, day=1, hour=0, minute=0)


def _as_utc(when: datetime) -> datetime:
    if when.tzinfo is None:
        return when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc)


# ------------------------------------------------------------------------------------------------
# the scheduler


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """A snapshot of one schedule, for listings."""

    schedule_id: str
    cron: str
    next_fire: datetime
    last_fire: datetime | None
    runs: int
    action: str  # the registered action's name, or "" for an in-memory callable
    params: Mapping[str, Any]
    persistent: bool
    bound: bool  # False: restored from disk but no action of that name is registered


@dataclass(frozen=True, slots=True)
class DueAction:
    """One schedule's action that is due. Call it (and await the result if it is awaitable)."""

    schedule_id: str
    fire_time: datetime
    run: Action

    def __call__(self) -> Any:
        return self.run()


@dataclass(slots=True)
class _Schedule:
    schedule_id: str
    cron: CronSchedule
    next_fire: datetime
    action_name: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    fn: Action | None = None
    last_fire: datetime | None = None
    runs: int = 0
    last_error: str = ""


class HintScheduler:
    """Cron schedules of hint actions (see the module docstring). Thread-safe.

    ``actions`` maps action names to callables taking the schedule's parameters; schedules that
    name one are persisted to ``path`` (a JSON file, typically ``<disk_dir>/hints.json``).
    """

    def __init__(
        self,
        clock: Clock | None = None,
        *,
        path: str | Path | None = None,
        actions: Mapping[str, NamedAction] | None = None,
        max_schedules: int = 10_000,
    ) -> None:
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._path = Path(path) if path is not None else None
        self._actions: dict[str, NamedAction] = dict(actions or {})
        self._max = max_schedules
        self._lock = threading.Lock()
        self._schedules: dict[str, _Schedule] = {}
        if self._path is not None:
            self._load()

    # -- public API ----------------------------------------------------------------------------

    def add(
        self,
        schedule_id: str,
        cron: str,
        action: Action | str,
        *,
        params: Mapping[str, Any] | None = None,
        now: datetime | None = None,
    ) -> ScheduleInfo:
        """Add (or replace) a schedule; it first fires at the first cron time after ``now``.

        ``action`` is a zero-argument callable (not persisted) or the name of a registered action
        (persisted with ``params``, which must be JSON-able and at most 64 KiB).
        """
        if not isinstance(schedule_id, str) or not _ID_RE.match(schedule_id):
            raise InvalidInput(f"schedule id must match {_ID_RE.pattern}, got {schedule_id!r}")
        sched = CronSchedule.parse(cron)
        start = _as_utc(now) if now is not None else self._clock.now()
        nxt = sched.next_fire(start)
        assert nxt is not None  # parse refuses expressions that never fire
        entry = _Schedule(schedule_id, sched, nxt)
        if isinstance(action, str):
            if action not in self._actions:
                known = ", ".join(sorted(self._actions)) or "none"
                raise InvalidInput(f"unknown hint action {action!r} (registered: {known})")
            entry.action_name = action
            entry.params = _check_params(params)
        elif callable(action):
            if params:
                raise InvalidInput("params go with a named action, not with a callable")
            entry.fn = action
        else:
            raise InvalidInput(f"a schedule's action must be callable or an action name, got {type(action).__name__}")
        with self._lock:
            if schedule_id not in self._schedules and len(self._schedules) >= self._max:
                raise InvalidInput(f"too many schedules (limit {self._max})")
            self._schedules[schedule_id] = entry
            info = self._info(entry)
            if entry.action_name:
                self._save()
        return info

    def cancel(self, schedule_id: str) -> bool:
        """Remove a schedule; False if there was none of that id."""
        with self._lock:
            entry = self._schedules.pop(schedule_id, None)
            if entry is not None and entry.action_name:
                self._save()
        return entry is not None

    def get(self, schedule_id: str) -> ScheduleInfo | None:
        with self._lock:
            entry = self._schedules.get(schedule_id)
            return None if entry is None else self._info(entry)

    def list(self) -> list[ScheduleInfo]:
        """Every schedule, soonest first."""
        with self._lock:
            return sorted((self._info(e) for e in self._schedules.values()), key=lambda i: (i.next_fire, i.schedule_id))

    def next_wakeup(self) -> datetime | None:
        """When the next schedule fires (None when there are none)."""
        with self._lock:
            times = [e.next_fire for e in self._schedules.values() if self._bound(e)]
            return min(times) if times else None

    def due(self, now: datetime | None = None) -> list[DueAction]:
        """Actions whose fire time is at or before ``now`` (default: the clock's now), soonest first.

        Each returned schedule moves on to its first fire time after ``now``; a schedule that
        missed several fire times is returned once. Unbound restored schedules are skipped.
        """
        at = _as_utc(now) if now is not None else self._clock.now()
        out: list[DueAction] = []
        with self._lock:
            for entry in sorted(self._schedules.values(), key=lambda e: (e.next_fire, e.schedule_id)):
                if entry.next_fire > at or not self._bound(entry):
                    continue
                fire_time = entry.next_fire
                nxt = entry.cron.next_fire(at)
                assert nxt is not None
                entry.next_fire = nxt
                entry.last_fire = fire_time
                entry.runs += 1
                out.append(DueAction(entry.schedule_id, fire_time, self._runner(entry)))
            if any(self._schedules[d.schedule_id].action_name for d in out):
                self._save()
        return out

    async def run_due(self, now: datetime | None = None) -> dict[str, BaseException | None]:
        """Run every due action (awaiting async ones); one failing does not stop the others.

        Returns ``schedule_id -> None`` (ran) or the exception it raised (also logged and kept as
        the schedule's ``last_error``).
        """
        results: dict[str, BaseException | None] = {}
        for item in self.due(now):
            try:
                result = item()
                if inspect.isawaitable(result):
                    await result
                results[item.schedule_id] = None
            except Exception as exc:  # noqa: BLE001 - an operator's action must not stop the loop
                log.warning("scheduled hint %s failed: %s", item.schedule_id, exc)
                results[item.schedule_id] = exc
                with self._lock:
                    entry = self._schedules.get(item.schedule_id)
                    if entry is not None:
                        entry.last_error = f"{type(exc).__name__}: {exc}"
        return results

    # -- internals -----------------------------------------------------------------------------

    def _bound(self, entry: _Schedule) -> bool:
        return entry.fn is not None or entry.action_name in self._actions

    def _runner(self, entry: _Schedule) -> Action:
        if entry.fn is not None:
            return entry.fn
        fn, params = self._actions[entry.action_name], dict(entry.params)
        return lambda: fn(params)

    def _info(self, entry: _Schedule) -> ScheduleInfo:
        return ScheduleInfo(
            schedule_id=entry.schedule_id,
            cron=entry.cron.expr,
            next_fire=entry.next_fire,
            last_fire=entry.last_fire,
            runs=entry.runs,
            action=entry.action_name,
            params=dict(entry.params),
            persistent=bool(entry.action_name),
            bound=self._bound(entry),
        )

    def _save(self) -> None:
        """Write the named schedules to ``path`` atomically (caller holds the lock)."""
        if self._path is None:
            return
        records = [
            {
                "id": e.schedule_id,
                "cron": e.cron.expr,
                "action": e.action_name,
                "params": e.params,
                "next_fire": e.next_fire.isoformat(),
                "last_fire": e.last_fire.isoformat() if e.last_fire else None,
                "runs": e.runs,
            }
            for e in self._schedules.values()
            if e.action_name
        ]
        body = json.dumps({"version": _FILE_VERSION, "schedules": records}, indent=1, sort_keys=True)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self._path)
            fd = os.open(self._path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _load(self) -> None:
        assert self._path is not None
        for stale in self._path.parent.glob(f".{self._path.name}.*.tmp"):
            stale.unlink(missing_ok=True)  # a writer killed before its rename
        try:
            text = self._path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ConfigError(f"cannot read hint schedules {self._path}: {exc}") from exc
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or not isinstance(doc.get("schedules"), list):
                raise ValueError("expected an object with a 'schedules' list")
            if doc.get("version", 0) > _FILE_VERSION:
                raise ValueError(f"file version {doc.get('version')} is newer than this edge ({_FILE_VERSION})")
            for rec in doc["schedules"]:
                entry = _Schedule(
                    schedule_id=_check_id(rec["id"]),
                    cron=CronSchedule.parse(rec["cron"]),
                    next_fire=_as_utc(datetime.fromisoformat(rec["next_fire"])),
                    action_name=str(rec["action"]),
                    params=_check_params(rec.get("params")),
                    last_fire=_as_utc(datetime.fromisoformat(rec["last_fire"])) if rec.get("last_fire") else None,
                    runs=int(rec.get("runs", 0)),
                )
                if not entry.action_name:
                    raise ValueError(f"schedule {entry.schedule_id!r} has no action name")
                if entry.action_name not in self._actions:
                    log.warning(
                        "hint schedule %s names unknown action %r: kept, but it will not run",
                        entry.schedule_id, entry.action_name,
                    )
                self._schedules[entry.schedule_id] = entry
        except (KdnError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"hint schedules file {self._path} is invalid: {exc}") from exc


def _check_id(value: object) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidInput(f"schedule id must match {_ID_RE.pattern}, got {value!r}")
    return value


def _check_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise InvalidInput(f"schedule params must be a JSON object, got {type(params).__name__}")
    try:
        text = json.dumps(params, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"schedule params must be JSON-serialisable: {exc}") from exc
    if len(text) > _MAX_PARAMS_BYTES:
        raise InvalidInput(f"schedule params of {len(text)} bytes exceed {_MAX_PARAMS_BYTES}")
    return json.loads(text)  # a private, plain copy
