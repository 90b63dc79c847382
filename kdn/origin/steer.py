"""Origin side of steered KV: an operator's emphasis on a document becomes a steered chain in the store.

The operator says what matters (``kdn ingest --emphasize METHOD [--emphasize-regex RX |
--emphasize-spans S:E,...] [--emphasize-strength NATS]``): an :class:`Emphasis`, checked before
any work. For each document it is resolved against that document's text and tokens into a
:class:`kdn.steer.SteerSpec` (lines matching the regex become token spans; marks past the stored
full chunks are dropped), the steered KV is computed here — the origin has the model — by
:func:`kdn.steer.methods.steered_kv`, cut into chunks under the variant's own chain
(:func:`kdn.steer.steer_root`), followed by the document's tail pieces read on top of the steered
chunks (so a steered hit, like a plain one, prefills only the question), and stored with every
configured codec, each header naming the spec. The edge needs no change: it keeps and serves these
artifacts by key like any other. A manifest row ``<doc_id>#steer`` lists the variant's keys and
pieces, and the ingest result names the variant id a client asks for (``ClientConfig(steer=...)``).

The same happens later through an edge: ``kdn edge emphasize`` sends an EMPHASIZE hint, the edge
asks the origin (``Document`` with an emphasis), and the origin reads the ingested file again (the
store keeps keys, not text; the file must still hash as it did at ingest), stores the variant and
answers its keys and id; the edge fetches them.

Key-edit needs the model's calibration (``kdn eval-steer`` writes it for a trained model: heads,
directions, profile and default strength, chosen on calibration documents); without one it is
refused with that advice. Marked spans must lie inside the document: a span past its last token is
refused, naming the span; marks past the stored full chunks (in the partial tail, which is read
plainly after the steered chunks) are dropped.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import torch

from kdn.artifact import encode_artifact
from kdn.errors import InvalidInput
from kdn.keys import PIECE_TOKENS, ChunkKey, ModelFingerprint, Namespace, chunk_keys, piece_keys
from kdn.models import LoadedModel
from kdn.origin.store import OriginStore
from kdn.prefill import document_tokens
from kdn.steer import Emphasis, SteerSpec, regex_lines, steer_root
from kdn.steer.methods import KeyEditCalibration, calibration_summary, load_calibration, read_after, steered_kv

__all__ = [
    "Emphasis", "STEER_SUFFIX", "SteeredChain", "calibration_for", "resolve", "steering_details", "store_steered_chain",
]

STEER_SUFFIX = "#steer"


def resolve(em: Emphasis, lm: LoadedModel, text: str, n_stored: int, cal: KeyEditCalibration | None, *,
            layout: str = "text") -> SteerSpec:
    """The spec of ``em`` for one document whose first ``n_stored`` tokens are stored as chunks
    (in ``layout``: token spans count from the request's first token)."""
    if em.regex:
        # token index of a character offset: tokens of the text before it (exact for tokenizers whose
        # tokens never cross a line end; approximate by a token at a BPE merge across one)
        lines: list[tuple[int, int]] = []
        for cs, ce in regex_lines(text, em.regex):  # consecutive matching lines: one span, fewer tokenizations
            if lines and cs - lines[-1][1] <= 2:
                lines[-1] = (lines[-1][0], ce)
            else:
                lines.append((cs, ce))
        marks = [(len(document_tokens(lm, text[:cs], layout)), len(document_tokens(lm, text[:ce], layout)))
                 for cs, ce in lines]
        marks = [(s, e) for s, e in marks if e > s]
        if not marks:  # else re-read would take "no marks" for "the whole document"
            raise InvalidInput(f"regex {em.regex!r} matches only empty lines of the document: nothing to emphasize")
    else:
        marks = list(em.spans)
        n_doc = len(document_tokens(lm, text, layout))
        outside = [(s, e) for s, e in marks if e > n_doc]
        if outside:
            raise InvalidInput(f"marked span [{outside[0][0]}, {outside[0][1]}) lies outside the document, which has "
                               f"{n_doc} tokens (in layout {layout!r}, counted from the request's first token)")
    kept = [(s, min(e, n_stored)) for s, e in marks if s < n_stored]
    if marks and not kept:
        raise InvalidInput(f"every marked span lies past the document's stored chunks (first {n_stored} tokens)")
    if em.method == "re-read":
        return SteerSpec("re-read", tuple(kept))
    if cal is None:
        raise InvalidInput(f"no key-edit calibration for model {lm.spec}; run `kdn eval-steer --model {lm.spec} "
                           "--out DIR` on it first (or use --emphasize re-read, which needs none)")
    return SteerSpec("key-edit", tuple(kept), float(em.strength if em.strength is not None else cal.strength), cal.digest)


def steering_details(store: OriginStore, fingerprints: Iterable[ModelFingerprint]) -> dict[str, Any]:
    """Per model (fingerprint hex): how many documents hold a steered variant (a ``#steer`` manifest
    row), and what key-edit's calibration is and was measured to do (:func:`calibration_summary`).
    Counts only: document names of one tenant are never shown beside another's."""
    counts = Counter(bytes(r.fingerprint).hex() for r in store.documents() if r.doc_id.endswith(STEER_SUFFIX))
    return {bytes(fp).hex(): {"variants": counts.get(bytes(fp).hex(), 0), **calibration_summary(bytes(fp).hex())}
            for fp in fingerprints}


def calibration_for(lm: LoadedModel) -> KeyEditCalibration | None:
    return load_calibration(bytes(lm.fingerprint).hex())


class SteeredChain(NamedTuple):
    """What :func:`store_steered_chain` stored: the variant's chunk keys, then its tail pieces' keys."""

    keys: list[ChunkKey]
    pieces: list[ChunkKey]
    computed: int  # chunks computed here (0: every chunk and piece was already stored)
    written: int  # bytes
    spec: SteerSpec  # the spec bound to the document (:meth:`SteerSpec.bound`): its variant id names the chain


def store_steered_chain(lm: LoadedModel, store: OriginStore, tokens: Sequence[int] | np.ndarray, spec: SteerSpec,
                        ns: Namespace, codecs: Sequence[str], cal: KeyEditCalibration | None) -> SteeredChain:
    """Store the steered variant of ``tokens`` (the document inside the model window): its full
    chunks, steered by ``spec``, then the full tail pieces after them (:func:`kdn.keys.piece_keys`
    under the variant's last chunk key), read plainly *on top of the steered chunks* — exactly what
    a client would otherwise prefill there at every hit, so a steered hit prefills only what a plain
    one does. Every artifact's header names the spec, bound to the document's stored tokens (an
    unbound ``spec`` is bound here; one bound to other tokens is refused)."""
    toks = [int(t) for t in np.asarray(tokens).tolist()]
    C = lm.chunk_size
    base = len(toks) // C * C
    own = spec.bound(toks[:base])
    if spec.document and spec.document != own.document:
        raise InvalidInput("the steer spec is bound to another document's tokens")
    spec, root = own, steer_root(own)
    keys = chunk_keys(toks, fingerprint=lm.fingerprint, namespace=ns, chunk_size=C, root=root)
    if not keys:
        return SteeredChain([], [], 0, 0, spec)
    pieces = piece_keys(toks[base:], after=keys[-1], fingerprint=lm.fingerprint, namespace=ns, chunk_size=C)
    spans = [*keys, *pieces]
    if len(store.stored_keys(spans, tenant=ns.tenant, codecs=codecs)) == len(spans):
        return SteeredChain(keys, pieces, 0, 0, spec)
    extra = sum(e - s for s, e in spec.marks) if spec.marks else base
    if spec.method == "re-read" and lm.max_positions and base + extra > lm.max_positions:
        raise InvalidInput(f"re-read of {extra} tokens after a {base}-token document needs {base + extra} "
                           f"positions; the model has {lm.max_positions}: mark less (--emphasize-regex/--emphasize-spans)")
    kv = steered_kv(lm.model, toks[:base], spec, cal)  # (L, 2, H, base, D)
    items = [kv[:, :, :, i * C : (i + 1) * C].contiguous() for i in range(len(keys))]
    if pieces:
        tail = read_after(lm.model, kv, toks[base : base + len(pieces) * PIECE_TOKENS])  # (L, 2, H, n, D)
        items += [tail[:, :, :, j * PIECE_TOKENS : (j + 1) * PIECE_TOKENS].contiguous() for j in range(len(pieces))]
    written = 0
    for i, (key, item) in enumerate(zip(spans, items)):
        for codec in codecs:
            blob = encode_artifact(item, key=key, parent_key=spans[i - 1] if i else root, fingerprint=lm.fingerprint,
                                   codec=codec, chunk_index=min(i, len(keys)), steer=spec.canonical())
            store.put(blob, tenant=ns.tenant)
            written += len(blob)
    return SteeredChain(keys, pieces, len(keys), written, spec)
