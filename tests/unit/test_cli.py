"""The ``kdn`` dispatcher: lists every DESIGN.md command, rejects unknown ones with exit code 2."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest

from kdn.ops import cli

DESIGN_COMMANDS = ("demo", "up", "down", "origin", "ingest", "edge", "query", "stats", "simulate", "tune")


def test_help_lists_every_design_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.strip()}
    missing = set(DESIGN_COMMANDS) - listed
    assert not missing, f"kdn --help does not list {sorted(missing)}"
    assert "--json" in out


@pytest.mark.parametrize("argv", [[], ["-h"], ["help"]])
def test_no_arguments_prints_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 0
    assert "usage: kdn" in capsys.readouterr().out


def test_unknown_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err


def test_console_script_help_and_unknown_command() -> None:
    """The installed entry point, in a fresh process: fast, and no torch import just for --help."""
    code = (
        "import sys; from kdn.ops.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'kdn --help imported torch'; sys.exit(rc)"
    )
    ok = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    for name in DESIGN_COMMANDS:
        assert f"  {name} " in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "kdn.ops.cli", "no-such-command"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2
    assert "unknown command" in bad.stderr


def test_every_command_target_is_well_formed() -> None:
    names = [c.name for c in cli.COMMANDS]
    assert len(names) == len(set(names))
    for c in cli.COMMANDS:
        module, _, func = c.target.partition(":")
        assert module and func, c


def test_every_command_target_resolves() -> None:
    """Each listed command names a function that exists (the dispatcher imports it without a fallback)."""
    import importlib

    for c in cli.COMMANDS:
        module, _, func = c.target.partition(":")
        assert callable(getattr(importlib.import_module(module), func, None)), c


def test_a_reader_that_left_ends_the_command_quietly(tmp_path) -> None:
    """`kdn stats | head` (issue 17 item 9): the pipe closes early; no BrokenPipeError traceback."""
    import os

    r, w = os.pipe()
    os.close(r)  # the reader has gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "kdn.ops.cli", "down", "--state-dir", str(tmp_path)], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert proc.stderr == "" and proc.returncode == 141, proc.stderr


@pytest.mark.parametrize("argv, kind", [
    (["simulate", "/nonexistent/scenario.yaml", "--json"], "ConfigError"),
    (["tune", "/nonexistent/scenario.yaml", "--json"], "ConfigError"),
    (["model", "info", "/nonexistent/model", "--json"], "UnknownModel"),
    (["stats", "--json", "--no-such-flag"], "UsageError"),
    (["up", "--json", "--edge-nodes", "0"], "ConfigError"),
    (["edge", "--json", "--listen", "127.0.0.1:0", "--tls-cert", "/nonexistent.pem"], "ConfigError"),
])
def test_json_errors_are_one_json_object_on_stdout(argv: list[str], kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 17 item 11: with --json, a failure is {"error": KIND, "message": ...} on stdout."""
    with pytest.raises(SystemExit) if kind == "UsageError" else contextlib.nullcontext() as raised:
        rc = cli.main(argv)
    rc = raised.value.code if kind == "UsageError" else rc
    out, err = capsys.readouterr()
    assert rc != 0 and err == ""
    answer = json.loads(out)
    assert answer["error"] == kind and answer["message"], answer
