"""The inference host's KDN client: reuse what the local edge holds, write back what was computed.

Public surface: :class:`ClientConfig`, :class:`AsyncKdnClient`, :class:`KdnClient` (the same, for
synchronous code: it runs the async client on a private event-loop thread), :class:`Reuse` and
:class:`Computed` (what ``write_back`` stores). The client's parts: :class:`Fetches` (verified
artifacts into their destinations) and :class:`WriteBacks` (background Puts).

One request goes::

    tokens ─► chunk keys (kdn.keys.chunk_keys) ─► Lookup: how many leading chunks the edge has
           ─► Fetch them, up to ``fetch_concurrency`` at once; each container streams through an
              ArtifactReader, and every section (one layer's K or V) is copied into its place in
              the prefix KV as soon as its bytes arrived and verified — layer l is decoded while
              layer l+1 is still on the wire
           ─► the caller prefills only the remainder, then hands the new full chunks to
              ``write_back`` which encodes and Puts them in the background.

Invariants:
- ``reuse`` never raises because the cache failed: an edge that is down or slow, a corrupt
  artifact, a fingerprint mismatch or a lossy artifact when lossless was required all end in
  "reuse the chunks fetched intact before the failure (maybe none), recompute the rest", with ONE
  warning logged on ``kdn.client`` and returned in :attr:`Reuse.warning`;
- only a contiguous prefix of verified chunks is ever used, so the KV handed back always equals
  what a prefill of those tokens by the fingerprinted model produced;
- every call carries a deadline; the namespace (tenant + salt) is folded into every key, so one
  tenant's requests can never name another tenant's chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import threading
import time
from concurrent.futures import Future
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, Literal, Sequence, TypeVar

import numpy as np
import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from kdn.artifact import ArtifactReader, Section, encode_artifact
from kdn.codecs import get_codec
from kdn.config import RoleConfig, check_address
from kdn.errors import ArtifactCorrupt, Unavailable
from kdn.keys import (
    DEFAULT_CHUNK_SIZE, PIECE_TOKENS, ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, chunk_keys, piece_keys,
    pieces_enabled, toggled_bos_key,
)
from kdn.kv import DestinationPool, KVShape, layers_to_chunk
from kdn.layered import LayerGate, fetch_layered
from kdn.segments import SEGMENT_PARENT, SegmentKey
from kdn.steer import SteerSpec, parse_variant, steer_root
from kdn.transport import EdgeTransport, FetchStats, connect, is_loopback
from kdn.wire.convert import FetchSpec
from kdn.wire.tls import TlsFiles

__all__ = ["ClientConfig", "AsyncKdnClient", "KdnClient", "Reuse", "Computed", "LOG", "MAX_WAIT_S"]

LOG = logging.getLogger("kdn.client")
T = TypeVar("T")
_PREFETCH_HINT = 8  # following keys sent with each Fetch so the edge can prefetch them
MAX_WAIT_S = 86400.0  # the longest deadline or backoff a config may set: longer is a typo (or inf)


class ClientConfig(RoleConfig):
    """Settings of one inference host's client. Defaults live here and nowhere else."""

    edge: str | None = Field(None, description="host:port of the local edge; None: never reuse, always recompute")
    fallback_edges: list[str] = Field(
        default_factory=list, description="further edges, in order, used while the edges before them are unavailable"
    )
    edge_backoff_s: float = Field(5.0, gt=0, le=MAX_WAIT_S,
                                  description="an unavailable edge sits out this long before it is retried")
    token: str | None = Field(None, description="bearer token for the edge")
    tenant: str = Field("default", description="namespace tenant folded into every chunk key")
    salt: str = Field("", description="optional per-tenant secret folded into every chunk key")
    shm: Literal["auto", "on", "off"] = Field(
        "auto", description="ask for shared-memory answers: auto = when the edge address is loopback"
    )
    bulk: bool = Field(
        True, description="move artifact bytes over the edge's bulk byte path when it offers one (else the gRPC stream)"
    )
    codec: str = Field("", description="preferred codec for fetches ('' = whatever the edge stores)")
    steer: str = Field("", description="steered variant id to reuse (kdn.steer; '' = plain KV, the default). A "
                       "client that names one computes that variant's keys, refuses any other KV, writes nothing back")
    require_lossless: bool = Field(True, description="refuse lossy artifacts (outputs then equal recompute)")
    put_codec: str = Field("raw", description="codec for chunks written back to the edge")
    write_back: bool = Field(True, description="Put newly computed full chunks to the edge in the background")
    fetch_concurrency: int = Field(4, ge=1, le=64, description="chunks fetched at once")
    lookup_timeout_s: float = Field(2.0, gt=0, le=MAX_WAIT_S, description="deadline of a Lookup")
    fetch_timeout_s: float = Field(10.0, gt=0, le=MAX_WAIT_S, description="deadline of one chunk's Fetch")
    put_timeout_s: float = Field(30.0, gt=0, le=MAX_WAIT_S, description="deadline of one chunk's Put")
    max_pending_puts: int = Field(256, ge=1, description="write-backs queued at most; more are dropped")
    destination_pool_bytes: int = Field(1 << 30, ge=0, description="prefix KV buffers of finished requests kept "
                                        "for reuse (no page faults per request); 0 maps a fresh one every time")
    layered: bool | None = Field(None, description="a host's forward runs layer l once layer l of the fetched "
                                 "prefix is in place (kdn.layered); off: the whole prefix is fetched first; unset: "
                                 "layered where it pays (kdn.layered.pays: a core torch leaves free)")
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @field_validator("codec", "put_codec")
    @classmethod
    def _codec(cls, v: str, info: ValidationInfo) -> str:
        if v or info.field_name == "put_codec":  # '' fetches whatever the edge stores; a Put needs a codec
            get_codec(v)  # raises UnknownCodec / InvalidInput (a bad level)
        return v

    @model_validator(mode="after")
    def _check(self) -> "ClientConfig":
        Namespace(self.tenant, self.salt)  # raises InvalidInput on a malformed tenant
        if self.edge == "" or "" in self.fallback_edges:
            raise ValueError("edge and fallback_edges: an edge address is host:port, not '' (no edge: leave edge unset)")
        if self.fallback_edges and not self.edge:
            raise ValueError("fallback_edges are used only after edge: set edge too")
        if self.require_lossless:  # every fetch would be refused, or everything written back
            for name in ("codec", "put_codec"):
                if getattr(self, name) and get_codec(getattr(self, name)).lossy:
                    raise ValueError(f"{name} {getattr(self, name)!r} is lossy while require_lossless is set")
        root = parse_variant(self.steer)  # raises InvalidInput on a malformed variant id
        self.__dict__["steer"] = "" if root == ROOT_KEY else bytes(root).hex()  # "plain" -> "", lower-case hex
        TlsFiles.for_client(self.tls_cert, self.tls_key, self.tls_ca)  # the TLS rules: kdn.wire.tls
        return self

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.tenant, self.salt)

    def tls(self) -> TlsFiles | None:
        return TlsFiles.for_client(self.tls_cert, self.tls_key, self.tls_ca)

    def use_shm(self, address: str | None = None) -> bool:
        address = address or self.edge
        return bool(address) and (self.shm == "on" or (self.shm == "auto" and is_loopback(address)))


