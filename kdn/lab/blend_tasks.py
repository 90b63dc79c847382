"""Blend evaluation prompts for a model that reads code: documents are excerpts of real files.

**Needle in one of n shuffled files.** A pool of documents: excerpts of ``doc_tokens`` tokens cut
at line starts from source files (for a held-out evaluation, the held-out split of
:func:`kdn.lab.reference.corpus_split`, so the split is by file), at most ``per_file`` per file,
evenly spread through it. Each prompt takes ``n_docs`` documents of the pool in a random order,
picks one of them (the *needle file*, its position cycling through ``0..n_docs-1`` so every
position is asked equally often) and one line of it: the question repeats the first
``cue_tokens`` tokens of that line, and the answer is the ``answer_tokens`` tokens that follow it
in the file. A prompt is right when the answer's first token — the line's next token — is the
model's top-1 prediction; the harness also reports how often every answer token is (teacher
forced: the same as greedy decoding reproducing them).

The task needs attention across documents: the cue sits after all of them, and the tokens that
answer it sit in one document among others computed apart. A cue is chosen only where it is
unambiguous: its tokens occur exactly once in the prompt's documents, it starts at the first code
token of a line, and it holds at least ``min_cue_chars`` non-blank characters.

Layout (ChatML, the model's chat format)::

    <|im_start|>system … <|im_end|> <|im_start|>user Here are some Python files: (exact prefix)
    [document 1] … [document n]                                   (segments, any order)
    Continue this line from the files above: [cue]                (question)
    [answer]                                                       (scored)

Everything is token ids joined as lists, so a document's tokens in the prompt are exactly its
tokens alone (no merge across a boundary).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kdn.errors import InvalidInput

SYSTEM = "You are a helpful coding assistant."
INTRO = "Here are some Python files:\n\n"
ASK = "\n\nContinue this line from the files above:\n"


@dataclass(frozen=True, slots=True)
class Document:
    """One excerpt: ``tokens`` of file ``name`` from its line ``line`` on."""

    name: str
    line: int
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NeedleSpec:
    n_docs: int = 8
    doc_tokens: int = 256
    per_file: int = 8
    cue_tokens: int = 10
    answer_tokens: int = 4
    min_cue_chars: int = 12

    def __post_init__(self) -> None:
        if self.n_docs < 2 or self.doc_tokens < 4 * (self.cue_tokens + self.answer_tokens):
            raise InvalidInput(f"needle prompts need >= 2 documents of >= {4 * (self.cue_tokens + self.answer_tokens)} "
                               f"tokens, got {self.n_docs} x {self.doc_tokens}")


def excerpts(tokenizer: Any, name: str, text: str, *, doc_tokens: int, per_file: int) -> list[Document]:
    """Up to ``per_file`` non-overlapping excerpts of ``doc_tokens`` tokens, each starting at a
    line start, evenly spread through the file."""
    lines = text.splitlines(keepends=True)
    starts, pos = [], 0
    for ln in lines:
        starts.append(pos)
        pos += len(ln)
    total = len(tokenizer.encode(text))
    if total < doc_tokens:
        return []
    n = max(1, min(per_file, total // doc_tokens))
    out: list[Document] = []
    next_free = 0  # character offset before which an excerpt would overlap the previous one
    for i in range(n):
        want = int(len(text) * i / n)
        li = next((j for j, s in enumerate(starts) if s >= max(want, next_free)), None)
        if li is None:
            break
        toks = tokenizer.encode(text[starts[li]:starts[li] + doc_tokens * 12])[:doc_tokens]
        if len(toks) < doc_tokens:
            break
        out.append(Document(name, li + 1, tuple(toks)))
        next_free = starts[li] + len(tokenizer.decode(list(toks)))
    return out


def document_pool(tokenizer: Any, files: Sequence[Path], root: Path | None = None, *, doc_tokens: int = 256,
                  per_file: int = 8) -> list[Document]:
    pool: list[Document] = []
    for f in files:
        name = str(f.relative_to(root)) if root is not None else f.name
        pool += excerpts(tokenizer, name, f.read_text(encoding="utf-8", errors="replace"), doc_tokens=doc_tokens,
                         per_file=per_file)
    return pool


def _line_starts(tokenizer: Any, doc: Sequence[int]) -> list[int]:
    """Indices of the first code token of each line of ``doc`` (after a token holding a newline
    and then only blanks)."""
    out = []
    for j in range(1, len(doc)):
        prev = tokenizer.decode([doc[j - 1]])
        cur = tokenizer.decode([doc[j]])
        if "\n" in prev and not prev.rsplit("\n", 1)[1].strip() and cur.strip():
            out.append(j)
    return out


def _count(hay: Sequence[int], needle: Sequence[int]) -> int:
    n, k = len(hay), len(needle)
    first = needle[0]
    return sum(1 for i in range(n - k + 1) if hay[i] == first and list(hay[i:i + k]) == list(needle))


def chat_parts(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The exact prefix (system message, the user turn's opening) and the question's lead-in."""
    prefix = tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{INTRO}")
    return prefix, tokenizer.encode(ASK)


def needle_cases(tokenizer: Any, pool: Sequence[Document], n: int, spec: NeedleSpec, seed: int) -> list[dict[str, Any]]:
    """``n`` prompts as dicts: ``prefix``, ``docs`` (token lists), ``question``, ``answer``,
    ``needle`` (position of the needle file), ``files`` (names, in prompt order)."""
    if len(pool) < spec.n_docs:
        raise InvalidInput(f"a pool of {len(pool)} documents cannot fill prompts of {spec.n_docs}")
    prefix, ask = chat_parts(tokenizer)
    rng = random.Random(seed)
    starts = {d: _line_starts(tokenizer, d.tokens) for d in pool}
    cases: list[dict[str, Any]] = []
    tries = 0
    while len(cases) < n:
        tries += 1
        if tries > 50 * n:
            raise InvalidInput(f"could not build {n} needle prompts from a pool of {len(pool)} documents")
        docs = rng.sample(list(pool), spec.n_docs)
        k = len(cases) % spec.n_docs
        target = docs[k]
        hay = [t for d in docs for t in d.tokens]
        cands = [j for j in starts[target] if j + spec.cue_tokens + spec.answer_tokens <= len(target.tokens)]
        rng.shuffle(cands)
        for j in cands:
            cue = list(target.tokens[j:j + spec.cue_tokens])
            if len(tokenizer.decode(cue).replace(" ", "").strip()) < spec.min_cue_chars or _count(hay, cue) != 1:
                continue
            ans = list(target.tokens[j + spec.cue_tokens:j + spec.cue_tokens + spec.answer_tokens])
            cases.append({"prefix": prefix, "docs": [list(d.tokens) for d in docs], "question": ask + cue,
                          "answer": ans, "needle": k, "files": [f"{d.name}:{d.line}" for d in docs]})
            break
    return cases
