"""The steering task on a trained chat model: lookalike facts in a haystack of source files.

A *haystack* is ``n_docs`` documents, each a slice of one Python source file of the standard
library (a ``# file: NAME`` line, then consecutive lines of the file), joined by blank lines and
stored as a chat's system message (layout ``system``). Every document carries one *note*, a
comment line at a random line of the slice::

    # NOTE: the access code for the cobalt vault is 4821.

The notes are lookalikes: same sentence, a different vault name and a different 4-digit code in
each document. A *question* asks for one vault's code (user: ``What is the access code for the
cobalt vault?``; the assistant's turn opens with ``The access code for the cobalt vault is``) and
is scored on the code's four digit tokens. One haystack serves one question per *depth*: the note
of document ``round(d * (n_docs - 1))`` for each ``d`` in :data:`DEPTHS`, so every depth cell has
one prompt per haystack and the cells are paired across depths and across variants of the same
stored KV.

Held out by file: calibration haystacks are cut from the ``train`` split of
:func:`kdn.lab.reference.corpus_split`, test haystacks from the ``heldout`` split; the two never
share a file. Everything is seeded (``torch.Generator``), so a haystack is a pure function of
``(split, length, n_docs, seed, index)``.

Marks (token spans of the stored document), computed from the text alone or from the question:

- ``realistic``: the lines an operator rule names without seeing any question — here
  :data:`NOTE_RULE` (``--emphasize-regex '^# NOTE:'``: every note, i.e. all lookalikes);
- ``headings``: another question-blind rule, the file headings and ``def``/``class`` lines
  (:data:`HEADING_RULE`), which never hold an answer;
- ``oracle``: the asked note's line only; ``wrong``: one other note's line;
- ``random``: as many non-note lines as the realistic rule marks, drawn at random per haystack;
- ``everything``: the whole document text.

The ceiling is the asked note's document alone (same question, one document).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from kdn.errors import InvalidInput
from kdn.prompts import Tokenizer, document_tokens, request_tokens

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NOTE_RULE = r"^# NOTE:"
HEADING_RULE = r"^(# file: |\s*(async\s+)?def |\s*class )"
LAYOUT = "system"
VAULTS = ("amber", "azure", "bronze", "cedar", "cobalt", "copper", "coral", "crimson", "ebony", "emerald", "garnet",
          "granite", "indigo", "ivory", "jade", "jasper", "lilac", "maple", "marble", "olive", "onyx", "opal", "pearl",
          "quartz", "ruby", "saffron", "sapphire", "scarlet", "silver", "slate", "topaz", "violet")
_SPLIT_SEED = {"calibration": 1_000_003, "test": 2_000_029}


def note_line(vault: str, code: str) -> str:
    return f"# NOTE: the access code for the {vault} vault is {code}."


def question_text(vault: str) -> str:
    return f"What is the access code for the {vault} vault?"


def answer_opening(vault: str) -> str:
    return f"The access code for the {vault} vault is "


@dataclass(frozen=True, slots=True)
class Question:
    """One scored question on a stored document: ``tail`` is fed after the document's tokens (the
    rest of the request, the assistant's opening and all but the last answer token), ``answer`` the
    code's digit tokens."""

    depth: float
    doc: int  # the asked note's document
    vault: str
    code: str
    tail: tuple[int, ...]
    answer: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Haystack:
    """A stored document of ``n_docs`` source slices, each with one note; see the module docstring."""

    split: str
    index: int
    text: str
    tokens: tuple[int, ...]  # document_tokens(text, LAYOUT): what is stored
    docs: tuple[str, ...]  # each document's text, in order
    files: tuple[str, ...]  # the source file of each document (relative path)
    vaults: tuple[str, ...]
    codes: tuple[str, ...]
    note_chars: tuple[tuple[int, int], ...]  # character span of each note line in ``text``
    line_chars: tuple[tuple[int, int], ...]  # character span of every line of ``text`` (without line end)
    questions: tuple[Question, ...]