@dataclass(frozen=True, slots=True)
class Reuse:
    """What the edge contributed to one request.

    ``kv`` is the reused prefix ``(L, 2, H, tokens, D)`` (None when nothing was reused); ``keys``
    are the keys of every full chunk of the request's tokens (for write-back); ``available`` is
    how many leading chunks the edge said it holds; ``chunks`` how many were fetched and used, and
    ``pieces`` how many tail pieces after them (a document's last partial chunk).
    """

    kv: torch.Tensor | None
    tokens: int
    chunks: int
    available: int
    keys: tuple[ChunkKey, ...]
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    bytes: int = 0
    via: str = ""
    warning: str | None = None
    edge_usable: bool = True  # False when the edge failed as a whole (no write-back then)
    pieces: int = 0  # tail pieces (kdn.keys.piece_keys) reused after the ``chunks`` full chunks
    room: torch.Tensor | None = None  # with ``room_tokens``: the whole destination, ``kv`` its first ``tokens``
    # with ``layered``: the fetch still going on; ``kv``/``tokens``/``chunks`` are what it will give
    # if every artifact arrives (wait on ``gate`` per layer, then settle for what did)
    gate: LayerGate | None = None
    pending: "_Pending | None" = None


@dataclass(slots=True)
class _Pending:
    """What :meth:`AsyncKdnClient.settle` needs of a layered reuse's request."""

    where: str
    t0: float
    t1: float
    available: int
    pieces: int
    limit: int
    chunk_size: int
    room_tokens: int
    keys: tuple[ChunkKey, ...]


