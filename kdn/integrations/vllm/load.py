"""The worker's loads of one step: every chunk's verified sections scattered into paged blocks.

A :class:`LoadJob` runs on the connector's loop thread (:class:`LoopThread`). Each chunk (or tail
piece) of a :class:`LoadSpec` streams through the client's verifying reader
(:meth:`kdn.client.AsyncKdnClient.fetch_into`; a blend variant's chunks come from the blend origin
instead) and every section is placed as soon as its checksum passed; ``wait_layer(l)`` returns once
every chunk has placed layer ``l`` (or failed). A job receives everything it needs in a
:class:`LoadContext`. Nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kdn.artifact import Section
from kdn.client import AsyncKdnClient, ClientConfig
from kdn.errors import FingerprintMismatch
from kdn.integrations.vllm.paged import PagedCache
from kdn.integrations.vllm_steer import check_variant_header
from kdn.keys import PIECE_TOKENS, ChunkKey, ModelFingerprint, Namespace

LOG = logging.getLogger("kdn.vllm")
_PREFETCH_HINT = 8  # following keys sent with each Fetch so the edge can prefetch them


class LoopThread:
    """An asyncio loop on a daemon thread: where the connector's clients live."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Clients:
    """One :class:`kdn.client.AsyncKdnClient` per namespace, all living on one :class:`LoopThread`;
    ``config_for(ns)``: that namespace's client settings."""

    def __init__(self, loop: LoopThread, config_for: Callable[[Namespace], ClientConfig]) -> None:
        self.loop = loop
        self._config_for = config_for
        self._clients: dict[Namespace, AsyncKdnClient] = {}

    def get(self, ns: Namespace) -> AsyncKdnClient:
        """``ns``'s client, called from outside the loop thread (built on it)."""
        client = self._clients.get(ns)
        if client is None:
            cfg = self._config_for(ns)

            async def make() -> AsyncKdnClient:
                return AsyncKdnClient(cfg)

            client = self._clients[ns] = self.loop.submit(make()).result(10)
        return client

    def on_loop(self, tenant: str, salt: str) -> AsyncKdnClient:
        """The client of namespace ``tenant``/``salt``, called on the loop thread."""
        ns = Namespace(tenant, salt)
        client = self._clients.get(ns)
        if client is None:  # called on the loop thread: build directly
            client = self._clients[ns] = AsyncKdnClient(self._config_for(ns))
        return client

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close(flush_timeout=2.0)


@dataclass(slots=True)
class LoadSpec:
    """Load chunks ``first .. first+len(keys)-1`` of one request, then the tail ``pieces`` after
    them (:func:`kdn.keys.piece_keys`). Tokens before ``write_from`` are already in the engine's
    own cache (their blocks may be shared): they are not written."""

    req_id: str
    tenant: str
    salt: str
    first: int
    keys: list[bytes]
    write_from: int
    block_ids: list[int]  # the request's blocks covering tokens 0 .. the load's end
    pieces: list[bytes] = field(default_factory=list)
    origin: bool = False  # a blend variant's chunks: fetched from the blend origin, not the edge
    steer: bytes = b""  # a steered variant's root: every artifact's header must name it

    def span(self, i: int, chunk_size: int) -> tuple[int, int]:
        """Token range of item ``i``: a chunk, or (from ``len(keys)`` on) a piece."""
        if i < len(self.keys):
            c = self.first + i
            return c * chunk_size, (c + 1) * chunk_size
        lo = (self.first + len(self.keys)) * chunk_size + (i - len(self.keys)) * PIECE_TOKENS
        return lo, lo + PIECE_TOKENS

    @property
    def items(self) -> list[bytes]:
        return [*self.keys, *self.pieces]


@dataclass(frozen=True, slots=True)
class LoadContext:
    """What a load job needs of its connector: the model, the engine's paged cache, the loop the
    clients live on, the deadlines, and where each request's artifacts come from."""

    fingerprint: ModelFingerprint
    paged: PagedCache
    loop: LoopThread
    fetch_timeout_s: float
    fetch_concurrency: int
    client_for: Callable[[str, str], AsyncKdnClient]  # (tenant, salt) -> that namespace's client
    origin_stream: Callable[[str, str, ChunkKey], Any]  # (tenant, salt, key) -> (piece, via) from the blend origin
    count: Callable[[str], None]  # bump one of the connector's counters


