"""Code under ``kdn/`` states contracts; its history lives in git.

Comments and docstrings (and comments in the package's ``.proto`` and ``.yaml`` files) must not
name tracker or milestone numbers ("issue 12", "stop 23", "wave 2"), narrate what code "used to"
do, or carry calendar dates ("2026-11-30", "November 2026"). Each finding names the file, the
line and what matched. Generated protobuf stubs (``kdn/proto/*_pb2*``) are left out.

"used to" is refused in every sense: for a purpose, write "to rebuild ..." or "for ...".
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kdn"

_MONTHS = (r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|"
           r"sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)")
HISTORY = [
    ("a tracker or milestone number", re.compile(r"\b(?:issues?|stops?|waves?|milestones?|sprints?|tickets?|PR)\s*#?\d+\b", re.I)),
    ("'used to'", re.compile(r"\bused to\b", re.I)),
    ("a calendar date", re.compile(r"\b(?:19|20)\d{2}-(?:0[1-9]|1[0-2])(?:-(?:0[1-9]|[12]\d|3[01]))?(?!\d)")),
    ("a calendar date", re.compile(rf"\b{_MONTHS}\.?\s+(?:\d{{1,2}}(?:st|nd|rd|th)?,?\s+)?(?:19|20)\d{{2}}\b", re.I)),
    ("a calendar date", re.compile(rf"\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTHS}\.?,?\s+(?:19|20)\d{{2}}\b", re.I)),
]


def _generated(path: Path) -> bool:
    return path.parent.name == "proto" and "_pb2" in path.name


def _python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string that stands alone as a statement (docstrings,
    attribute docstrings)."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return out


def _comment_prose(source: str, marker: str) -> list[tuple[int, str]]:
    out = []
    for n, line in enumerate(source.splitlines(), 1):
        at = line.find(marker)
        if at >= 0:
            out.append((n, line[at:]))
    return out


def prose(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return _python_prose(source)
    return _comment_prose(source, "//" if path.suffix == ".proto" else "#")


def findings(path: Path) -> list[str]:
    out = []
    for line, text in prose(path):
        for what, pattern in HISTORY:
            for m in pattern.finditer(text):
                # a docstring's match is reported at the docstring's line plus the match's own offset
                at = line + text.count("\n", 0, m.start()) if path.suffix == ".py" and text.count("\n") else line
                out.append(f"{path.relative_to(REPO)}:{at}: {what}: {m.group(0)!r}")
    return out


def _files() -> list[Path]:
    return sorted(p for ext in ("*.py", "*.proto", "*.yaml") for p in PACKAGE.rglob(ext) if not _generated(p))


def test_no_history_in_kdn_comments_or_docstrings() -> None:
    found = [f for path in _files() for f in findings(path)]
    assert not found, "history belongs in git; state the contract instead:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    '"""Keys (issue 12)."""', "# see stop 23", '"""Wave 2: the connector."""', "x = 1  # used to be 2",
    '"""Measured 2026-11-30."""', '"""Since November 2026."""', '"""Before 30 Nov 2026."""', "# until 2026-11",
])
def test_each_kind_of_history_is_found(text: str) -> None:
    found = [what for line, t in _python_prose(text + "\n") for what, p in HISTORY if p.search(t)]
    assert found, text


@pytest.mark.parametrize("text", [
    '"""4096-token contexts, 7 rounds, 2048-4096 bytes, 0.2026 ratio."""', "# one stop per chunk",
    'x = "issue 12"  # a string literal, not prose', '"""Waves of requests; 1-2 s."""',
])
def test_ordinary_prose_passes(text: str) -> None:
    found = [what for line, t in _python_prose(text + "\n") for what, p in HISTORY if p.search(t)]
    assert not found, (text, found)


def test_generated_stubs_are_left_out() -> None:
    stubs = list((PACKAGE / "proto").glob("*_pb2*.py"))
    assert stubs and all(_generated(p) for p in stubs)
    assert not _generated(PACKAGE / "proto" / "__init__.py")
