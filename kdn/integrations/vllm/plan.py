"""The scheduler's plan for a request: what it loads and what it saves, step by step.

The connector's scheduler side keeps one :class:`ReqState` per request it looked up; each step
:func:`load_of` turns an allocated load into a :class:`kdn.integrations.vllm.load.LoadSpec` for the
workers, and :func:`saves_of` names the chunks (then, once the prompt is computed, the tail pieces)
that became fully computed, as :class:`SaveSpec`. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kdn.integrations.vllm.load import LoadSpec
from kdn.keys import PIECE_TOKENS, ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, piece_keys


@dataclass(slots=True)
class SaveSpec:
    """Chunk ``index`` (or, with ``lo``/``hi`` set, one tail piece of it) of one request was fully
    computed in this step: copy it out and Put it."""

    req_id: str
    tenant: str
    salt: str
    index: int
    key: bytes
    parent: bytes
    block_ids: list[int]  # the blocks of this chunk (or of the piece's tokens), in token order
    lo: int = 0  # a piece: its tokens' offset inside the first of ``block_ids`` ...
    hi: int = 0  # ... and the end (0: a whole chunk)


@dataclass(slots=True)
class ReqState:
    """What the scheduler knows of one request it looked up (keyed by request id)."""

    ns: Namespace
    keys: list[ChunkKey]
    n_prompt: int
    on_edge: int  # leading chunks the edge said it holds
    saved: int  # chunks below this index need no write-back
    load: tuple[int, int] | None = None  # token range to load, set once blocks are allocated
    block_ids: list[int] = field(default_factory=list)
    looked_up: int = 0  # chunks asked about in the Lookup
    engine_cached: int = 0  # tokens the engine's own prefix cache held when the request arrived
    loading: int = 0  # tokens the connector told vLLM it loads
    load_failed: bool = False  # a block of the load was reported failed (vLLM recomputed from there)
    first_saved: int = 0  # saves scheduled from this chunk on
    tokens: Any = None  # the prompt's token ids (np.int64): tail pieces are keyed by them
    pieces: list[ChunkKey] = field(default_factory=list)  # tail pieces after the ``on_edge`` chunks the edge holds
    end: int = 0  # tokens the edge can give: whole chunks, then pieces
    pieces_saved: bool = False
    blend: bool = False  # the keys are a blend variant's, fetched from the blend origin (never saved)
    steer: bytes = b""  # the keys are this steered variant's chain (its root; never saved)

    def never_save(self) -> None:
        """Nothing of this request is written back (a variant's chain, or a blend's)."""
        self.saved = self.first_saved = len(self.keys)
        self.pieces_saved = True

    def source(self, edge: str | None, blend_origin: str | None) -> str:
        """Where this request's prefix KV came from, for its log line."""
        if not self.loading:
            return "none" if not self.engine_cached else "engine prefix cache"
        where = (f"blend variant from origin {blend_origin}" if self.blend
                 else f"steered variant {self.steer.hex()[:16]}... from edge {edge}" if self.steer else f"edge {edge}")
        return where + (" (load failed: recomputed)" if self.load_failed else "")


def load_of(rid: str, st: ReqState, chunk_size: int, block_size: int) -> LoadSpec | None:
    """The load vLLM allocated blocks for in this step (once), else None."""
    if st.load is None:
        return None
    C, bs = chunk_size, block_size
    lo, hi = st.load
    first = lo // C
    chunks = [bytes(k) for k in st.keys[first : min(hi // C, st.on_edge)]]
    pieces = [bytes(k) for k in st.pieces] if hi > st.on_edge * C else []
    st.load = None
    return LoadSpec(rid, st.ns.tenant, st.ns.salt, first, chunks, lo, st.block_ids[: -(-hi // bs)], pieces,
                    origin=st.blend, steer=st.steer)


def saves_of(rid: str, st: ReqState, end: int, *, chunk_size: int, block_size: int,
             fingerprint: ModelFingerprint) -> list[SaveSpec]:
    """The chunks of ``rid`` fully computed once its first ``end`` tokens are, not saved yet; once
    the whole prompt is computed, its tail's pieces too."""
    C, bs = chunk_size, block_size
    full = min(end // C, len(st.keys))
    saves = []
    for c in range(st.saved, full):
        blocks = st.block_ids[c * C // bs : (c + 1) * C // bs]
        if len(blocks) * bs < C:
            break
        saves.append(SaveSpec(rid, st.ns.tenant, st.ns.salt, c, bytes(st.keys[c]),
                              bytes(st.keys[c - 1]) if c else bytes(ROOT_KEY), blocks))
    st.saved = max(st.saved, full)
    if end >= st.n_prompt and not st.pieces_saved:  # the prompt is computed: its tail's pieces
        st.pieces_saved = True
        saves += _piece_saves(rid, st, full, C, bs, fingerprint)
    return saves


def _piece_saves(rid: str, st: ReqState, full: int, C: int, bs: int, fingerprint: ModelFingerprint) -> list[SaveSpec]:
    """Saves of the tail pieces after the prompt's ``full`` chunks that the edge does not hold."""
    base = full * C
    after = st.keys[full - 1] if full else ROOT_KEY
    pkeys = piece_keys(st.tokens[base : st.n_prompt], after=after, fingerprint=fingerprint, namespace=st.ns,
                       chunk_size=C)
    skip = len(st.pieces) if full == st.on_edge else 0  # every piece the edge holds (all are loaded)
    saves = []
    for j in range(skip, len(pkeys)):
        lo, hi = base + j * PIECE_TOKENS, base + (j + 1) * PIECE_TOKENS
        blocks = st.block_ids[lo // bs : -(-hi // bs)]
        if len(blocks) * bs < hi - lo // bs * bs:
            break
        saves.append(SaveSpec(rid, st.ns.tenant, st.ns.salt, full, bytes(pkeys[j]),
                              bytes(pkeys[j - 1] if j else after), blocks, lo - lo // bs * bs, hi - lo // bs * bs))
    return saves
