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
  at once; every artifact streams through a verifying :class:`kdn.artifact.ArtifactReader`, and
  each section (one layer's K or V of one chunk, ``(H, T, D)``) is scattered into the request's
  paged blocks as soon as its checksum passed; ``wait_for_layer_load(layer)`` returns once every
  chunk has placed that layer (or failed), so layer l's attention runs while layer l+1 is still
  on the wire;
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

Paged layout (vLLM 0.32): every attention layer's cache is allocated as ``[blocks, H, block, 2*D]``,
but what the bytes inside a block mean is the attention backend's business. Artifacts always hold
KDN's layout ``(L, 2, H, T, D)``, so :class:`PagedKV` gives, per backend, K and V as strided views
``[blocks, H, block, D]`` of the engine's own tensor (no copy), and refuses a backend it does not
know at start (a wrong guess would swap numbers between hosts, not fail):

- ``CPU_ATTN`` with the ``vec``/``vec16`` kernels: per block and head, K is stored column-major
  ``[D, block]`` and then V row-major ``[block, D]`` (``csrc/cpu/cpu_attn_vec.hpp``);
- ``FLASH_ATTN``, ``TRITON_ATTN`` (CUDA): K is ``[..., :D]`` and V ``[..., D:2D]`` of each token.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import Field

from kdn.artifact import ArtifactReader, Section, encode_artifact
from kdn.client import AsyncKdnClient, ClientConfig
from kdn.errors import FingerprintMismatch, InvalidInput
from kdn.integrations.vllm_blend import BlendRequests
from kdn.integrations.vllm_steer import check_variant_header, requested_variant, variant_namespace
from kdn.keys import DEFAULT_CHUNK_SIZE, PIECE_TOKENS, ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, chunk_keys, piece_keys
from kdn.models import DTYPES, dir_fingerprint
from kdn.wire.convert import FetchSpec

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
_PREFETCH_HINT = 8


class KdnConnectorConfig(ClientConfig):
    """``kv_connector_extra_config`` of the KDN connector: every :class:`~kdn.client.ClientConfig`
    setting (edge, fallback edges, token, TLS, shared memory, timeouts, write-back; their defaults
    live there), plus what only the connector has. ``tenant``/``salt`` are the namespace of requests
    that name none (no ``cache_salt``, no ``kdn_tenant``). Loads are always lossless."""

    tokens: dict[str, str] = Field(default_factory=dict, description="tenant -> bearer token (other tenants use `token`)")
    chunk_size: int = Field(DEFAULT_CHUNK_SIZE, gt=0, description="tokens per chunk; a multiple of vLLM's block size")
    lookup_timeout_s: float = Field(1.0, gt=0, description="deadline of the scheduler's Lookup (it holds up a scheduler step)")
    model_dir: str | None = Field(None, description="directory that names the weights (default: vLLM's model path)")
    blend_origin: str | None = Field(None, description="host:port of the origin that blends documents for requests "
                                     "that opt in (kdn.integrations.vllm_blend); None: no blending")
    blend: bool = Field(False, description="every request opts in to blending (else kv_transfer_params kdn_blend)")
    blend_timeout_s: float = Field(120.0, gt=0, description="how long a request waits for the store's blend before "
                                   "it is served exact KV")
    blend_poll_s: float = Field(0.02, gt=0, description="longest a scheduler step waits on a pending blend")

    def client_config(self, ns: Namespace) -> ClientConfig:
        """The client settings of one namespace's requests."""
        shared = self.model_dump(include=set(ClientConfig.model_fields))
        return ClientConfig(**{**shared, "tenant": ns.tenant, "salt": ns.salt,
                               "token": self.tokens.get(ns.tenant, self.token), "require_lossless": True})


def engine_fingerprint(model_dir: str | Path, dtype: torch.dtype, chunk_size: int) -> ModelFingerprint:
    """The fingerprint :func:`kdn.models.load_model` gives ``model_dir`` in ``dtype``
    (:func:`kdn.models.dir_fingerprint`: its config file, weights digest, dtype, chunk size)."""
    if dtype not in _DTYPE_NAMES:
        raise InvalidInput(f"KDN stores KV as {sorted(DTYPES)}; the engine runs {dtype}")
    return dir_fingerprint(model_dir, dtype=_DTYPE_NAMES[dtype], chunk_size=chunk_size)


def request_namespace(cache_salt: str | None, params: dict[str, Any] | None, default: Namespace) -> Namespace | None:
    """The namespace of one request, or None when it opted out (``kv_transfer_params: {"kdn": false}``).

    ``kv_transfer_params`` ``{"kdn_tenant": T, "kdn_salt": S}`` wins; else ``cache_salt`` (which
    also separates vLLM's own prefix cache) read as ``tenant`` or ``tenant:salt``, and a salt that
    is no valid tenant name becomes a tenant named by its digest; else ``default``."""
    params = params or {}
    if params.get("kdn") is False:
        return None
    if params.get("kdn_tenant"):
        return Namespace(str(params["kdn_tenant"]), str(params.get("kdn_salt", "")))
    if cache_salt:
        try:
            return Namespace.parse(cache_salt)
        except InvalidInput:
            return Namespace("salt-" + hashlib.blake2b(cache_salt.encode(), digest_size=16).hexdigest())
    return default


# -- metadata: scheduler -> worker, one per step ------------------------------------------------


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


@dataclass(slots=True)
class SaveSpec:
    """Chunk ``index`` (or, with ``lo``/``hi`` set, one tail piece of it) of one request was fully
    computed in this step: copy it out and Put it."""

    req_id: str
    tenant: str
    salt: str
    index: int
    key: bytes
    parent: bytes
    block_ids: list[int]  # the blocks of this chunk (or of the piece's tokens), in token order
    lo: int = 0  # a piece: its tokens' offset inside the first of ``block_ids`` ...
    hi: int = 0  # ... and the end (0: a whole chunk)


@dataclass(slots=True)
class KdnConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class _ReqState:
    ns: Namespace
    keys: list[ChunkKey]
    n_prompt: int
    on_edge: int  # leading chunks the edge said it holds
    saved: int  # chunks below this index need no write-back
    load: tuple[int, int] | None = None  # token range to load, set once blocks are allocated
    block_ids: list[int] = field(default_factory=list)
    looked_up: int = 0  # chunks asked about in the Lookup
    engine_cached: int = 0  # tokens the engine's own prefix cache held when the request arrived
    loading: int = 0  # tokens the connector told vLLM it loads
    load_failed: bool = False  # a block of the load was reported failed (vLLM recomputed from there)
    first_saved: int = 0  # saves scheduled from this chunk on
    tokens: Any = None  # the prompt's token ids (np.int64): tail pieces are keyed by them
    pieces: list[ChunkKey] = field(default_factory=list)  # tail pieces after the ``on_edge`` chunks the edge holds
    end: int = 0  # tokens the edge can give: whole chunks, then pieces, cut to vLLM's block size
    pieces_saved: bool = False
    blend: bool = False  # the keys are a blend variant's, fetched from the blend origin (never saved)
    steer: bytes = b""  # the keys are this steered variant's chain (its root; never saved)


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


def _fetch_stream(client: AsyncKdnClient, fingerprint: ModelFingerprint, key: ChunkKey, next_keys: list[ChunkKey],
                  timeout: float) -> Any:
    """The one call into the client's transport: ``(piece, via)`` of one lossless artifact."""
    assert client.transport is not None
    spec = FetchSpec(key, fingerprint, client.config.namespace, codec="", require_lossless=True)
    return client.transport.fetch(spec, timeout=timeout, next_keys=next_keys)


class _LoopThread:
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


_CPU_ISAS = ("vec", "vec16")  # their reshape_and_cache writes the layout below; amx/neon/... pack differently
_TOKEN_MAJOR_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")


@dataclass(frozen=True, slots=True)
class PagedKV:
    """One layer's paged cache as two views ``[kernel_blocks, H, kernel_block, D]`` (K, V) into
    vLLM's own tensor: indexing them reads and writes the engine's blocks in place."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def of(cls, kv: torch.Tensor, backend: str, isa: str | None, head_dim: int) -> "PagedKV":
        nb, H, kb, c = kv.shape
        D = head_dim
        if backend == "CPU_ATTN":
            if isa not in _CPU_ISAS or c != 2 * D:
                raise ValueError(f"KDN does not know the block layout of vLLM's CPU attention kernel {isa!r} "
                                 f"(supported: {', '.join(_CPU_ISAS)}); refusing rather than mixing up KV")
            region = kv.view(nb, H, 2, kb * D)  # per block and head: K's bytes, then V's
            k = region[:, :, 0].unflatten(-1, (D, kb)).transpose(-1, -2)  # stored [D, kb] -> [kb, D] view
            v = region[:, :, 1].unflatten(-1, (kb, D))
            return cls(k, v)
        if backend in _TOKEN_MAJOR_BACKENDS:
            if c < 2 * D:
                raise ValueError(f"KDN: paged KV of {backend} has {c} values per token, expected 2*{D}")
            return cls(kv[..., :D], kv[..., c // 2 : c // 2 + D])
        raise ValueError(f"KDN does not know the paged KV layout of vLLM's {backend} attention backend "
                         f"(supported: CPU_ATTN, {', '.join(_TOKEN_MAJOR_BACKENDS)})")


class KdnConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by a KDN edge (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = KdnConnectorConfig.build(dict(ktc.kv_connector_extra_config or {}), source="kv_connector_extra_config")
        self.block_size = int(vllm_config.cache_config.block_size)
        C = self.config.chunk_size
        if C % self.block_size:
            raise ValueError(
                f"KDN chunk_size {C} is not a multiple of vLLM's block size {self.block_size}: set "
                f"kv_connector_extra_config.chunk_size to a multiple of {self.block_size} (or --block-size to a divisor of {C})"
            )
        if ktc.kv_load_failure_policy != "recompute":
            raise ValueError(
                'the KDN connector needs kv_load_failure_policy "recompute" in --kv-transfer-config, so that a failed '
                f'cache load is recomputed instead of failing the request (got {ktc.kv_load_failure_policy!r})'
            )
        mc = vllm_config.model_config
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", None) and str(cache_dtype) != _DTYPE_NAMES.get(mc.dtype):
            raise ValueError(f"KDN stores KV in the model dtype; kv_cache_dtype {cache_dtype!r} is not supported")
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
        self._loop = _LoopThread(f"kdn-vllm-{role.name.lower()}")
        self._clients: dict[Namespace, AsyncKdnClient] = {}
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._lookup_off_until = 0.0
        self._blend = BlendRequests(self, _ReqState, request_namespace)  # requests that opted in to the store's blend
        # worker side
        self._kv: list[PagedKV] = []  # per layer: K and V views [kernel_blocks, H, kernel_block, D]
        self._layer_of: dict[str, int] = {}
        self._jobs: list[_LoadJob] = []
        self._failed_blocks: set[int] = set()
        self._puts: set[Any] = set()
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

    def _client(self, ns: Namespace) -> AsyncKdnClient:
        client = self._clients.get(ns)
        if client is None:
            cfg = self.config.client_config(ns)

            async def make() -> AsyncKdnClient:
                return AsyncKdnClient(cfg)

            client = self._clients[ns] = self._loop.submit(make()).result(10)
        return client

    def shutdown(self) -> None:
        async def close_all() -> None:
            for c in self._clients.values():
                await c.close(flush_timeout=2.0)
            await self._blend.close()

        try:
            self._loop.submit(close_all()).result(10)
        except Exception as exc:  # shutting down: report, never raise
            LOG.debug("KDN connector shutdown: %s", exc)
        self._loop.close()

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._blend.pending(request):
            return None, False  # the store is still blending: vLLM asks again next step
        st = self._state(request)
        if st is None:
            return 0, False
        st.engine_cached = num_computed_tokens
        return max(0, st.end - num_computed_tokens), False

    def _state(self, request: "Request") -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is not None or self.config.edge is None:
            return st
        try:
            variant = requested_variant(request.cache_salt, request.kv_transfer_params)
            ns = (variant_namespace(request.kv_transfer_params, self.config.namespace) if variant is not None
                  else request_namespace(request.cache_salt, request.kv_transfer_params, self.config.namespace))
        except InvalidInput as exc:
            LOG.warning("KDN: request %s names an invalid namespace or variant (%s); not cached", request.request_id, exc)
            return None
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
            client = self._client(ns)
            try:
                on_edge = int(self._loop.submit(client.lookup(self.fingerprint, wanted)).result(self.config.lookup_timeout_s + 2))
            except Exception as exc:  # KdnError or a timeout: recompute, and leave the edge alone a while
                self._count("lookup_errors")
                self._lookup_off_until = time.monotonic() + self.config.edge_backoff_s
                LOG.warning("KDN edge %s unusable for Lookup (%s: %s); recomputing", self.config.edge, type(exc).__name__, exc)
        probe = wanted and on_edge == 0 and self._bos is not None and variant is None
        if probe and time.monotonic() >= self._lookup_off_until:
            try:  # none held: were the documents stored under another tokenization? (a warning, a count)
                if self._loop.submit(self._client(ns).tokenization_probe(
                        tokens, self.fingerprint, self.config.chunk_size, self._bos)).result(self.config.lookup_timeout_s + 2):
                    self._count("tokenization_mismatch")
            except Exception as exc:  # advice only
                LOG.debug("KDN tokenization probe failed: %s", exc)
        st = self._reqs[request.request_id] = _ReqState(ns, keys, len(tokens), on_edge, saved=on_edge,
                                                        looked_up=len(wanted) if wanted else 0, first_saved=on_edge,
                                                        tokens=tokens, steer=bytes(variant) if variant is not None else b"")
        if variant is not None:
            self._steered(request, st, len(wanted))
        self._match_pieces(st)
        self._count("edge_hit_tokens", st.end)
        self._blend.never_save(request, st)
        return st

    def _steered(self, request: "Request", st: _ReqState, wanted: int) -> None:
        """A steered request: never saved; a variant the edge lacks is a plain recompute, said aloud."""
        st.saved = st.first_saved = len(st.keys)
        st.pieces_saved = True
        if wanted and st.on_edge == 0:
            self._count("steer_misses")
            LOG.warning("KDN: request %s asked for steered variant %s..., which the edge does not hold for tenant %s; "
                        "vLLM computes the plain prompt", request.request_id, st.steer.hex()[:16], st.ns.tenant)

    def _match_pieces(self, st: _ReqState) -> None:
        """``st.end``: the edge's whole chunks (the last prompt token is vLLM's to compute), then the
        tail pieces it holds after them, the total cut to vLLM's block size."""
        C, bs = self.config.chunk_size, self.block_size
        limit = max(0, st.n_prompt - 1)
        chunks = min(st.on_edge, limit // C)
        st.end = chunks * C
        if chunks < st.on_edge or st.steer or time.monotonic() < self._lookup_off_until:
            return
        after = st.keys[chunks - 1] if chunks else ROOT_KEY
        pkeys = piece_keys(st.tokens[chunks * C : limit], after=after, fingerprint=self.fingerprint, namespace=st.ns,
                           chunk_size=C)
        if not pkeys:
            return
        try:
            held = int(self._loop.submit(self._client(st.ns).lookup(self.fingerprint, pkeys)).result(
                self.config.lookup_timeout_s + 2))
        except Exception as exc:  # the chunks stand; pieces are a bonus
            LOG.debug("KDN Lookup of tail pieces failed: %s", exc)
            return
        end = (chunks * C + held * PIECE_TOKENS) // bs * bs  # whole blocks only
        if end > st.end:
            st.pieces = pkeys[: (end - chunks * C) // PIECE_TOKENS]
            st.end = end

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
            if st.load is not None:
                lo, hi = st.load
                first = lo // C
                chunks = [bytes(k) for k in st.keys[first : min(hi // C, st.on_edge)]]
                pieces = [bytes(k) for k in st.pieces] if hi > st.on_edge * C else []
                meta.loads.append(LoadSpec(rid, st.ns.tenant, st.ns.salt, first, chunks, lo,
                                           st.block_ids[: -(-hi // bs)], pieces, origin=st.blend, steer=st.steer))
                st.load = None
            if not self.config.write_back:
                continue
            end = min(computed + scheduler_output.num_scheduled_tokens.get(rid, 0), st.n_prompt)
            full = min(end // C, len(st.keys))
            for c in range(st.saved, full):
                blocks = st.block_ids[c * C // bs : (c + 1) * C // bs]
                if len(blocks) * bs < C:
                    break
                meta.saves.append(SaveSpec(rid, st.ns.tenant, st.ns.salt, c, bytes(st.keys[c]),
                                           bytes(st.keys[c - 1]) if c else bytes(ROOT_KEY), blocks))
            st.saved = max(st.saved, full)
            if end >= st.n_prompt and not st.pieces_saved:  # the prompt is computed: its tail's pieces
                st.pieces_saved = True
                meta.saves += self._piece_saves(rid, st, full)
        return meta

    def _piece_saves(self, rid: str, st: _ReqState, full: int) -> list[SaveSpec]:
        """Saves of the tail pieces after the prompt's ``full`` chunks that the edge does not hold."""
        C, bs = self.config.chunk_size, self.block_size
        base = full * C
        after = st.keys[full - 1] if full else ROOT_KEY
        pkeys = piece_keys(st.tokens[base : st.n_prompt], after=after, fingerprint=self.fingerprint, namespace=st.ns,
                           chunk_size=C)
        skip = len(st.pieces) if full == st.on_edge else 0  # loaded from the edge: held there already
        saves = []
        for j in range(skip, len(pkeys)):
            lo, hi = base + j * PIECE_TOKENS, base + (j + 1) * PIECE_TOKENS
            blocks = st.block_ids[lo // bs : -(-hi // bs)]
            if len(blocks) * bs < hi - lo // bs * bs:
                break
            saves.append(SaveSpec(rid, st.ns.tenant, st.ns.salt, full, bytes(pkeys[j]),
                                  bytes(pkeys[j - 1] if j else after), blocks, lo - lo // bs * bs, hi - lo // bs * bs))
        return saves

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
            source = ("none" if not st.loading and not st.engine_cached
                      else "engine prefix cache" if not st.loading
                      else (f"blend variant from origin {self.config.blend_origin}" if st.blend
                            else f"steered variant {st.steer.hex()[:16]}... from edge {self.config.edge}" if st.steer
                            else f"edge {self.config.edge}") + (" (load failed: recomputed)" if st.load_failed else ""))
            LOG.info("KDN request %s (tenant %s): %d prompt tokens; looked up %d, edge held %d, loaded %d, engine "
                     "cache %d; saving %d chunks; source: %s", request.request_id, st.ns.tenant, st.n_prompt,
                     st.looked_up * C, st.on_edge * C, st.loading, st.engine_cached, max(0, st.saved - st.first_saved),
                     source)
        return False, None  # saves copy their chunks out during the step: the blocks are free now

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        by_index = sorted((extract_layer_index(name), name) for name in kv_caches)
        if [i for i, _ in by_index] != list(range(self.num_layers)):
            raise ValueError(f"KDN expects one KV cache per layer 0..{self.num_layers - 1}; vLLM has {[n for _, n in by_index]}")
        self._layer_of = {name: i for i, name in by_index}
        kv = kv_caches[by_index[0][1]]
        if kv.dim() != 4 or kv.shape[1] != self.num_kv_heads:
            raise ValueError(f"KDN: unsupported paged KV shape {tuple(kv.shape)} (want [blocks, {self.num_kv_heads}, block, 2*D])")
        if kv.dtype != self.dtype:
            raise ValueError(f"KDN: KV cache dtype {kv.dtype} differs from the model dtype {self.dtype}")
        layers = self._vllm_config.compilation_config.static_forward_context
        first = layers.get(by_index[0][1])
        backend = first.attn_backend.get_name() if first is not None else "CPU_ATTN"
        isa = getattr(first, "isa", None)
        self._kv = [PagedKV.of(kv_caches[name], backend, isa, self.head_dim) for _, name in by_index]
        num_blocks = self._num_blocks or kv.shape[0]
        if kv.shape[0] % num_blocks or self.block_size % kv.shape[2]:
            raise ValueError(f"KDN: {kv.shape[0]} kernel blocks of {kv.shape[2]} tokens do not tile {num_blocks} blocks of {self.block_size}")
        self._ratio = kv.shape[0] // num_blocks  # kernel blocks per scheduler block
        self._kernel_block = int(kv.shape[2])
        self._device = kv.device
        LOG.info("KDN connector: %d layers of paged KV %s %s, backend %s (isa %s) on %s", len(self._kv), tuple(kv.shape),
                 kv.dtype, backend, isa, kv.device)

    def _kernel_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Kernel block ids, in token order, of scheduler blocks ``block_ids``."""
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        if self._ratio > 1:
            ids = (ids[:, None] * self._ratio + torch.arange(self._ratio)).reshape(-1)
        return ids.to(self._device)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KdnConnectorMetadata) or not meta.loads:
            return
        job = _LoadJob(self, meta.loads)
        if self._device.type == "cuda":
            # the loop thread's copies must follow what this step already queued (new blocks are
            # zeroed before the load starts)
            job.after = torch.cuda.Event()
            job.after.record()
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
        if not isinstance(meta, KdnConnectorMetadata) or not meta.saves or not self._kv:
            return
        for spec in meta.saves:
            if spec.req_id in failed_reqs:
                self._count("saves_dropped")
                continue
            if len(self._puts) >= self.config.max_pending_puts:
                self._count("saves_dropped")
                continue
            kv = self._gather(spec.block_ids, spec.lo, spec.hi)  # (L, 2, H, T, D) on the CPU
            fut = self._loop.submit(self._put(spec, kv))
            self._puts.add(fut)
            fut.add_done_callback(self._puts.discard)

    def _gather(self, block_ids: list[int], lo: int = 0, hi: int = 0) -> torch.Tensor:
        """One chunk out of the paged blocks, or (``hi`` > 0) the tokens ``lo .. hi-1`` counted from
        the first of ``block_ids``: ``(L, 2, H, T, D)``, a CPU copy."""
        idx = self._kernel_blocks(block_ids)
        D = self.head_dim
        T = hi - lo if hi else self.config.chunk_size
        out = torch.empty((self.num_layers, 2, self.num_kv_heads, T, D), dtype=self.dtype)
        for l, paged in enumerate(self._kv):
            for s, view in ((0, paged.k), (1, paged.v)):
                # (nkb, H, kb, D) -> (H, nkb, kb, D) -> (H, nkb*kb, D), then the span's tokens
                run = view[idx].permute(1, 0, 2, 3).reshape(self.num_kv_heads, -1, D)
                out[l, s].copy_(run[:, lo : lo + T] if hi else run)
        return out

    async def _put(self, spec: SaveSpec, kv: torch.Tensor) -> None:
        client = self._clients_for(spec.tenant, spec.salt)
        try:
            data = await asyncio.to_thread(
                encode_artifact, kv, key=ChunkKey(spec.key), parent_key=ChunkKey(spec.parent),
                fingerprint=self.fingerprint, codec=self.config.put_codec, chunk_index=spec.index,
            )
            if await client.put(self.fingerprint, ChunkKey(spec.key), data):
                self._count("saved_chunks")
        except Exception as exc:  # a write-back is an optimisation, never part of the answer
            self._count("save_errors")
            LOG.debug("KDN write-back of chunk %d failed: %s", spec.index, exc)

    def _clients_for(self, tenant: str, salt: str) -> AsyncKdnClient:
        ns = Namespace(tenant, salt)
        client = self._clients.get(ns)
        if client is None:  # called on the loop thread: build directly
            client = self._clients[ns] = AsyncKdnClient(self.config.client_config(ns))
        return client

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for background write-backs (tests and benchmarks; vLLM never calls this)."""
        deadline = time.monotonic() + timeout
        for fut in list(self._puts):
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
            except Exception:
                pass


class _LoadJob:
    """The loads of one step: every chunk's sections scattered into paged blocks as they verify.

    ``progress[r][i]`` counts the layers of chunk i of request r that are in place; a chunk that
    failed or finished counts as all layers (a failed one's blocks are reported, never trusted)."""

    def __init__(self, conn: KdnConnector, specs: list[LoadSpec]) -> None:
        self.conn = conn
        self.specs = specs
        L = conn.num_layers
        self.progress = [[0] * len(s.items) for s in specs]
        self.first_failed = [len(s.items) for s in specs]
        self.cond = threading.Condition()
        self.future: Any = None
        self.failed_blocks: set[int] = set()
        self.failed_reqs: set[str] = set()
        self._L = L
        self.after: Any = None  # CUDA: an event the copies wait for
        self._events: dict[int, list[Any]] = {}  # CUDA: per layer, events after its copies
        self._timeout = conn.config.fetch_timeout_s * (1 + max(len(s.items) for s in specs) // conn.config.fetch_concurrency) + 5
        self._deadline = 0.0

    def start(self) -> None:
        self._deadline = time.monotonic() + self._timeout
        self.future = self.conn._loop.submit(self._run())

    async def _run(self) -> None:
        sem = asyncio.Semaphore(self.conn.config.fetch_concurrency)

        async def one(r: int, i: int) -> None:
            async with sem:
                if i >= self.first_failed[r]:
                    return self._done(r, i)  # an earlier chunk failed: this one will be recomputed anyway
                try:
                    await asyncio.wait_for(self._load_chunk(r, i), self.conn.config.fetch_timeout_s + 0.5)
                    self.conn._count("loaded_chunks")
                except Exception as exc:  # KdnError, a deadline, a geometry refusal: recompute from here
                    self._fail(r, i, exc)
                finally:
                    self._done(r, i)

        await asyncio.gather(*(one(r, i) for r, s in enumerate(self.specs) for i in range(len(s.items))))

    async def _load_chunk(self, r: int, i: int) -> None:
        spec = self.specs[r]
        conn = self.conn
        client = conn._clients_for(spec.tenant, spec.salt)
        items = spec.items
        key = ChunkKey(items[i])
        lo, hi = spec.span(i, conn.config.chunk_size)
        fits = False

        def place(section: Section) -> None:
            nonlocal fits
            if not fits:  # before the first byte reaches a block: the whole geometry, not one section's
                assert reader.header is not None
                self._check_geometry(reader.header, hi - lo)
                if spec.steer:
                    check_variant_header(reader.header, spec.steer)
                fits = True
            # a verified section, borrowed from the received bytes (raw codec: a view, no copy):
            # the scatter into the engine's blocks is the one copy out of the receive buffer
            self._place(spec, lo, hi, section)
            if section.kind == "v":
                with self.cond:
                    self.progress[r][i] = section.layer + 1
                    self.cond.notify_all()

        reader = ArtifactReader(expect_fingerprint=conn.fingerprint, expect_key=key, require_lossless=True, sink=place,
                                expect_steer=None if spec.steer else "")  # plain keys: a steered artifact is refused
        stream = conn._blend.fetch_stream(spec.tenant, spec.salt, key) if spec.origin else _fetch_stream(
            client, conn.fingerprint, key, [ChunkKey(k) for k in items[i + 1 : i + 1 + _PREFETCH_HINT]],
            conn.config.fetch_timeout_s)
        async with aclosing(stream):
            async for piece, _via in stream:
                reader.feed(piece)
        reader.finish()
        with self.cond:
            placed = self.progress[r][i]
        if placed != conn.num_layers:  # every layer of the engine's came, or the chunk is not loaded
            raise FingerprintMismatch(f"artifact placed {placed} of the engine's {conn.num_layers} layers")

    def _check_geometry(self, h: Any, tokens: int) -> None:
        """``FingerprintMismatch`` unless artifact header ``h`` holds exactly what the engine's
        blocks of one chunk (or piece: ``tokens``) hold: every layer, its KV heads, the tokens, its
        head dim and dtype (a shorter artifact would leave the other layers with another request's KV)."""
        from kdn.artifact import PB_TO_DTYPE

        conn = self.conn
        got = (h.num_layers, h.num_kv_heads, h.token_count, h.head_dim, PB_TO_DTYPE.get(h.dtype))
        want = (conn.num_layers, conn.num_kv_heads, tokens, conn.head_dim, conn.dtype)
        if got != want:
            raise FingerprintMismatch(f"artifact holds (layers, KV heads, tokens, head dim, dtype) {got}, "
                                      f"this engine loads {want}")

    def _place(self, spec: LoadSpec, lo: int, hi: int, section: Section) -> None:
        """Scatter one verified section ``(H, T, D)`` of request tokens ``lo .. hi-1`` (a chunk or a
        tail piece) into its blocks: whole blocks at once, a piece's tokens inside a block one by one."""
        conn = self.conn
        bs, D = conn.block_size, conn.head_dim
        x = section.tensor
        if tuple(x.shape) != (conn.num_kv_heads, hi - lo, D) or x.dtype != conn.dtype:
            raise FingerprintMismatch(f"artifact section {tuple(x.shape)} {x.dtype} is not this engine's "
                                      f"({conn.num_kv_heads}, {hi - lo}, {D}) {conn.dtype}")
        start = max(lo, spec.write_from)  # tokens before write_from: the engine already holds them
        if start >= hi:
            return
        paged = conn._kv[section.layer]
        dst = paged.k if section.kind == "k" else paged.v
        idx: Any
        if start % bs == 0 and hi % bs == 0:
            idx = conn._kernel_blocks(spec.block_ids[start // bs : hi // bs])
            # (H, T, D) -> (H, nkb, kb, D) -> (nkb, H, kb, D): the views' [block, H, token, D] order
            src = x[:, start - lo:].reshape(conn.num_kv_heads, -1, conn._kernel_block, D).permute(1, 0, 2, 3)
        else:  # inside blocks: each token's kernel block and offset
            pos = torch.arange(start, hi)
            kb = conn._kernel_block
            blk = torch.as_tensor(spec.block_ids, dtype=torch.long)[pos // bs] * conn._ratio + (pos % bs) // kb
            idx = (blk.to(conn._device), slice(None), (pos % kb).to(conn._device))
            src = x[:, start - lo:].permute(1, 0, 2)  # (H, T, D) -> (T, H, D): what dst[block, :, offset] takes
        if conn._device.type != "cuda":
            dst[idx] = src
            return
        # CUDA (untested here): copy on this thread's stream after the step's earlier work, and
        # let wait_for_layer_load make the compute stream wait for it
        stream = torch.cuda.current_stream(conn._device)
        if self.after is not None:
            stream.wait_event(self.after)
        dst[idx] = src.to(conn._device, non_blocking=False)
        ev = torch.cuda.Event()
        ev.record(stream)
        with self.cond:
            self._events.setdefault(section.layer, []).append(ev)

    def _fail(self, r: int, i: int, exc: BaseException) -> None:
        spec = self.specs[r]
        self.conn._count("load_failures")
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
        self.conn._loop.loop.call_soon_threadsafe(self.future.cancel)
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
        C, bs = self.conn.config.chunk_size, self.conn.block_size
        for r, spec in enumerate(self.specs):
            i = self.first_failed[r]
            if i < len(spec.items):
                start = max(spec.write_from, spec.span(i, C)[0])
                self.failed_blocks.update(spec.block_ids[start // bs :])
                self.failed_reqs.add(spec.req_id)
