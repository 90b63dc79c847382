"""The ingest pipeline: discovered documents -> an executor's prefill workers -> the origin store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, Sequence, TextIO

from kdn.errors import InvalidInput
from kdn.prompts import check_layout
from kdn.origin.config import OriginConfig
from kdn.origin.ingest.documents import Discovery, discover, read_text
from kdn.origin.ingest.executors import Executor, OnResult, make_executor
from kdn.origin.ingest.report import IngestSummary, Progress, ProgressMode
from kdn.origin.store import OriginStore
from kdn.origin.worker import DocumentResult, DocumentTask

__all__ = ["BYTES_PER_TOKEN", "ingest"]

# bytes of a file read per token of the model window: more than any token of a real tokenizer spans
BYTES_PER_TOKEN = 64


def ingest(
    paths: Sequence[str | Path],
    config: OriginConfig,
    *,
    executor: Executor | None = None,
    progress: ProgressMode | bool = False,
    on_result: OnResult | None = None,
    found: Discovery | None = None,
    progress_stream: TextIO | None = None,
    emphasize: str = "",
    layout: str = "text",
    segments: bool = False,
) -> IngestSummary:
    """Ingest ``paths`` into ``config``'s store; never raises for a bad document (see summary).

    ``executor``: reuse one (tests, benchmarks); otherwise one is made from ``config`` and closed.
    ``emphasize``: an :class:`kdn.origin.steer.Emphasis` as JSON: also store that steered variant.
    ``segments``: also store each document as a segment, reusable anywhere in a prompt
    (:mod:`kdn.origin.segments`), so the store can blend it (:mod:`kdn.origin.blend`).
    ``layout``: where each document sits in the requests that will reuse it (:mod:`kdn.prompts`):
    ``text`` (a completion prompt starts with it), ``system`` or ``user`` (a chat message).
    ``found``: ``paths`` already discovered (the CLI checks there is something to do first).
    ``progress``: ``"bar"`` (or True), ``"lines"`` (one line per document and a heartbeat, on
    ``progress_stream``, default stderr) or ``"off"`` (or False); see :class:`Progress`.
    Raises :class:`~kdn.errors.UnknownModel` before any work for an unknown model spec, and
    InvalidInput when ``paths`` hold no document and no problem at all (an empty directory).
    Nothing is created on disk when no path holds a document.
    """
    found = found if found is not None else discover(paths)
    if not found.sources and not found.problems:
        raise InvalidInput(found.nothing_to_ingest())
    if found.sources:
        OriginStore(config.store_path, fsync=config.fsync, verify=config.verify_on_start).close()  # self-check once
    layout = check_layout(layout)
    own = executor is None
    ex = executor if executor is not None else make_executor(config)
    try:
        info = ex.info()
        if layout != "text" and not info.get("chat_template"):
            raise InvalidInput(f"layout {layout!r} places documents in chat messages, but {info['spec']} has no chat "
                               "template that renders one; use --layout text")
        ns = config.default_namespace
        summary = IngestSummary(
            model=info["spec"],
            fingerprint=info["fingerprint"],
            namespace=str(ns),
            codecs=list(info["codecs"]),
            workers=int(info.get("workers", 0)),
            ignored=found.ignored,
            not_regular=found.not_regular,
            layout=layout,
        )
        bar = Progress(len(found.sources) + len(found.problems), progress, stream=progress_stream)
        where = "in this process" if not summary.workers else f"on {summary.workers} Ray worker(s)"
        bar.lines.line(f"{len(found.sources)} document(s) to prefill with {summary.model} {where}; "
                       f"codecs {', '.join(summary.codecs)}")
        t0 = time.perf_counter()

        def record(r: DocumentResult) -> None:
            summary.results.append(r)
            bar.update(r)
            if on_result is not None:
                on_result(r)

        for p in found.problems:
            record(p)

        # only the first tokens of a document within the window are ever used: read (and send to
        # a worker) a bounded prefix of each file, generous enough for any tokenizer's window
        window = int(info.get("max_positions", 0) or 0)
        max_bytes = window * BYTES_PER_TOKEN if window > 0 else None

        def tasks() -> Iterator[DocumentTask]:
            for s in found.sources:
                try:
                    doc = read_text(s.path, max_bytes)
                except InvalidInput as exc:
                    record(DocumentResult(s.doc_id, "failed", str(exc)))
                    continue
                bar.started(s.doc_id)
                yield DocumentTask(s.doc_id, doc.text, doc.digest, ns.tenant, ns.salt, complete=doc.complete,
                                   emphasize=emphasize, layout=layout, segment=segments)

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
