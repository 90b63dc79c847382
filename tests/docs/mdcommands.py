"""Read the shell commands and Python snippets out of Markdown files, as a reader would copy them.

A fenced block's language decides what it is: ``bash``/``sh``/``shell`` blocks hold commands,
``python`` blocks hold snippets. A command is one logical shell line: lines ending in ``\\`` and
lines inside an open quote are joined, full-line comments are dropped, and a trailing comment
stays (the shell ignores it).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)\s*$")
SHELL = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True, slots=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


@dataclass(frozen=True, slots=True)
class Command:
    block: Block
    text: str  # as written (continuations joined with the backslash-newline kept)

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text.replace("\\\n", " "), comments=True)


def blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    lang: str | None = None
    start = 0
    body: list[str] = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = _FENCE.match(line.strip())
        if lang is None and m:
            lang, start, body = m.group(1).lower(), i, []
        elif lang is not None and line.strip() == "```":
            out.append(Block(path, start, lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def _complete(text: str) -> bool:
    if text.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def commands(block: Block) -> list[Command]:
    out: list[Command] = []
    pending = ""
    for line in block.text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        if _complete(pending):
            out.append(Command(block, pending))
            pending = ""
    if pending:
        raise ValueError(f"{block.where}: unterminated command {pending!r}")
    return out
