"""The ingest pipeline: files and directories -> documents -> prefill workers -> origin store.

Steps: :func:`discover` expands paths (directories recursively, text-like files only, hidden
entries skipped); the driver reads each file (:func:`read_document`: empty, binary and non-UTF-8
files are refused with a clear message), hands it to a worker as a :class:`DocumentTask`; the
worker tokenises, skips it entirely if every chunk key is already stored, else prefills, encodes
with every configured codec and writes to the store (see :mod:`kdn.origin.worker`).

Two executors run the same worker code: :class:`LocalExecutor` (in this process, no Ray) and
:class:`RayExecutor` (``OriginWorker`` actors fed from a driver-side work queue; a worker that
dies is restarted by Ray and the document it held is resubmitted, up to ``max_attempts``).

Every document ends with a :class:`~kdn.origin.worker.DocumentResult`; one bad document never stops
the batch. :class:`IngestSummary` totals them; ``failed`` tells the CLI's exit code.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

from kdn.errors import InvalidInput, UnknownModel
from kdn.models import BUILTIN_SPECS, is_model_dir
from kdn.origin.config import OriginConfig
from kdn.origin.worker import DocumentResult, DocumentTask, PrefillWorker, spawn_workers

TEXT_SUFFIXES = frozenset(
    """.txt .md .markdown .rst .adoc .tex .org .csv .tsv .json .jsonl .yaml .yml .toml .ini .cfg .conf .xml
    .html .htm .css .py .pyi .c .h .cc .cpp .hpp .cs .java .kt .scala .go .rs .js .jsx .ts .tsx .rb .php .pl
    .lua .r .jl .swift .m .sh .bash .zsh .sql .proto .mk .cmake .gradle .dockerfile .vue .svelte .hs .ml
    .ex .exs .erl .clj .el .vim .bat .ps1""".split()
)
TEXT_NAMES = frozenset({"Makefile", "Dockerfile", "README", "LICENSE", "CHANGELOG", "NOTICE"})
_BINARY_SNIFF = 8192

OnResult = Callable[[DocumentResult], None]


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


# -- executors ---------------------------------------------------------------------------------


class Executor(Protocol):
    """Runs document tasks on prefill workers and reports each result exactly once."""

    def info(self) -> dict[str, Any]: ...

    def run(self, tasks: Iterator[DocumentTask], on_result: OnResult) -> None: ...

    def close(self) -> None: ...


class LocalExecutor:
    """One :class:`PrefillWorker` in this process."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def info(self) -> dict[str, Any]:
        return {**self.worker.info(), "workers": 0}

    def run(self, tasks: Iterator[DocumentTask], on_result: OnResult) -> None:
        for t in tasks:
            try:
                on_result(DocumentResult.from_dict(self.worker.process(_task_dict(t))))
            except Exception as exc:  # a bug or a pathological document: report, keep going
                on_result(DocumentResult(t.doc_id, "failed", f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        self.worker.close()


class RayExecutor:
    """``OriginWorker`` actors fed from a work queue, at most one document in flight per worker.

    Worker death (``RayActorError``): the document goes back to the queue with ``attempt + 1``
    (failed after ``max_attempts``); the actor is probed until Ray has restarted it, or dropped
    when Ray gives it up. Exceptions raised inside ``process`` fail only that document.
    """

    def __init__(
        self, actors: list[Any], *, max_attempts: int = 3, max_restarts: int = 3, probe_timeout_s: float = 120.0
    ) -> None:
        self.actors = actors
        self.max_attempts = max_attempts
        self.max_restarts = max_restarts
        self.probe_timeout_s = probe_timeout_s
        self.deaths = 0

    def info(self) -> dict[str, Any]:
        import ray

        infos = ray.get([a.info.remote() for a in self.actors], timeout=self.probe_timeout_s)
        return {**infos[0], "workers": len(self.actors), "pids": [i["pid"] for i in infos]}

    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors], timeout=self.probe_timeout_s)

    def run(self, tasks: Iterator[DocumentTask], on_result: OnResult) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        retry: deque[DocumentTask] = deque()
        free: deque[int] = deque(range(len(self.actors)))
        work: dict[Any, tuple[int, DocumentTask]] = {}  # ref -> (actor, task)
        probes: dict[Any, tuple[int, float]] = {}  # ref -> (actor, since)
        died = [0] * len(self.actors)
        exhausted = False

        def next_task() -> DocumentTask | None:
            nonlocal exhausted
            if retry:
                return retry.popleft()
            if exhausted:
                return None
            t = next(tasks, None)
            exhausted = t is None
            return t

        while True:
            while free:
                t = next_task()
                if t is None:
                    break
                idx = free.popleft()
                work[self.actors[idx].process.remote(_task_dict(t))] = (idx, t)
            if not work and not probes:
                if not free:  # every worker is gone: what is left cannot run
                    while (t := next_task()) is not None:
                        on_result(DocumentResult(t.doc_id, "failed", "no origin worker left (all died)", attempts=t.attempt))
                break  # else: free workers and no task left, done
            ready, _ = ray.wait([*work, *probes], num_returns=1, timeout=5.0)
            for ref in ready:
                if ref in probes:
                    idx, since = probes.pop(ref)
                    try:
                        ray.get(ref)
                        free.append(idx)
                    except RayActorError:
                        # still restarting, or gone for good once Ray's restarts are used up
                        gone = died[idx] > self.max_restarts or time.monotonic() - since > self.probe_timeout_s
                        if not gone:
                            time.sleep(0.2)
                            probes[self.actors[idx].pid.remote()] = (idx, since)
                    continue
                idx, t = work.pop(ref)
                try:
                    on_result(DocumentResult.from_dict(ray.get(ref)))
                    free.append(idx)
                except RayActorError as exc:
                    self.deaths += 1
                    died[idx] += 1
                    redo = replace(t, attempt=t.attempt + 1)
                    if redo.attempt >= self.max_attempts:
                        on_result(DocumentResult(t.doc_id, "failed", f"worker died {redo.attempt} times on it: {_first_line(exc)}", attempts=redo.attempt))
                    else:
                        retry.append(redo)
                    probes[self.actors[idx].pid.remote()] = (idx, time.monotonic())
                except RayTaskError as exc:
                    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                    on_result(DocumentResult(t.doc_id, "failed", f"{type(cause).__name__}: {_first_line(cause)}"))
                    free.append(idx)

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []


