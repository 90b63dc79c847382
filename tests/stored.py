"""What the origin stores for a document, computed as a host computes it: the chunk chain, then
the tail pieces after it (:func:`kdn.keys.piece_keys`). For tests that check the store's contents."""

from __future__ import annotations

from kdn.keys import PIECE_TOKENS, ROOT_KEY, ChunkKey, Namespace, chunk_keys, piece_keys
from kdn.models import LoadedModel
from kdn.prefill import document_tokens


def document_keys(lm: LoadedModel, text: str, ns: Namespace) -> tuple[list[ChunkKey], list[ChunkKey]]:
    """(chunk keys, tail piece keys) of ``text`` ingested with the text layout."""
    toks = document_tokens(lm, text)
    keys = chunk_keys(toks, fingerprint=lm.fingerprint, namespace=ns, chunk_size=lm.chunk_size)
    pieces = piece_keys(toks[len(keys) * lm.chunk_size:], after=keys[-1] if keys else ROOT_KEY,
                        fingerprint=lm.fingerprint, namespace=ns, chunk_size=lm.chunk_size)
    return keys, pieces


def whole_document_tokens(lm: LoadedModel, text: str) -> int:
    """Tokens of ``text`` a request carrying it reuses: whole chunks, then whole tail pieces."""
    n = len(document_tokens(lm, text))
    full = n // lm.chunk_size * lm.chunk_size
    return full + len(document_keys(lm, text, Namespace("default"))[1]) * PIECE_TOKENS
