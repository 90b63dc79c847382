"""Who runs the prefill workers for ingest: in this process, or Ray actors fed from a work queue.

Two executors run the same worker code (:class:`~kdn.origin.worker.PrefillWorker`):
:class:`LocalExecutor` (in this process, no Ray) and :class:`RayExecutor` (``OriginWorker`` actors
fed from a driver-side work queue; a worker that dies is restarted by Ray and the document it held
is resubmitted, up to ``max_attempts``). :func:`make_executor` builds the one an
:class:`~kdn.origin.config.OriginConfig` asks for. Each reports every document's
:class:`~kdn.origin.worker.DocumentResult` exactly once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Iterator, Protocol, Sequence

from kdn.errors import Unavailable
from kdn.models import check_spec
from kdn.origin.config import OriginConfig
from kdn.origin.worker import DocumentResult, DocumentTask, PrefillWorker, spawn_workers

__all__ = ["Executor", "LocalExecutor", "OnResult", "RayExecutor", "check_model_spec", "make_executor"]

OnResult = Callable[[DocumentResult], None]


class Executor(Protocol):
    """Runs document tasks on prefill workers and reports each result exactly once."""

    def info(self) -> dict[str, Any]: ...

    def run(self, tasks: Iterator[DocumentTask], on_result: OnResult) -> None: ...

    def close(self) -> None: ...


class LocalExecutor:
    """One :class:`PrefillWorker` in this process."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def info(self) -> dict[str, Any]:
        return {**self.worker.info(), "workers": 0}

    def run(self, tasks: Iterator[DocumentTask], on_result: OnResult) -> None:
        for t in tasks:
            try:
                on_result(DocumentResult.from_dict(self.worker.process(t.to_dict())))
            except Exception as exc:  # a bug or a pathological document: report, keep going
                on_result(DocumentResult(t.doc_id, "failed", f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        self.worker.close()


class RayExecutor:
    """``OriginWorker`` actors fed from a work queue, at most one document in flight per worker.

    Worker death (``RayActorError``): the document goes back to the queue with ``attempt + 1``
    (failed after ``max_attempts``); the actor is probed until Ray has restarted it, or dropped
    when Ray gives it up. Exceptions raised inside ``process`` fail only that document.
    """

    def __init__(
        self, actors: list[Any], *, max_attempts: int, max_restarts: int, probe_timeout_s: float = 120.0
    ) -> None:
        self.actors = actors
        self.max_attempts = max_attempts
        self.max_restarts = max_restarts
        self.probe_timeout_s = probe_timeout_s
        self.deaths = 0

    def info(self) -> dict[str, Any]:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            infos = ray.get([a.info.remote() for a in self.actors], timeout=self.probe_timeout_s)
        except GetTimeoutError as exc:
            raise Unavailable(
                f"{len(self.actors)} Ray prefill worker(s) did not start within {self.probe_timeout_s:.0f}s: does the "
                "cluster have a kdn_origin node with a free CPU? (`ray status`; --local to ingest in this process)"
            ) from exc
        return {**infos[0], "workers": len(self.actors), "pids": [i["pid"] for i in infos]}

    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors], timeout=self.probe_timeout_s)

    def run(self, tasks: Iterator[DocumentTask], on_result: OnResult) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        retry: deque[DocumentTask] = deque()
        free: deque[int] = deque(range(len(self.actors)))
        work: dict[Any, tuple[int, DocumentTask]] = {}  # ref -> (actor, task)
        probes: dict[Any, tuple[int, float]] = {}  # ref -> (actor, since)
        died = [0] * len(self.actors)
        exhausted = False

        def next_task() -> DocumentTask | None:
            nonlocal exhausted
            if retry:
                return retry.popleft()
            if exhausted:
                return None
            t = next(tasks, None)
            exhausted = t is None
            return t

        while True:
            while free:
                t = next_task()
                if t is None:
                    break
                idx = free.popleft()
                work[self.actors[idx].process.remote(t.to_dict())] = (idx, t)
            if not work and not probes:
                if not free:  # every worker is gone: what is left cannot run
                    while (t := next_task()) is not None:
                        on_result(DocumentResult(t.doc_id, "failed", "no origin worker left (all died)", attempts=t.attempt))
                break  # else: free workers and no task left, done
            ready, _ = ray.wait([*work, *probes], num_returns=1, timeout=5.0)
            for ref in ready:
                if ref in probes:
                    idx, since = probes.pop(ref)
                    try:
                        ray.get(ref)
                        free.append(idx)
                    except RayActorError:
                        # still restarting, or gone for good once Ray's restarts are used up
                        gone = died[idx] > self.max_restarts or time.monotonic() - since > self.probe_timeout_s
                        if not gone:
                            time.sleep(0.2)
                            probes[self.actors[idx].pid.remote()] = (idx, since)
                    continue
                idx, t = work.pop(ref)
                try:
                    on_result(DocumentResult.from_dict(ray.get(ref)))
                    free.append(idx)
                except RayActorError as exc:
                    self.deaths += 1
                    died[idx] += 1
                    redo = replace(t, attempt=t.attempt + 1)
                    if redo.attempt >= self.max_attempts:
                        on_result(DocumentResult(t.doc_id, "failed", f"worker died {redo.attempt} times on it: {_first_line(exc)}", attempts=redo.attempt))
                    else:
                        retry.append(redo)
                    probes[self.actors[idx].pid.remote()] = (idx, time.monotonic())
                except RayTaskError as exc:
                    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                    on_result(DocumentResult(t.doc_id, "failed", f"{type(cause).__name__}: {_first_line(cause)}"))
                    free.append(idx)

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def check_model_spec(spec: str) -> None:
    """Refuse an unknown or uninstalled model spec before any worker starts (and convert a trained
    built-in here, once, rather than in every worker)."""
    check_spec(spec)


def make_executor(config: OriginConfig, model: str | None = None, *, on_nodes: Sequence[str] = ()) -> Executor:
    """In-process when ``config.workers == 0``; otherwise Ray actors (Ray must be initialised),
    on ``on_nodes`` when given (a cluster's ``kdn_origin`` nodes: see :mod:`kdn.origin.ingest.where`)."""
    spec = model or config.models[0]
    check_model_spec(spec)
    if config.workers == 0:
        return LocalExecutor(PrefillWorker(config, spec))
    return RayExecutor(spawn_workers(config, spec, on_nodes=on_nodes),
                       max_attempts=config.max_attempts, max_restarts=config.max_restarts)
