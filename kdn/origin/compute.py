"""Where the origin's prefill runs when it serves: in this process, or on Ray origin workers.

One small interface, :class:`ComputeBackend`, two implementations:

- :class:`LocalCompute`: one :class:`~kdn.origin.worker.PrefillWorker` per served model in this
  process, forward passes serialised per model (CPU-bound anyway; it also coalesces concurrent
  requests for the same chain: the second finds the keys stored and computes nothing);
- :class:`RayCompute`: ``OriginWorker`` actors on ``kdn_origin`` nodes, picked round-robin; a
  call that hits a dead worker is retried once on the next one.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Protocol, Sequence

import numpy as np

from kdn.errors import FingerprintMismatch, InvalidInput, Unavailable
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.models import LoadedModel
from kdn.origin.config import OriginConfig
from kdn.origin.worker import ChainResult, DocumentResult, DocumentTask, PrefillWorker, spawn_workers

__all__ = ["ComputeBackend", "LocalCompute", "RayCompute"]


class ComputeBackend(Protocol):
    def models(self) -> dict[ModelFingerprint, dict[str, Any]]:
        """Fingerprint -> worker info (spec, chunk_size, max_positions, codecs) of every served model."""

    def compute(self, fingerprint: ModelFingerprint, tokens: np.ndarray, ns: Namespace, codecs: Sequence[str]) -> ChainResult:
        """Store every missing full chunk of ``tokens``; blocking."""

    def ingest(self, fingerprint: ModelFingerprint, task: DocumentTask) -> DocumentResult:
        """Ingest one document; blocking."""

    def blend(self, fingerprint: ModelFingerprint, tokens: np.ndarray, ns: Namespace, plan: dict[str, Any],
              codec: str) -> dict[str, Any]:
        """Compute a blend variant (:meth:`kdn.origin.worker.PrefillWorker.blend`); blocking."""

    def close(self) -> None: ...


def _check_tokens(tokens: np.ndarray, vocab: int) -> None:
    if tokens.ndim != 1:
        raise InvalidInput("tokens must be a flat list")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise InvalidInput(f"token ids must lie in [0, {vocab}) for this model")


class LocalCompute:
    """Prefill workers in this process (no Ray)."""

    def __init__(self, workers: Sequence[PrefillWorker]) -> None:
        self._workers = {w.lm.fingerprint: w for w in workers}
        self._locks = {fp: threading.Lock() for fp in self._workers}

    @classmethod
    def from_config(cls, config: OriginConfig, *, preloaded: Sequence[LoadedModel] = ()) -> "LocalCompute":
        by_spec = {lm.spec: lm for lm in preloaded}
        return cls([PrefillWorker(config, spec, lm=by_spec.get(spec)) for spec in config.models])

    def worker(self, fingerprint: ModelFingerprint) -> PrefillWorker:
        w = self._workers.get(ModelFingerprint(bytes(fingerprint)))
        if w is None:
            raise FingerprintMismatch(
                f"this origin does not serve model {bytes(fingerprint).hex()[:16]}…; it serves "
                + ", ".join(f"{w.lm.spec} ({bytes(fp).hex()[:16]}…)" for fp, w in self._workers.items())
            )
        return w

    def models(self) -> dict[ModelFingerprint, dict[str, Any]]:
        return {fp: w.info() for fp, w in self._workers.items()}

    def compute(self, fingerprint: ModelFingerprint, tokens: np.ndarray, ns: Namespace, codecs: Sequence[str]) -> ChainResult:
        w = self.worker(fingerprint)
        _check_tokens(tokens, int(w.lm.config.vocab_size))
        with self._locks[w.lm.fingerprint]:
            return w.compute_chain(tokens, ns, codecs)

    def ingest(self, fingerprint: ModelFingerprint, task: DocumentTask) -> DocumentResult:
        w = self.worker(fingerprint)
        with self._locks[w.lm.fingerprint]:
            return DocumentResult.from_dict(w.process(task.to_dict()))

    def blend(self, fingerprint: ModelFingerprint, tokens: np.ndarray, ns: Namespace, plan: dict[str, Any],
              codec: str) -> dict[str, Any]:
        w = self.worker(fingerprint)
        _check_tokens(tokens, int(w.lm.config.vocab_size))
        with self._locks[w.lm.fingerprint]:
            return w.blend(tokens, ns.tenant, ns.salt, plan, codec)

    def close(self) -> None:
        for w in self._workers.values():
            w.close()


class RayCompute:
    """``OriginWorker`` actors (Ray must be initialised), one pool per served model."""

    def __init__(self, config: OriginConfig, *, timeout_s: float | None = None) -> None:
        import ray

        self._timeout = timeout_s or config.compute_timeout_s
        self._pools: dict[ModelFingerprint, list[Any]] = {}
        self._info: dict[ModelFingerprint, dict[str, Any]] = {}
        self._rr: dict[ModelFingerprint, Any] = {}
        for spec in config.models:
            actors = spawn_workers(config, spec, n=max(1, config.workers))
            info = ray.get(actors[0].info.remote(), timeout=self._timeout)
            fp = ModelFingerprint(bytes.fromhex(info["fingerprint"]))
            self._pools[fp], self._info[fp], self._rr[fp] = actors, info, itertools.cycle(range(len(actors)))

    def models(self) -> dict[ModelFingerprint, dict[str, Any]]:
        return dict(self._info)

    def _pool(self, fingerprint: ModelFingerprint) -> tuple[ModelFingerprint, list[Any]]:
        fp = ModelFingerprint(bytes(fingerprint))
        if fp not in self._pools:
            raise FingerprintMismatch(
                f"this origin does not serve model {bytes(fp).hex()[:16]}…; it serves "
                + ", ".join(f"{i['spec']} ({i['fingerprint'][:16]}…)" for i in self._info.values())
            )
        return fp, self._pools[fp]

    def _call(self, fingerprint: ModelFingerprint, method: str, *args: Any) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        fp, pool = self._pool(fingerprint)
        last: Exception | None = None
        for _ in range(2):
            actor = pool[next(self._rr[fp])]
            try:
                return ray.get(getattr(actor, method).remote(*args), timeout=self._timeout)
            except RayActorError as exc:  # worker died: Ray restarts it; try the next one
                last = exc
            except GetTimeoutError as exc:
                raise Unavailable(f"origin worker did not answer within {self._timeout}s") from exc
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, Exception):
                    raise cause from exc
                raise
        raise Unavailable(f"origin workers unavailable: {last}") from last

    def compute(self, fingerprint: ModelFingerprint, tokens: np.ndarray, ns: Namespace, codecs: Sequence[str]) -> ChainResult:
        out = self._call(fingerprint, "compute", np.ascontiguousarray(tokens, dtype=np.int64), ns.tenant, ns.salt, list(codecs))
        return ChainResult(
            keys=tuple(ChunkKey(bytes.fromhex(k)) for k in out["keys"]),
            computed=int(out["computed"]),
            already_stored=int(out["already_stored"]),
            beyond_window_tokens=int(out["beyond_window_tokens"]),
        )

    def ingest(self, fingerprint: ModelFingerprint, task: DocumentTask) -> DocumentResult:
        out = self._call(fingerprint, "process", task.to_dict())
        return DocumentResult.from_dict(out)

    def blend(self, fingerprint: ModelFingerprint, tokens: np.ndarray, ns: Namespace, plan: dict[str, Any],
              codec: str) -> dict[str, Any]:
        return self._call(fingerprint, "blend", np.ascontiguousarray(tokens, dtype=np.int64), ns.tenant, ns.salt,
                          plan, codec)

    def close(self) -> None:
        import ray

        for pool in self._pools.values():
            for a in pool:
                ray.kill(a, no_restart=True)
        self._pools.clear()
