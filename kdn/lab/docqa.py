"""Documents and extractive questions about them: judging decoded KV by the answers it gives.

A *document* is held-out Python source (whole files joined in sorted order, each headed
``# file: <path>``, cut at line ends into spans of at least ``min_tokens`` tokens; a file too long
for one document continues in the next, headed ``# file: <path> (continued)``). The held-out
standard-library files (:func:`kdn.lab.reference.corpus_split`) are split once more, by a digest of
their path, into a *calibration* part (what codec tuning may look at) and a *test* part (what
figures are reported on), so no tuning ever sees a reported document. Machine-generated data
tables (files that tokenize at under 0.6 of the median characters per token: codec tables,
case-folding maps) are left out: they hold no facts to ask about.

A *fact* is something a reader finds by looking at the text, with one right answer that is
written in it: the base class of a class (``class A(B):``), the value a module-level name is set
to (``NAME = 42``), a parameter's default (``def f(x, n=8):``), the module a name is imported
from (``from m import n``). Only facts whose subject is defined once in the document (as the model
sees it: its first ``C`` tokens) and whose answer is not a near-universal guess (``None``,
``True``, ``0``, ``object``...) become questions. The reply's first words are written into the
assistant's turn (its *lead*: "The class `A` inherits from `"), so the model's next tokens are the
answer itself; a question is answered correctly when the expected answer occurs in those tokens as
a whole word (:func:`is_correct`).
"""

from __future__ import annotations

import ast
import hashlib
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Sequence

from kdn.errors import InvalidInput
from kdn.prompts import Tokenizer, document_tokens

Split = Literal["calibration", "test", "all"]
SPLITS: tuple[str, ...] = ("calibration", "test", "all")
CALIBRATION_PER_MILLE = 333
TABLE_DENSITY = 0.6  # a file under this share of the median characters per token is a data table
TRIVIAL_ANSWERS = frozenset({"None", "True", "False", "0", "1", "-1", "object", "''", '""', "()", "[]", "{}", "self"})


@dataclass(frozen=True, slots=True)
class Fact:
    """One question and its answer, and where in the document the answer is written."""

    kind: str  # "base" | "const" | "default" | "import"
    subject: str  # what must be defined once for the question to be fair (a regex over the text)
    question: str
    answer: str
    char_end: int  # end of the line that holds the answer, in the document's text
    lead: str = ""  # how the reply starts (written into the assistant's turn), so the answer comes next


@dataclass(frozen=True, slots=True)
class Document:
    name: str  # "file.py+other.py" (the files it holds)
    text: str
    facts: tuple[Fact, ...]


@dataclass(frozen=True, slots=True)
class Question:
    """A fact placed in a document of ``context`` tokens: ``token_end`` is where its line ends."""

    document: str
    context: int
    kind: str
    question: str
    answer: str
    token_end: int
    lead: str = ""


