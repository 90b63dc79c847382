"""Segments: a document's KV stored once, usable at any position of any prompt.

A *segment* is the KV of one document (or retrieved passage) prefilled after the model's
*lead* and nothing else: the lead is the model's BOS token (``bos_token_id`` in its config)
when it has one, else nothing (:func:`segment_lead`). The lead's own KV is dropped; the
document's tokens keep positions ``a .. a+n-1`` (``a`` = the lead's length). Why the lead: every
prompt of a chat model starts with that token at position 0, and a decoder parks most of its
attention there (an "attention sink"). A document prefilled with nothing before it makes its own
first token that sink, and every later token of it reads through the wrong sink at every layer;
prefilled after the real one, the document's KV differs from its KV inside a prompt only by the
context it did not see. On SmolLM2-135M-Instruct this cut the KL of naive concatenation to full
prefill about fivefold on held-out needle prompts (``kdn eval-blend`` reports ``naive`` and
``naive+lead`` side by side). The lead is a function of the model, so the model
fingerprint fixes it; the key's version names the rule. A segment is named by what it is, not by
what precedes it::

    segment_key = BLAKE2b-256(person="kdn/segment/v2", fingerprint ‖ namespace ‖ tokens as LE u32)

Chain keys (:mod:`kdn.keys`) use BLAKE2b-256 without personalisation, so a segment key and a chain
key are outputs of two independent hash functions (domain separation by BLAKE2's ``person``
parameter): they cannot collide short of a BLAKE2 break, and both can live in one edge store,
which keeps artifacts as opaque bytes under their key. Segments therefore need no edge change:
``Put``/``Fetch``/``Lookup`` and every hint (pin, TTL, prefetch) work on a segment key as on a
chunk key.

Container: the ordinary artifact container (:mod:`kdn.artifact`) holding ``(L, 2, H, n, D)``,
``key`` = the segment key, ``parent_key`` = :data:`SEGMENT_PARENT` (so a reader can tell a segment
from a chain chunk), ``chunk_index`` = the position the segment's first token had when it was
prefilled (the lead's length: :func:`segment_lead`). Keys are stored *after* rotary
embedding at positions ``a .. a+n-1``: a segment placed at position ``a`` right after the lead
is bit-for-bit the KV a prefill of ``lead + document`` produces, and placing it at position
``s`` is one rotation by ``s - a`` (:mod:`kdn.blend.rope`).

Invariants:
- equal segment keys imply equal tokens, model fingerprint (hence lead) and namespace;
- a segment's key never depends on its neighbours or its position in a prompt;
- blended KV (segments re-placed and partly recomputed) is never stored under a segment key or a
  chain key: it is what *this* prompt read, not what a prefill of any token sequence produces.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NewType, Sequence

import numpy as np
import torch

from kdn.artifact import decode_artifact, encode_artifact
from kdn.errors import ArtifactCorrupt, InvalidInput
from kdn.keys import KEY_BYTES, ChunkKey, ModelFingerprint, Namespace, tokens_u32

SegmentKey = NewType("SegmentKey", bytes)
"""32-byte digest of a segment's tokens, model fingerprint and namespace (position-free)."""

SEGMENT_PERSON = b"kdn/segment/v2"  # BLAKE2 personalisation: at most 16 bytes
SEGMENT_PARENT = ChunkKey(hashlib.blake2b(b"kdn/segment/parent/v1", digest_size=KEY_BYTES).digest())
SEGMENT_START = 0  # where a segment of a model without a lead token starts
MAX_SEGMENT_TOKENS = 1 << 16


def segment_lead(config: object) -> tuple[int, ...]:
    """The tokens a model's segments are prefilled after: its BOS token when its config names one
    (an int ``bos_token_id``), else none. Their KV is not part of the segment."""
    bos = getattr(config, "bos_token_id", None)
    return (int(bos),) if isinstance(bos, int) and not isinstance(bos, bool) and bos >= 0 else ()


def segment_key(tokens: Sequence[int] | np.ndarray, *, fingerprint: ModelFingerprint, namespace: Namespace) -> SegmentKey:
    """The key of a document's segment. Seedless and cryptographic, like chain keys."""
    arr = tokens_u32(tokens)
    if arr.size == 0:
        raise InvalidInput("a segment needs at least one token")
    if arr.size > MAX_SEGMENT_TOKENS:
        raise InvalidInput(f"a segment holds at most {MAX_SEGMENT_TOKENS} tokens, got {arr.size}")
    if len(fingerprint) != KEY_BYTES:
        raise InvalidInput(f"model fingerprint must be {KEY_BYTES} bytes, got {len(fingerprint)}")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=SEGMENT_PERSON)
    h.update(bytes(fingerprint))
    h.update(namespace.encode())
    h.update(arr.tobytes())
    return SegmentKey(h.digest())


@dataclass(frozen=True, slots=True)
class Segment:
    """A segment ready to be placed: its tokens and KV ``(L, 2, H, n, D)`` computed at positions
    ``start .. start+n-1`` after the model's lead (``start`` tokens) and nothing else."""

    key: SegmentKey
    tokens: tuple[int, ...]
    kv: torch.Tensor  # (L, 2, H, n, D)
    start: int = SEGMENT_START

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[1] != 2 or self.kv.shape[3] != len(self.tokens):
            raise InvalidInput(f"segment KV {tuple(self.kv.shape)} does not hold {len(self.tokens)} tokens")


def encode_segment(seg: Segment, *, fingerprint: ModelFingerprint, codec: str = "raw") -> bytes:
    """The container for one segment (see the module docstring for the header's fields)."""
    return encode_artifact(seg.kv, key=ChunkKey(seg.key), parent_key=SEGMENT_PARENT, fingerprint=fingerprint,
                           codec=codec, chunk_index=seg.start)


def decode_segment(data: bytes | memoryview, tokens: Sequence[int], *, key: SegmentKey,
                   fingerprint: ModelFingerprint, require_lossless: bool = True) -> Segment:
    """Verify and decode a segment container (every checksum, the fingerprint, the key, the token
    count). Raises :class:`~kdn.errors.ArtifactCorrupt` / ``FingerprintMismatch`` / ``LossyRefused``."""
    art = decode_artifact(data, expect_fingerprint=fingerprint, expect_key=ChunkKey(key), require_lossless=require_lossless)
    h = art.header
    if h.parent_key != bytes(SEGMENT_PARENT):
        raise ArtifactCorrupt("artifact under a segment key is not a segment (parent key is not the segment marker)")
    if h.token_count != len(tokens):
        raise ArtifactCorrupt(f"segment holds {h.token_count} tokens, the document has {len(tokens)}")
    return Segment(key, tuple(int(t) for t in tokens), art.kv, start=int(h.chunk_index))
