"""Origin-side segment ingest: each document's KV prefilled alone, stored once under its segment key.

Beside the prefix chains of :mod:`kdn.origin.ingest`, a document meant to be reused anywhere in a
prompt (:mod:`kdn.segments`) is prefilled **alone**, at positions ``0..n-1``, and stored as one
artifact under its segment key. The origin store and the edges keep it as opaque bytes by key, so
``Fetch``/``Lookup``/``Put`` and every hint (pin, TTL, priority, scheduled prefetch) work on it
unchanged. A manifest row ``<doc_id>#segment`` names the segment key, so a hint by document name
reaches the segment as it reaches a chain.

Documents longer than the model window, or than :data:`kdn.segments.MAX_SEGMENT_TOKENS`, are
refused (a segment is whole or absent: a cut document would be reused as if it were complete).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Sequence

from kdn.blend import prefill_segment
from kdn.errors import InvalidInput
from kdn.keys import Namespace
from kdn.models import LoadedModel
from kdn.origin.store import DocumentRecord, OriginStore
from kdn.segments import MAX_SEGMENT_TOKENS, Segment, SegmentKey, encode_segment, segment_key

SEGMENT_SUFFIX = "#segment"


@dataclass(frozen=True, slots=True)
class SegmentIngest:
    doc_id: str
    key: SegmentKey
    tokens: int
    bytes: int
    computed: bool  # False when the store already held it (same content, model, namespace)


def ingest_segments(
    lm: LoadedModel,
    store: OriginStore,
    documents: Sequence[tuple[str, str]],
    *,
    namespace: Namespace,
    codec: str = "raw",
) -> list[SegmentIngest]:
    """Store every ``(doc_id, text)`` as a segment; already stored segments are not recomputed."""
    out = []
    for doc_id, text in documents:
        tokens = lm.tokenizer.encode(text)  # a fragment placed anywhere in a prompt: no BOS of its own
        limit = min(MAX_SEGMENT_TOKENS, lm.max_positions or MAX_SEGMENT_TOKENS)
        if not tokens or len(tokens) > limit:
            raise InvalidInput(f"document {doc_id!r} has {len(tokens)} tokens; a segment holds 1..{limit}")
        key = segment_key(tokens, fingerprint=lm.fingerprint, namespace=namespace)
        existing = store.variants(key, tenant=namespace.tenant)  # type: ignore[arg-type]
        if existing:
            out.append(SegmentIngest(doc_id, key, len(tokens), existing[0].size, False))
        else:
            kv = prefill_segment(lm.model, tokens)  # (L, 2, H, n, D), alone at positions 0..n-1
            data = encode_segment(Segment(key, tuple(tokens), kv), fingerprint=lm.fingerprint, codec=codec)
            row = store.put(data, tenant=namespace.tenant)
            out.append(SegmentIngest(doc_id, key, len(tokens), row.size, True))
        store.record_document(DocumentRecord(
            tenant=namespace.tenant, fingerprint=lm.fingerprint, doc_id=doc_id + SEGMENT_SUFFIX,
            content_hash=hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), n_tokens=len(tokens),
            keys=(key,), beyond_window_tokens=0, updated=time.time()))  # type: ignore[arg-type]
    return out
