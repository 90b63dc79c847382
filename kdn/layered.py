"""A prefix fetched while the forward over it runs: layer ``l`` of the model runs once layer ``l``
of every fetched chunk is in place, while later layers are still arriving.

:meth:`kdn.client.AsyncKdnClient.reuse` with ``layered=True`` returns once its Lookups are done,
with the fetch going on behind a :class:`LayerGate`; the caller's forward calls
``gate.wait(l)`` before layer ``l`` (:func:`kdn.blend.prefill_in_place`'s ``ready``) and then
:meth:`kdn.client.KdnClient.settle` for what was really reused.

Contract of the gate:

- ``wait(l)`` returns only when every item's layer ``l`` is in place and verified (its sections'
  checksums). An item's last layer counts only once the item is whole: its trailer digest
  matched and its header was checked (steering). So a forward that passed ``wait(L-1)`` used
  only KV that :meth:`ArtifactReader.finish` accepted;
- ``wait`` raises :class:`LoadBroken` as soon as any item failed (corrupt, refused, missing, late)
  or past the deadline: the forward's earlier layers used KV that is still right, but its later
  layers cannot be computed over the whole prefix. The caller settles (which says how many
  leading items are usable) and computes again over those;
- nothing is written into the destination once :attr:`LayerGate.ended` is set; ``settle`` waits
  for it, so a caller may then reuse the destination's positions after the usable prefix.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from kdn.artifact import ArtifactReader, layer_cuts
from kdn.errors import Unavailable
from kdn.transport import FetchStats

__all__ = ["Held", "LayerGate", "LoadBroken", "fetch_layered", "pays", "release"]

_READER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdn-layers")  # held containers, layer-major


def pays(model: Any) -> bool:
    """Whether a prefix layered under ``model``'s forward (on the CPU, as the transformers path
    runs it) can save time: torch leaves a core free for the reader. When torch's threads take
    every core the reader and the forward contend for them: on a 2-core Xeon with smollm2-135m
    fp32 a layered hit took 1.10x / 1.08x the time of one fetched whole first at 4k / 8k tokens,
    and with one torch thread 0.91x / 0.95x (``benchmarks/real_model.py``, ``--torch-threads 1``).
    ``model`` names the forward the reader would run beside (its threads are torch's)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


class LoadBroken(Exception):
    """A layered fetch failed while the forward waited on it (internal: the caller settles)."""


class LayerGate:
    """Per-layer readiness of ``items`` artifacts being placed into one destination (see the module)."""

    def __init__(self, items: int, layers: int, deadline_s: float) -> None:
        self.items = items
        self.layers = layers
        self.progress = [0] * items  # layers of item i in place (its last counts once it is whole)
        self.ready = [0] * layers  # per layer: the items past it
        self.first_failed = items
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.deadline = time.monotonic() + deadline_s
        self.stop = False  # set when abandoned: readers place nothing more
        self.ended = threading.Event()  # set once the fetch has returned: nothing is written after it
        self.ended_at = 0.0  # time.perf_counter() then
        self.tally = FetchStats()
        self.task: Any = None  # the concurrent future of the fetch (on the client's loop)

    def advance(self, i: int, to: int) -> None:
        """Item ``i`` is past layer ``to - 1`` (capped below its last layer until :meth:`done`)."""
        with self.cond:
            self._advance(i, min(to, self.layers - 1))

    def done(self, i: int) -> None:
        """Item ``i`` is whole and verified."""
        with self.cond:
            self._advance(i, self.layers)

    def fail(self, i: int, exc: BaseException) -> None:
        with self.cond:
            if i < self.first_failed:
                self.first_failed, self.error = i, exc
            self.cond.notify_all()

    def _advance(self, i: int, to: int) -> None:
        was = self.progress[i]
        if to <= was:
            return
        self.progress[i] = to
        woke = False
        for layer in range(was, to):
            self.ready[layer] += 1
            woke |= self.ready[layer] == self.items
        if woke:
            self.cond.notify_all()

    @property
    def broken(self) -> bool:
        return self.first_failed < self.items

    def wait(self, layer: int) -> None:
        """Block until every item's ``layer`` is in place; raise :class:`LoadBroken` if that cannot be."""
        with self.cond:
            ok = self.cond.wait_for(lambda: self.ready[layer] >= self.items or self.broken,
                                    timeout=max(0.0, self.deadline - time.monotonic()))
            if self.broken:
                raise LoadBroken(f"item {self.first_failed} failed")
        if not ok:
            raise LoadBroken("deadline")

    def settle(self) -> int:
        """The leading items usable, once the fetch has ended (call after :attr:`ended`)."""
        with self.cond:
            whole = next((i for i, p in enumerate(self.progress) if p < self.layers), self.items)
            return min(whole, self.first_failed)


@dataclass(slots=True)
class Held:
    """Item ``i`` (of request ``r``, where a load serves several) whose whole container is held
    where it is mapped (``view``, valid while ``stream`` is open), not yet read, and where it
    splits into layers (``cuts``); ``over``: read whole, or failed. Also the vLLM connector's
    (:mod:`kdn.integrations.vllm.load`)."""

    i: int
    reader: ArtifactReader
    view: memoryview | None
    stream: Any
    cuts: list[int]
    over: bool = False
    r: int = 0


async def release(held: Iterable[Held]) -> None:
    """Let go of held containers: each mapping closes once no view of it is left."""
    for h in held:
        h.view = None
        await h.stream.aclose()


async def fetch_layered(
    gate: LayerGate,
    open_reader: Callable[[int], ArtifactReader],
    pieces: Callable[[int], Any],
    check: Callable[[int, ArtifactReader], None],
    *,
    concurrency: int,
    timeout_s: float,
) -> None:
    """Fetch each of ``gate.items`` items into its reader (``open_reader(i)``, a reader with ``out=``
    its span of the destination), ``concurrency`` at once, advancing ``gate`` as layers land.

    ``pieces(i)``: item i's container as the transport hands it over. One that comes whole and
    in place (same-host shared memory) is held until every item is held or placed; the held ones
    are then read layer by layer across items on one thread, so layer 0 of every chunk is in
    place after about 1/L of the reading. Any other is fed as it arrives. ``check(i, reader)``:
    the whole item read, its digest and header are accepted (raises otherwise)."""
    sem = asyncio.Semaphore(concurrency)
    held: list[Held] = []
    tally = gate.tally

    async def open_one(i: int) -> Held | None:
        reader = open_reader(i)
        stream = pieces(i)
        try:
            async for piece, via in stream:
                if via == "shm" and not reader.received:  # the whole container, where it is mapped
                    h, stream = Held(i, reader, piece, stream, layer_cuts(piece)), None
                    return h
                t0 = time.perf_counter()
                for s in reader.feed(piece):
                    if s.kind == "v":
                        gate.advance(i, s.layer + 1)
                tally.decode_s += time.perf_counter() - t0
                tally.bytes += len(piece)
                tally.via = via
        finally:
            if stream is not None:
                await stream.aclose()
        check(i, reader)
        gate.done(i)
        return None

    async def one(i: int) -> None:
        async with sem:
            if i >= gate.first_failed or gate.stop:
                return  # an earlier item failed: this one will be recomputed anyway
            try:
                async with asyncio.timeout(timeout_s + 0.5):
                    h = await open_one(i)
            except Exception as exc:  # KdnError, a deadline, a geometry refusal: computed from here
                gate.fail(i, exc if not isinstance(exc, TimeoutError) else
                          Unavailable(f"Fetch of item {i} did not finish within {timeout_s:g}s"))
                return
            if h is not None:
                held.append(h)

    try:
        await asyncio.gather(*(one(i) for i in range(gate.items)))
        if held:
            held.sort(key=lambda h: h.i)
            future = _READER.submit(_read_layers, gate, held, check)
            try:
                await asyncio.wrap_future(future)
            except BaseException:
                gate.stop = True
                concurrent.futures.wait([future])  # a reader finishes at most the layer it is in
                raise
    finally:
        try:
            await release(held)
        finally:
            gate.ended_at = time.perf_counter()
            gate.ended.set()
            with gate.cond:
                gate.cond.notify_all()


def _read_layers(gate: LayerGate, held: list[Held], check: Callable[[int, ArtifactReader], None]) -> None:
    tally = gate.tally
    t0 = time.perf_counter()
    for step in range(max(len(h.cuts) for h in held)):
        for h in held:
            if h.over:
                continue
            if gate.stop or h.i >= gate.first_failed:  # abandoned, or an earlier item failed
                h.over = True
                continue
            try:
                assert h.view is not None
                cut = h.cuts[step] if step < len(h.cuts) else len(h.view)
                for s in h.reader.feed(h.view[h.cuts[step - 1] if step else 0 : cut]):
                    if s.kind == "v":
                        gate.advance(h.i, s.layer + 1)
                if cut == len(h.view):
                    h.over = True
                    check(h.i, h.reader)
                    tally.bytes += len(h.view)
                    gate.done(h.i)
            except Exception as exc:  # a bad checksum, a refused header: computed from here
                h.over = True
                gate.fail(h.i, exc)
    tally.decode_s += time.perf_counter() - t0
    tally.via = "shm"
