"""KV tensors: the layout KDN stores, and conversion to and from a transformers ``DynamicCache``.

A *chunk's KV* is one tensor ``(L, 2, H, T, D)``: layers, K/V, KV heads, tokens, head dim, for a
single sequence (batch 1). A ``DynamicCache`` holds per layer ``keys``/``values`` of shape
``(B, H, N, D)``. Chunks of a chain concatenate along ``T`` into the cache's ``N``.

``KV_LAYOUT_VERSION`` is folded into the model fingerprint: change the layout, change every key.
"""

from __future__ import annotations

import functools
import inspect
import math
import mmap
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from kdn.errors import InvalidInput

KV_LAYOUT_VERSION = 1


PREFAULT_MIN_BYTES = 32 << 20  # glibc maps every allocation above 32 MiB anew; below, pages may be reused


def empty_prefaulted(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)``, with its pages mapped up front when it is large.

    A prefix KV of 100 MB allocated by ``torch.empty`` is a fresh anonymous mapping (glibc maps
    every allocation above 32 MiB anew), and writing it takes one page fault per 4 KiB: 25,000
    traps that cost more than the bytes' copy (measured: decode of 16 chunks into it 25% faster
    with the pages mapped first, on 2 busy cores). ``MAP_POPULATE`` maps them in one system call.
    The tensor keeps its mapping alive; it is unmapped when the last view of it goes."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < PREFAULT_MIN_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    return _tensor_in(_new_region(nbytes), nbytes, shape, dtype)


def _new_region(nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, nbytes, flags=flags)


def _tensor_in(region: mmap.mmap, nbytes: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    # torch.frombuffer holds a reference to the region for as long as any tensor, view or storage
    # made from it lives: the region cannot be unmapped (or, in a pool, handed out) under them
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype).view(tuple(shape))


class DestinationPool:
    """Prefix KV destinations that are reused once nothing refers to them.

    :func:`empty_prefaulted` pays for its pages on every request: ~30 ms for the 101 MB prefix of a
    4096-token context here, more than fetching those bytes over shared memory. This pool keeps
    the mappings of earlier requests and hands one out again once every tensor, view and storage
    made from it is gone — which CPython's reference count tells exactly, because
    ``torch.frombuffer`` holds a reference to the mapping for as long as any of them lives. A
    mapping in use is therefore never handed out twice. Free mappings beyond ``max_idle_bytes``
    are unmapped, oldest first. Thread-safe."""

    def __init__(self, max_idle_bytes: int = 1 << 30) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._regions: list[mmap.mmap] = []  # oldest first; in use or free
        self._lock = threading.Lock()
        self.reused = 0
        self.mapped = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised ``shape`` tensor of ``dtype`` (contents: whatever an earlier request left)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < PREFAULT_MIN_BYTES or not self.max_idle_bytes:
            return empty_prefaulted(shape, dtype)
        with self._lock:
            region = self._take(nbytes)
        return _tensor_in(region, nbytes, shape, dtype)

    def _free(self, i: int) -> bool:
        # references: the list's slot and getrefcount's argument; a tensor made from it adds one
        return sys.getrefcount(self._regions[i]) <= 2

    def _take(self, nbytes: int) -> mmap.mmap:
        pick = -1
        for i in range(len(self._regions)):
            size = len(self._regions[i])
            if nbytes <= size <= 2 * nbytes and self._free(i) and (pick < 0 or size < len(self._regions[pick])):
                pick = i
        if pick >= 0:
            region = self._regions.pop(pick)
            self.reused += 1
        else:
            region = _new_region(nbytes)
            self.mapped += 1
        self._regions.append(region)  # the newest: pruned last
        idle = sum(len(self._regions[i]) for i in range(len(self._regions) - 1) if self._free(i))
        i = 0
        while idle > self.max_idle_bytes and i < len(self._regions) - 1:
            if self._free(i):
                idle -= len(self._regions[i])
                self._regions.pop(i).close()
            else:
                i += 1
        return region

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(self._regions[i]) for i in range(len(self._regions)) if self._free(i))


@dataclass(frozen=True, slots=True)
class KVShape:
    """Per-token KV geometry of a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype) -> "KVShape":
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def chunk_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)


def layers_to_chunk(layers: Iterable[Any], start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Tokens ``start .. stop-1`` (default: every token) of one sequence's per-layer KV as one
    contiguous ``(L, 2, H, stop-start, D)`` copy (a chunk's, a segment's or a tail piece's KV,
    independent of the source). ``layers``: a cache's layers (each with ``keys``/``values``,
    ``(1, H, N, D)``) or ``(keys, values)`` pairs of that shape."""
    pairs = ((layer.keys, layer.values) if hasattr(layer, "keys") else layer for layer in layers)
    # per layer: keys/values (1, H, N, D) -> (H, T, D); stacked -> (L, 2, H, T, D)
    return torch.stack([torch.stack((k[0, :, start:stop], v[0, :, start:stop])) for k, v in pairs])


def split_cache(cache: Any, chunk_size: int, *, start: int = 0, count: int | None = None) -> list[torch.Tensor]:
    """Cut full chunks out of a single-sequence ``DynamicCache``.

    Returns chunks ``start .. start+count-1`` (default: every full chunk from ``start``), each a
    contiguous ``(L, 2, H, chunk_size, D)`` copy, independent of the cache's storage.
    """
    layers = list(cache.layers)
    if not layers:
        return []
    n_tokens = layers[0].keys.shape[2]
    full = n_tokens // chunk_size
    stop = full if count is None else min(full, start + count)
    return [layers_to_chunk(layers, c * chunk_size, (c + 1) * chunk_size) for c in range(start, stop)]


