"""How commands talk to a person: one shape for every failure.

Every ``kdn`` command reports errors through :func:`report_error`, so scripts parsing ``--json``
see one schema and people see one line, whichever role raised it. The schema, with ``--json``:
one object on stdout, ``{"error": KIND, "message": TEXT}`` (KIND is the class name from
:mod:`kdn.errors`, or ``UsageError`` for a bad flag), possibly with the command's own keys
beside them, and a non-zero exit code. Without ``--json``: one line on stderr.
"""

from __future__ import annotations

import json
import re
import sys

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
