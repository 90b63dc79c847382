"""The store blends: a prompt's documents, held as segments, joined and partly recomputed at the
origin, and served as a *blend variant* of the prompt's prefix chain to any engine.

One ``Blend`` call (``OriginService``) carries a prompt's tokens. The origin:

1. **gates** on the model's blend verdict (:mod:`kdn.blend.verdict`, written by ``kdn
   eval-blend``): no verdict, an unreadable or malformed one (``passed`` not a bool, ``ratio``
   not a number in [0, 1], ``check_layer`` not an int >= 0), a failed one, or a model the
   selective pass cannot drive (its RoPE or attention implementation) — refused; so is a
   blended region reaching past the model's window (``max_positions``), which a plain chain
   never stores either;
2. **recognises the documents**: by content, against the segments it holds
   (:meth:`kdn.origin.segments.SegmentCatalog.match`: exact, position-free), or — when the
   request names them — at the token spans it gives, computing and storing any segment it does
   not hold yet (compute on demand; later requests then find it by content). Tokens before the
   first document are the exact *prefix*; tokens between documents are *glue*, computed at
   every layer; the blended region ends where the last document ends;
3. **names the variant**: ``root = BLAKE2b-256(person="kdn/blend/root/1", canonical plan)`` with
   the plan's recompute ratio, check layer, every document's ``[start, end)`` and segment key,
   and a digest of *every* token of the blended region ``[0, end)``; the variant's chunk keys
   are :func:`kdn.keys.chunk_keys` of the prompt's tokens over the region's whole chunks, from
   that root. The region's tokens past its last whole chunk are named too because they change
   the KV before it: the deviation check ranks all document tokens of the region together, so
   glue after the last whole chunk changes which earlier tokens are recomputed. No blend key
   equals a plain key (another root) or another plan's (another digest); equal keys mean equal
   blended-region tokens, documents, model, namespace and policy;
4. **blends** on a prefill worker (:func:`compute_variant`: the model's own layers, the same
   :func:`kdn.blend.blend` the inference host runs) and encodes one artifact per chunk;
5. keeps them in a bounded in-memory :class:`BlendCache` (never in the durable store, never under
   a plain or segment key) and answers the keys — only when the cache holds every one of them
   (else refused, ``no_room``); the client fetches them by key from the origin, like any
   artifact. A held variant answers a later request only in the codec that request asked for,
   and a lossy one is never served to a fetch that requires lossless KV.

An engine therefore gets blending without running it: the vLLM connector asks for the variant
when a request opts in and loads its chunks like a prefix. A request that does not ask computes
plain keys, which no blend artifact is stored under.

Refusals are answers, not errors: :class:`Refusal` carries a short ``code`` (for counters) and a
reason; the client then serves the request by plain prefill or prefix reuse, never with partial
or unverified KV. A segment that fails to decode (a checksum, another model's fingerprint, not a
segment) refuses the whole request.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from kdn.artifact import encode_artifact, read_header
from kdn.blend import Deviation, Glue, blend, check_model, place
from kdn.blend.verdict import Verdict, read_verdict
from kdn.errors import ArtifactCorrupt, FingerprintMismatch, InvalidInput, KdnError, NotFound
from kdn.keys import KEY_BYTES, ChunkKey, ModelFingerprint, Namespace, chunk_keys, tokens_u32
from kdn.kv import layers_to_chunk
from kdn.models import LoadedModel
from kdn.origin.segments import ANCHOR_TOKENS, SegmentCatalog, store_segment
from kdn.origin.store import OriginStore
from kdn.segments import Segment, SegmentKey, decode_segment, segment_key

__all__ = ["BlendCache", "BlendPlan", "Refusal", "check_spans", "compute_variant", "plan_blend"]

PLAN_VERSION = 2  # 2: the root names the blended region's tokens
_ROOT_PERSON = b"kdn/blend/root/1"

# refusal codes (each becomes a counter: blend_refused_<code>)
NO_VERDICT = "no_verdict"
VERDICT_FAILED = "verdict_failed"
UNSUPPORTED_MODEL = "unsupported_model"
NO_SEGMENTS = "no_segments"
TOO_SHORT = "too_short"
SEGMENT_MISSING = "segment_missing"
SEGMENT_CORRUPT = "segment_corrupt"
SEGMENT_FINGERPRINT = "segment_fingerprint"
BAD_DOCUMENTS = "bad_documents"
TOO_LONG = "too_long"
NO_ROOM = "no_room"


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class Piece:
    """A document of the plan: prompt tokens ``[start, end)``, stored (or to be stored) as ``key``."""

    start: int
    end: int
    key: SegmentKey
    stored: bool = True


@dataclass(frozen=True, slots=True)
class BlendPlan:
    """What one prompt's blend variant is (see the module docstring)."""

    pieces: tuple[Piece, ...]
    ratio: float
    check_layer: int
    covered: int  # prompt tokens held by the variant's chunks (whole chunks of the blended region)
    root: ChunkKey
    keys: tuple[ChunkKey, ...]

    @property
    def end(self) -> int:
        return self.pieces[-1].end

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a worker (crosses to Ray actors)."""
        return {"pieces": [[p.start, p.end, bytes(p.key).hex(), p.stored] for p in self.pieces], "ratio": self.ratio,
                "check_layer": self.check_layer, "covered": self.covered, "root": bytes(self.root).hex(),
                "keys": [bytes(k).hex() for k in self.keys]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BlendPlan":
        return cls(tuple(Piece(int(s), int(e), SegmentKey(bytes.fromhex(k)), bool(st)) for s, e, k, st in d["pieces"]),
                   float(d["ratio"]), int(d["check_layer"]), int(d["covered"]), ChunkKey(bytes.fromhex(d["root"])),
                   tuple(ChunkKey(bytes.fromhex(k)) for k in d["keys"]))


def blend_root(pieces: Sequence[Piece], ratio: float, check_layer: int,
               region: Sequence[int] | np.ndarray) -> ChunkKey:
    """The variant's chain root: a digest of the canonical plan (documents and policy) and of
    ``region``, the prompt's tokens ``[0, end)`` the blend reads (see the module docstring)."""
    tokens = hashlib.blake2b(tokens_u32(region).tobytes(), digest_size=KEY_BYTES).hexdigest()
    canon = json.dumps({"v": PLAN_VERSION, "ratio": round(float(ratio), 6), "check_layer": int(check_layer),
                        "documents": [[p.start, p.end, bytes(p.key).hex()] for p in pieces], "tokens": tokens},
                       sort_keys=True, separators=(",", ":"))
    return ChunkKey(hashlib.blake2b(canon.encode(), digest_size=KEY_BYTES, person=_ROOT_PERSON).digest())


