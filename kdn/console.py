"""How commands talk to a person: one shape for every failure.

Every ``kdn`` command reports errors through :func:`report_error`, so scripts parsing ``--json``
see one schema and people see one line, whichever role raised it.
"""

from __future__ import annotations

import json
import sys


def report_error(prog: str, exc: BaseException, /, *, as_json: bool, **extra: object) -> None:
    """How every command reports a failure: one JSON object on stdout with ``--json``
    (``{"error": <exception class>, "message": ...}``), else one line on stderr."""
    if as_json:
        print(json.dumps({**extra, "error": type(exc).__name__, "message": str(exc)}))
    else:
        print(f"kdn {prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
