"""Ingest: files and directories -> documents -> prefill workers -> origin store.

Steps: :func:`~.documents.discover` expands paths (directories recursively, text-like files only,
hidden entries skipped); the driver reads each file (:func:`~.documents.read_document`: empty,
binary and non-UTF-8 files are refused with a clear message), hands it to a worker as a
:class:`~kdn.origin.worker.DocumentTask`; the worker tokenises, skips it entirely if every chunk
key is already stored, else prefills, encodes with every configured codec and writes to the store
(see :mod:`kdn.origin.worker`).

One idea per file: :mod:`.documents` (discovery and reading), :mod:`.executors` (in-process or
Ray workers), :mod:`.report` (summary and progress), :mod:`.pipeline` (:func:`ingest`).

Every document ends with a :class:`~kdn.origin.worker.DocumentResult`; one bad document never stops
the batch. :class:`IngestSummary` totals them; ``failed`` tells the CLI's exit code.
"""

from kdn.origin.ingest.documents import Discovery, Source, discover, doc_id_for, is_text_like, read_document
from kdn.origin.ingest.executors import Executor, LocalExecutor, RayExecutor, check_model_spec, make_executor
from kdn.origin.ingest.pipeline import ingest
from kdn.origin.ingest.report import IngestSummary, Progress

__all__ = [
    "Discovery",
    "Executor",
    "IngestSummary",
    "LocalExecutor",
    "Progress",
    "RayExecutor",
    "Source",
    "check_model_spec",
    "discover",
    "doc_id_for",
    "ingest",
    "is_text_like",
    "make_executor",
    "read_document",
]