def is_calibration(rel: str) -> bool:
    """Whether a held-out file belongs to the calibration part (a digest of its relative path)."""
    digest = hashlib.blake2b(b"kdn-codec-calibration:" + rel.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1000 < CALIBRATION_PER_MILLE


def split_files(files: Sequence[Path], root: Path, split: str) -> list[Path]:
    if split not in SPLITS:
        raise InvalidInput(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if split == "all":
        return list(files)
    want = split == "calibration"
    return [f for f in files if is_calibration(f.relative_to(root).as_posix()) == want]


def heldout_files(split: str = "test") -> tuple[Path, list[Path]]:
    """(stdlib root, the held-out files of ``split``), sorted."""
    from kdn.lab.reference import corpus_split

    s = corpus_split()
    return s.root, sorted(split_files(s.heldout, s.root, split))


# -- facts --------------------------------------------------------------------------------------


def _literal(node: ast.AST, source: str) -> str | None:
    """The answer text of a short literal (a string's contents, a number's source), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        v = node.value
        return v if 2 <= len(v) <= 40 and "\n" not in v and v.strip() == v and v.isprintable() else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _literal(node.operand, source)
        return None if inner is None or not inner[:1].isdigit() else "-" + inner
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        seg = ast.get_source_segment(source, node)
        return seg if seg and len(seg) <= 20 else None
    return None


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def file_facts(source: str) -> list[tuple[int, str, str, str, str, str]]:
    """``(line, kind, subject regex, question, answer, lead)`` for the facts of one Python file."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out: list[tuple[int, str, str, str, str, str]] = []
    for node in tree.body:  # module level: constants and imports
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, _literal(node.value, source)
            if value is not None and len(name) >= 3:
                out.append((node.end_lineno or node.lineno, "const", rf"(?m)^{re.escape(name)}\s*=",
                            f"In the code above, what value is the name `{name}` set to?", value,
                            f"`{name}` is set to `"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if alias.name != "*" and alias.asname is None and len(alias.name) >= 3:
                    out.append((node.end_lineno or node.lineno, "import", rf"\b{re.escape(alias.name)}\b",
                                f"In the code above, from which module is `{alias.name}` imported?", node.module,
                                f"`{alias.name}` is imported from the module `"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            base = _dotted(node.bases[0]) if len(node.bases) == 1 and not node.keywords else None
            if base and base.split(".")[-1] != node.name:
                out.append((node.lineno, "base", rf"\bclass\s+{re.escape(node.name)}\b",
                            f"In the code above, which class does the class `{node.name}` inherit from?", base,
                            f"The class `{node.name}` inherits from `"))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    out.append((item.lineno, "method", rf"\bdef\s+{re.escape(item.name)}\b",
                                f"In the code above, which class defines the method `{item.name}`?", node.name,
                                f"The method `{item.name}` is defined in the class `"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
            raised = {_dotted(r.exc.func if isinstance(r.exc, ast.Call) else r.exc)
                      for r in ast.walk(node) if isinstance(r, ast.Raise) and r.exc is not None}
            if len(raised) == 1 and None not in raised:
                out.append((node.lineno, "raises", rf"\bdef\s+{re.escape(node.name)}\b",
                            f"In the code above, which exception does the function `{node.name}` raise?", raised.pop(),
                            f"The function `{node.name}` raises `"))
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            for arg, default in pairs:
                value = _literal(default, source)
                if value is not None:
                    out.append((default.end_lineno or node.lineno, "default", rf"\bdef\s+{re.escape(node.name)}\b",
                                f"In the code above, what is the default value of the parameter `{arg.arg}` of "
                                f"the function `{node.name}`?", value, f"The default value of `{arg.arg}` is `"))
    return [f for f in out if f[4] not in TRIVIAL_ANSWERS]


# -- documents ----------------------------------------------------------------------------------


def build_documents(tok: Tokenizer, files: Sequence[Path], root: Path, *, min_tokens: int, count: int,
                    layout: str = "system") -> list[Document]:
    """Up to ``count`` documents of at least ``min_tokens`` tokens (as ``layout`` places them), in order."""
    sources = {f: f.read_text(encoding="utf-8", errors="replace") for f in files}
    density = {f: len(s) / max(1, len(tok.encode(s))) for f, s in sources.items() if s.strip()}
    usual = statistics.median(density.values()) if density else 0.0
    lines: list[tuple[str, str, int]] = []  # (line text with its newline, file, line number from 1)
    for f in files:
        source = sources[f]
        if f not in density or density[f] < TABLE_DENSITY * usual:
            continue
        rel = f.relative_to(root).as_posix()
        lines += [(ln, rel, i + 1) for i, ln in enumerate(source.splitlines(keepends=True))]
        if lines and not lines[-1][0].endswith("\n"):
            lines[-1] = (lines[-1][0] + "\n", rel, lines[-1][2])
    facts_of = {f.relative_to(root).as_posix(): file_facts(src) for f, src in sources.items()}
    docs: list[Document] = []
    i = 0
    approx = max(1, int(min_tokens * 3.5))  # chars to take before measuring in tokens
    while i < len(lines) and len(docs) < count:
        parts: list[str] = []
        where: dict[tuple[str, int], int] = {}  # (file, line) -> char end in the document
        names: list[str] = []
        size, prev = 0, None
        j = i
        while j < len(lines):
            ln, rel, no = lines[j]
            if rel != prev:
                head = f"# file: {rel}{'' if no == 1 else ' (continued)'}\n"
                parts.append(head)
                size += len(head)
                names.append(rel)
                prev = rel
            parts.append(ln)
            size += len(ln)
            where[(rel, no)] = size
            j += 1
            if size >= approx and (j % 50 == 0 or j == len(lines)):
                if len(document_tokens(tok, "".join(parts), layout)) >= min_tokens:
                    break
                approx = int(approx * 1.02) + 1
        text = "".join(parts)
        if len(document_tokens(tok, text, layout)) < min_tokens:
            break
        facts = [Fact(kind, subject, q, a, where[(rel, line)], lead)
                 for rel in dict.fromkeys(names) for line, kind, subject, q, a, lead in facts_of.get(rel, [])
                 if (rel, line) in where]
        docs.append(Document("+".join(dict.fromkeys(names)), text, tuple(sorted(facts, key=lambda f: f.char_end))))
        i = j
    return docs


def questions_for(tok: Tokenizer, doc: Document, context: int, limit: int, layout: str = "system") -> list[Question]:
    """Up to ``limit`` questions whose answer lies in the document's first ``context`` tokens, spread
    over those tokens; only facts whose subject is defined once there, one question per subject."""
    ids = document_tokens(tok, doc.text, layout)
    seen = tok.decode(ids[:context])  # the document as the model sees it at this context
    cands: list[Question] = []
    subjects: set[str] = set()
    for f in doc.facts:
        if f.char_end > len(seen) + 200 or f.subject in subjects:
            continue
        end = len(document_tokens(tok, doc.text[: f.char_end], layout))
        if end > context or len(re.findall(f.subject, seen)) != 1:
            continue
        if f.answer not in seen or f.answer in f.question:
            continue
        subjects.add(f.subject)
        cands.append(Question(doc.name, context, f.kind, f.question, f.answer, end, f.lead))
    if len(cands) <= limit:
        return cands
    step = len(cands) / limit
    return [cands[int(k * step)] for k in range(limit)]


_STRIP = re.compile(r"[`'\"]")


def is_correct(reply: str, answer: str) -> bool:
    """The expected answer occurs in the reply as a whole word (quotes and backticks ignored, any case)."""
    text, want = _STRIP.sub("", reply), _STRIP.sub("", answer)
    if not want:
        return False
    return re.search(rf"(?<![\w.]){re.escape(want)}(?![\w])", text, re.IGNORECASE) is not None


def mcnemar_p(a_only: int, b_only: int) -> float:
    """Exact two-sided McNemar p-value: discordant pairs ``a_only`` (right only under A) and ``b_only``."""
    from math import comb

    n = a_only + b_only
    if n == 0:
        return 1.0
    k = min(a_only, b_only)
    tail = sum(comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def summarise(kinds: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in kinds:
        out[k] = out.get(k, 0) + 1
    return out