class LoadJob:
    """The loads of one step: every chunk's sections scattered into paged blocks as they verify.

    ``progress[r][i]`` counts the layers of chunk i of request r that are in place; a chunk that
    failed or finished counts as all layers (a failed one's blocks are reported, never trusted).
    ``after``: on CUDA, an event the copies wait for."""

    def __init__(self, ctx: LoadContext, specs: list[LoadSpec], *, after: Any = None) -> None:
        self.ctx = ctx
        self.specs = specs
        self.progress = [[0] * len(s.items) for s in specs]
        self.first_failed = [len(s.items) for s in specs]
        self.cond = threading.Condition()
        self.future: Any = None
        self.failed_blocks: set[int] = set()
        self.failed_reqs: set[str] = set()
        self._L = ctx.paged.geometry.num_layers
        self.after = after
        self._events: dict[int, list[Any]] = {}  # CUDA: per layer, events after its copies
        self._timeout = ctx.fetch_timeout_s * (1 + max(len(s.items) for s in specs) // ctx.fetch_concurrency) + 5
        self._deadline = 0.0

    def start(self) -> None:
        self._deadline = time.monotonic() + self._timeout
        self.future = self.ctx.loop.submit(self._run())

    async def _run(self) -> None:
        sem = asyncio.Semaphore(self.ctx.fetch_concurrency)

        async def one(r: int, i: int) -> None:
            async with sem:
                if i >= self.first_failed[r]:
                    return self._done(r, i)  # an earlier chunk failed: this one will be recomputed anyway
                try:
                    await asyncio.wait_for(self._load_chunk(r, i), self.ctx.fetch_timeout_s + 0.5)
                    self.ctx.count("loaded_chunks")
                except Exception as exc:  # KdnError, a deadline, a geometry refusal: recompute from here
                    self._fail(r, i, exc)
                finally:
                    self._done(r, i)

        await asyncio.gather(*(one(r, i) for r, s in enumerate(self.specs) for i in range(len(s.items))))

    async def _load_chunk(self, r: int, i: int) -> None:
        spec, ctx = self.specs[r], self.ctx
        paged = ctx.paged
        client = ctx.client_for(spec.tenant, spec.salt)
        items = spec.items
        key = ChunkKey(items[i])
        lo, hi = spec.span(i, paged.geometry.chunk_size)

        def check(header: Any) -> None:  # before the first byte reaches a block: the whole geometry
            paged.geometry.check_header(header, hi - lo)
            if spec.steer:
                check_variant_header(header, spec.steer)

        def place(section: Section) -> None:
            # a verified section, borrowed from the received bytes (raw codec: a view, no copy):
            # the scatter into the engine's blocks is the one copy out of the receive buffer
            ev = paged.place(spec.block_ids, spec.write_from, lo, hi, section, self.after)
            with self.cond:
                if ev is not None:
                    self._events.setdefault(section.layer, []).append(ev)
                if section.kind == "v":
                    self.progress[r][i] = section.layer + 1
                    self.cond.notify_all()

        steered = bool(spec.steer)  # plain keys: a steered artifact is refused
        if spec.origin:
            reader = client.fetches.section_reader(ctx.fingerprint, key, place, check=check, steered=steered)
            stream = ctx.origin_stream(spec.tenant, spec.salt, key)
            async with aclosing(stream):
                async for piece, _via in stream:
                    reader.feed(piece)
            reader.finish()
        else:
            await client.fetch_into(ctx.fingerprint, key, place, check=check, steered=steered,
                                    next_keys=[ChunkKey(k) for k in items[i + 1 : i + 1 + _PREFETCH_HINT]])
        with self.cond:
            placed = self.progress[r][i]
        if placed != self._L:  # every layer of the engine's came, or the chunk is not loaded
            raise FingerprintMismatch(f"artifact placed {placed} of the engine's {self._L} layers")

    def _fail(self, r: int, i: int, exc: BaseException) -> None:
        spec = self.specs[r]
        self.ctx.count("load_failures")
        with self.cond:
            if i < self.first_failed[r]:
                self.first_failed[r] = i
        what = f"chunk {spec.first + i}" if i < len(spec.keys) else f"tail piece {i - len(spec.keys)}"
        LOG.warning("KDN load of %s for request %s failed (%s: %s); vLLM recomputes from there",
                    what, spec.req_id, type(exc).__name__, exc)

    def _done(self, r: int, i: int) -> None:
        with self.cond:
            self.progress[r][i] = self._L
            self.cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: all(p > layer for ps in self.progress for p in ps),
                                    timeout=max(0.0, self._deadline - time.monotonic()))
        if not ok:
            self._cancel()
        if self._events:
            with self.cond:
                events = list(self._events.get(layer, ()))
            for ev in events:
                torch.cuda.current_stream().wait_event(ev)

    def _cancel(self) -> None:
        """Past the deadline: stop the fetches (no write happens after this returns) and fail
        every chunk that had not finished."""
        with self.cond:
            for r, ps in enumerate(self.progress):
                for i, p in enumerate(ps):
                    if p < self._L and i < self.first_failed[r]:
                        self.first_failed[r] = i
        self.ctx.loop.loop.call_soon_threadsafe(self.future.cancel)
        try:
            self.future.result(10)
        except BaseException:
            pass
        with self.cond:
            for ps in self.progress:
                ps[:] = [self._L] * len(ps)
            self.cond.notify_all()

    def finish(self) -> None:
        """End of step: every fetch has ended (or is cancelled); collect the failed blocks."""
        try:
            self.future.result(max(0.0, self._deadline - time.monotonic()))
        except Exception:
            self._cancel()
        g = self.ctx.paged.geometry
        C, bs = g.chunk_size, g.block_size
        for r, spec in enumerate(self.specs):
            i = self.first_failed[r]
            if i < len(spec.items):
                start = max(spec.write_from, spec.span(i, C)[0])
                self.failed_blocks.update(spec.block_ids[start // bs :])
                self.failed_reqs.add(spec.req_id)
