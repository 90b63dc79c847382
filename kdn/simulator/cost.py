"""The cost model: what moving, decoding and recomputing KV costs, as functions of their inputs.

Nothing here holds run state. A :class:`CostModel` is built once per run from the scenario, the
topology and the presets, and is never changed: every method returns a number computed from its
arguments and the model's constants (byte sizes per link class, decode times, latencies, the
prefill FLOP model). State that changes during a run — a link's FIFO backlog, a GPU replica's next
free time, the origin's published set — lives elsewhere (:mod:`kdn.simulator.context`) and is
passed in where a cost depends on it (``sent`` in :meth:`CostModel.arrival`, ``gpu_free`` in
:meth:`CostModel.best_prefix`).

Prefill of ``n`` tokens after ``s`` cached ones costs ``pa * n + pb * (n * s + n² / 2)`` GPU
seconds (dense FLOPs plus attention over the growing context); the first token costs one read of
the weights from HBM. A fetch of ``k`` chunks from site ``src`` to edge ``e`` puts
``k * wire[class]`` bytes on ``src``'s link, and the data is usable one propagation delay after
the link has sent it plus ``k`` decodes at the receiver.

With ``layer_pipelining`` (a client that starts layer ``l`` of the prefill once layer ``l`` of the
fetched KV is there, as KDN's vLLM connector does), the fetched data of a segment is taken to
flow in layer by layer, evenly, over its *span* (from its first bytes' arrival to its last), and
prefill runs layer by layer behind it. Of ``L`` layers, layer ``l``'s data is in at
``ready - span + span * (l + 1) / L``, so the last layer finishes at
``max(ready + c / L, ready - span + span / L + c)`` for ``c`` seconds of prefill: the first token
comes ``(1 - 1 / L) * min(span, c)`` sooner than "fetch, then prefill" (:meth:`CostModel.overlap`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kdn.simulator.presets import Presets
from kdn.simulator.scenario import Scenario
from kdn.simulator.topology import Topology

__all__ = ["CostModel"]


@dataclass(frozen=True, slots=True)
class CostModel:
    block_tokens: int
    raw_block: float  # bytes of one chunk's KV, uncompressed
    wire: tuple[float, ...]  # bytes on the wire per chunk, by link class (metro, regional, long haul)
    decode: tuple[float, ...]  # receiver decode seconds per chunk, by link class
    stored: int  # bytes a chunk takes in an edge cache
    local_s: float  # seconds to read and decode one chunk from the edge next to the GPUs
    pa: float
    pb: float
    first_token_s: float
    gpus_per_replica: int
    layers: int
    pipelined: bool  # the client overlaps prefill with the fetch, layer by layer
    gpu_price: float  # USD per GPU-hour
    lat: list[list[float]]  # one-way latency, [to][from]
    cls: list[list[int]]  # link class, [to][from]
    is_wan: list[list[bool]]  # the two sites are in different places (> 1 km)

    @classmethod
    def build(cls, sc: Scenario, topo: Topology, presets: Presets, block_tokens: int) -> CostModel:
        model = presets.models[sc.model]
        gpu = presets.gpus[sc.gpu]
        raw_block = model.kv_bytes_per_token * block_tokens
        link_codecs = [presets.codecs[sc.codecs.metro], presets.codecs[sc.codecs.regional], presets.codecs[sc.codecs.long_haul]]
        storage = presets.codecs[sc.cache.storage_codec]
        stored = max(1, int(raw_block * storage.ratio))
        tp = sc.gpus_per_replica
        flops = gpu.flops_per_s * tp
        return cls(
            block_tokens=block_tokens,
            raw_block=raw_block,
            wire=tuple(raw_block * c.ratio for c in link_codecs),
            decode=tuple(c.decode_s(raw_block) for c in link_codecs),
            stored=stored,
            local_s=stored / topo.local_read_Bps + storage.decode_s(raw_block),
            pa=2.0 * model.params / flops,
            pb=4.0 * model.layers * model.q_heads * model.head_dim / flops,
            first_token_s=model.params * model.dtype_bytes / (gpu.hbm_tbps * 1e12 * tp),
            gpus_per_replica=tp,
            layers=model.layers,
            pipelined=sc.params.layer_pipelining,
            gpu_price=sc.prices.gpu_per_hour if sc.prices.gpu_per_hour is not None else gpu.usd_per_hour,
            lat=topo.latency_s.tolist(),
            cls=topo.link_class.tolist(),
            is_wan=(topo.distance_km > 1.0).tolist(),
        )

    def prefill_s(self, start: int, n: int) -> float:
        """GPU seconds to prefill ``n`` tokens after ``start`` cached ones."""
        return self.pa * n + self.pb * (n * start + 0.5 * n * n) if n > 0 else 0.0

    def serve_s(self, covered: int, n_in: int) -> float:
        """GPU seconds from a request's data being there to its first token: prefill of the
        ``n_in`` input tokens after the ``covered`` reused chunks (:meth:`prefill_s`, written out:
        this runs once or twice per request), plus one decode step."""
        start = covered * self.block_tokens
        n = n_in - start
        return (self.pa * n + self.pb * (n * start + 0.5 * n * n) if n > 0 else 0.0) + self.first_token_s

    def overlap(self, span: float, compute_s: float, ready: float, gpu_free: float) -> float:
        """Seconds by which layer pipelining brings the first token forward: data that flows in
        over ``span`` seconds up to ``ready``, ``compute_s`` seconds of prefill behind it, a GPU
        free from ``gpu_free`` on (only the part of the span after that overlaps). 0 when the
        client does not pipeline."""
        if not self.pipelined or span <= 0.0 or compute_s <= 0.0:
            return 0.0
        free_span = ready - gpu_free
        if free_span < span:
            span = free_span if free_span > 0.0 else 0.0
        return (1.0 - 1.0 / self.layers) * (span if span < compute_s else compute_s)

    def transfer(self, e: int, src: int, nblocks: int) -> tuple[float, float, float]:
        """``nblocks`` chunks from site ``src`` to edge ``e``: ``(one-way latency, bytes on the
        link, decode seconds at e)``. The data is usable at ``sent + latency + decode``, where
        ``sent`` is when the link has sent the last byte."""
        c = self.cls[e][src]
        return self.lat[e][src], nblocks * self.wire[c], nblocks * self.decode[c]

    def best_prefix(
        self, decision: str, now: float, gpu_free: float, n_in: int, ready: list[float], sizes: list[int], spans: list[float] | None = None
    ) -> int:
        """The fetch-or-recompute rule: how many leading segments to use (0 = recompute
        everything). ``ready[j]`` is when segment ``j`` (``sizes[j]`` chunks) would be at the GPUs,
        its data flowing in over the ``spans[j]`` seconds before (layer pipelining, see
        :meth:`overlap`); prefill starts once the data is there and a GPU replica is free at ``gpu_free``.
        ``decision`` ``auto`` picks the smallest predicted TTFT; ``fetch`` and ``recompute`` force."""
        if decision == "recompute" or not sizes:
            return 0
        if decision == "fetch":
            return len(sizes)
        B = self.block_tokens
        best_m = 0
        best = (gpu_free if gpu_free > now else now) + self.prefill_s(0, n_in)
        t_ready = now
        span = 0.0
        cov = 0
        for m in range(len(sizes)):
            if ready[m] > t_ready:
                t_ready = ready[m]
                span = spans[m] if spans is not None else 0.0
            cov += sizes[m]
            c = self.prefill_s(cov * B, n_in - cov * B)
            total = (t_ready if t_ready > gpu_free else gpu_free) + c - self.overlap(span, c, t_ready, gpu_free)
            if total < best:
                best = total
                best_m = m + 1
        return best_m
