"""The operator's schedules: the scheduler that fires hint actions at cron times, and its file.

Operators know when a document is hot ("the policy manual, every weekday at 08:00"); a schedule
turns that into a prefetch (or any other hint action) shortly before it is needed. When a schedule
fires is a cron expression (:mod:`kdn.edge.cron`).

**The scheduler** (:class:`HintScheduler`) holds schedules ``id -> (cron, action)`` and, asked
:meth:`~HintScheduler.due` at some instant, returns the actions whose fire time has come and moves
each schedule to its next fire time after that instant. A schedule that missed several fire times
(the edge was down, the loop stalled) runs once, not once per missed time. It never sleeps or
spawns anything itself: the edge's event loop asks :meth:`~HintScheduler.next_wakeup`, sleeps, and
runs what :meth:`~HintScheduler.due` returns (or calls :meth:`~HintScheduler.run_due`).

An action is either a plain or async callable taking no arguments (kept in memory only: code is
not persisted, since that would need pickle), or the *name* of an action registered with the
scheduler plus JSON parameters; named schedules are saved to a JSON file (with the tree's one
atomic writer, :func:`kdn.blobstore.write_json_atomic`: temp file, fsync, rename, fsync the
directory) when the scheduler has a ``path``, and restored — with their pending fire time, so a
fire missed while the edge was down runs right after restart — when it is reopened. The edge keeps
that file beside its disk tier as :data:`SCHEDULES_FILE`.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kdn.blobstore import sweep_file_tmp, write_json_atomic
from kdn.edge.clock import Clock, MonotonicClock
from kdn.edge.cron import CronSchedule, as_utc
from kdn.errors import ConfigError, InvalidInput, KdnError

__all__ = ["SCHEDULES_FILE", "DueAction", "HintScheduler", "ScheduleInfo", "schedules_file"]

log = logging.getLogger(__name__)

SCHEDULES_FILE = ".hint-schedules.json"
"""The edge's named hint schedules, beside its disk tier (a dot-file: no tenant may take the name)."""


Action = Callable[[], Any]
"""A zero-argument callable; if it returns an awaitable, :meth:`HintScheduler.run_due` awaits it."""
NamedAction = Callable[[Mapping[str, Any]], Any]
"""A registered action: called with the schedule's JSON parameters."""

_ID_RE = re.compile(r"^(?!\.)[A-Za-z0-9_.\-]{1,128}(/[A-Za-z0-9_.\-]{1,128})?$")
"""A schedule id; an edge scopes the ids its tenants choose as ``tenant/id`` (one namespace per tenant)."""
_FILE_VERSION = 1
_MAX_PARAMS_BYTES = 64 * 1024


def schedules_file(state_dir: str | Path) -> Path:
    """The edge's schedules file in ``state_dir`` (its disk tier's root)."""
    return Path(state_dir) / SCHEDULES_FILE


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
    name one are persisted to ``path`` (a JSON file, on an edge :func:`schedules_file`).
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
        start = as_utc(now) if now is not None else self._clock.now()
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
        at = as_utc(now) if now is not None else self._clock.now()
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
        write_json_atomic(self._path, {"version": _FILE_VERSION, "schedules": records}, indent=1, sort_keys=True)

    def _load(self) -> None:
        assert self._path is not None
        sweep_file_tmp(self._path)  # a writer killed before its rename
        try:
            text = self._path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as exc:
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
                    next_fire=as_utc(datetime.fromisoformat(rec["next_fire"])),
                    action_name=str(rec["action"]),
                    params=_check_params(rec.get("params")),
                    last_fire=as_utc(datetime.fromisoformat(rec["last_fire"])) if rec.get("last_fire") else None,
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
        except (KdnError, ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
            raise ConfigError(f"hint schedules file {self._path} is invalid: {type(exc).__name__}: {exc}") from exc


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