def split_files(split: str, root: Path | None = None) -> tuple[Path, tuple[Path, ...]]:
    """(corpus root, the split's files): ``calibration`` = the corpus's train split, ``test`` = held out."""
    from kdn.lab.reference import corpus_split

    if split not in _SPLIT_SEED:
        raise InvalidInput(f"unknown split {split!r}; choose calibration or test")
    cs = corpus_split(root)
    files = cs.train if split == "calibration" else cs.heldout
    return cs.root, files


class SourcePool:
    """Lines of a split's files, read once; a file's lines are tokenized the first time a slice is
    cut from it (slices are cut by token budget)."""

    def __init__(self, tok: Tokenizer, split: str, root: Path | None = None) -> None:
        base, files = split_files(split, root)
        self.split = split
        self.tok = tok
        self.files: list[tuple[str, list[str]]] = []  # (name, lines)
        self._counts: dict[int, list[int]] = {}  # file -> tokens per line
        for f in files:
            lines = [ln.rstrip() for ln in f.read_text(encoding="utf-8", errors="replace").splitlines()]
            lines = [ln for ln in lines if ln.strip() and not re.search(NOTE_RULE, ln) and "\x00" not in ln]
            if len(lines) >= 40:
                self.files.append((f.relative_to(base).as_posix(), lines))
        if not self.files:
            raise InvalidInput(f"no usable source files in the {split} split")

    def _line_tokens(self, i: int) -> list[int]:
        if i not in self._counts:
            self._counts[i] = [len(self.tok.encode(ln + "\n")) for ln in self.files[i][1]]
        return self._counts[i]

    def slice(self, budget: int, gen: torch.Generator, avoid: set[int]) -> tuple[int, list[str]]:
        """A run of consecutive lines of one file (not in ``avoid`` when possible) of about ``budget`` tokens."""
        order = torch.randperm(len(self.files), generator=gen).tolist()
        pick = next((i for i in order if i not in avoid), order[0])
        lines, counts = self.files[pick][1], self._line_tokens(pick)
        if sum(counts) <= budget:
            return pick, list(lines)
        start = int(torch.randint(0, len(lines), (1,), generator=gen))
        out, used, i = [], 0, start
        while used < budget:
            out.append(lines[i % len(lines)])
            used += counts[i % len(lines)]
            i += 1
        return pick, out


def make_haystack(pool: SourcePool, *, length: int, n_docs: int, seed: int, index: int) -> Haystack:
    """Haystack ``index`` of about ``length`` document tokens (see the module docstring)."""
    if n_docs < 2 or n_docs > len(VAULTS):
        raise InvalidInput(f"documents per haystack must be in 2..{len(VAULTS)}, got {n_docs}")
    if length < 64 * n_docs:
        raise InvalidInput(f"{length} tokens is too short for {n_docs} documents")
    tok = pool.tok
    gen = torch.Generator().manual_seed(_SPLIT_SEED[pool.split] + 7919 * seed + 104_729 * length + 613 * n_docs + index)
    vaults = [VAULTS[i] for i in torch.randperm(len(VAULTS), generator=gen)[:n_docs].tolist()]
    codes: list[str] = []
    while len(codes) < n_docs:
        c = str(int(torch.randint(1000, 10000, (1,), generator=gen)))
        if c not in codes:
            codes.append(c)
    budget = length // n_docs - 12  # the heading, the note and the separator
    docs, files, used = [], [], set()
    for d in range(n_docs):
        pick, lines = pool.slice(budget, gen, used)
        used.add(pick)
        at = int(torch.randint(0, len(lines) + 1, (1,), generator=gen))
        lines = lines[:at] + [note_line(vaults[d], codes[d])] + lines[at:]
        files.append(pool.files[pick][0])
        docs.append("\n".join([f"# file: {pool.files[pick][0]}"] + lines))
    text = "\n\n".join(docs)
    note_chars, line_chars, pos = [], [], 0
    for line in text.split("\n"):
        line_chars.append((pos, pos + len(line)))
        if re.search(NOTE_RULE, line):
            note_chars.append((pos, pos + len(line)))
        pos += len(line) + 1
    if len(note_chars) != n_docs:
        raise InvalidInput("a source line looks like a note")  # filtered out above; kept as a guard
    tokens = document_tokens(tok, text, LAYOUT)
    questions = []
    for depth in DEPTHS:
        d = int(round(depth * (n_docs - 1)))
        questions.append(make_question(tok, text, tokens, depth, d, vaults[d], codes[d]))
    return Haystack(pool.split, index, text, tuple(tokens), tuple(docs), tuple(files), tuple(vaults), tuple(codes),
                    tuple(note_chars), tuple(line_chars), tuple(questions))