def _task_dict(t: DocumentTask) -> dict[str, Any]:
    return {f: getattr(t, f) for f in DocumentTask.__dataclass_fields__}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# -- summary -----------------------------------------------------------------------------------


@dataclass(slots=True)
class IngestSummary:
    model: str
    fingerprint: str
    namespace: str
    codecs: list[str]
    workers: int
    results: list[DocumentResult] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    seconds: float = 0.0
    worker_deaths: int = 0

    def count(self, status: str) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def failed(self) -> int:
        return self.count("failed")

    @property
    def tokens(self) -> int:
        return sum(r.n_tokens for r in self.results)

    @property
    def prefilled_tokens(self) -> int:
        """Tokens this run actually ran through the model (documents with computed chunks)."""
        return sum(r.n_chunks * _chunk(r) for r in self.results if r.computed_chunks)

    @property
    def bytes_written(self) -> int:
        return sum(r.bytes_written for r in self.results)

    @property
    def chunks(self) -> int:
        return sum(r.n_chunks for r in self.results)

    @property
    def computed_chunks(self) -> int:
        return sum(r.computed_chunks for r in self.results)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "namespace": self.namespace,
            "codecs": self.codecs,
            "workers": self.workers,
            "seconds": round(self.seconds, 3),
            "documents": len(self.results),
            "by_status": {s: self.count(s) for s in ("stored", "skipped", "truncated", "short", "failed")},
            "tokens": self.tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "chunks": self.chunks,
            "computed_chunks": self.computed_chunks,
            "bytes_written": self.bytes_written,
            "tokens_per_s": round(self.prefilled_tokens / self.seconds, 1) if self.seconds else 0.0,
            "worker_deaths": self.worker_deaths,
            "ignored": self.ignored,
            "results": [{k: v for k, v in r.to_dict().items() if k != "keys"} | {"keys": len(r.keys)} for r in self.results],
            "failed": self.failed,
        }

    def render(self) -> str:
        lines = [
            f"ingest: {len(self.results)} documents with {self.model} ({self.fingerprint[:16]}…) "
            f"into namespace {self.namespace!r}, codecs {', '.join(self.codecs)}, "
            f"{'in-process' if not self.workers else f'{self.workers} Ray workers'}",
            "  " + ", ".join(f"{self.count(s)} {s}" for s in ("stored", "skipped", "truncated", "short", "failed")),
            f"  {self.tokens} tokens, {self.chunks} chunks ({self.computed_chunks} computed), "
            f"{_human(self.bytes_written)} written in {self.seconds:.2f}s "
            f"({self.prefilled_tokens / self.seconds if self.seconds else 0:.0f} prefilled tokens/s)",
        ]
        if self.worker_deaths:
            lines.append(f"  {self.worker_deaths} worker deaths; their documents were redone")
        notes = [r for r in self.results if r.status in ("failed", "truncated", "short")]
        for r in notes:
            lines.append(f"  {r.status.upper():9} {r.doc_id}: {r.message}")
        if self.ignored:
            lines.append(f"  ignored {len(self.ignored)} files that are not text-like (by suffix)")
        return "\n".join(lines)