class AsyncKdnClient:
    """Talks to one edge from inside an asyncio event loop.

    >>> async with AsyncKdnClient(ClientConfig(edge="127.0.0.1:50051")) as client:
    ...     reuse = await client.reuse(tokens, fingerprint=fp, kv_shape=shape, chunk_size=256)
    """

    def __init__(self, config: ClientConfig | None = None, *, transport: EdgeTransport | None = None) -> None:
        self.config = config or ClientConfig()
        if transport is None and self.config.edge:
            c = self.config
            for address in (c.edge, *c.fallback_edges):  # host:port, [v6]:port, dns:///host:port, unix:PATH
                check_address(address, "edge address", unix=True)
            transport = connect([c.edge, *c.fallback_edges], token=c.token, shm=c.use_shm, bulk=c.bulk, tls=c.tls(),
                                backoff_s=c.edge_backoff_s)
        self.transport = transport
        self.destinations = DestinationPool(self.config.destination_pool_bytes)
        self.fetches = Fetches(self.config, transport, self.destinations)
        self.counters: dict[str, float] = {
            "requests": 0, "reused_chunks": 0, "fetch_errors": 0, "edge_errors": 0,
            "written_back": 0, "write_back_errors": 0, "write_back_dropped": 0, "tokenization_mismatch": 0,
            "reused_pieces": 0, "written_back_pieces": 0, "steer_misses": 0,
        }
        self._mismatch_logged_at = -1e9
        self.writes = WriteBacks(self.config, self.counters, self.put if transport is not None else None,
                                 transport.name if transport is not None else "")

    async def __aenter__(self) -> "AsyncKdnClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the fallible primitives (raise KdnError) ---------------------------------------------

    async def lookup(self, fingerprint: ModelFingerprint, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the edge holds."""
        if self.transport is None or not keys:
            return 0
        answer = await _deadline(
            self.transport.lookup(fingerprint, self.config.namespace, keys, timeout=self.config.lookup_timeout_s),
            self.config.lookup_timeout_s, "Lookup",
        )
        try:
            n = operator.index(answer)
        except TypeError:
            n = -1
        if n < 0:  # a broken edge or transport: not a count, so nothing it says can be used
            raise Unavailable(f"edge {self.transport.name} answered a Lookup with {answer!r}, not a count of chunks")
        return min(n, len(keys))  # a claim beyond the chain asked for is held to it

    async def fetch_into(self, fingerprint: ModelFingerprint, key: ChunkKey, sink: Callable[[Section], None], *,
                         next_keys: Sequence[ChunkKey] = (), check: Callable[[Any], None] | None = None,
                         steered: bool = False) -> FetchStats:
        """Stream one artifact's verified sections into ``sink``: :meth:`Fetches.sections`."""
        return await self.fetches.sections(fingerprint, key, sink, next_keys=next_keys, check=check, steered=steered)

    async def fetch_segments(
        self, fingerprint: ModelFingerprint, wanted: Sequence[tuple[SegmentKey, int]], kv_shape: KVShape
    ) -> list[tuple[torch.Tensor, int, int] | Exception]:
        """Fetch ``(key, tokens)`` segments (:mod:`kdn.segments`), ``fetch_concurrency`` at once: each
        result is ``(kv, bytes, start)`` or the KdnError that stopped it (``NotFound`` for a miss). Never
        raises because the cache failed (:meth:`Fetches.segments`)."""
        return await self.fetches.segments(fingerprint, wanted, kv_shape)

    async def put(self, fingerprint: ModelFingerprint, key: ChunkKey, data: bytes) -> bool:
        """Store one container on the edge."""
        if self.transport is None:
            return False
        return await _deadline(
            self.transport.put(fingerprint, self.config.namespace, key, data, timeout=self.config.put_timeout_s),
            self.config.put_timeout_s, "Put",
        )

    # -- the request-level operations (never fail because the cache did) ----------------------

    def keys_for(self, tokens: Sequence[int] | np.ndarray, fingerprint: ModelFingerprint, chunk_size: int) -> list[ChunkKey]:
        return chunk_keys(tokens, fingerprint=fingerprint, namespace=self.config.namespace, chunk_size=chunk_size,
                          root=parse_variant(self.config.steer))

    async def reuse(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        fingerprint: ModelFingerprint,
        kv_shape: KVShape,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_tokens: int | None = None,
        bos_token_id: int | None = None,
        room_tokens: int = 0,
        layered: bool = False,
    ) -> Reuse:
        """The longest prefix of ``tokens`` (at most ``max_tokens``) whose KV the edge can give.

        Chunks are fetched whole; when ``max_tokens`` ends inside a fetched chunk the KV is cut
        there (e.g. ``len(tokens) - 1``, so the last prompt token is computed and yields logits).

        ``room_tokens``: fetch into a destination of at least that many tokens, handed back as
        :attr:`Reuse.room`, so that the rest of the prompt can be prefilled into it in place
        (:func:`kdn.blend.prefill_in_place`) instead of appended to a copy.

        ``bos_token_id``: the model's BOS. When the edge holds no chunk of the request, one more
        Lookup asks for its first chunk with the BOS toggled (:func:`kdn.keys.toggled_bos_key`);
        a hit means the documents were stored under another tokenization than this request's (a
        BOS added on one side only), which :meth:`tokenization_probe` reports loudly.

        ``layered`` (with ``room_tokens``): return once the Lookups are answered, the fetch going
        on; the Reuse says what a whole fetch gives, and its ``gate`` tells a forward running in
        another thread when each layer is in place (:mod:`kdn.layered`). The caller must then
        :meth:`settle` it, for what was really reused, before it trusts the KV or reuses the room.
        """
        self.counters["requests"] += 1
        keys = self.keys_for(tokens, fingerprint, chunk_size)
        limit = len(tokens) if max_tokens is None else max(0, min(max_tokens, len(tokens)))
        wanted = keys[: -(-limit // chunk_size)] if limit else []
        if self.transport is None or not limit:
            return Reuse(None, 0, 0, 0, tuple(keys), edge_usable=self.transport is not None)
        where = self.transport.name
        t0 = time.perf_counter()
        try:
            available = await self.lookup(fingerprint, wanted)
        except Exception as exc:  # KdnError by contract; anything else must not fail the request either
            self.counters["edge_errors"] += 1
            warning = f"KDN edge {where} unusable ({type(exc).__name__}: {exc}); recomputing all {len(tokens)} tokens locally"
            LOG.warning(warning)
            return Reuse(None, 0, 0, 0, tuple(keys), lookup_s=time.perf_counter() - t0, warning=warning, edge_usable=False)
        pkeys = self._piece_keys(tokens, keys, available, limit, fingerprint, chunk_size)
        pieces = await self._lookup_pieces(fingerprint, pkeys)
        t1 = time.perf_counter()
        if available == 0 and pieces == 0:
            warning = await self.tokenization_probe(tokens, fingerprint, chunk_size, bos_token_id)
            if warning is None and self.config.steer:  # asked for a variant, answered plain: say so
                self.counters["steer_misses"] += 1
                warning = (f"KDN: steered variant {self.config.steer[:16]}... is not held for tenant "
                           f"{self.config.tenant!r} (another tenant's, or never stored): recomputing the plain prompt")
                LOG.warning(warning)
            return Reuse(None, 0, 0, 0, tuple(keys), lookup_s=t1 - t0, warning=warning)
        pending = _Pending(where, t0, t1, available, pieces, limit, chunk_size, room_tokens, tuple(keys))
        if layered and room_tokens:
            kv, gate = self.fetches.prefix_layered(fingerprint, wanted[:available], kv_shape, chunk_size=chunk_size,
                                                   pieces=pkeys[:pieces], room_tokens=room_tokens)
            n_tokens = min(available * chunk_size + pieces * PIECE_TOKENS, limit)
            return Reuse(kv[:, :, :, :n_tokens], n_tokens, available, available, tuple(keys), lookup_s=t1 - t0,
                         pieces=pieces, room=kv, gate=gate, pending=pending)
        kv, usable, error, tally = await self.fetches.prefix(fingerprint, wanted[:available], kv_shape, chunk_size=chunk_size,
                                                           pieces=pkeys[:pieces], room_tokens=room_tokens)
        return self._reused(pending, kv, usable, error, tally)

    async def settle(self, reuse: Reuse) -> Reuse:
        """What a ``layered`` :meth:`reuse` really gave, once its fetch has ended (at most at its
        deadline, when what had not arrived is abandoned): the usable leading artifacts and the
        warning for the first that failed. Never raises because the cache failed. A Reuse that
        was not layered is returned as it is."""
        gate, p = reuse.gate, reuse.pending
        if gate is None or p is None:
            return reuse
        task = gate.task
        try:
            await asyncio.wait_for(asyncio.shield(task), max(0.0, gate.deadline - time.monotonic()))
        except TimeoutError:
            gate.stop = True  # the reader stops before its next layer; the fetches are cancelled
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        except Exception:  # items' failures are in the gate; anything else ends the fetch here
            LOG.debug("KDN layered fetch ended with an error", exc_info=True)
        usable = gate.settle()
        error = gate.error
        if usable < gate.items and error is None:
            error = Unavailable(f"Fetch did not finish within {self.config.fetch_timeout_s:g}s")
        assert reuse.room is not None  # a layered Reuse's room is its whole destination
        return self._reused(p, reuse.room, usable, error, gate.tally, gate.ended_at or None)

    def _reused(self, p: "_Pending", kv: torch.Tensor, usable: int, error: BaseException | None,
                tally: FetchStats, t2: float | None = None) -> Reuse:
        """The Reuse of a fetched prefix: its ``usable`` leading artifacts, ``error`` the first
        failure; ``t2``: when the fetch ended (now when not given)."""
        available, pieces, limit, chunk_size, where = p.available, p.pieces, p.limit, p.chunk_size, p.where
        t2 = time.perf_counter() if t2 is None else t2
        warning = None
        used_chunks, used_pieces = min(usable, available), max(0, usable - available)  # pieces count only after every chunk
        if error is not None:
            self.counters["fetch_errors"] += 1
            what = f"chunk {usable} of {available}" if usable < available else f"tail piece {used_pieces} of {pieces}"
            warning = (
                f"KDN fetch of {what} from kdn.edge {where} failed ({type(error).__name__}: {error}); reusing "
                f"{used_chunks} verified chunk(s) and {used_pieces} piece(s), recomputing the rest locally"
            )
            LOG.warning(warning)
        n_tokens = min(used_chunks * chunk_size + used_pieces * PIECE_TOKENS, limit)
        self.counters["reused_chunks"] += used_chunks
        self.counters["reused_pieces"] += used_pieces
        if n_tokens == 0:
            kv_out = None
        else:
            kv_out = kv[:, :, :, :n_tokens]  # (L, 2, H, n_tokens, D), a view
        room = kv if kv_out is not None and p.room_tokens and kv.shape[3] >= p.room_tokens else None
        return Reuse(
            kv_out, n_tokens, used_chunks, available, p.keys, lookup_s=p.t1 - p.t0, fetch_s=t2 - p.t1,
            decode_s=tally.decode_s, bytes=tally.bytes, via=tally.via, warning=warning, pieces=used_pieces,
            room=room,
        )

    def _piece_keys(self, tokens: Sequence[int] | np.ndarray, keys: Sequence[ChunkKey], available: int, limit: int,
                    fingerprint: ModelFingerprint, chunk_size: int) -> list[ChunkKey]:
        """Keys of the tail pieces after the ``available`` leading chunks, within ``limit`` tokens."""
        base = available * chunk_size
        if base >= limit:
            return []
        after = keys[available - 1] if available else parse_variant(self.config.steer)
        return piece_keys(tokens[base:limit], after=after, fingerprint=fingerprint, namespace=self.config.namespace,
                          chunk_size=chunk_size)

    async def _lookup_pieces(self, fingerprint: ModelFingerprint, pkeys: Sequence[ChunkKey]) -> int:
        """How many leading tail pieces the edge holds; 0 when that Lookup fails (the chunks stand)."""
        if not pkeys:
            return 0
        try:
            return await self.lookup(fingerprint, pkeys)
        except Exception as exc:
            LOG.debug("KDN Lookup of tail pieces failed: %s", exc)
            return 0

    async def tokenization_probe(self, tokens: Sequence[int] | np.ndarray, fingerprint: ModelFingerprint,
                                 chunk_size: int, bos_token_id: int | None) -> str | None:
        """The warning when ``tokens``' first chunk is stored only with its BOS toggled, else None.

        Counted here (``tokenization_mismatch``) and by the edge (``kdn stats``: the same name);
        logged at WARNING the first time, then at most once a minute. Never raises."""
        alt = toggled_bos_key(tokens, bos_token_id, fingerprint=fingerprint, namespace=self.config.namespace,
                              chunk_size=chunk_size, root=parse_variant(self.config.steer))
        if alt is None or self.transport is None:
            return None
        try:
            hit = await _deadline(self.transport.lookup(fingerprint, self.config.namespace, [alt],
                                                        timeout=self.config.lookup_timeout_s, probe=True),
                                  self.config.lookup_timeout_s, "Lookup")
        except Exception:  # a probe is advice: its failure changes nothing
            return None
        if not hit:
            return None
        self.counters["tokenization_mismatch"] += 1
        stored = "without" if int(np.asarray(tokens[:1])[0]) == bos_token_id else "with"
        warning = (f"KDN: none of this request's chunks are stored, but its first chunk is, {stored} a leading BOS "
                   f"token (id {bos_token_id}): the documents were ingested under another tokenization than this "
                   "request's, and no request tokenized like it will reuse them. Ingest them with this KDN (it "
                   "tokenizes as engines do; `kdn model check-tokens` compares). Recomputing.")
        now = time.monotonic()
        if now - self._mismatch_logged_at >= 60.0:
            self._mismatch_logged_at = now
            LOG.warning(warning)
        return warning

    # -- write-back (in the background: WriteBacks) --------------------------------------------

    async def write_back(self, *args: Any, **kwargs: Any) -> int:
        """Encode and Put :class:`Computed` ``(*args, **kwargs)`` now; returns how many chunks and
        pieces the edge stored. Failures are counted and logged at debug level: a write-back is
        an optimisation, never part of the answer."""
        return await self.writes.write_back(Computed(*args, **kwargs))

    def schedule_write_back(self, *args: Any, **kwargs: Any) -> bool:
        """Start :meth:`write_back` in the background (call from the loop). False when dropped."""
        return self.writes.schedule(Computed(*args, **kwargs))

    def schedule_put(self, fingerprint: ModelFingerprint, key: ChunkKey | SegmentKey, data: bytes) -> bool:
        """Put one container in the background (a segment computed here; call from the loop).
        False when dropped."""
        return self.writes.schedule_put(fingerprint, key, data)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait for background write-backs (at most ``timeout`` seconds)."""
        await self.writes.flush(timeout)

    async def close(self, *, flush_timeout: float = 5.0) -> None:
        await self.writes.close(flush_timeout)
        if self.transport is not None:
            await self.transport.close()


class Fetches:
    """A client's fetches: verified artifacts streamed into their destinations (a prefix's KV, a
    segment's, a caller's sink), ``fetch_concurrency`` at once. Raises KdnError."""

    def __init__(self, config: ClientConfig, transport: EdgeTransport | None, destinations: DestinationPool) -> None:
        self.config = config
        self.transport = transport
        self.destinations = destinations

    async def prefix(
        self,
        fingerprint: ModelFingerprint,
        keys: Sequence[ChunkKey],
        kv_shape: KVShape,
        *,
        chunk_size: int,
        pieces: Sequence[ChunkKey] = (),
        room_tokens: int = 0,
    ) -> tuple[torch.Tensor, int, BaseException | None, FetchStats]:
        """Fetch ``keys`` (a chain from the start), then ``pieces`` (the tail pieces after it),
        into one ``(L, 2, H, n*chunk_size + p*PIECE_TOKENS, D)`` tensor (at least ``room_tokens``
        long: the positions after the artifacts are left for the caller).

        Returns ``(kv, usable, error, tally)``: the ``usable`` leading artifacts (chunks, then
        pieces) are verified and in place; ``error`` is the first failure (None when all arrived).
        """
        assert self.transport is not None
        chain, spans, out = self._destination(keys, pieces, kv_shape, chunk_size, room_tokens)
        n = len(chain)
        tally = FetchStats()
        sem = asyncio.Semaphore(self.config.fetch_concurrency)

        async def one(i: int) -> None:
            async with sem:
                await _deadline(
                    self._into(out, i, chain, spans[i], fingerprint, tally),
                    self.config.fetch_timeout_s, f"Fetch of {'chunk' if i < len(keys) else 'piece'} {i}",
                )

        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        usable, error = n, None
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r  # cancellation, KeyboardInterrupt
                usable, error = i, r
                break
        return out, usable, error, tally

    def prefix_layered(
        self,
        fingerprint: ModelFingerprint,
        keys: Sequence[ChunkKey],
        kv_shape: KVShape,
        *,
        chunk_size: int,
        pieces: Sequence[ChunkKey] = (),
        room_tokens: int = 0,
    ) -> tuple[torch.Tensor, LayerGate]:
        """:meth:`prefix`, started on this (the client's) loop and returned at once: the
        destination and the :class:`~kdn.layered.LayerGate` its layers become ready behind."""
        assert self.transport is not None
        chain, spans, out = self._destination(keys, pieces, kv_shape, chunk_size, room_tokens)
        n, c = len(chain), self.config.fetch_concurrency
        gate = LayerGate(n, kv_shape.num_layers, self.config.fetch_timeout_s * (1 + n // c) + 5)
        steer = self.config.steer

        def open_reader(i: int) -> ArtifactReader:
            lo, hi = spans[i]
            return ArtifactReader(expect_fingerprint=fingerprint, expect_key=chain[i],
                                  require_lossless=self.config.require_lossless, out=out[:, :, :, lo:hi],
                                  expect_steer=None if steer else "")

        def check(i: int, reader: ArtifactReader) -> None:
            self._check_steer(i, reader.finish())

        def item_pieces(i: int) -> Any:
            return self.pieces(fingerprint, chain[i], chain[i + 1 : i + 1 + _PREFETCH_HINT])

        gate.task = asyncio.ensure_future(fetch_layered(gate, open_reader, item_pieces, check,
                                                        concurrency=c, timeout_s=self.config.fetch_timeout_s))
        return out, gate

    def _destination(self, keys: Sequence[ChunkKey], pieces: Sequence[ChunkKey], kv_shape: KVShape, chunk_size: int,
                     room_tokens: int) -> tuple[list[ChunkKey], list[tuple[int, int]], torch.Tensor]:
        """A prefix's chain (chunks, then tail pieces), each one's token span, and the
        ``(L, 2, H, N, D)`` destination they land in (at least ``room_tokens`` long)."""
        spans = [(lo, lo + chunk_size) for lo in range(0, len(keys) * chunk_size, chunk_size)]
        base = len(keys) * chunk_size
        spans += [(base + j * PIECE_TOKENS, base + (j + 1) * PIECE_TOKENS) for j in range(len(pieces))]
        # the pages of an earlier request's destination, once nothing refers to it: no faults
        out = self.destinations.empty(kv_shape.chunk_shape(max(spans[-1][1] if spans else 0, room_tokens)),
                                      kv_shape.dtype)
        return [*keys, *pieces], spans, out

    def _check_steer(self, i: int, header: Any) -> None:
        steer = self.config.steer
        if steer and (not header.steer or bytes(steer_root(SteerSpec.from_canonical(header.steer))).hex() != steer):
            raise ArtifactCorrupt(f"artifact {i} is not steered variant {steer[:16]}... (its header names "
                                  f"{header.steer[:120] or 'plain KV'!r})")

    async def _into(
        self,
        out: torch.Tensor,
        i: int,
        keys: Sequence[ChunkKey],
        span: tuple[int, int],
        fingerprint: ModelFingerprint,
        tally: FetchStats,
    ) -> None:
        assert self.transport is not None
        lo, hi = span
        # sections decode straight into chunk i's token range of the prefix KV: (L, 2, H, T, D) view
        steer = self.config.steer
        reader = ArtifactReader(
            expect_fingerprint=fingerprint, expect_key=keys[i], require_lossless=self.config.require_lossless,
            out=out[:, :, :, lo:hi], expect_steer=None if steer else "",  # plain asked: a steered header is refused
            pool=self.transport.pool,  # large raw runs are hashed on two threads: this one and the pool's
        )
        # the reader verifies, refuses a geometry other than out's, and writes each complete
        # section into out (over the bulk path the raw KV is received there in place)
        stats = await self.read(fingerprint, keys[i], reader, keys[i + 1 : i + 1 + _PREFETCH_HINT])
        tally.decode_s += stats.decode_s
        tally.bytes += stats.bytes
        tally.via = stats.via
        self._check_steer(i, reader.finish())

    async def read(self, fingerprint: ModelFingerprint, key: ChunkKey, reader: ArtifactReader,
                    next_keys: Sequence[ChunkKey] = ()) -> FetchStats:
        """Fetch ``key``'s container into ``reader`` (the caller calls ``reader.finish()``)."""
        assert self.transport is not None
        spec = FetchSpec(key, fingerprint, self.config.namespace, codec=self.config.codec,
                         require_lossless=self.config.require_lossless)
        return await self.transport.fetch_into(spec, reader, timeout=self.config.fetch_timeout_s, next_keys=next_keys)

    def pieces(self, fingerprint: ModelFingerprint, key: ChunkKey,
               next_keys: Sequence[ChunkKey] = ()) -> AsyncIterator[tuple[bytes | memoryview, str]]:
        """``key``'s container as the transport hands it over, ``(piece, via)``, unverified (feed
        a reader). A same-host answer (``via == "shm"``) is the whole container in one piece, read
        where it is mapped; every piece stays valid until the iterator takes its next step or is
        closed (close it: a refused artifact then ends its call at once)."""
        assert self.transport is not None
        spec = FetchSpec(key, fingerprint, self.config.namespace, codec=self.config.codec,
                         require_lossless=self.config.require_lossless)
        return self.transport.fetch(spec, timeout=self.config.fetch_timeout_s, next_keys=next_keys)

    def section_reader(self, fingerprint: ModelFingerprint, key: ChunkKey, sink: Callable[[Section], None], *,
                       check: Callable[[Any], None] | None = None, steered: bool = False) -> ArtifactReader:
        """A verifying reader of ``key``'s artifact that hands each verified section to ``sink``
        (its ``(H, T, D)`` tensor borrowed: copy what you need, keep no reference). ``check(header)``
        runs once, before the first section reaches ``sink`` (raise to refuse the artifact).
        ``steered``: the caller expects a steered variant (``check`` says which); else a steered
        header is refused."""
        checked = False

        def place(section: Section) -> None:
            nonlocal checked
            if not checked:
                assert reader.header is not None
                if check is not None:
                    check(reader.header)
                checked = True
            sink(section)

        reader = ArtifactReader(expect_fingerprint=fingerprint, expect_key=key,
                                require_lossless=self.config.require_lossless, sink=place,
                                expect_steer=None if steered else "")
        return reader

    async def sections(self, fingerprint: ModelFingerprint, key: ChunkKey, sink: Callable[[Section], None], *,
                         next_keys: Sequence[ChunkKey] = (), check: Callable[[Any], None] | None = None,
                         steered: bool = False) -> FetchStats:
        """Stream one artifact's verified sections into ``sink`` as they arrive (a
        :meth:`section_reader`; ``next_keys``: the chain's following keys, a prefetch hint). The
        artifact is whole and verified only once this returns; raises KdnError."""
        reader = self.section_reader(fingerprint, key, sink, check=check, steered=steered)

        async def go() -> FetchStats:
            stats = await self.read(fingerprint, key, reader, next_keys)
            reader.finish()
            return stats

        return await _deadline(go(), self.config.fetch_timeout_s, "Fetch")

    async def segment(
        self, fingerprint: ModelFingerprint, key: SegmentKey, kv_shape: KVShape, *, tokens: int
    ) -> tuple[torch.Tensor, int, int]:
        """Fetch one segment (:mod:`kdn.segments`) of ``tokens`` tokens into ``(L, 2, H, tokens, D)``.

        Verified like a chunk (checksums, fingerprint, key, lossless when required) and refused
        unless it is a segment of exactly that length. Returns ``(kv, bytes, start)``, ``start``
        the position its first token was prefilled at; raises KdnError.
        """
        assert self.transport is not None
        out = self.destinations.empty(kv_shape.chunk_shape(tokens), kv_shape.dtype)  # (L, 2, H, n, D)
        reader = ArtifactReader(expect_fingerprint=fingerprint, expect_key=ChunkKey(key),
                                require_lossless=self.config.require_lossless, out=out, expect_steer="",
                                pool=self.transport.pool)
        n_bytes = start = 0

        async def go() -> None:
            nonlocal n_bytes, start
            # a geometry other than out's (another length) is refused by the reader
            stats = await self.read(fingerprint, ChunkKey(key), reader)
            n_bytes += stats.bytes
            header = reader.finish()
            if header.parent_key != bytes(SEGMENT_PARENT):
                raise ArtifactCorrupt("artifact under a segment key is not a segment")
            start = int(header.chunk_index)

        await _deadline(go(), self.config.fetch_timeout_s, "Fetch of a segment")
        return out, n_bytes, start

    async def segments(
        self, fingerprint: ModelFingerprint, wanted: Sequence[tuple[SegmentKey, int]], kv_shape: KVShape
    ) -> list[tuple[torch.Tensor, int, int] | Exception]:
        """Fetch ``(key, tokens)`` segments, ``fetch_concurrency`` at once: each result is
        ``(kv, bytes, start)`` or the KdnError that stopped it (``NotFound`` for a miss). Never raises
        because the cache failed."""
        if self.transport is None:
            return [Unavailable("no edge configured") for _ in wanted]
        sem = asyncio.Semaphore(self.config.fetch_concurrency)

        async def one(key: SegmentKey, n: int) -> tuple[torch.Tensor, int, int]:
            async with sem:
                return await self.segment(fingerprint, key, kv_shape, tokens=n)

        res = await asyncio.gather(*(one(k, n) for k, n in wanted), return_exceptions=True)
        for r in res:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
        return list(res)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Computed:
    """KV the host computed, to write back: chunks ``start ..`` of ``keys`` cut from per-layer
    ``(1, H, N, D)`` KV, then, given the ``tokens`` that KV is of, the tail pieces after the last
    full chunk from ``piece_start`` on (:func:`kdn.keys.piece_keys`)."""

    layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
    keys: Sequence[ChunkKey]
    _: KW_ONLY
    fingerprint: ModelFingerprint
    chunk_size: int
    start: int
    tokens: Sequence[int] | np.ndarray | None = None
    piece_start: int = 0

    def anything_new(self) -> bool:
        n_pieces = 0 if self.tokens is None or not pieces_enabled(self.chunk_size) else \
            (len(self.tokens) - len(self.keys) * self.chunk_size) // PIECE_TOKENS
        return self.start < len(self.keys) or self.piece_start < n_pieces

    def spans(self, namespace: Namespace) -> list[tuple[ChunkKey, ChunkKey, int, int, int]]:
        """``(key, parent, lo, hi, chunk index)`` of every chunk and piece to store, in order."""
        keys, C = self.keys, self.chunk_size
        n_tokens = int(self.layers[0][0].shape[2]) if self.layers else 0
        stop = min(len(keys), n_tokens // C)
        spans = [(keys[c], keys[c - 1] if c else ROOT_KEY, c * C, (c + 1) * C, c) for c in range(self.start, stop)]
        if self.tokens is not None:
            base = stop * C
            pkeys = piece_keys(self.tokens[base:n_tokens], after=keys[stop - 1] if stop else ROOT_KEY,
                               fingerprint=self.fingerprint, namespace=namespace, chunk_size=C)
            spans += [(k, pkeys[j - 1] if j else (keys[stop - 1] if stop else ROOT_KEY), base + j * PIECE_TOKENS,
                       base + (j + 1) * PIECE_TOKENS, stop) for j, k in enumerate(pkeys) if j >= self.piece_start]
        return spans


class WriteBacks:
    """A client's write-backs: encoded and Put in the background, at most ``max_pending_puts``
    queued (more are dropped and counted). ``put``: the client's Put (None: no edge, nothing is
    written); ``where``: the edge's name in log lines."""

    def __init__(self, config: ClientConfig, counters: dict[str, float],
                 put: Callable[[ModelFingerprint, ChunkKey, bytes], Awaitable[bool]] | None, where: str) -> None:
        self.config = config
        self.counters = counters
        self._put = put
        self._where = where
        self.pending: set[asyncio.Task[int]] = set()

    async def write_back(self, job: Computed) -> int:
        """Encode and Put ``job``'s chunks and pieces; stops at the first failure."""
        if self._put is None or self.config.steer:  # locally computed KV is plain: never under a variant's keys
            return 0
        stored = pieces = 0
        for key, parent, lo, hi, index in job.spans(self.config.namespace):
            try:
                data = await asyncio.to_thread(_encode_span, job.layers, lo, hi, key, parent, job.fingerprint,
                                               self.config.put_codec, index)
                if await self._put(job.fingerprint, key, data):
                    stored += 1
                    pieces += hi - lo != job.chunk_size
            except Exception as exc:  # KdnError by contract; a write-back never raises into the request
                self.counters["write_back_errors"] += 1
                LOG.debug("KDN write-back of tokens %d..%d to %s failed: %s", lo, hi, self._where, exc)
                break
        self.counters["written_back"] += stored - pieces
        self.counters["written_back_pieces"] += pieces
        return stored

    def schedule(self, job: Computed) -> bool:
        """Start :meth:`write_back` of ``job`` (call from the loop). False when dropped."""
        if self._put is None or not self.config.write_back or self.config.steer:
            return False
        if not job.anything_new():
            return False  # nothing new to store
        if len(self.pending) >= self.config.max_pending_puts:
            self.counters["write_back_dropped"] += 1
            return False
        return self._start(self.write_back(job))

    def schedule_put(self, fingerprint: ModelFingerprint, key: ChunkKey | SegmentKey, data: bytes) -> bool:
        """Put one container (call from the loop). False when dropped."""
        put = self._put
        if put is None or not self.config.write_back or len(self.pending) >= self.config.max_pending_puts:
            return False

        async def one() -> int:
            try:
                return int(await put(fingerprint, ChunkKey(key), data))
            except Exception as exc:  # a write-back never raises into the request
                self.counters["write_back_errors"] += 1
                LOG.debug("KDN put of segment %s failed: %s", bytes(key).hex()[:16], exc)
                return 0

        return self._start(one())

    def _start(self, coro: Coroutine[Any, Any, int]) -> bool:
        task = asyncio.get_running_loop().create_task(coro)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return True

    async def flush(self, timeout: float | None = None) -> None:
        """Wait for the pending write-backs (at most ``timeout`` seconds)."""
        if self.pending:
            await asyncio.wait(list(self.pending), timeout=timeout)

    async def close(self, flush_timeout: float) -> None:
        await self.flush(flush_timeout)
        for task in list(self.pending):
            task.cancel()


def _blocking(method: Callable[..., Any], *, on_loop: bool = False) -> Callable[..., Any]:
    """The synchronous twin of an :class:`AsyncKdnClient` method, run on the client's loop thread.
    ``on_loop``: a plain method that must be called from inside the loop (it starts tasks)."""

    @functools.wraps(method)
    def run(self: "KdnClient", *args: Any, **kwargs: Any) -> Any:
        if on_loop:

            async def call() -> Any:
                return method(self.aio, *args, **kwargs)

            return self._run(call())
        return self._run(method(self.aio, *args, **kwargs))

    return run


class KdnClient:
    """Synchronous facade over :class:`AsyncKdnClient`, which runs on a private loop thread
    (so background write-backs proceed while the caller generates). Close it, or use ``with``."""

    def __init__(self, config: ClientConfig | None = None, *, transport: EdgeTransport | None = None) -> None:
        self.config = config or ClientConfig()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kdn-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def make() -> AsyncKdnClient:
            return AsyncKdnClient(self.config, transport=transport)

        self.aio: AsyncKdnClient = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def __enter__(self) -> "KdnClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def counters(self) -> dict[str, float]:
        return self.aio.counters

    def keys_for(self, tokens: Sequence[int] | np.ndarray, fingerprint: ModelFingerprint, chunk_size: int) -> list[ChunkKey]:
        return self.aio.keys_for(tokens, fingerprint, chunk_size)

    # the blocking twins of AsyncKdnClient's operations: same signatures and docstrings
    lookup = _blocking(AsyncKdnClient.lookup)
    put = _blocking(AsyncKdnClient.put)
    reuse = _blocking(AsyncKdnClient.reuse)
    settle = _blocking(AsyncKdnClient.settle)
    fetch_segments = _blocking(AsyncKdnClient.fetch_segments)
    fetch_into = _blocking(AsyncKdnClient.fetch_into)  # the sink runs on the client's loop thread
    schedule_put = _blocking(AsyncKdnClient.schedule_put, on_loop=True)
    write_back = _blocking(AsyncKdnClient.write_back)
    schedule_write_back = _blocking(AsyncKdnClient.schedule_write_back, on_loop=True)
    flush = _blocking(AsyncKdnClient.flush)

    def close(self, *, flush_timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.aio.close(flush_timeout=flush_timeout), timeout=flush_timeout + 5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._loop.close()


def _encode_span(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    s: int,
    e: int,
    key: ChunkKey,
    parent: ChunkKey,
    fingerprint: ModelFingerprint,
    codec: str,
    index: int,
) -> bytes:
    """Tokens ``s..e`` (a chunk or a tail piece) of per-layer KV as one artifact."""
    kv = layers_to_chunk(layers, s, e)  # (L, 2, H, e-s, D)
    return encode_artifact(kv, key=key, parent_key=parent, fingerprint=fingerprint, codec=codec, chunk_index=index)


async def _deadline(aw: Awaitable[T], seconds: float, what: str) -> T:
    try:
        async with asyncio.timeout(seconds + 0.5):  # the transport's own deadline fires first
            return await aw
    except TimeoutError as exc:
        raise Unavailable(f"{what} did not finish within {seconds:g}s") from exc
