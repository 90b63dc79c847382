"""How commands talk to a person: one shape for every failure.

Every ``kdn`` command reports errors through :func:`report_error`, so scripts parsing ``--json``
see one schema and people see one line, whichever role raised it. The schema, with ``--json``:
one object on stdout, ``{"error": KIND, "message": TEXT}`` (KIND is the class name from
:mod:`kdn.errors`, or ``UsageError`` for a bad flag), possibly with the command's own keys
beside them, and a non-zero exit code. Without ``--json``: one line on stderr.

Long commands say what they are doing with :class:`StageLines`, one plain line per stage on stderr
(stdout stays the result), and print the first one before importing torch, transformers or Ray.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

__all__ = ["StageLines", "plain", "report_error"]

_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def plain(text: str) -> str:
    """A docstring's text for a terminal: ````kdn demo```` -> ``kdn demo``, ``:class:`X``` -> ``X``.
    For ``--help`` descriptions taken from module docstrings (argparse prints markup as is)."""
    return _RST_ROLE.sub(r"\1", text).replace("``", "`")


def report_error(prog: str, exc: BaseException, /, *, as_json: bool, **extra: object) -> None:
    """How every command reports a failure: one JSON object on stdout with ``--json``
    (``{"error": <exception class>, "message": ...}``), else one line on stderr."""
    if as_json:
        print(json.dumps({**extra, "error": type(exc).__name__, "message": str(exc)}))
    else:
        print(f"kdn {prog}: {type(exc).__name__}: {exc}", file=sys.stderr)


class StageLines:
    """One plain line per stage on ``stream`` (stderr): ``ingest [  12.3s] what happens now``.

    ``stream=None`` writes nothing. The elapsed time counts from construction (``clock``)."""

    def __init__(self, stream: TextIO | None, *, prog: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.prog = prog
        self.clock = clock
        self.t0 = clock()
        self.last = self.t0

    def line(self, msg: str) -> None:
        if self.stream is None:
            return
        self.last = self.clock()
        print(f"{self.prog} [{self.last - self.t0:7.1f}s] {msg}", file=self.stream, flush=True)

    @contextmanager
    def ongoing(self, what: str, *, every_s: float = 15.0) -> Iterator[None]:
        """Say ``what`` now and, until the block ends, ``still busy: <what> (Ns so far)`` every
        ``every_s`` seconds (from a thread), so one long step (a prefill) is not a silence."""
        self.line(what)
        if self.stream is None or every_s <= 0:
            yield
            return
        stop = threading.Event()
        since = self.clock()

        def beat() -> None:
            while not stop.wait(every_s):
                self.line(f"still busy: {what} ({self.clock() - since:.0f}s so far)")

        thread = threading.Thread(target=beat, name=f"{self.prog}-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)
