"""Origin-side segments: each document's KV prefilled on its own, stored once, and recognised in prompts.

Beside the prefix chains of :mod:`kdn.origin.ingest`, a document meant to be reused anywhere in a
prompt (:mod:`kdn.segments`) is prefilled after the model's lead token and nothing else, and stored as one
artifact under its segment key. The origin store and the edges keep it as opaque bytes by key, so
``Fetch``/``Lookup``/``Put`` and every hint (pin, TTL, priority, scheduled prefetch) work on it
unchanged. A manifest row ``<doc_id>#segment`` names the segment key, so a hint by document name
reaches the segment as it reaches a chain.

A segment's tokens are the document's text tokenized as a fragment (no BOS, no chat template):
what it contributes to any prompt it sits in, wherever it sits. Documents longer than the model
window, or than :data:`kdn.segments.MAX_SEGMENT_TOKENS`, are refused (a segment is whole or
absent: a cut document would be reused as if it were complete), and so are documents shorter
than :data:`ANCHOR_TOKENS` (they could not be recognised in a prompt).

**Recognising documents in a prompt** (what the store-side blend needs, :mod:`kdn.origin.blend`):
the :class:`SegmentCatalog` (``<store>/segments.sqlite``) keeps, per tenant and model fingerprint,
each segment's key, token count and *anchor* — a digest of its first :data:`ANCHOR_TOKENS` tokens.
:meth:`SegmentCatalog.match` slides over the prompt's tokens: where the anchor of the next
``ANCHOR_TOKENS`` tokens names stored segments, each candidate (longest first) is confirmed by
computing the segment key of the prompt's tokens at that place — a content address, so a match
means the prompt holds exactly that document's tokens — and the scan continues after it.
Matching is by content, so a client needs no change: the same document in any prompt, at any
place, after any other documents, is found. Invariants:

- a match is exact: the segment key of the prompt's tokens ``[start, end)`` equals a stored one;
- matches never overlap and are in prompt order;
- the catalogue answers only for the tenant and fingerprint asked (keys hash both anyway).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kdn.blend import prefill_document
from kdn.errors import InvalidInput
from kdn.keys import ModelFingerprint, Namespace, tokens_u32
from kdn.models import LoadedModel
from kdn.origin.store import DocumentRecord, OriginStore
from kdn.segments import MAX_SEGMENT_TOKENS, Segment, SegmentKey, encode_segment, segment_key

__all__ = [
    "ANCHOR_TOKENS", "SegmentCatalog", "ingest_segments", "record_segment_document", "segment_tokens",
    "store_segment",
]

SEGMENT_SUFFIX = "#segment"
ANCHOR_TOKENS = 16
CATALOG_FILE = "segments.sqlite"
_ANCHOR_PERSON = b"kdn/seg-anchor/1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS segments (
    tenant TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    key BLOB NOT NULL,
    anchor BLOB NOT NULL,
    n_tokens INTEGER NOT NULL,
    doc_id TEXT NOT NULL,
    PRIMARY KEY (tenant, fingerprint, key)
);
CREATE INDEX IF NOT EXISTS segments_by_anchor ON segments (tenant, fingerprint, anchor);
"""


def anchor(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Digest of the first :data:`ANCHOR_TOKENS` tokens (little-endian u32)."""
    arr = tokens_u32(tokens)
    if arr.size < ANCHOR_TOKENS:
        raise InvalidInput(f"an anchor needs {ANCHOR_TOKENS} tokens, got {arr.size}")
    return hashlib.blake2b(arr[:ANCHOR_TOKENS].tobytes(), digest_size=16, person=_ANCHOR_PERSON).digest()


@dataclass(frozen=True, slots=True)
class Match:
    """A stored segment found at prompt tokens ``[start, end)``."""

    start: int
    end: int
    key: SegmentKey


class SegmentCatalog:
    """Which segments the store holds, by anchor (see the module docstring). Several processes
    (the server, Ray workers) may open one file: SQLite serialises writers; readers cache the
    anchors of a (tenant, fingerprint) until the file's data version changes."""

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root).expanduser() / CATALOG_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=60.0, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, bytes], tuple[int, dict[bytes, list[tuple[int, SegmentKey]]]]] = {}

    def record(self, tenant: str, fingerprint: ModelFingerprint, key: SegmentKey, tokens: Sequence[int],
               doc_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO segments VALUES (?, ?, ?, ?, ?, ?)",
                             (tenant, bytes(fingerprint), bytes(key), anchor(tokens), len(tokens), doc_id))

    def forget(self, tenant: str, fingerprint: ModelFingerprint, key: SegmentKey) -> None:
        with self._lock:
            self._db.execute("DELETE FROM segments WHERE tenant = ? AND fingerprint = ? AND key = ?",
                             (tenant, bytes(fingerprint), bytes(key)))

    def count(self, tenant: str, fingerprint: ModelFingerprint) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM segments WHERE tenant = ? AND fingerprint = ?",
                                        (tenant, bytes(fingerprint))).fetchone()[0])

    def _anchors(self, tenant: str, fingerprint: ModelFingerprint) -> dict[bytes, list[tuple[int, SegmentKey]]]:
        with self._lock:
            version = int(self._db.execute("PRAGMA data_version").fetchone()[0])
            total = int(self._db.execute("SELECT count(*), 0 FROM segments").fetchone()[0])
            stamp = version * 1_000_003 + total
            hit = self._cache.get((tenant, bytes(fingerprint)))
            if hit is not None and hit[0] == stamp:
                return hit[1]
            index: dict[bytes, list[tuple[int, SegmentKey]]] = {}
            for a, n, k in self._db.execute(
                    "SELECT anchor, n_tokens, key FROM segments WHERE tenant = ? AND fingerprint = ?",
                    (tenant, bytes(fingerprint))):
                index.setdefault(bytes(a), []).append((int(n), SegmentKey(bytes(k))))
            for cands in index.values():
                cands.sort(key=lambda c: -c[0])  # longest first
            self._cache[(tenant, bytes(fingerprint))] = (stamp, index)
            return index

    def match(self, tokens: Sequence[int] | np.ndarray, *, fingerprint: ModelFingerprint, namespace: Namespace,
              start: int = 0, end: int | None = None) -> list[Match]:
        """Stored segments found in ``tokens[start:end]``, in order, never overlapping."""
        arr = tokens_u32(tokens)
        stop = len(arr) if end is None else min(end, len(arr))
        index = self._anchors(namespace.tenant, fingerprint)
        if not index:
            return []
        out: list[Match] = []
        p = start
        while p + ANCHOR_TOKENS <= stop:
            cands = index.get(anchor(arr[p:p + ANCHOR_TOKENS]))
            found = None
            for n, key in cands or ():
                if p + n <= stop and segment_key(arr[p:p + n], fingerprint=fingerprint, namespace=namespace) == key:
                    found = Match(p, p + n, key)
                    break
            if found is None:
                p += 1
                continue
            out.append(found)
            p = found.end
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass(frozen=True, slots=True)
class SegmentIngest:
    doc_id: str
    key: SegmentKey
    tokens: int
    bytes: int
    computed: bool  # False when the store already held it (same content, model, namespace)


