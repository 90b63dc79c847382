"""Which files are documents, and reading one: discovery and the text rules of ingest.

:func:`discover` expands paths (directories recursively, text-like files only, hidden entries
skipped; explicit files are always tried); :func:`read_text` streams one file (hashing and checking all of it,
keeping only the prefix a model window can use) and refuses empty, binary and non-UTF-8 files with
a clear message.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Sequence

from kdn.errors import InvalidInput
from kdn.origin.worker import DocumentResult

__all__ = ["Discovery", "DocumentText", "Source", "discover", "doc_id_for", "document_matches", "not_ingested", "is_text_like", "read_document", "read_text"]

TEXT_SUFFIXES = frozenset(
    """.txt .md .markdown .rst .adoc .tex .org .csv .tsv .json .jsonl .yaml .yml .toml .ini .cfg .conf .xml
    .html .htm .css .py .pyi .c .h .cc .cpp .hpp .cs .java .kt .scala .go .rs .js .jsx .ts .tsx .rb .php .pl
    .lua .r .jl .swift .m .sh .bash .zsh .sql .proto .mk .cmake .gradle .dockerfile .vue .svelte .hs .ml
    .ex .exs .erl .clj .el .vim .bat .ps1""".split()
)
TEXT_NAMES = frozenset({"Makefile", "Dockerfile", "README", "LICENSE", "CHANGELOG", "NOTICE"})
_BINARY_SNIFF = 8192
_BLOCK = 1 << 20


@dataclass(frozen=True, slots=True)
class Source:
    path: Path
    doc_id: str


@dataclass(slots=True)
class Discovery:
    sources: list[Source] = field(default_factory=list)
    problems: list[DocumentResult] = field(default_factory=list)  # paths that do not exist ...
    ignored: list[str] = field(default_factory=list)  # files in directories that are not text-like
    not_regular: list[str] = field(default_factory=list)  # FIFOs, sockets, devices in directories: skipped

    def nothing_to_ingest(self) -> str:
        """Why there is no document at all (for a one-line error), or "" when there is one."""
        if self.sources:
            return ""
        why = [f"{p.doc_id}: {p.message}" for p in self.problems]
        if self.ignored:
            why.append(f"{len(self.ignored)} files that are not text-like (by suffix)")
        if self.not_regular:
            why.append(f"{len(self.not_regular)} entries that are not regular files")
        return "nothing to ingest: no text document found" + (f" ({'; '.join(why)})" if why else "")


def doc_id_for(path: Path) -> str:
    """A document's id: its absolute path (stable on a machine, readable in summaries)."""
    return path.resolve().as_posix()


def document_matches(name: str, ids: Sequence[str]) -> list[str]:
    """The stored ids ``name`` can mean: itself, or every id it is a path suffix of.

    Ids are absolute paths, but a reader names a document the way they ingested it
    (``docs/manual.md``, ``./docs/manual.md``): a name matches the ids that end in ``/`` + it,
    whole path components only (``manual.md`` does not match ``/x/my-manual.md``).
    """
    if name in ids:
        return [name]
    tail = PurePosixPath(name).as_posix().removeprefix("./")
    if not tail or tail == ".":
        return []
    return [i for i in ids if i.endswith("/" + tail.lstrip("/"))]


def not_ingested(name: str, matches: Sequence[str], ids: Sequence[str], limit: int = 5) -> str:
    """The NotFound text: why ``name`` named no single document, and which ids come closest."""
    def listed(xs: Sequence[str]) -> str:
        return ", ".join(xs[:limit]) + (f" and {len(xs) - limit} more" if len(xs) > limit else "")

    head = f"document {name[:200]!r}"
    if len(matches) > 1:
        return f"{head} is ambiguous: it matches {listed(matches)}; give more of the path"
    if not ids:
        return f"{head} is not ingested: no document is ingested for this model and namespace"
    base = PurePosixPath(name).name
    near = [i for i in ids if PurePosixPath(i).name == base]
    if near:
        return f"{head} is not ingested for this model and namespace; documents with that name: {listed(near)}"
    return (f"{head} is not ingested for this model and namespace ({len(ids)} documents are, e.g. "
            f"{listed(ids[:3])}); name a document by its ingest path or by the id `kdn ingest` prints")


def is_text_like(path: Path) -> bool:
    return path.suffix.lower() in TEXT_SUFFIXES or path.name in TEXT_NAMES