def build_cache(chunks: Sequence[torch.Tensor], config: Any) -> Any:
    """Rebuild a ``DynamicCache`` holding the given chunks of one chain, in order."""
    from transformers import DynamicCache

    if not chunks:
        return DynamicCache(config=config)
    shape0 = chunks[0].shape
    for c in chunks:
        if c.dim() != 5 or c.shape[:3] != shape0[:3] or c.shape[4] != shape0[4] or c.dtype != chunks[0].dtype:
            raise InvalidInput(f"chunk KV shapes disagree: {tuple(c.shape)} vs {tuple(shape0)}")
    kv = chunks[0] if len(chunks) == 1 else torch.cat(list(chunks), dim=3)  # (L, 2, H, N, D)
    return cache_from_layers([(kv[l, 0].unsqueeze(0), kv[l, 1].unsqueeze(0)) for l in range(kv.shape[0])], config)


def cache_from_layers(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], config: Any) -> Any:
    """A ``DynamicCache`` from per-layer ``(keys, values)``, each ``(1, H, N, D)``.

    A full-attention layer holds the given tensors themselves, not a copy (transformers' own
    constructor appends them to an empty tensor: a copy of every layer, 190 MB for 4k tokens of
    smollm2-135m fp32). A forward over the cache appends by concatenation, so it never writes
    into them; a sliding-window layer, which crops as it appends, gets them through ``update``."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    if len(cache.layers) != len(layers):  # no layers (empty) or a config that does not match: as given
        return DynamicCache(list(layers), config=config)
    for layer, (k, v) in zip(cache.layers, layers):
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        else:
            layer.update(k, v)
    return cache


def cache_in_room(rooms: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int, config: Any) -> Any:
    """A ``DynamicCache`` over the first ``length`` positions of per-layer ``(keys, values)``
    rooms, each ``(1, H, R, D)``, whose later tokens are written into the rooms in place.

    transformers' own cache appends by concatenation: every decoded token copies every layer's
    whole KV (190 MB at 4k tokens of smollm2-135m fp32), more than the step's compute. Here a
    step writes its K/V at positions ``length ..`` of the rooms and the layer holds views of them;
    the tensors a layer held before are views that no later step writes into (positions below
    its length never change), so they may be read (encoded, written back) while decoding goes on.
    Past the end of a room a layer appends by concatenation, as transformers' does; a config
    with other than full-attention layers gets :func:`cache_from_layers` of the first ``length``."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    if len(cache.layers) != len(rooms) or not all(type(layer) is DynamicLayer for layer in cache.layers):
        return cache_from_layers([(k[:, :, :length], v[:, :, :length]) for k, v in rooms], config)
    room_layer = _room_layer_class()
    cache.layers = [room_layer(k, v, length) for k, v in rooms]
    return cache


@functools.cache
def _room_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class RoomLayer(DynamicLayer):
        """A full-attention cache layer that appends into preallocated rooms (:func:`cache_in_room`)."""

        def __init__(self, room_k: torch.Tensor, room_v: torch.Tensor, length: int) -> None:
            super().__init__()
            self.lazy_initialization(room_k, room_v)
            self._room: tuple[torch.Tensor, torch.Tensor] | None = (room_k, room_v)
            self._end = length  # positions below it may be held by a reader: never written again
            self.keys, self.values = room_k[:, :, :length], room_v[:, :, :length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            room = self._room
            n, s = self.keys.shape[-2], key_states.shape[-2]
            if (room is not None and n == self._end and n + s <= room[0].shape[-2]
                    and self.keys.data_ptr() == room[0].data_ptr() and self.values.data_ptr() == room[1].data_ptr()):
                room[0][:, :, n : n + s] = key_states
                room[1][:, :, n : n + s] = value_states
                self._end = n + s
                self.keys, self.values = room[0][:, :, : n + s], room[1][:, :, : n + s]
                return self.keys, self.values
            self._room = None  # full, or cropped or reordered: concatenation from here on
            return super().update(key_states, value_states, *args, **kwargs)

    return RoomLayer


def cache_length(cache: Any) -> int:
    """Tokens held by a cache; 0 for an empty one (whose layers have not allocated keys yet)."""
    layers = getattr(cache, "layers", None)
    keys = getattr(layers[0], "keys", None) if layers else None
    return int(keys.shape[2]) if keys is not None else 0


@functools.cache
def _cache_argument(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def forward(module: Any, /, *args: Any, cache: Any = None, **kwargs: Any) -> Any:
    """Call a transformers model or decoder layer with ``cache`` as its KV cache.

    transformers 5.20 renamed the argument from ``past_key_values`` to ``cache`` (vLLM 0.32 pins
    an earlier release); the other name is swallowed by ``**kwargs`` and the cache silently
    ignored, so every KDN call that passes a cache goes through here."""
    return module(*args, **{_cache_argument(type(module)): cache}, **kwargs)


def output_cache(out: Any) -> Any:
    """The KV cache of a model's output: ``cache`` from transformers 5.20, ``past_key_values`` before."""
    return out.cache if hasattr(out, "cache") else out.past_key_values
