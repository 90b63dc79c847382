"""Background prefetch: fetch chunks before anyone asks for them.

Two sources feed one bounded queue:
- read-ahead — after chunk i of a chain is fetched, chunks i+1..i+depth (the request's
  ``next_keys``) are offered;
- operators — the Prefetch RPC and cron-scheduled prefetches (``kdn.edge.schedules.HintScheduler``,
  driven by the node's schedule loop) offer whole key lists or documents.

The queue is bounded: when it is full, offers are dropped and counted (prefetch is an
optimisation; it must never build an unbounded backlog or slow the foreground). A key already
queued is not queued twice. Workers run the node's ordinary fetch path, so a prefetch and a
client miss of the same key coalesce into one upstream fetch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from kdn.edge.tasks import cancel_and_wait
from kdn.edge.upstream import FetchSpec
from kdn.errors import KdnError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefetchJob:
    spec: FetchSpec
    token: str | None = None

    @property
    def ident(self) -> tuple[str, bytes]:
        return (self.spec.namespace.tenant, bytes(self.spec.key))


class Prefetcher:
    """A bounded queue of prefetch jobs and a few workers that run ``run(job)``.

    ``queue_size`` and ``workers`` come from the edge's config (``prefetch_queue``,
    ``prefetch_workers``), which holds their defaults."""

    def __init__(
        self,
        run: Callable[[PrefetchJob], Awaitable[object]],
        *,
        queue_size: int,
        workers: int,
    ) -> None:
        self._run = run
        self._queue: asyncio.Queue[PrefetchJob] = asyncio.Queue(maxsize=queue_size)
        self._queued: set[tuple[str, bytes]] = set()
        self._n_workers = workers
        self._workers: list[asyncio.Task[None]] = []
        self._busy = 0
        self.offered = 0
        self.dropped = 0
        self.done = 0
        self.failed = 0

    def start(self) -> None:
        if not self._workers:
            self._workers = [asyncio.ensure_future(self._work()) for _ in range(self._n_workers)]

    async def stop(self) -> None:
        await cancel_and_wait(self._workers)
        self._workers = []

    def offer(self, job: PrefetchJob) -> bool:
        """Queue ``job`` unless it is already queued or the queue is full. Never blocks."""
        self.offered += 1
        if job.ident in self._queued:
            return False
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        self._queued.add(job.ident)
        return True

    @property
    def pending(self) -> int:
        return self._queue.qsize() + self._busy

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait until the queue is empty and no job is running (tests, shutdown)."""
        async with asyncio.timeout(timeout):
            while self.pending:
                await asyncio.sleep(0.005)

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            self._busy += 1
            self._queued.discard(job.ident)
            try:
                await self._run(job)
                self.done += 1
            except KdnError as exc:
                self.failed += 1
                log.debug("prefetch of %s failed: %s", job.spec.key.hex()[:16], exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one prefetch must not kill the worker
                self.failed += 1
                log.exception("prefetch of %s crashed", job.spec.key.hex()[:16])
            finally:
                self._busy -= 1
                self._queue.task_done()

    def stats(self) -> dict[str, float]:
        return {
            "prefetch_offered": self.offered,
            "prefetch_dropped": self.dropped,
            "prefetch_done": self.done,
            "prefetch_failed": self.failed,
            "prefetch_pending": self.pending,
        }
