"""KDN for vLLM: a v1 KV connector that loads a request's prefix KV from the local edge and writes
newly computed full chunks back.

    vllm serve DIR --kv-transfer-config '{"kv_connector": "KdnConnector",
        "kv_connector_module_path": "kdn.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"edge": "127.0.0.1:7070", "chunk_size": 256}}'

How one request goes (vLLM's v1 connector API, ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``):

- scheduler, ``get_num_new_matched_tokens``: the request's namespace (tenant + salt, from the
  request's ``cache_salt`` or ``kv_transfer_params``, never from process state) and its prompt
  token ids give the chain of chunk keys (:func:`kdn.keys.chunk_keys`); ONE Lookup asks the edge
  how many leading chunks it holds. The match is whole chunks, ends at least one token before the
  prompt's end (vLLM computes the last token), and is reported for synchronous loading;
- scheduler, ``build_connector_meta``: tells the worker which chunks to load into which block ids,
  and which chunks became fully computed in this step (to save);
- worker, ``start_load_kv``: fetches the chunks on a private event-loop thread, ``fetch_concurrency``
  at once; every artifact goes through a verifying :class:`kdn.artifact.ArtifactReader`, and
  each section (one layer's K or V of one chunk, ``(H, T, D)``) is scattered into the request's
  paged blocks as soon as its checksum passed. Chunks that arrive whole in same-host shared
  memory are read layer by layer across the step's chunks, on reader threads
  (:mod:`kdn.integrations.vllm.load`); ``wait_for_layer_load(layer)`` returns once every chunk
  has placed that layer (or failed), so layer l's attention runs while later layers are still
  being read;
- worker, ``wait_for_save``: the chunks computed in this step are copied out of the paged blocks
  (one chunk at a time, ``(L, 2, H, T, D)``), then encoded and Put by the loop thread in the
  background: the forward pass never waits on the edge;
- worker, ``get_block_ids_with_load_errors``: the blocks of the first chunk that failed and of
  every chunk after it. vLLM (with ``kv_load_failure_policy: "recompute"``, which the connector
  requires) recomputes from the first failed block.

Requests that opt in to blending (``kv_transfer_params: {"kdn_blend": true}`` and a blend
``cache_salt``) get their documents' blend variant from the store and load it like a prefix:
:mod:`kdn.integrations.vllm_blend`. Requests that name a steered variant (``kdn_steer`` and a
``cache_salt`` containing its id) load that variant's chain: :mod:`kdn.integrations.vllm_steer`.

Invariants:
- a cache failure never changes an answer: a section is written into a block only after its
  checksum verified, a chunk that failed anywhere (edge gone, deadline, corrupt bytes, wrong model)
  reports its blocks and all later ones as failed, and the steps' saves of a request whose load
  failed are dropped (their KV attended to unverified blocks);
- chunk keys are those of :mod:`kdn.keys` with the fingerprint of :func:`engine_fingerprint`: the
  same model directory in the same dtype gives the origin's keys (``kdn ingest --model DIR
  --dtype bfloat16``), so vLLM finds what the origin made;
- ``chunk_size`` is a multiple of vLLM's block size, checked when the connector is built.

The engine's paged KV (slot mapping, block gather and scatter, the backends' layouts) is
:mod:`kdn.integrations.vllm.paged`; the worker's loads are :mod:`kdn.integrations.vllm.load`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import Field

from kdn.client import MAX_WAIT_S, ClientConfig
from kdn.errors import InvalidInput
from kdn.integrations.vllm.load import Clients, LoadContext, LoadJob, LoadSpec, LoopThread
from kdn.integrations.vllm.paged import EngineGeometry, PagedCache, WriteKernel
from kdn.integrations.vllm.plan import ReqState, SaveSpec, load_of, saves_of
from kdn.integrations.vllm.save import Saver
from kdn.integrations.vllm_blend import BlendHost, BlendRequests
from kdn.integrations.vllm_steer import requested_variant, variant_namespace
from kdn.keys import (DEFAULT_CHUNK_SIZE, PIECE_TOKENS, ROOT_KEY, ModelFingerprint, Namespace, chunk_keys, piece_keys,
                      request_namespace)
from kdn.models import DTYPES, dir_fingerprint

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KdnConnector", "KdnConnectorConfig", "engine_fingerprint", "request_namespace"]

LOG = logging.getLogger("kdn.vllm")
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class KdnConnectorConfig(ClientConfig):
    """``kv_connector_extra_config`` of the KDN connector: every :class:`~kdn.client.ClientConfig`
    setting (edge, fallback edges, token, TLS, shared memory, timeouts, write-back; their defaults
    live there), plus what only the connector has. ``tenant``/``salt`` are the namespace of requests
    that name none (no ``cache_salt``, no ``kdn_tenant``). Loads are always lossless."""

    tokens: dict[str, str] = Field(default_factory=dict, description="tenant -> bearer token (other tenants use `token`)")
    chunk_size: int = Field(DEFAULT_CHUNK_SIZE, gt=0, description="tokens per chunk; a multiple of vLLM's block size")
    lookup_timeout_s: float = Field(1.0, gt=0, le=MAX_WAIT_S, description="deadline of the scheduler's Lookup (it holds up a scheduler step)")
    model_dir: str | None = Field(None, description="directory that names the weights (default: vLLM's model path)")
    blend_origin: str | None = Field(None, description="host:port of the origin that blends documents for requests "
                                     "that opt in (kdn.integrations.vllm_blend); None: no blending")
    blend: bool = Field(False, description="every request opts in to blending (else kv_transfer_params kdn_blend)")
    blend_timeout_s: float = Field(120.0, gt=0, le=MAX_WAIT_S, description="how long a request waits for the store's blend before "
                                   "it is served exact KV")
    blend_poll_s: float = Field(0.02, gt=0, le=MAX_WAIT_S, description="longest a scheduler step waits on a pending blend")

    def client_config(self, ns: Namespace) -> ClientConfig:
        """The client settings of one namespace's requests."""
        shared = self.model_dump(include=set(ClientConfig.model_fields))
        return ClientConfig(**{**shared, "tenant": ns.tenant, "salt": ns.salt, "token": self.tokens.get(ns.tenant, self.token),
                               "require_lossless": True, "codec": ""})  # loads take whatever codec the edge stores