def discover(paths: Iterable[str | Path]) -> Discovery:
    """Expand ``paths``: explicit files are always tried; directories are walked recursively for
    text-like files (by suffix), skipping hidden entries. Each document appears once.

    Reported as problems (failed documents), never silently dropped: a path that does not exist,
    a symbolic link that leads nowhere (broken, or a loop; in a directory only a text-like one), a
    directory that cannot be read, and a file whose name is not valid UTF-8 (its id could not be
    stored or sent; the problem's id shows the bad bytes as ``\\xNN``)."""
    out = Discovery()
    seen: set[str] = set()

    def add(p: Path) -> None:
        doc = doc_id_for(p)
        if not _utf8(doc):
            out.problems.append(DocumentResult(_shown(doc), "failed", "the file name is not valid UTF-8: rename it "
                                               "to ingest it (a document id is stored and sent as UTF-8 text)"))
        elif doc not in seen:
            seen.add(doc)
            out.sources.append(Source(p, doc))

    def unreadable(exc: OSError) -> None:
        out.problems.append(DocumentResult(_shown(str(exc.filename)), "failed",
                                           f"cannot read the directory: {exc.strerror or exc}"))

    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            for root, dirs, files in os.walk(p, onerror=unreadable):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    f = Path(root) / name
                    if name.startswith("."):
                        continue
                    if _broken_link(f):
                        if is_text_like(f):
                            out.problems.append(DocumentResult(_shown(f.as_posix()), "failed", _BROKEN_LINK))
                        else:
                            out.ignored.append(f.as_posix())
                    elif not f.is_file():  # a FIFO named *.txt would block the reader forever
                        out.not_regular.append(f.as_posix())
                    elif is_text_like(f):
                        add(f)
                    else:
                        out.ignored.append(f.as_posix())
        elif p.is_file():
            add(p)
        elif p.exists():
            out.problems.append(DocumentResult(_shown(str(raw)), "failed", "not a regular file or directory"))
        elif _broken_link(p):
            out.problems.append(DocumentResult(_shown(str(raw)), "failed", _BROKEN_LINK))
        else:
            out.problems.append(DocumentResult(_shown(str(raw)), "failed", "path does not exist"))
    return out


_BROKEN_LINK = "a symbolic link that leads nowhere (its target is missing, or the links loop)"


def _broken_link(p: Path) -> bool:
    return p.is_symlink() and not p.exists()


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a name's undecodable bytes, kept by Python as lone surrogates
        return False
    return True


def _shown(text: str) -> str:
    """``text`` with the undecodable bytes of a file name written as ``\\xNN`` (valid UTF-8)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass(frozen=True, slots=True)
class DocumentText:
    """A document as ingest uses it: ``text`` (all of it when ``complete``, else the first
    ``max_bytes`` bytes cut at a character boundary), the content hash of the whole file, its size."""

    text: str
    digest: str
    complete: bool
    size: int


def read_text(path: Path, max_bytes: int | None = None) -> DocumentText:
    """Stream ``path`` once: hash and check all of it (NUL bytes in the first 8 KiB, UTF-8,
    not only whitespace) but keep only the first ``max_bytes`` bytes (None: all), so a huge file
    costs bounded memory. InvalidInput with a clear reason when the file is unusable."""
    h = hashlib.blake2b(digest_size=16)
    check = codecs.getincrementaldecoder("utf-8")()
    kept: list[bytes] = []
    n_kept = pos = 0
    blank = True
    try:
        # non-blocking open: a FIFO (or device) must not hang ingest waiting for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise InvalidInput("not a regular file")
        with os.fdopen(fd, "rb") as f:
            while block := f.read(_BLOCK):
                if pos == 0 and b"\x00" in block[:_BINARY_SNIFF]:
                    raise InvalidInput("binary file (NUL bytes): not a text document")
                h.update(block)
                try:
                    part = check.decode(block)
                except UnicodeDecodeError as exc:
                    raise _not_utf8(pos + exc.start, exc) from exc
                blank = blank and not part.strip()
                if max_bytes is None or n_kept < max_bytes:
                    take = block if max_bytes is None else block[: max_bytes - n_kept]
                    kept.append(take)
                    n_kept += len(take)
                pos += len(block)
    except OSError as exc:
        raise InvalidInput(f"cannot read: {exc.strerror or exc}") from exc
    if pos == 0:
        raise InvalidInput("empty file: nothing to ingest")
    try:
        check.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise _not_utf8(pos, exc) from exc
    if blank:
        raise InvalidInput("only whitespace: nothing to ingest")
    complete = n_kept == pos
    data = b"".join(kept)
    # a cut may split a character: the incremental decoder leaves the partial one out
    text = data.decode("utf-8") if complete else codecs.getincrementaldecoder("utf-8")().decode(data)
    return DocumentText(text, h.hexdigest(), complete, pos)


def _not_utf8(at: int, exc: UnicodeDecodeError) -> InvalidInput:
    return InvalidInput(f"not valid UTF-8 (byte {at}: {exc.reason}); convert it to UTF-8 first")


def read_document(path: Path) -> tuple[str, str]:
    """The whole text and content hash of a file; InvalidInput with a clear reason when unusable."""
    doc = read_text(path)
    return doc.text, doc.digest
