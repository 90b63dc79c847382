"""The ``kdn`` command: one entry point, one module per command.

Each command lives in the module that owns it and exposes ``main(argv) -> int``; this file only
dispatches, so ``kdn --help`` stays fast (no torch or Ray import) and a command that a later piece
of work fills in says so instead of pretending.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Iterator, NoReturn

from kdn.console import report_error
from kdn.errors import KdnError



@dataclass(frozen=True, slots=True)
class Command:
    name: str
    target: str  # "module:function"
    summary: str


COMMANDS: tuple[Command, ...] = (
    Command("demo", "kdn.ops.demo:main", "local cluster + sample documents + TTFT table: recompute vs reuse"),
    Command("up", "kdn.ops.cluster:main_up", "start (or join) a Ray cluster with origin and edge roles"),
    Command("down", "kdn.ops.cluster:main_down", "stop exactly what `kdn up` started"),
    Command("origin", "kdn.origin.cli:main_origin", "run an origin (gRPC serving + compute on demand)"),
    Command("ingest", "kdn.origin.cli:main_ingest", "turn documents into KV artifacts in the origin store"),
    Command("edge", "kdn.edge.cli:main", "run an edge node, or send it hints (pin, ttl, schedule ...)"),
    Command("query", "kdn.ops.query:main", "run one request through an edge and print the TTFT breakdown"),
    Command("route", "kdn.route.cli:main", "KV-aware router: send each request to the host where its KV is cheapest"),
    Command("stats", "kdn.edge.cli:main_stats", "show an edge's or origin's counters"),
    Command("simulate", "kdn.simulator.cli:main_simulate", "run a WAN simulation scenario"),
    Command("tune", "kdn.simulator.cli:main_tune", "search placement settings; print the cost/TTFT Pareto front"),
    Command("model", "kdn.ops.model:main", "models: `kdn model list`, `info`, `path`, `check-tokens`, `train-reference`"),
    Command("eval-codec", "kdn.lab.quality:main", "judge a codec by what the model does with decoded KV"),
    Command("eval-blend", "kdn.lab.blend_eval:main", "judge document blending (non-prefix reuse) against full prefill and baselines"),
    Command("eval-steer", "kdn.lab.steer_eval:main", "judge steered KV on the trained model: deficit, calibration, marks of every kind"),
)


def _usage() -> str:
    width = max(len(c.name) for c in COMMANDS)
    lines = ["usage: kdn COMMAND [ARGS...]   (kdn COMMAND --help for each)", "", "commands:"]
    lines += [f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS]
    lines += ["", "Every command accepts --json for machine-readable output; with it, an error is one JSON",
              'object on stdout too: {"error": KIND, "message": TEXT}, with a non-zero exit code.']
    return "\n".join(lines)


@contextlib.contextmanager
def _usage_errors_as_json(on: bool) -> Iterator[None]:
    """With ``--json``, argparse's usage errors (unknown flag, missing argument) are JSON too:
    ``{"error": "UsageError", "message": ...}`` on stdout, exit code 2, like every other error."""
    if not on:
        yield
        return
    original = argparse.ArgumentParser.error

    def error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
        print(json.dumps({"error": "UsageError", "message": f"{parser.prog}: {message}"}))
        sys.exit(2)

    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from importlib.metadata import version

        print(version("kdn"))
        return 0
    by_name = {c.name: c for c in COMMANDS}
    cmd = by_name.get(argv[0])
    if cmd is None:
        print(f"kdn: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name = cmd.target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    as_json = "--json" in argv[1:]
    try:
        with _usage_errors_as_json(as_json):
            rc = int(func(argv[1:]) or 0)
        sys.stdout.flush()
    except KdnError as exc:  # a command that let one through: still the one shape
        report_error(cmd.name, exc, as_json=as_json)
        return 1
    except BrokenPipeError:
        # `kdn stats | head`: the reader has gone; end quietly, as `cat` does (Python's recipe:
        # point stdout at devnull so the interpreter's own flush at exit cannot fail again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command that a pipe ended
    return rc


if __name__ == "__main__":
    sys.exit(main())