def engine_fingerprint(model_dir: str | Path, dtype: torch.dtype, chunk_size: int) -> ModelFingerprint:
    """The fingerprint :func:`kdn.models.load_model` gives ``model_dir`` in ``dtype``
    (:func:`kdn.models.dir_fingerprint`: its config file, weights digest, dtype, chunk size)."""
    if dtype not in _DTYPE_NAMES:
        raise InvalidInput(f"KDN stores KV as {sorted(DTYPES)}; the engine runs {dtype}")
    return dir_fingerprint(model_dir, dtype=_DTYPE_NAMES[dtype], chunk_size=chunk_size)


# -- metadata: scheduler -> worker, one per step ------------------------------------------------


@dataclass(slots=True)
class KdnConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class KdnConnectorStats(KVConnectorStats):
    """The connector's counters over one stats interval, in vLLM's stats pipeline: summed over the
    scheduler and every worker, printed in ``vllm serve``'s periodic "KV Transfer metrics" line."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KdnConnectorStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _log_with_vllm() -> None:
    """Send KDN's log lines where vLLM's go (``vllm serve``'s log), at INFO, unless the process
    configured logging for ``kdn`` itself."""
    kdn_log = logging.getLogger("kdn")
    if kdn_log.handlers:
        return
    vllm_log = logging.getLogger("vllm")
    for h in vllm_log.handlers:
        kdn_log.addHandler(h)
    if kdn_log.handlers:
        kdn_log.setLevel(logging.INFO)
        kdn_log.propagate = False


def _cpu_write_kernel(isa: str) -> WriteKernel:
    """vLLM's CPU cache writer for kernel ``isa``, called as its CPU attention backend calls it
    (``vllm/v1/attention/backends/cpu_attn.py``): the paged layout is learned from it."""
    from vllm import _custom_ops as ops

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor) -> None:
        nb, heads, block, _ = cache.shape
        key_cache, value_cache = cache.view(nb, heads, block * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                       torch.arange(key.shape[0], dtype=torch.long), isa)

    return write


def check_engine(vllm_config: "VllmConfig", chunk_size: int) -> None:
    """ValueError, saying what to change, for an engine this connector cannot serve correctly."""
    ktc, block = vllm_config.kv_transfer_config, int(vllm_config.cache_config.block_size)
    if chunk_size % block:
        raise ValueError(
            f"KDN chunk_size {chunk_size} is not a multiple of vLLM's block size {block}: set "
            f"kv_connector_extra_config.chunk_size to a multiple of {block} (or --block-size to a divisor of {chunk_size})"
        )
    if ktc.kv_load_failure_policy != "recompute":
        raise ValueError(
            'the KDN connector needs kv_load_failure_policy "recompute" in --kv-transfer-config, so that a failed '
            f'cache load is recomputed instead of failing the request (got {ktc.kv_load_failure_policy!r})'
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None) and str(cache_dtype) != _DTYPE_NAMES.get(vllm_config.model_config.dtype):
        raise ValueError(f"KDN stores KV in the model dtype; kv_cache_dtype {cache_dtype!r} is not supported")


class KdnConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by a KDN edge (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = KdnConnectorConfig.build(dict(ktc.kv_connector_extra_config or {}), source="kv_connector_extra_config")
        self.block_size = int(vllm_config.cache_config.block_size)
        C = self.config.chunk_size
        check_engine(vllm_config, C)
        mc = vllm_config.model_config
        self.dtype: torch.dtype = mc.dtype
        model_dir = self.config.model_dir or mc.model
        self.fingerprint = engine_fingerprint(model_dir, self.dtype, C)
        hf = mc.hf_config
        bos = getattr(hf, "bos_token_id", None)
        self._bos: int | None = bos if isinstance(bos, int) else None
        self.num_layers = int(hf.num_hidden_layers)
        self.num_kv_heads = int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
        self.head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self._loop = LoopThread(f"kdn-vllm-{role.name.lower()}")
        self._clients = Clients(self._loop, self.config.client_config)
        if self.config.edge:  # an edge address the client refuses is refused here, not at the first request
            self._clients.get(self.config.namespace)
        # scheduler side
        self._reqs: dict[str, ReqState] = {}
        self._lookup_off_until = 0.0
        self._blend = BlendRequests(BlendHost(  # requests that opted in to the store's blend
            self.config, self.fingerprint, self.block_size, states=self._reqs, count=self._count,
            submit=self._loop.submit, new_state=ReqState, namespace_of=request_namespace,
        ))
        # worker side
        self.geometry = EngineGeometry(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.block_size, C)
        self._paged: PagedCache | None = None  # the engine's paged KV, once registered
        self._layer_of: dict[str, int] = {}
        self._jobs: list[LoadJob] = []
        self._failed_blocks: set[int] = set()
        self._saver = Saver(self._clients, self.fingerprint, codec=self.config.put_codec,
                            max_pending=self.config.max_pending_puts, count=self._count)
        self.counters: dict[str, int] = {"lookups": 0, "lookup_errors": 0, "loaded_chunks": 0, "load_failures": 0,
                                         "saved_chunks": 0, "save_errors": 0, "saves_dropped": 0,
                                         "looked_up_tokens": 0, "edge_hit_tokens": 0, "matched_tokens": 0}
        self._reported: dict[str, int] = {}  # counters as last handed to vLLM's stats
        _log_with_vllm()
        LOG.info("KDN connector (%s): edge %s, chunk %d, fingerprint %s…", role.name, self.config.edge, C,
                 bytes(self.fingerprint).hex()[:16])

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def get_kv_connector_stats(self) -> KdnConnectorStats | None:
        """What changed since vLLM last asked (each role reports its own counters)."""
        delta = {k: v - self._reported.get(k, 0) for k, v in self.counters.items()}
        self._reported = dict(self.counters)
        return KdnConnectorStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KdnConnectorStats:
        return KdnConnectorStats(data=dict(data or {}))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss, never a wrong answer

    # -- shared --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        async def close_all() -> None:
            await self._clients.close()
            await self._blend.close()

        try:
            self._loop.submit(close_all()).result(10)
        except Exception as exc:  # shutting down: report, never raise
            LOG.debug("KDN connector shutdown: %s", exc)
        self._loop.close()

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        try:  # a raise here stops vLLM's scheduler: a request KDN cannot serve is vLLM's alone
            request_namespace(request.cache_salt, request.kv_transfer_params, self.config.namespace)  # bad params
            if self._blend.pending(request):
                return None, False  # the store is still blending: vLLM asks again next step
            st = self._state(request)
        except Exception as exc:
            self._reqs.pop(request.request_id, None)  # nothing of it is loaded or saved
            self._count("bad_requests" if isinstance(exc, InvalidInput) else "request_errors")
            LOG.warning("KDN: request %s: %s: %s; vLLM computes it without KDN", request.request_id,
                        type(exc).__name__, exc)
            return 0, False
        if st is None:
            return 0, False
        st.engine_cached = num_computed_tokens
        return max(0, st.end - num_computed_tokens), False

    def _state(self, request: "Request") -> ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is not None or self.config.edge is None:
            return st
        # InvalidInput for a malformed variant, namespace or prompt: the caller counts it
        variant = requested_variant(request.cache_salt, request.kv_transfer_params)
        ns = (variant_namespace(request.kv_transfer_params, self.config.namespace) if variant is not None
              else request_namespace(request.cache_salt, request.kv_transfer_params, self.config.namespace))
        if ns is None:
            return None
        tokens = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        keys = chunk_keys(tokens, fingerprint=self.fingerprint, namespace=ns, chunk_size=self.config.chunk_size,
                          root=variant if variant is not None else ROOT_KEY)
        on_edge = 0
        wanted = keys[: max(0, (len(tokens) - 1) // self.config.chunk_size)]
        if wanted and time.monotonic() >= self._lookup_off_until:
            self._count("lookups")
            self._count("looked_up_tokens", len(wanted) * self.config.chunk_size)
            try:
                client = self._clients.get(ns)
                on_edge = int(self._loop.submit(client.lookup(self.fingerprint, wanted)).result(self.config.lookup_timeout_s + 2))
            except Exception as exc:  # KdnError or a timeout: recompute, and leave the edge alone a while
                self._count("lookup_errors")
                self._lookup_off_until = time.monotonic() + self.config.edge_backoff_s
                LOG.warning("KDN edge %s unusable for Lookup (%s: %s); recomputing", self.config.edge, type(exc).__name__, exc)
        probe = wanted and on_edge == 0 and self._bos is not None and variant is None
        if probe and time.monotonic() >= self._lookup_off_until:
            try:  # none held: were the documents stored under another tokenization? (a warning, a count)
                if self._loop.submit(self._clients.get(ns).tokenization_probe(
                        tokens, self.fingerprint, self.config.chunk_size, self._bos)).result(self.config.lookup_timeout_s + 2):
                    self._count("tokenization_mismatch")
            except Exception as exc:  # advice only
                LOG.debug("KDN tokenization probe failed: %s", exc)
        st = self._reqs[request.request_id] = ReqState(ns, keys, len(tokens), on_edge, saved=on_edge,
                                                        looked_up=len(wanted) if wanted else 0, first_saved=on_edge,
                                                        tokens=tokens, steer=bytes(variant) if variant is not None else b"")
        if variant is not None:
            self._steered(request, st, len(wanted))
        self._match_pieces(st)
        self._count("edge_hit_tokens", st.end)
        self._blend.never_save(request, st)
        return st

    def _steered(self, request: "Request", st: ReqState, wanted: int) -> None:
        """A steered request: never saved; a variant the edge lacks is a plain recompute, said aloud."""
        st.never_save()
        if wanted and st.on_edge == 0:
            self._count("steer_misses")
            LOG.warning("KDN: request %s asked for steered variant %s..., which the edge does not hold for tenant %s; "
                        "vLLM computes the plain prompt", request.request_id, st.steer.hex()[:16], st.ns.tenant)

    def _match_pieces(self, st: ReqState) -> None:
        """``st.end``: the edge's whole chunks (the last prompt token is vLLM's to compute), then the
        tail pieces it holds after them. The end may fall inside a vLLM block: vLLM's scheduler takes
        a load that ends anywhere, and the loader writes a piece's tokens inside their block."""
        C = self.config.chunk_size
        limit = max(0, st.n_prompt - 1)
        chunks = min(st.on_edge, limit // C)
        st.end = chunks * C
        if chunks < st.on_edge or (st.steer and not chunks) or time.monotonic() < self._lookup_off_until:
            return  # a variant's pieces follow its chunks: none without them
        after = st.keys[chunks - 1] if chunks else ROOT_KEY
        pkeys = piece_keys(st.tokens[chunks * C : limit], after=after, fingerprint=self.fingerprint, namespace=st.ns,
                           chunk_size=C)
        if not pkeys:
            return
        try:
            held = int(self._loop.submit(self._clients.get(st.ns).lookup(self.fingerprint, pkeys)).result(
                self.config.lookup_timeout_s + 2))
        except Exception as exc:  # the chunks stand; pieces are a bonus
            LOG.debug("KDN Lookup of tail pieces failed: %s", exc)
            return
        if held:
            st.pieces = pkeys[:held]
            st.end = chunks * C + held * PIECE_TOKENS  # pieces cover tokens before ``limit`` only

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        end = st.end
        st.load = (end - num_external_tokens, end)
        st.loading = num_external_tokens
        self._count("matched_tokens", num_external_tokens)
        st.block_ids = list(blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KdnConnectorMetadata()
        C, bs = self.config.chunk_size, self.block_size
        progress: list[tuple[str, int]] = []
        for r in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(r.req_id)
            if st is not None:
                st.block_ids = list(r.block_ids[0])
                progress.append((r.req_id, r.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new is not None:
                st.block_ids = list(new[0])
            elif new is not None:
                st.block_ids.extend(new[0])
            progress.append((rid, cached.num_computed_tokens[i]))
        for rid, computed in progress:
            st = self._reqs[rid]
            load = load_of(rid, st, C, bs)
            if load is not None:
                meta.loads.append(load)
            if self.config.write_back:
                end = min(computed + scheduler_output.num_scheduled_tokens.get(rid, 0), st.n_prompt)
                meta.saves += saves_of(rid, st, end, chunk_size=C, block_size=bs, fingerprint=self.fingerprint)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks the workers failed to load: their requests' lines say the load failed."""
        bad = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not bad:
            return
        for st in self._reqs.values():
            if st.loading and bad.intersection(st.block_ids):
                st.load_failed = True

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        self._blend.finished(request.request_id)
        if st is not None:
            C = self.config.chunk_size
            LOG.info("KDN request %s (tenant %s): %d prompt tokens; looked up %d, edge held %d, loaded %d, engine "
                     "cache %d; saving %d chunks; source: %s", request.request_id, st.ns.tenant, st.n_prompt,
                     st.looked_up * C, st.on_edge * C, st.loading, st.engine_cached, max(0, st.saved - st.first_saved),
                     st.source(self.config.edge, self.config.blend_origin))
        return False, None  # saves copy their chunks out during the step: the blocks are free now

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        by_index = sorted((extract_layer_index(name), name) for name in kv_caches)
        if [i for i, _ in by_index] != list(range(self.num_layers)):
            raise ValueError(f"KDN expects one KV cache per layer 0..{self.num_layers - 1}; vLLM has {[n for _, n in by_index]}")
        self._layer_of = {name: i for i, name in by_index}
        layers = self._vllm_config.compilation_config.static_forward_context
        first = layers.get(by_index[0][1])
        backend = first.attn_backend.get_name() if first is not None else "CPU_ATTN"
        isa = getattr(first, "isa", None)
        paged = self._paged = PagedCache.of(self.geometry, [kv_caches[name] for _, name in by_index], backend, isa,
                                            self._num_blocks,
                                            _cpu_write_kernel(isa) if backend == "CPU_ATTN" and isa else None)
        kv = kv_caches[by_index[0][1]]
        LOG.info("KDN connector: %d layers of paged KV %s %s, backend %s (isa %s) on %s", len(paged.layers),
                 tuple(kv.shape), kv.dtype, backend, isa, kv.device)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KdnConnectorMetadata) or not meta.loads:
            return
        assert self._paged is not None
        after = None
        if self._paged.device.type == "cuda":
            # the loop thread's copies must follow what this step already queued (new blocks are
            # zeroed before the load starts)
            after = torch.cuda.Event()
            after.record()
        ctx = LoadContext(self.fingerprint, self._paged, self._loop, self.config.fetch_timeout_s,
                          self.config.fetch_concurrency, self._clients.on_loop, self._blend.fetch_stream, self._count)
        job = LoadJob(ctx, meta.loads, after=after)
        self._jobs.append(job)
        job.start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for job in self._jobs:
            job.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # chunks are copied out once the step's forward has written every layer (wait_for_save)

    def wait_for_save(self) -> None:
        failed_reqs: set[str] = set()
        for job in self._jobs:
            job.finish()
            self._failed_blocks |= job.failed_blocks
            failed_reqs |= job.failed_reqs
        self._jobs = []
        meta = self._connector_metadata
        if not isinstance(meta, KdnConnectorMetadata) or not meta.saves or self._paged is None:
            return
        self._saver.save(meta.saves, self._paged, failed_reqs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for background write-backs (tests and benchmarks; vLLM never calls this)."""
        self._saver.flush(timeout)
