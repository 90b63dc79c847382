"""Which files are documents, and reading one: discovery and the text rules of ingest.

:func:`discover` expands paths (directories recursively, text-like files only, hidden entries
skipped; explicit files are always tried); :func:`read_document` reads one file and refuses empty,
binary and non-UTF-8 files with a clear message.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from kdn.errors import InvalidInput
from kdn.origin.worker import DocumentResult

__all__ = ["Discovery", "Source", "discover", "doc_id_for", "is_text_like", "read_document"]

TEXT_SUFFIXES = frozenset(
    """.txt .md .markdown .rst .adoc .tex .org .csv .tsv .json .jsonl .yaml .yml .toml .ini .cfg .conf .xml
    .html .htm .css .py .pyi .c .h .cc .cpp .hpp .cs .java .kt .scala .go .rs .js .jsx .ts .tsx .rb .php .pl
    .lua .r .jl .swift .m .sh .bash .zsh .sql .proto .mk .cmake .gradle .dockerfile .vue .svelte .hs .ml
    .ex .exs .erl .clj .el .vim .bat .ps1""".split()
)
TEXT_NAMES = frozenset({"Makefile", "Dockerfile", "README", "LICENSE", "CHANGELOG", "NOTICE"})
_BINARY_SNIFF = 8192


@dataclass(frozen=True, slots=True)
class Source:
    path: Path
    doc_id: str


@dataclass(slots=True)
class Discovery:
    sources: list[Source] = field(default_factory=list)
    problems: list[DocumentResult] = field(default_factory=list)  # paths that do not exist ...
    ignored: list[str] = field(default_factory=list)  # files in directories that are not text-like


def doc_id_for(path: Path) -> str:
    """A document's id: its absolute path (stable on a machine, readable in summaries)."""
    return path.resolve().as_posix()


def is_text_like(path: Path) -> bool:
    return path.suffix.lower() in TEXT_SUFFIXES or path.name in TEXT_NAMES


def discover(paths: Iterable[str | Path]) -> Discovery:
    """Expand ``paths``: explicit files are always tried; directories are walked recursively for
    text-like files (by suffix), skipping hidden entries. Each document appears once."""
    out = Discovery()
    seen: set[str] = set()

    def add(p: Path) -> None:
        doc = doc_id_for(p)
        if doc not in seen:
            seen.add(doc)
            out.sources.append(Source(p, doc))

    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    f = Path(root) / name
                    if name.startswith("."):
                        continue
                    if is_text_like(f):
                        add(f)
                    else:
                        out.ignored.append(f.as_posix())
        elif p.is_file():
            add(p)
        elif p.exists():
            out.problems.append(DocumentResult(str(raw), "failed", "not a regular file or directory"))
        else:
            out.problems.append(DocumentResult(str(raw), "failed", "path does not exist"))
    return out


def read_document(path: Path) -> tuple[str, str]:
    """The text and content hash of a file; InvalidInput with a clear reason when unusable."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read: {exc.strerror or exc}") from exc
    if not data:
        raise InvalidInput("empty file: nothing to ingest")
    if b"\x00" in data[:_BINARY_SNIFF]:
        raise InvalidInput("binary file (NUL bytes): not a text document")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"not valid UTF-8 (byte {exc.start}: {exc.reason}); convert it to UTF-8 first") from exc
    if not text.strip():
        raise InvalidInput("only whitespace: nothing to ingest")
    return text, hashlib.blake2b(data, digest_size=16).hexdigest()