def segment_tokens(lm: LoadedModel, text: str) -> list[int]:
    """A document's tokens as a segment: its text as a fragment (no BOS, no template), checked to
    fit a segment and to be recognisable (see the module docstring)."""
    tokens = list(lm.tokenizer.encode(text))
    limit = min(MAX_SEGMENT_TOKENS, lm.max_positions or MAX_SEGMENT_TOKENS)
    if not ANCHOR_TOKENS <= len(tokens) <= limit:
        raise InvalidInput(f"document has {len(tokens)} tokens; a segment holds {ANCHOR_TOKENS}..{limit}")
    return tokens


def store_segment(lm: LoadedModel, store: OriginStore, catalog: SegmentCatalog, tokens: Sequence[int], *,
                  namespace: Namespace, doc_id: str, codecs: Sequence[str] = ("raw",)) -> SegmentIngest:
    """Store ``tokens`` as a segment (prefilled after the model's lead) unless it is stored, and catalogue it."""
    key = segment_key(tokens, fingerprint=lm.fingerprint, namespace=namespace)
    existing = store.variants(key, tenant=namespace.tenant)
    if existing:
        catalog.record(namespace.tenant, lm.fingerprint, key, tokens, doc_id)
        return SegmentIngest(doc_id, key, len(tokens), existing[0].size, False)
    kv, start = prefill_document(lm.model, list(tokens))  # (L, 2, H, n, D) after the model's lead
    seg = Segment(key, tuple(int(t) for t in tokens), kv, start)
    size = 0
    for codec in codecs:
        size += store.put(encode_segment(seg, fingerprint=lm.fingerprint, codec=codec), tenant=namespace.tenant).size
    catalog.record(namespace.tenant, lm.fingerprint, key, tokens, doc_id)  # after the blob: a row means servable
    return SegmentIngest(doc_id, key, len(tokens), size, True)


def ingest_segments(
    lm: LoadedModel,
    store: OriginStore,
    documents: Sequence[tuple[str, str]],
    *,
    namespace: Namespace,
    codec: str = "raw",
    catalog: SegmentCatalog | None = None,
) -> list[SegmentIngest]:
    """Store every ``(doc_id, text)`` as a segment; already stored segments are not recomputed."""
    own = catalog is None
    cat = catalog or SegmentCatalog(store.root)
    try:
        out = []
        for doc_id, text in documents:
            try:
                tokens = segment_tokens(lm, text)
            except InvalidInput as exc:
                raise InvalidInput(f"document {doc_id!r}: {exc}") from None
            res = store_segment(lm, store, cat, tokens, namespace=namespace, doc_id=doc_id, codecs=(codec,))
            record_segment_document(store, lm, namespace, doc_id, text, res)
            out.append(res)
        return out
    finally:
        if own:
            cat.close()


def record_segment_document(store: OriginStore, lm: LoadedModel, namespace: Namespace, doc_id: str, text: str,
                            res: SegmentIngest) -> None:
    """The manifest row ``<doc_id>#segment``: hints by document name reach the segment."""
    store.record_document(DocumentRecord(
        tenant=namespace.tenant, fingerprint=lm.fingerprint, doc_id=doc_id + SEGMENT_SUFFIX,
        content_hash=hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), n_tokens=res.tokens,
        keys=(res.key,), beyond_window_tokens=0, updated=time.time()))  # type: ignore[arg-type]
