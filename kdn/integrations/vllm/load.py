"""The worker's loads of one step: every chunk's verified sections scattered into paged blocks.

A :class:`LoadJob` runs on the connector's loop thread (:class:`LoopThread`). Each chunk (or tail
piece) of a :class:`LoadSpec` goes through the client's verifying reader, its bytes from
:meth:`kdn.client.Fetches.pieces` (a blend variant's from the blend origin), and every section is
placed as soon as its checksum passed. Containers that arrive whole in same-host shared memory
(the default on an edge's host) are read layer by layer across all the step's items once every
item is at hand, so every chunk's layer 0 is placed first; any other container is read as its
bytes arrive. ``wait_layer(l)`` returns once every chunk has placed layer ``l`` (or failed). A job
receives everything it needs in a :class:`LoadContext`. Nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kdn.artifact import ArtifactReader, Section, layer_cuts
from kdn.client import AsyncKdnClient, ClientConfig
from kdn.errors import FingerprintMismatch
from kdn.integrations.vllm.paged import PagedCache
from kdn.integrations.vllm_steer import check_variant_header
from kdn.keys import PIECE_TOKENS, ChunkKey, ModelFingerprint, Namespace
from kdn.layered import Held, release

LOG = logging.getLogger("kdn.vllm")
_PREFETCH_HINT = 8  # following keys sent with each Fetch so the edge can prefetch them


class LoopThread:
    """An asyncio loop on a daemon thread: where the connector's clients live; and ``readers``,
    the threads that read (verify and place) containers that arrived whole, one per core up to 4:
    hashing and the copies into the blocks release the GIL, so they run side by side."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self.read_threads = max(1, min(4, os.cpu_count() or 1))
        self.readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix=f"{name}-read")

    def submit(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.readers.shutdown(wait=False)


MAX_CLIENTS = 256
"""Namespaces whose clients the connector keeps at once: every distinct ``cache_salt`` an API
caller sends is a namespace, so the set must be bounded."""


class Clients:
    """One :class:`kdn.client.AsyncKdnClient` per namespace, all living on one :class:`LoopThread`;
    ``config_for(ns)``: that namespace's client settings.

    At most ``max_clients`` are kept, the least recently used going first. An evicted client is
    closed once its fetch and put deadlines have passed, so a load or write-back already holding
    it ends first; a later request of its namespace gets a new one."""

    def __init__(self, loop: LoopThread, config_for: Callable[[Namespace], ClientConfig], *,
                 max_clients: int = MAX_CLIENTS) -> None:
        self.loop = loop
        self._config_for = config_for
        self._max = max(1, max_clients)
        self._clients: OrderedDict[Namespace, AsyncKdnClient] = OrderedDict()
        self._closing: set[AsyncKdnClient] = set()
        self._later: set[concurrent.futures.Future[None]] = set()  # the evicted clients' pending closes
        self._lock = threading.Lock()

    def get(self, ns: Namespace) -> AsyncKdnClient:
        """``ns``'s client, called from outside the loop thread (built on it)."""
        client = self._held(ns)
        if client is None:
            cfg = self._config_for(ns)

            async def make() -> AsyncKdnClient:
                return AsyncKdnClient(cfg)

            client = self._keep(ns, self.loop.submit(make()).result(10))
        return client

    def on_loop(self, tenant: str, salt: str) -> AsyncKdnClient:
        """The client of namespace ``tenant``/``salt``, called on the loop thread."""
        ns = Namespace(tenant, salt)
        client = self._held(ns)
        if client is None:  # called on the loop thread: build directly
            client = self._keep(ns, AsyncKdnClient(self._config_for(ns)))
        return client

    def _held(self, ns: Namespace) -> AsyncKdnClient | None:
        with self._lock:
            client = self._clients.get(ns)
            if client is not None:
                self._clients.move_to_end(ns)
            return client

    def _keep(self, ns: Namespace, client: AsyncKdnClient) -> AsyncKdnClient:
        """Hold ``client`` for ``ns`` (or the one another thread held first, closing ``client``)."""
        with self._lock:
            held = self._clients.get(ns)
            spare = [client] if held is not None else []
            if held is None:
                self._clients[ns] = held = client
                while len(self._clients) > self._max:
                    spare.append(self._clients.popitem(last=False)[1])
            self._closing.update(spare)
        for c in spare:
            later = self.loop.submit(self._close_later(c))
            with self._lock:
                self._later.add(later)
            later.add_done_callback(self._later.discard)
        return held

    async def _close_later(self, client: AsyncKdnClient) -> None:
        await asyncio.sleep(client.config.fetch_timeout_s + client.config.put_timeout_s)
        try:
            await client.close(flush_timeout=2.0)
        except Exception as exc:  # closing: report, never raise
            LOG.debug("KDN: closing an evicted client: %s", exc)
        finally:
            with self._lock:
                self._closing.discard(client)

    async def close(self) -> None:
        with self._lock:
            every = [*self._clients.values(), *self._closing]
            later = list(self._later)
            self._clients.clear()
            self._closing.clear()
        for f in later:  # their clients are closed here, now
            f.cancel()
        for c in every:
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
    ``_ready[l]`` counts the items past layer ``l``: a waiter for layer ``l`` is woken once, when
    it reaches every item, not at each of the step's sections (each wake-up takes the GIL from
    the readers).
    ``after``: on CUDA, an event the copies wait for."""

    def __init__(self, ctx: LoadContext, specs: list[LoadSpec], *, after: Any = None) -> None:
        self.ctx = ctx
        self.specs = specs
        self.progress = [[0] * len(s.items) for s in specs]
        self._items = sum(len(s.items) for s in specs)
        self._ready = [0] * ctx.paged.geometry.num_layers  # per layer: the items that have it (or are over)
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
        self._stop = False  # set when cancelled: the reader threads place nothing more
        self._began = False  # _run's first step ran (on the loop thread)
        self._ended = threading.Event()  # set once _run has returned: nothing is placed after that

    def start(self) -> None:
        self._deadline = time.monotonic() + self._timeout
        self.future = self.ctx.loop.submit(self._run())

    async def _run(self) -> None:
        """Every item's container, ``fetch_concurrency`` at once. One that comes whole and in place
        (same-host shared memory) is held until every item is held or in its blocks; the held
        ones are then read layer by layer across items (:meth:`_by_layer`). Any other streams
        into its blocks as it arrives."""
        self._began = True
        sem = asyncio.Semaphore(self.ctx.fetch_concurrency)
        held: list[Held] = []

        async def one(r: int, i: int) -> None:
            async with sem:
                if i >= self.first_failed[r]:
                    return self._done(r, i)  # an earlier chunk failed: this one will be recomputed anyway
                try:
                    h = await asyncio.wait_for(self._open(r, i), self.ctx.fetch_timeout_s + 0.5)
                except Exception as exc:  # KdnError, a deadline, a geometry refusal: recompute from here
                    self._fail(r, i, exc)
                    return self._done(r, i)
                if h is None:
                    self.ctx.count("loaded_chunks")
                    self._done(r, i)
                else:
                    held.append(h)

        try:
            await asyncio.gather(*(one(r, i) for r, s in enumerate(self.specs) for i in range(len(s.items))))
            await self._by_layer(held)
        finally:
            try:
                await release(held)
            finally:
                self._ended.set()

    async def _open(self, r: int, i: int) -> "Held | None":
        """Start item ``i`` of request ``r``: a container that came whole (same-host shared
        memory) is returned held, unread; any other is read into its blocks here (None)."""
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

        put = paged.placer(spec.block_ids, spec.write_from, lo, hi, self.after)

        def place(section: Section) -> None:
            # a verified section, borrowed from the received bytes (raw codec: a view, no copy):
            # the scatter into the engine's blocks is the one copy out of the receive buffer
            ev = put(section)
            with self.cond:
                if ev is not None:
                    self._events.setdefault(section.layer, []).append(ev)
                if section.kind == "v":
                    self._advance(r, i, section.layer + 1)

        # plain keys: a steered artifact is refused
        reader = client.fetches.section_reader(ctx.fingerprint, key, place, check=check, steered=bool(spec.steer))
        if spec.origin:
            stream = ctx.origin_stream(spec.tenant, spec.salt, key)
        else:
            stream = client.fetches.pieces(ctx.fingerprint, key,
                                           next_keys=[ChunkKey(k) for k in items[i + 1 : i + 1 + _PREFETCH_HINT]])
        try:
            async for piece, via in stream:
                if via == "shm" and not reader.received:  # the whole container, where it is mapped
                    held, stream = Held(i, reader, piece, stream, layer_cuts(piece), r=r), None
                    return held
                reader.feed(piece)
        finally:
            if stream is not None:
                await stream.aclose()
        self._check_item(r, i, reader)
        return None

    async def _by_layer(self, held: list[Held]) -> None:
        """Read the held containers layer by layer across items, on the loop's reader threads
        (items dealt out among them): layer 0 of every chunk is in its blocks after about 1/L of
        the reading, so the forward's first layer runs while later layers are still read, instead
        of after most of the load. A section is never split (:func:`kdn.artifact.layer_cuts`);
        each is verified before it is placed, as when streamed. Cancelled (the deadline), the
        readers stop before their next layer and no write happens once this has returned."""
        if not held:
            return
        n = min(self.ctx.loop.read_threads, len(held))
        futures = [self.ctx.loop.readers.submit(self._read_layers, held[k::n]) for k in range(n)]
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except BaseException:
            self._stop = True
            concurrent.futures.wait(futures)  # a reader finishes at most the layer it is in
            raise

    def _read_layers(self, held: list[Held]) -> None:
        """One reader thread's share of :meth:`_by_layer`. Counters are bumped on the loop thread."""

        def count(name: str) -> None:
            self.ctx.loop.loop.call_soon_threadsafe(self.ctx.count, name)

        for step in range(max(len(h.cuts) for h in held)):
            for h in held:
                if h.over:
                    continue
                if self._stop or h.i >= self.first_failed[h.r]:  # cancelled, or an earlier chunk failed
                    h.over = True
                    self._done(h.r, h.i)
                    continue
                try:
                    assert h.view is not None
                    h.reader.feed(h.view[h.cuts[step - 1] if step else 0 : h.cuts[step]])
                    if step == len(h.cuts) - 1:
                        h.over = True
                        self._check_item(h.r, h.i, h.reader)
                        count("loaded_chunks")
                        self._done(h.r, h.i)
                except Exception as exc:  # a bad checksum, a geometry refusal: recompute from here
                    h.over = True
                    self._fail(h.r, h.i, exc, count)
                    self._done(h.r, h.i)

    def _check_item(self, r: int, i: int, reader: ArtifactReader) -> None:
        """Every byte of item ``i`` was read: its whole-container digest matched and every one of
        the engine's layers was placed (a shorter artifact would leave layers of another request)."""
        reader.finish()
        with self.cond:
            placed = self.progress[r][i]
        if placed != self._L:
            raise FingerprintMismatch(f"artifact placed {placed} of the engine's {self._L} layers")

    def _fail(self, r: int, i: int, exc: BaseException, count: Callable[[str], Any] | None = None) -> None:
        spec = self.specs[r]
        (count or self.ctx.count)("load_failures")
        with self.cond:
            if i < self.first_failed[r]:
                self.first_failed[r] = i
        what = f"chunk {spec.first + i}" if i < len(spec.keys) else f"tail piece {i - len(spec.keys)}"
        LOG.warning("KDN load of %s for request %s failed (%s: %s); vLLM recomputes from there",
                    what, spec.req_id, type(exc).__name__, exc)

    def _advance(self, r: int, i: int, to: int) -> None:
        """Item ``i`` of request ``r`` is past layer ``to - 1``; wakes the waiters where a layer
        became ready for every item. Called holding ``cond``."""
        was = self.progress[r][i]
        if to <= was:
            return
        self.progress[r][i] = to
        ready = self._ready
        woke = False
        for layer in range(was, to):
            ready[layer] += 1
            woke |= ready[layer] == self._items
        if woke:
            self.cond.notify_all()

    def _done(self, r: int, i: int) -> None:
        with self.cond:
            self._advance(r, i, self._L)

    def wait_layer(self, layer: int) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: self._ready[layer] >= self._items,
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
        self._stop = True  # the reader threads stop before their next layer

        async def stop() -> bool:
            self.future.cancel()
            return self._began  # not begun: cancelled before its first step, it never places

        try:
            began = asyncio.run_coroutine_threadsafe(stop(), self.ctx.loop.loop).result(10)
        except Exception:  # the loop is gone or stuck: wait as if it had begun
            began = True
        if began:  # the future says "cancelled" at once; the job may still be placing a section
            self._ended.wait(10)
        with self.cond:
            for r, ps in enumerate(self.progress):
                for i in range(len(ps)):
                    self._advance(r, i, self._L)
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