def make_question(tok: Tokenizer, text: str, doc_tokens: Sequence[int], depth: float, doc: int, vault: str,
                  code: str) -> Question:
    req = request_tokens(tok, text, question_text(vault), LAYOUT)
    if list(req[: len(doc_tokens)]) != list(doc_tokens):
        raise InvalidInput("the request does not start with the stored document's tokens")
    opening = tok.encode(answer_opening(vault))
    full = tok.encode(answer_opening(vault) + code)
    answer = full[len(opening):]
    if full[: len(opening)] != opening or tok.decode(answer).strip() != code:
        raise InvalidInput(f"the tokenizer merges the answer {code!r} with its opening")
    tail = list(req[len(doc_tokens):]) + opening + answer[:-1]
    return Question(depth, doc, vault, code, tuple(tail), tuple(answer))


def ceiling_question(tok: Tokenizer, hs: Haystack, q: Question) -> tuple[list[int], Question]:
    """The asked note's document alone as the stored document, and the same question on it."""
    text = hs.docs[q.doc]
    toks = document_tokens(tok, text, LAYOUT)
    return toks, make_question(tok, text, toks, q.depth, 0, q.vault, q.code)


# -- marks --------------------------------------------------------------------------------------------

MARK_KINDS = ("realistic", "headings", "oracle", "wrong", "random", "everything")


def char_spans_to_tokens(tok: Tokenizer, text: str, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token spans of the stored document covering character spans of its text (the tokens of the
    text before each span's start and end, as :func:`kdn.origin.steer.resolve` computes them)."""
    out = []
    for cs, ce in spans:
        s, e = len(document_tokens(tok, text[:cs], LAYOUT)), len(document_tokens(tok, text[:ce], LAYOUT))
        if e > s:
            out.append((s, e))
    return out


def mark_chars(hs: Haystack, kind: str, q: Question, gen: torch.Generator | None = None) -> list[tuple[int, int]]:
    """Character spans of ``hs.text`` that ``kind`` marks for question ``q``."""
    if kind == "realistic":
        return list(hs.note_chars)
    if kind == "headings":
        return [(s, e) for s, e in hs.line_chars if re.search(HEADING_RULE, hs.text[s:e])]
    if kind == "oracle":
        return [hs.note_chars[q.doc]]
    if kind == "wrong":
        others = [d for d in range(len(hs.note_chars)) if d != q.doc]
        g = gen if gen is not None else torch.Generator().manual_seed(hs.index * 31 + q.doc)
        return [hs.note_chars[others[int(torch.randint(0, len(others), (1,), generator=g))]]]
    if kind == "random":
        notes = set(hs.note_chars)
        pool = [sp for sp in hs.line_chars if sp not in notes and sp[1] > sp[0]]
        g = gen if gen is not None else torch.Generator().manual_seed(hs.index * 17 + 5)
        pick = sorted(torch.randperm(len(pool), generator=g)[: len(hs.note_chars)].tolist())
        return [pool[i] for i in pick]
    if kind == "everything":
        return [(0, len(hs.text))]
    raise InvalidInput(f"unknown mark kind {kind!r}; choose one of {', '.join(MARK_KINDS)}")


QUESTION_BLIND = frozenset({"realistic", "headings", "random", "everything"})