def _chunk(r: DocumentResult) -> int:
    covered = r.n_tokens - r.tail_tokens - r.beyond_window_tokens
    return covered // r.n_chunks if r.n_chunks else 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


# -- progress ----------------------------------------------------------------------------------


class Progress:
    """Live progress (rich): documents, tokens, bytes and prefill rate. No-op when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._p = None
        self.docs = self.tokens = self.bytes = 0
        self._t0 = time.perf_counter()
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._p = RichProgress(
                TextColumn("ingest"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("docs  {task.fields[tokens]} tokens  {task.fields[bytes]}  {task.fields[rate]} tok/s"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task = self._p.add_task("ingest", total=total, tokens=0, bytes="0 B", rate="0")
            self._p.start()

    def update(self, r: DocumentResult) -> None:
        self.docs += 1
        self.tokens += r.n_tokens
        self.bytes += r.bytes_written
        if self._p is not None:
            dt = max(time.perf_counter() - self._t0, 1e-9)
            self._p.update(self._task, advance=1, tokens=self.tokens, bytes=_human(self.bytes), rate=f"{self.tokens / dt:.0f}")

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


# -- the pipeline ------------------------------------------------------------------------------


def check_model_spec(spec: str) -> None:
    """Refuse an unknown model spec before any worker starts."""
    if spec not in BUILTIN_SPECS and not is_model_dir(spec):
        raise UnknownModel(
            f"unknown model spec {spec!r}: not a built-in ({', '.join(BUILTIN_SPECS)}) and not a directory with a config.json"
        )


def make_executor(config: OriginConfig, model: str | None = None) -> Executor:
    """In-process when ``config.workers == 0``; otherwise Ray actors (Ray must be initialised)."""
    spec = model or config.models[0]
    check_model_spec(spec)
    kw = dict(
        store_dir=str(config.store_path),
        model=spec,
        dtype=config.dtype,
        chunk_size=config.chunk_size,
        codecs=list(config.codecs),
        fsync=config.fsync,
    )
    if config.workers == 0:
        return LocalExecutor(PrefillWorker(**kw, threads=None))
    actors = spawn_workers(
        config.workers, **kw, threads=config.worker_threads, max_restarts=config.max_restarts
    )
    return RayExecutor(actors, max_attempts=config.max_attempts, max_restarts=config.max_restarts)


def ingest(
    paths: Sequence[str | Path],
    config: OriginConfig,
    *,
    executor: Executor | None = None,
    progress: bool = False,
    on_result: OnResult | None = None,
) -> IngestSummary:
    """Ingest ``paths`` into ``config``'s store; never raises for a bad document (see summary).

    ``executor``: reuse one (tests, benchmarks); otherwise one is made from ``config`` and closed.
    Raises :class:`~kdn.errors.UnknownModel` before any work for an unknown model spec.
    """
    from kdn.origin.store import OriginStore

    OriginStore(config.store_path, fsync=config.fsync, verify=config.verify_on_start).close()  # self-check once
    own = executor is None
    ex = executor if executor is not None else make_executor(config)
    try:
        info = ex.info()
        ns = config.default_namespace
        found = discover(paths)
        summary = IngestSummary(
            model=info["spec"],
            fingerprint=info["fingerprint"],
            namespace=str(ns),
            codecs=list(info["codecs"]),
            workers=int(info.get("workers", 0)),
            ignored=found.ignored,
        )
        bar = Progress(len(found.sources) + len(found.problems), progress)
        t0 = time.perf_counter()

        def record(r: DocumentResult) -> None:
            summary.results.append(r)
            bar.update(r)
            if on_result is not None:
                on_result(r)

        for p in found.problems:
            record(p)

        def tasks() -> Iterator[DocumentTask]:
            for s in found.sources:
                try:
                    text, digest = read_document(s.path)
                except InvalidInput as exc:
                    record(DocumentResult(s.doc_id, "failed", str(exc)))
                    continue
                yield DocumentTask(s.doc_id, text, digest, ns.tenant, ns.salt)

        try:
            ex.run(tasks(), record)
        finally:
            bar.close()
        summary.seconds = time.perf_counter() - t0
        summary.worker_deaths = int(getattr(ex, "deaths", 0))
        return summary
    finally:
        if own:
            ex.close()
