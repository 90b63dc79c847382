"""Every `kdn` subcommand's --help reads cleanly (issue 17 item 12).

Each command's parser is caught as the command builds it (``parse_args`` is intercepted before
anything runs), then checked: every option and positional has help text, and neither the
description nor any help carries reStructuredText (````literal````, ``:class:`...```` and the like),
which argparse would print as is. Subcommands (``kdn model info``, ``kdn edge pin`` ...) too.
"""

from __future__ import annotations

import argparse
import importlib
import re

import pytest

from kdn.edge.cli import HINT_COMMANDS
from kdn.ops.cli import COMMANDS

RST = re.compile(r"``|:(class|func|mod|meth|attr|data|exc|obj|ref|doc):`|^\s*\.\. |::\s*$", re.M)


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(argv_head: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    def catch(self: argparse.ArgumentParser, *a: object, **k: object) -> None:
        raise _Caught(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    cmd = {c.name: c for c in COMMANDS}[argv_head[0]]
    module, func = cmd.target.split(":")
    with pytest.raises(_Caught) as caught:
        getattr(importlib.import_module(module), func)(argv_head[1:] + ["--help"])
    return caught.value.parser


def _problems(parser: argparse.ArgumentParser, where: str) -> list[str]:
    out = []
    for text in (parser.description or "", parser.epilog or ""):
        if RST.search(text):
            out.append(f"{where}: reStructuredText in its description: {text[:120]!r}")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for sub, subparser in action.choices.items():
                if not helps.get(sub):
                    out.append(f"{where} {sub}: no help line in {where} --help")
                out += _problems(subparser, f"{where} {sub}")
            continue
        if not action.help or action.help == argparse.SUPPRESS:
            out.append(f"{where} {name}: no help text")
        elif RST.search(action.help):
            out.append(f"{where} {name}: reStructuredText in its help: {action.help!r}")
    return out


COMMAND_LINES = [[c.name] for c in COMMANDS] + [["edge", h] for h in HINT_COMMANDS]


@pytest.mark.parametrize("head", COMMAND_LINES, ids=" ".join)
def test_every_option_has_help_and_no_markup(head: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    parser = _parser_of(head, monkeypatch)
    problems = _problems(parser, "kdn " + " ".join(head))
    assert not problems, "\n".join(problems)


def test_cancel_lists_only_what_it_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = _parser_of(["edge", "cancel"], monkeypatch)
    dests = {a.dest for a in parser._actions}
    assert "schedule_id" in dests
    assert not dests & {"fingerprint", "document", "keys"}, dests
