"""Cron expressions: when a hint schedule fires (pure; no clock, no I/O).

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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from kdn.errors import InvalidInput

__all__ = ["CronSchedule", "as_utc", "parse_cron"]

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
        t = as_utc(when)
        return (
            t.month in self.months and self._day_ok(t) and t.hour in self.hours and t.minute in self.minutes
        )

    def next_fire(self, after: datetime) -> datetime | None:
        """The first fire time strictly after ``after`` (aware UTC, whole minute), or None if the
        expression never fires (only possible for expressions :meth:`parse` refuses)."""
        t = as_utc(after).replace(second=0, microsecond=0) + timedelta(minutes=1)
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


def as_utc(when: datetime) -> datetime:
    if when.tzinfo is None:
        return when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc)

