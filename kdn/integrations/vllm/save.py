"""The worker's saves: chunks fully computed in a step, copied out of the paged blocks and Put.

The copy (:meth:`kdn.integrations.vllm.paged.PagedCache.gather`) happens in the step, on the
worker's thread; encoding and the Put run on the loop thread in the background, so the forward
pass never waits on the edge. A save is an optimisation: a failed or dropped one is counted, never
raised. Nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterable

import torch

from kdn.artifact import encode_artifact
from kdn.integrations.vllm.load import Clients
from kdn.integrations.vllm.paged import PagedCache
from kdn.integrations.vllm.plan import SaveSpec
from kdn.keys import ChunkKey, ModelFingerprint

LOG = logging.getLogger("kdn.vllm")


class Saver:
    """Background Puts of :class:`SaveSpec` s, at most ``max_pending`` at once (more are dropped);
    ``count(name)`` bumps the connector's ``saved_chunks``/``save_errors``/``saves_dropped``."""

    def __init__(self, clients: Clients, fingerprint: ModelFingerprint, *, codec: str, max_pending: int,
                 count: Callable[[str], None]) -> None:
        self.clients = clients
        self.fingerprint = fingerprint
        self.codec = codec
        self.max_pending = max_pending
        self._count = count
        self._puts: set[Any] = set()

    def save(self, specs: Iterable[SaveSpec], paged: PagedCache, failed_reqs: set[str]) -> None:
        """Copy out and start the Put of each spec; a request whose load failed saves nothing (its
        KV attended to unverified blocks)."""
        for spec in specs:
            if spec.req_id in failed_reqs or len(self._puts) >= self.max_pending:
                self._count("saves_dropped")
                continue
            kv = paged.gather(spec.block_ids, spec.lo, spec.hi)  # (L, 2, H, T, D) on the CPU
            fut = self.clients.loop.submit(self._put(spec, kv))
            self._puts.add(fut)
            fut.add_done_callback(self._puts.discard)

    async def _put(self, spec: SaveSpec, kv: torch.Tensor) -> None:
        try:
            client = self.clients.on_loop(spec.tenant, spec.salt)
            data = await asyncio.to_thread(
                encode_artifact, kv, key=ChunkKey(spec.key), parent_key=ChunkKey(spec.parent),
                fingerprint=self.fingerprint, codec=self.codec, chunk_index=spec.index,
            )
            if await client.put(self.fingerprint, ChunkKey(spec.key), data):
                self._count("saved_chunks")
        except Exception as exc:  # a write-back is an optimisation, never part of the answer
            self._count("save_errors")
            LOG.debug("KDN write-back of chunk %d failed: %s", spec.index, exc)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for the background Puts (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        for fut in list(self._puts):
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
