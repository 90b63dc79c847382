"""What an ingest run reports: the summary of every document's result, and live progress."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, TextIO

from kdn.console import StageLines
from kdn.origin.worker import DocumentResult

__all__ = ["IngestSummary", "Progress", "ProgressMode"]

DOCUMENTS_SHOWN = 20  # the plain summary lists this many documents (problems first); --json lists all


@dataclass(slots=True)
class IngestSummary:
    model: str
    fingerprint: str
    namespace: str
    codecs: list[str]
    workers: int
    results: list[DocumentResult] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    not_regular: list[str] = field(default_factory=list)  # FIFOs, sockets, devices: skipped
    seconds: float = 0.0
    worker_deaths: int = 0
    where: str = ""  # where it prefilled, as the CLI decided (kdn.origin.ingest.where)
    layout: str = "text"  # where the documents sit in the requests that reuse them (kdn.prompts)

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
            "layout": self.layout,
            "codecs": self.codecs,
            "workers": self.workers,
            "where": self.where or ("in this process" if not self.workers else f"on {self.workers} Ray worker(s)"),
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
            "not_regular": self.not_regular,
            "results": [{k: v for k, v in r.to_dict().items()
                         if k not in ("keys", "steer_keys", "steer_piece_keys", "piece_keys")}
                        | {"keys": len(r.keys), "steer_keys": len(r.steer_keys), "steer_pieces": len(r.steer_piece_keys),
                           "pieces": len(r.piece_keys)}
                        for r in self.results],
            "failed": self.failed,
        }

    def render(self) -> str:
        lines = [
            f"ingest: {len(self.results)} documents with {self.model} ({self.fingerprint[:16]}…) "
            f"into namespace {self.namespace!r}, layout {self.layout}, codecs {', '.join(self.codecs)}, "
            + (self.where or ('in-process' if not self.workers else f'{self.workers} Ray workers')),
            "  " + ", ".join(f"{self.count(s)} {s}" for s in ("stored", "skipped", "truncated", "short", "failed")),
            f"  {self.tokens} tokens, {self.chunks} chunks ({self.computed_chunks} computed), "
            f"{_human(self.bytes_written)} written in {self.seconds:.2f}s "
            f"({self.prefilled_tokens / self.seconds if self.seconds else 0:.0f} prefilled tokens/s)",
        ]
        if self.worker_deaths:
            lines.append(f"  {self.worker_deaths} worker deaths; their documents were redone")
        lines.append(f"  fingerprint {self.fingerprint}  (--fingerprint of `kdn edge pin/schedule/prefetch`)")
        if self.results:  # hints name a document by the path it was ingested as, or by this id
            lines.append("  documents (hints accept the path you gave or this id):")
        shown = sorted(self.results, key=lambda r: (r.status in ("stored", "skipped"), r.doc_id))
        for r in shown[:DOCUMENTS_SHOWN]:
            if r.status in ("stored", "skipped"):
                lines.append(f"    {r.status:9} {r.doc_id}  ({r.n_chunks} chunks)"
                             + (f"; steered variant {r.steer_variant} (ClientConfig(steer=...))" if r.steer_variant else "")
                             + (f"; segment {r.segment_key[:16]}… ({r.segment_tokens} tokens)" if r.segment_key else ""))
            else:  # a problem: upper case, with the reason
                lines.append(f"    {r.status.upper():9} {r.doc_id}: {r.message}")
        if len(shown) > DOCUMENTS_SHOWN:
            lines.append(f"    … {len(shown) - DOCUMENTS_SHOWN} more (`kdn ingest --json` lists every one)")
        if self.ignored:
            lines.append(f"  ignored {len(self.ignored)} files that are not text-like (by suffix)")
        if self.not_regular:
            lines.append(f"  skipped {len(self.not_regular)} entries that are not regular files (FIFO, socket, device): "
                         + ", ".join(self.not_regular[:5]) + (" …" if len(self.not_regular) > 5 else ""))
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


ProgressMode = Literal["bar", "lines", "off"]


class Progress:
    """Live progress of an ingest: documents, tokens, bytes and prefill rate.

    ``mode``: ``"bar"`` a rich bar on stderr (a terminal); ``"lines"`` (a pipe, a log, CI) one line per
    finished document plus, while nothing finishes, a heartbeat line every ``heartbeat_s`` naming
    what is in flight (a thread calls :meth:`tick`); ``"off"`` (or ``False``) nothing. ``True``
    means ``"bar"``. Lines go to ``stream`` (default stderr: stdout holds the summary).
    """

    def __init__(
        self,
        total: int,
        mode: ProgressMode | bool,
        *,
        stream: TextIO | None = None,
        heartbeat_s: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
    ) -> None:
        self.mode: ProgressMode = "bar" if mode is True else "off" if mode is False else mode
        self.total = total
        self._p = None
        self.docs = self.tokens = self.bytes = 0
        self._t0 = time.perf_counter()
        self.heartbeat_s = heartbeat_s
        self.in_flight: dict[str, float] = {}  # doc id -> when it was handed to a worker
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lines = StageLines((stream or sys.stderr) if self.mode == "lines" else None, prog="ingest", clock=clock)
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._p = RichProgress(
                TextColumn("ingest"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("docs  {task.fields[tokens]} tokens  {task.fields[bytes]}  {task.fields[rate]} tok/s"),
                TimeElapsedColumn(),
                transient=False,
                console=Console(file=stream or sys.stderr),
            )
            self._task = self._p.add_task("ingest", total=total, tokens=0, bytes="0 B", rate="0")
            self._p.start()
        elif self.mode == "lines" and background and heartbeat_s > 0:
            self._thread = threading.Thread(target=self._beat, name="ingest-progress", daemon=True)
            self._thread.start()

    def started(self, doc_id: str) -> None:
        """``doc_id`` was handed to a worker (for the heartbeat's "working on ...")."""
        with self._lock:
            self.in_flight[doc_id] = self.lines.clock()

    def update(self, r: DocumentResult) -> None:
        with self._lock:
            self.in_flight.pop(r.doc_id, None)
            self.docs += 1
            self.tokens += r.n_tokens
            self.bytes += r.bytes_written
            dt = max(time.perf_counter() - self._t0, 1e-9)
            if self._p is not None:
                self._p.update(self._task, advance=1, tokens=self.tokens, bytes=_human(self.bytes), rate=f"{self.tokens / dt:.0f}")
            what = f"{r.n_tokens} tokens, {r.n_chunks} chunks ({r.computed_chunks} computed), {_human(r.bytes_written)}"
            if r.status == "failed":
                what = r.message
            self.lines.line(f"{self.docs}/{self.total} {r.status} {r.doc_id}: {what}")

    def tick(self) -> bool:
        """Print a heartbeat if no line was printed for ``heartbeat_s``; returns whether it did."""
        with self._lock:
            now = self.lines.clock()
            if self.lines.stream is None or now - self.lines.last < self.heartbeat_s:
                return False
            if self.in_flight:
                doc, since = next(iter(self.in_flight.items()))
                more = f" and {len(self.in_flight) - 1} more" if len(self.in_flight) > 1 else ""
                doing = f"prefilling {doc}{more} ({now - since:.0f}s so far)"
            else:
                doing = "waiting for the workers"
            self.lines.line(f"{self.docs}/{self.total} done; still working: {doing}")
            return True

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            self.tick()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._p is not None:
            self._p.stop()
