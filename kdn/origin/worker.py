"""Prefill workers: a model plus the store, turning documents or token chains into stored artifacts.

:class:`PrefillWorker` is plain Python (used in-process by the server, by ``kdn ingest
--workers 0`` and by unit tests). :func:`spawn_workers` wraps it as Ray actors (``OriginWorker``)
placed on nodes that carry the custom resource ``kdn_origin``.

Workers write artifacts to the store themselves and return only plain data (document ids, key
hex strings, counts): no tensor crosses a process boundary, and the only artifact bytes that do
are a blend variant's (numpy byte arrays: the server serves them from memory, they are never
stored). A worker that
dies mid-document leaves at most complete blobs behind (atomic writes; rows only after blobs);
the driver resubmits the document, and the store's key-based idempotence means the redo writes
only what is still missing: nothing is lost, duplicated or partial.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch

from kdn.artifact import encode_artifact
from kdn.codecs import get_codec
from kdn.errors import InvalidInput
from kdn.keys import ROOT_KEY, ChunkKey, Namespace, chunk_keys, piece_keys
from kdn.models import LoadedModel, load_model
from kdn.prefill import plan_chunks, prefill_document, window_tokens
from kdn.prompts import check_chat_template
from kdn.origin.config import OriginConfig
from kdn.origin.store import DocumentRecord, OriginStore

__all__ = ["ChainResult", "DocumentResult", "DocumentTask", "PrefillWorker", "spawn_workers"]

Status = Literal["stored", "skipped", "truncated", "short", "failed"]


@dataclass(frozen=True, slots=True)
class DocumentTask:
    """One document to ingest. Plain data: crosses to Ray actors as a dict."""

    doc_id: str
    text: str
    content_hash: str
    tenant: str
    salt: str = ""
    attempt: int = 0
    complete: bool = True  # False: ``text`` is only the first part of the document (see ingest)
    emphasize: str = ""  # an operator's emphasis (kdn.origin.steer.Emphasis as JSON): also store a steered variant
    layout: str = "text"  # where the document sits in the requests that reuse it (kdn.prompts.Layout)
    segment: bool = False  # also store it as a segment, reusable anywhere in a prompt (kdn.origin.segments)

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in DocumentTask.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class DocumentResult:
    """What became of one document. ``status``: stored (all chunks now stored), skipped (every
    chunk was already stored, nothing computed), truncated (stored, but tokens past the model
    window have no KV), short (fewer tokens than one chunk: no chunk stored, only its tail pieces if any; a warning),
    failed (``message`` says why)."""

    doc_id: str
    status: Status
    message: str = ""
    n_tokens: int = 0
    n_chunks: int = 0
    computed_chunks: int = 0
    already_stored: int = 0
    bytes_written: int = 0
    tail_tokens: int = 0
    beyond_window_tokens: int = 0
    keys: tuple[str, ...] = ()  # hex, in chain order
    seconds: float = 0.0
    worker_pid: int = 0
    attempts: int = 1
    steer: str = ""  # the steered variant's canonical spec ("" when none was asked for or it failed)
    steer_variant: str = ""  # its id (hex): what a client names to reuse it
    steer_keys: tuple[str, ...] = ()
    steer_piece_keys: tuple[str, ...] = ()  # hex: the steered variant's tail pieces, after its chunks
    piece_keys: tuple[str, ...] = ()  # hex: the tail pieces stored after the chunks (kdn.keys.piece_keys)
    segment_key: str = ""  # hex: the document's segment, when asked for and stored
    segment_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DocumentResult":
        return cls(**{**d, **{f: tuple(d.get(f, ())) for f in ("keys", "steer_keys", "steer_piece_keys", "piece_keys")}})


@dataclass(frozen=True, slots=True)
class ChainResult:
    """Outcome of computing a chain on demand."""

    keys: tuple[ChunkKey, ...]
    computed: int
    already_stored: int
    beyond_window_tokens: int


def layout_doc_id(doc_id: str, layout: str) -> str:
    """The id a document is recorded under: its path, with ``#system``/``#user`` for a chat layout
    (the same file ingested in two layouts is two documents with different chunks)."""
    return doc_id if layout == "text" else f"{doc_id}#{layout}"


class PrefillWorker:
    """Holds one model and the store; prefill + encode + store, skipping keys already stored."""

    def __init__(
        self,
        config: OriginConfig,
        model: str | None = None,
        *,
        threads: int | None = None,
        lm: LoadedModel | None = None,
        writers: int = 4,
    ) -> None:
        """A worker for ``model`` (default: the config's first) over ``config``'s store, dtype,
        chunk size, codecs and fsync. ``lm``: an already loaded model to use instead."""
        if threads:
            torch.set_num_threads(threads)
        spec = model or config.models[0]
        self.lm = lm if lm is not None else load_model(spec, dtype=config.dtype, chunk_size=config.chunk_size)
        # the driver/server checks the store on open; a worker must not sweep others' temp files
        self.store = OriginStore(config.store_path, fsync=config.fsync, verify="none")
        self.codecs = [get_codec(c).spec for c in config.codecs]
        self._writers = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="kdn-origin-write")
        self._catalog: Any = None  # the segment catalogue (kdn.origin.segments), opened on first use

    # -- introspection (also Ray actor methods) -------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "spec": self.lm.spec,
            "fingerprint": bytes(self.lm.fingerprint).hex(),
            "chunk_size": self.lm.chunk_size,
            "max_positions": self.lm.max_positions,
            "codecs": list(self.codecs),
            "chat_template": self._chat_template(),
        }

    def _chat_template(self) -> bool:
        """Whether documents can be stored as chat messages for this model (kdn.prompts layouts)."""
        try:
            check_chat_template(self.lm.tokenizer, self.lm.spec)
        except InvalidInput:
            return False
        return True

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self._writers.shutdown(wait=True)
        if self._catalog is not None:
            self._catalog.close()
        self.store.close()

    # -- work -----------------------------------------------------------------------------------

    def process(self, task: dict[str, Any]) -> dict[str, Any]:
        """Ingest one document (a :class:`DocumentTask` as a dict); returns a DocumentResult dict."""
        t = DocumentTask(**task)
        t0 = time.perf_counter()
        ns = Namespace(t.tenant, t.salt)
        # bounded: the tokenizer sees about the window's worth of text, however long the document
        wt = window_tokens(self.lm, t.text, text_complete=t.complete, layout=t.layout)
        tokens = wt.tokens
        plan = plan_chunks(len(tokens), self.lm.chunk_size, self.lm.max_positions)
        n_tokens, beyond = len(tokens), plan.beyond_window_tokens
        if not wt.complete:  # longer than the window: ``counted`` is a lower bound of its tokens
            n_tokens = max(wt.counted, len(tokens))
            beyond = n_tokens - plan.covered_tokens - plan.tail_tokens
        # the chain of full chunks, then the document's tail in pieces (whole-document hits)
        within = tokens[: plan.covered_tokens + plan.tail_tokens]
        keys, computed, written, pieces = self._store_chain(np.asarray(within, dtype=np.int64), ns, self.codecs,
                                                             pieces=True)
        self.store.record_document(
            DocumentRecord(
                tenant=t.tenant,
                fingerprint=self.lm.fingerprint,
                doc_id=layout_doc_id(t.doc_id, t.layout),
                content_hash=t.content_hash,
                n_tokens=n_tokens,
                keys=tuple(keys) + tuple(pieces),
                beyond_window_tokens=beyond,
                updated=time.time(),
            )
        )
        if plan.n_chunks == 0:
            status: Status = "short"
            message = f"{len(tokens)} tokens: shorter than one chunk ({self.lm.chunk_size} tokens); " + (
                f"stored as {len(pieces)} tail pieces only" if pieces else "nothing to store")
        elif not wt.complete:
            status = "truncated"
            message = (
                f"more than {n_tokens} tokens: the rest lies beyond the model window ({self.lm.max_positions} "
                f"positions) and was not tokenized; stored the first {plan.n_chunks} chunks only"
            )
        elif plan.truncated:
            status = "truncated"
            message = (
                f"{plan.beyond_window_tokens} of {len(tokens)} tokens lie beyond the model window "
                f"({self.lm.max_positions} positions): stored the first {plan.n_chunks} chunks only"
            )
        elif computed == 0:
            status, message = "skipped", "every chunk already stored"
        else:
            status, message = "stored", ""
        steer: dict[str, Any] = {}
        if t.emphasize:
            try:
                steer = self._store_steered(t, tokens[: plan.covered_tokens + plan.tail_tokens], ns)
            except InvalidInput as exc:  # the plain chain is stored; the variant is not
                status, message = "failed", f"steered variant not stored: {exc} (plain KV stored)"
            if steer.pop("computed", 0) and status == "skipped":
                status, message = "stored", "plain chunks were already stored; computed the steered variant"
            written += steer.pop("written", 0)
        seg: dict[str, Any] = {}
        if t.segment:
            try:
                seg = self._store_segment(t, ns)
            except InvalidInput as exc:  # the plain chain is stored; the segment is not
                status, message = "failed", f"segment not stored: {exc} (plain KV stored)"
            if seg.pop("computed", False) and status == "skipped":
                status, message = "stored", "plain chunks were already stored; computed the segment"
            written += seg.pop("written", 0)
        return DocumentResult(
            doc_id=layout_doc_id(t.doc_id, t.layout),
            status=status,
            message=message,
            n_tokens=n_tokens,
            n_chunks=plan.n_chunks,
            computed_chunks=computed,
            already_stored=plan.n_chunks - computed,
            bytes_written=written,
            tail_tokens=plan.tail_tokens,
            beyond_window_tokens=beyond,
            keys=tuple(bytes(k).hex() for k in keys),
            piece_keys=tuple(bytes(k).hex() for k in pieces),
            seconds=time.perf_counter() - t0,
            worker_pid=os.getpid(),
            attempts=t.attempt + 1,
            **steer,
            **seg,
        ).to_dict()

    def _store_segment(self, t: DocumentTask, ns: Namespace) -> dict[str, Any]:
        """Store the document as a segment (see :mod:`kdn.origin.segments`); its result fields."""
        from kdn.origin.segments import SegmentCatalog, record_segment_document, segment_tokens, store_segment

        if not t.complete:
            raise InvalidInput("the document is longer than the model window; a segment is a whole document")
        tokens = segment_tokens(self.lm, t.text)
        if self._catalog is None:
            self._catalog = SegmentCatalog(self.store.root)
        res = store_segment(self.lm, self.store, self._catalog, tokens, namespace=ns, doc_id=t.doc_id,
                            codecs=self.codecs)
        record_segment_document(self.store, self.lm, ns, t.doc_id, t.text, res)
        return {"segment_key": bytes(res.key).hex(), "segment_tokens": res.tokens, "computed": res.computed,
                "written": res.bytes if res.computed else 0}

    def _store_steered(self, t: DocumentTask, tokens: Sequence[int], ns: Namespace) -> dict[str, Any]:
        """Store the document's steered variant (see :mod:`kdn.origin.steer`) from its ``tokens``
        inside the window; its result fields."""
        from kdn.origin.steer import STEER_SUFFIX, Emphasis, calibration_for, resolve, store_steered_chain

        em = Emphasis.from_json(t.emphasize)
        n_stored = len(tokens) // self.lm.chunk_size * self.lm.chunk_size
        if not n_stored:
            raise InvalidInput("the document holds no full chunk: nothing to steer")
        cal = calibration_for(self.lm) if em.method == "key-edit" else None
        spec = resolve(em, self.lm, t.text, n_stored, cal, layout=t.layout)
        res = store_steered_chain(self.lm, self.store, tokens, spec, ns, self.codecs, cal)
        self.store.record_document(DocumentRecord(
            tenant=t.tenant, fingerprint=self.lm.fingerprint, doc_id=layout_doc_id(t.doc_id, t.layout) + STEER_SUFFIX,
            content_hash=t.content_hash, n_tokens=len(tokens), keys=(*res.keys, *res.pieces), beyond_window_tokens=0,
            updated=time.time()))
        return {"steer": res.spec.canonical(), "steer_variant": res.spec.variant_id,
                "steer_keys": tuple(bytes(k).hex() for k in res.keys),
                "steer_piece_keys": tuple(bytes(k).hex() for k in res.pieces),
                "computed": res.computed, "written": res.written}

    def blend(self, tokens: np.ndarray, tenant: str, salt: str, plan: dict[str, Any], codec: str = "raw") -> dict[str, Any]:
        """A blend variant of ``tokens`` (:mod:`kdn.origin.blend`): its chunk containers as numpy
        byte arrays (the server keeps them in memory; they are never stored here), or a refusal."""
        from kdn.origin.blend import BlendPlan, Refusal, compute_variant
        from kdn.origin.segments import SegmentCatalog

        if self._catalog is None:
            self._catalog = SegmentCatalog(self.store.root)
        out = compute_variant(self.lm, self.store, self._catalog, np.asarray(tokens, dtype=np.int64),
                              BlendPlan.from_dict(plan), Namespace(tenant, salt), codec or "raw")
        if isinstance(out, Refusal):
            return {"refused": out.code, "reason": out.reason}
        return {"artifacts": [np.frombuffer(b, dtype=np.uint8) for b in out.artifacts], "documents": out.documents,
                "document_tokens": out.document_tokens, "recomputed": out.recomputed,
                "computed_segments": out.computed_segments, "seconds": out.seconds}

    def compute(self, tokens: np.ndarray, tenant: str, salt: str = "", codecs: Sequence[str] | None = None) -> dict[str, Any]:
        """Compute on demand: store every missing full chunk of the chain ``tokens``."""
        res = self.compute_chain(tokens, Namespace(tenant, salt), codecs)
        return {
            "keys": [bytes(k).hex() for k in res.keys],
            "computed": res.computed,
            "already_stored": res.already_stored,
            "beyond_window_tokens": res.beyond_window_tokens,
        }

    def compute_chain(self, tokens: np.ndarray | Sequence[int], ns: Namespace, codecs: Sequence[str] | None = None) -> ChainResult:
        arr = np.asarray(tokens, dtype=np.int64)
        plan = plan_chunks(len(arr), self.lm.chunk_size, self.lm.max_positions)
        specs = [get_codec(c).spec for c in codecs] if codecs else self.codecs
        keys, computed, _, _ = self._store_chain(arr[: plan.covered_tokens], ns, specs)
        return ChainResult(tuple(keys), computed, len(keys) - computed, plan.beyond_window_tokens)

    def _store_chain(self, tokens: np.ndarray, ns: Namespace, codecs: Sequence[str], *,
                     pieces: bool = False) -> tuple[list[ChunkKey], int, int, list[ChunkKey]]:
        """Keys of every full chunk of ``tokens`` (already cut to the window) and, with ``pieces``,
        of the full tail pieces after them; prefill only when some (key, codec) is missing, and
        only as far as the last missing one. Returns chunk keys, chunks computed, bytes written,
        piece keys."""
        lm = self.lm
        C = lm.chunk_size
        keys = chunk_keys(tokens, fingerprint=lm.fingerprint, namespace=ns, chunk_size=C)
        pkeys = piece_keys(tokens[len(keys) * C:], after=keys[-1] if keys else ROOT_KEY, fingerprint=lm.fingerprint,
                           namespace=ns, chunk_size=C) if pieces else []
        spans = [*keys, *pkeys]
        stored = self.store.stored_keys(spans, tenant=ns.tenant, codecs=codecs)
        missing = [i for i, k in enumerate(spans) if k not in stored]
        if not missing:
            return keys, 0, 0, pkeys
        n = len(keys)
        chunks, tail = prefill_document(lm, tokens, max_chunks=None if missing[-1] >= n else missing[-1] + 1,
                                        pieces=missing[-1] >= n)
        kv = [*chunks, *tail]  # each (L, 2, H, C or PIECE_TOKENS, D)

        def write(i: int, spec: str) -> int:
            if self.store.artifact(spans[i], spec) is not None:
                return 0
            blob = encode_artifact(kv[i], key=spans[i], parent_key=spans[i - 1] if i else ROOT_KEY,
                                   fingerprint=lm.fingerprint, codec=spec, chunk_index=min(i, n))
            self.store.put(blob, tenant=ns.tenant)
            return len(blob)

        # encode + fsynced writes overlap (codecs and fsync release the GIL); all are done, and
        # durable, before this returns: a result never reports a chunk that is not stored. When one
        # fails (a full disk) every other one still ends first: no write outlives its document's result
        jobs = [self._writers.submit(write, i, spec) for i in missing for spec in codecs]
        wait(jobs)
        written = sum(j.result() for j in jobs)
        return keys, sum(1 for i in missing if i < n), written, pkeys


# Ray Data actor pools vs plain actors: ingest is a handful of documents per worker with a
# per-document retry rule (redo on worker death, give up after max_attempts) and results that
# are tiny records; plain actors fed from a driver-side work queue express that directly, keep
# the store writes inside the workers, and need no Dataset schema for documents of wildly
# different sizes. Ray Data would add a block/batch layer without adding throughput here.


def spawn_workers(
    config: OriginConfig, model: str, *, n: int | None = None, on_nodes: Sequence[str] = ()
) -> list[Any]:
    """Start ``n`` (default ``config.workers``) ``OriginWorker`` Ray actors for ``model``, each
    needing one unit of ``kdn_origin`` and ``config.worker_threads`` CPUs; or, given ``on_nodes``
    (Ray node ids), placed on those nodes in turn, needing only the CPUs (on a ``kdn up`` cluster
    each origin node's one ``kdn_origin`` unit is held by its origin server).

    ``config.max_restarts``: Ray restarts a dead worker (SIGKILL, OOM) that many times; the driver
    resubmits the document it held (``max_task_retries=0``: the driver, not Ray, decides about
    redo, so it can count attempts and report).
    """
    import ray

    threads = config.worker_threads
    actor_cls = ray.remote(PrefillWorker)
    def placement(i: int) -> dict[str, Any]:
        if not on_nodes:
            return {"resources": {"kdn_origin": 1}}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(on_nodes[i % len(on_nodes)], soft=False)}

    return [
        actor_cls.options(
            num_cpus=threads,
            max_restarts=config.max_restarts,
            max_task_retries=0,
            **placement(i),
        ).remote(config, model, threads=threads)
        for i in range(config.workers if n is None else n)
    ]