def plan_blend(
    catalog: SegmentCatalog,
    store: OriginStore,
    tokens: Sequence[int] | np.ndarray,
    *,
    fingerprint: ModelFingerprint,
    namespace: Namespace,
    chunk_size: int,
    documents: Sequence[tuple[int, int]] = (),
    verdict_root: Any = None,
    window: int = 0,
) -> BlendPlan | Refusal:
    """The blend variant of ``tokens``, or why there is none. Cheap: no model runs here.

    ``documents``: token spans ``[start, end)`` the request names as its documents; empty: the
    documents are recognised by content. ``window``: the model's ``max_positions`` (0: none);
    a blended region reaching past it is refused (``too_long``)."""
    try:
        v = read_verdict(fingerprint, verdict_root)
    except KdnError as exc:
        return Refusal(NO_VERDICT, f"the model's blend verdict is unreadable: {exc}")
    if v is None:
        return Refusal(NO_VERDICT, "no blend verdict for this model at the origin (run `kdn eval-blend --model ...` "
                                   "there)")
    bad = _malformed(v)
    if bad:
        return Refusal(NO_VERDICT, f"the model's blend verdict is malformed: {bad}")
    if not v.passed:
        return Refusal(VERDICT_FAILED, f"this model failed the blend quality gate ({v.reason})")
    arr = np.asarray(tokens, dtype=np.int64)
    n = len(arr)
    pieces: list[Piece] = []
    if documents:
        last = 0
        for s, e in documents:
            if not (last <= s < e <= n) or e - s < ANCHOR_TOKENS:
                return Refusal(BAD_DOCUMENTS, f"document span [{s}, {e}) is not a sorted, disjoint span of at least "
                                              f"{ANCHOR_TOKENS} of the prompt's {n} tokens")
            key = segment_key(arr[s:e], fingerprint=fingerprint, namespace=namespace)
            pieces.append(Piece(s, e, key, bool(store.variants(key, tenant=namespace.tenant))))
            last = e
    else:
        pieces = [Piece(m.start, m.end, m.key) for m in catalog.match(arr, fingerprint=fingerprint, namespace=namespace)]
    if not pieces:
        return Refusal(NO_SEGMENTS, "no document of this prompt is stored as a segment (`kdn ingest --segments`)")
    if window > 0 and pieces[-1].end > window:
        return Refusal(TOO_LONG, f"the documents end at token {pieces[-1].end}, past the model's window of {window} "
                                 "positions")
    covered = (min(pieces[-1].end, n - 1) // chunk_size) * chunk_size
    if covered == 0:
        return Refusal(TOO_SHORT, f"the documents end at token {pieces[-1].end}: no whole chunk of {chunk_size} "
                                  "tokens to serve")
    root = blend_root(pieces, v.ratio, v.check_layer, arr[:pieces[-1].end])
    keys = chunk_keys(arr[:covered], fingerprint=fingerprint, namespace=namespace, chunk_size=chunk_size, root=root)
    return BlendPlan(tuple(pieces), float(v.ratio), int(v.check_layer), covered, root, tuple(keys))


def _malformed(v: Verdict) -> str:
    """Why ``v`` cannot gate a blend ("" when it can): a verdict file is outside input, and a
    string ``"false"`` must not read as a pass nor a bad ratio fail deep in a worker."""
    if not isinstance(v.passed, bool):
        return f"passed is {v.passed!r}, not a bool"
    if isinstance(v.ratio, bool) or not isinstance(v.ratio, (int, float)) or not 0.0 <= float(v.ratio) <= 1.0:
        return f"ratio is {v.ratio!r}, not a number in [0, 1]"
    if isinstance(v.check_layer, bool) or not isinstance(v.check_layer, int) or v.check_layer < 0:
        return f"check_layer is {v.check_layer!r}, not an int >= 0"
    return ""


@dataclass(frozen=True, slots=True)
class Variant:
    """A computed blend variant: one container per chunk key of the plan, and what it cost."""

    artifacts: tuple[bytes, ...]
    documents: int
    document_tokens: int
    recomputed: int
    computed_segments: int
    seconds: float


def _segment(lm: LoadedModel, store: OriginStore, catalog: SegmentCatalog, arr: np.ndarray, p: Piece,
             ns: Namespace) -> Segment | Refusal:
    toks = [int(t) for t in arr[p.start:p.end]]
    if not p.stored:  # named by the request and not held yet: compute on demand, store, catalogue
        res = store_segment(lm, store, catalog, toks, namespace=ns, doc_id=f"blend:{bytes(p.key).hex()[:16]}")
        if res.key != p.key:
            return Refusal(BAD_DOCUMENTS, "segment key changed between plan and compute")
    variants = [v for v in store.variants(p.key, tenant=ns.tenant) if not v.lossy]
    if not variants:
        return Refusal(SEGMENT_MISSING, f"segment {bytes(p.key).hex()[:16]}… is catalogued but not stored")
    try:
        data = store.get(p.key, variants[0].codec, tenant=ns.tenant)
        return decode_segment(data, toks, key=p.key, fingerprint=lm.fingerprint)
    except FingerprintMismatch as exc:
        return Refusal(SEGMENT_FINGERPRINT, f"segment {bytes(p.key).hex()[:16]}… belongs to another model: {exc}")
    except (ArtifactCorrupt, NotFound, KdnError) as exc:
        return Refusal(SEGMENT_CORRUPT, f"segment {bytes(p.key).hex()[:16]}… is unusable: {type(exc).__name__}: {exc}")


@torch.inference_mode()
def compute_variant(lm: LoadedModel, store: OriginStore, catalog: SegmentCatalog, tokens: Sequence[int] | np.ndarray,
                    plan: BlendPlan, ns: Namespace, codec: str = "raw") -> Variant | Refusal:
    """Blend the plan's documents and encode the variant's chunks (runs where the model is)."""
    t0 = time.perf_counter()
    try:
        check_model(lm.model)
    except KdnError as exc:
        return Refusal(UNSUPPORTED_MODEL, f"blending refused for this model: {exc}")
    arr = np.asarray(tokens, dtype=np.int64)
    computed = sum(1 for p in plan.pieces if not p.stored)
    parts: list[Segment | Glue] = []
    pos = plan.pieces[0].start
    for p in plan.pieces:
        if p.start > pos:
            parts.append(Glue(tuple(int(t) for t in arr[pos:p.start])))
        seg = _segment(lm, store, catalog, arr, p, ns)
        if isinstance(seg, Refusal):
            return seg
        parts.append(seg)
        pos = p.end
    # the prefix is glue: computed at every layer in the blend's own pass (its KV is a prefill's,
    # at position 0), not by a pass of its own over the weights
    prefix = Glue(tuple(int(t) for t in arr[:plan.pieces[0].start]))
    layout = place(lm.model, [prefix, *parts])
    cache, stats = blend(lm.model, layout, Deviation(plan.ratio, plan.check_layer))
    C = lm.chunk_size
    blobs = []
    for i, key in enumerate(plan.keys):
        kv = layers_to_chunk(cache.layers, i * C, (i + 1) * C)
        blobs.append(encode_artifact(kv, key=key, parent_key=plan.keys[i - 1] if i else plan.root,
                                     fingerprint=lm.fingerprint, codec=codec, chunk_index=i))
    doc_tokens = sum(p.end - p.start for p in plan.pieces)
    return Variant(tuple(blobs), len(plan.pieces), doc_tokens, stats.selected, computed, time.perf_counter() - t0)


@dataclass(slots=True)
class BlendCache:
    """Blend variants' artifacts in memory, by (tenant, key), least recently used out first,
    bounded by ``max_bytes``. Never the durable store: a variant serves the request that asked
    (and its repeats), not the store's contents."""

    max_bytes: int
    _items: "OrderedDict[tuple[str, bytes], bytes]" = field(default_factory=OrderedDict)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put_variant(self, tenant: str, keys: Sequence[ChunkKey], blobs: Sequence[Any]) -> bool:
        """Hold one variant's chunks (``blobs``: bytes-like, one per key); whether every one of them
        is held afterwards (a variant larger than the cache pushes out its own first chunks, and
        keys that cannot all be fetched must not be answered)."""
        for key, blob in zip(keys, blobs):
            self.put(tenant, key, np.asarray(blob, dtype=np.uint8).tobytes())
        return self.holds(tenant, keys)

    def put(self, tenant: str, key: ChunkKey, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop((tenant, bytes(key)), None)
            if old is not None:
                self._bytes -= len(old)
            self._items[(tenant, bytes(key))] = data
            self._bytes += len(data)
            while self._bytes > self.max_bytes:
                _, gone = self._items.popitem(last=False)
                self._bytes -= len(gone)

    def get(self, tenant: str, key: ChunkKey) -> bytes | None:
        with self._lock:
            data = self._items.get((tenant, bytes(key)))
            if data is not None:
                self._items.move_to_end((tenant, bytes(key)))
            return data

    def holds(self, tenant: str, keys: Sequence[ChunkKey], codec: str | None = None) -> bool:
        """Whether every one of ``keys`` is held for ``tenant`` (and, when ``codec`` is given,
        held in that codec: a variant held in another codec does not answer the request)."""
        with self._lock:
            held = [self._items.get((tenant, bytes(k))) for k in keys]
        if any(d is None for d in held):
            return False
        if codec is None:
            return True
        try:
            return all(read_header(memoryview(d)).codec == codec for d in held if d is not None)
        except KdnError:
            return False

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)


def check_spans(flat: Sequence[int]) -> list[tuple[int, int]]:
    """Document spans from a flat ``[s0, e0, s1, e1, ...]`` list (the wire form)."""
    if len(flat) % 2:
        raise InvalidInput("document spans come in [start, end) pairs")
    return [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]
