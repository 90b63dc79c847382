"""The engine's paged KV as KDN reads and writes it: slot mapping, block gather and scatter.

Paged layout (vLLM 0.32): every attention layer's cache is allocated as ``[blocks, H, block, 2*D]``,
but what the bytes inside a block mean is the attention backend's business. Artifacts always hold
KDN's layout ``(L, 2, H, T, D)``, so :class:`PagedKV` gives, per backend, K and V as strided views
``[blocks, H, block, D]`` of the engine's own tensor (no copy), and refuses a backend it does not
know at start (a wrong guess would swap numbers between hosts, not fail):

- ``CPU_ATTN`` with the ``vec``/``vec16`` kernels: per block and head, K is stored column-major
  ``[D, block]`` and then V row-major ``[block, D]`` (``csrc/cpu/cpu_attn_vec.hpp``);
- ``FLASH_ATTN``, ``TRITON_ATTN`` (CUDA): K is ``[..., :D]`` and V ``[..., D:2D]`` of each token.

:class:`PagedCache` is every layer's views plus the slot mapping: a scheduler block may hold
several kernel blocks (``ratio``), and a token's slot is its kernel block and offset. Nothing
here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kdn.artifact import PB_TO_DTYPE, Section
from kdn.errors import FingerprintMismatch

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
                                 f"(supported: {', '.join(_CPU_ISAS)}); refusing rather than mixing up KV. On a CPU "
                                 "with AMX vLLM runs bfloat16 on 'amx': serve with --dtype float32 (kernel 'vec')")
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


@dataclass(frozen=True, slots=True)
class EngineGeometry:
    """What one chunk's KV is in this engine: layers, KV heads, head dim, dtype, and the
    scheduler's block and KDN's chunk sizes in tokens."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    chunk_size: int

    def check_header(self, h: Any, tokens: int) -> None:
        """``FingerprintMismatch`` unless artifact header ``h`` holds exactly what the engine's
        blocks of one chunk (or piece: ``tokens``) hold: every layer, its KV heads, the tokens, its
        head dim and dtype (a shorter artifact would leave the other layers with another request's KV)."""
        got = (h.num_layers, h.num_kv_heads, h.token_count, h.head_dim, PB_TO_DTYPE.get(h.dtype))
        want = (self.num_layers, self.num_kv_heads, tokens, self.head_dim, self.dtype)
        if got != want:
            raise FingerprintMismatch(f"artifact holds (layers, KV heads, tokens, head dim, dtype) {got}, "
                                      f"this engine loads {want}")


class PagedCache:
    """Every layer's :class:`PagedKV` (in layer order) and how scheduler blocks map to kernel blocks."""

    def __init__(self, geometry: EngineGeometry, layers: Sequence[PagedKV], *, ratio: int, kernel_block: int,
                 device: torch.device) -> None:
        self.geometry = geometry
        self.layers = list(layers)
        self.ratio = ratio  # kernel blocks per scheduler block
        self.kernel_block = kernel_block
        self.device = device

    @classmethod
    def of(cls, geometry: EngineGeometry, caches: Sequence[torch.Tensor], backend: str, isa: str | None,
           num_blocks: int = 0) -> "PagedCache":
        """The views of vLLM's per-layer caches (layer 0 first), checked against ``geometry``;
        ``num_blocks``: the scheduler's block count (0: one kernel block per block)."""
        g = geometry
        kv = caches[0]
        if kv.dim() != 4 or kv.shape[1] != g.num_kv_heads:
            raise ValueError(f"KDN: unsupported paged KV shape {tuple(kv.shape)} (want [blocks, {g.num_kv_heads}, block, 2*D])")
        if kv.dtype != g.dtype:
            raise ValueError(f"KDN: KV cache dtype {kv.dtype} differs from the model dtype {g.dtype}")
        layers = [PagedKV.of(c, backend, isa, g.head_dim) for c in caches]
        num_blocks = num_blocks or kv.shape[0]
        if kv.shape[0] % num_blocks or g.block_size % kv.shape[2]:
            raise ValueError(f"KDN: {kv.shape[0]} kernel blocks of {kv.shape[2]} tokens do not tile {num_blocks} blocks of {g.block_size}")
        return cls(g, layers, ratio=kv.shape[0] // num_blocks, kernel_block=int(kv.shape[2]), device=kv.device)

    def kernel_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Kernel block ids, in token order, of scheduler blocks ``block_ids``."""
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        if self.ratio > 1:
            ids = (ids[:, None] * self.ratio + torch.arange(self.ratio)).reshape(-1)
        return ids.to(self.device)

    def gather(self, block_ids: list[int], lo: int = 0, hi: int = 0) -> torch.Tensor:
        """One chunk out of the paged blocks, or (``hi`` > 0) the tokens ``lo .. hi-1`` counted from
        the first of ``block_ids``: ``(L, 2, H, T, D)``, a CPU copy."""
        g = self.geometry
        idx = self.kernel_blocks(block_ids)
        D = g.head_dim
        T = hi - lo if hi else g.chunk_size
        out = torch.empty((g.num_layers, 2, g.num_kv_heads, T, D), dtype=g.dtype)
        for l, paged in enumerate(self.layers):
            for s, view in ((0, paged.k), (1, paged.v)):
                # (nkb, H, kb, D) -> (H, nkb, kb, D) -> (H, nkb*kb, D), then the span's tokens
                run = view[idx].permute(1, 0, 2, 3).reshape(g.num_kv_heads, -1, D)
                out[l, s].copy_(run[:, lo : lo + T] if hi else run)
        return out

    def place(self, block_ids: list[int], write_from: int, lo: int, hi: int, section: Section, after: Any = None) -> Any:
        """Scatter one verified section into its blocks: :meth:`placer`'s for one section."""
        return self.placer(block_ids, write_from, lo, hi, after)(section)

    def placer(self, block_ids: list[int], write_from: int, lo: int, hi: int,
               after: Any = None) -> Callable[[Section], Any]:
        """What scatters each verified section ``(H, T, D)`` of request tokens ``lo .. hi-1`` (a
        chunk or a tail piece) into its blocks (``block_ids``: the request's), skipping tokens
        before ``write_from`` (the engine holds them): whole blocks at once, a piece's tokens inside
        a block one by one. Where the tokens go is worked out once, here, not per section (an
        item has 2 sections per layer). A section of another shape or dtype raises
        ``FingerprintMismatch``. On CUDA each copy waits for event ``after`` and the event recorded
        after it is returned (else None)."""
        g = self.geometry
        bs, D, H = g.block_size, g.head_dim, g.num_kv_heads
        want = (H, hi - lo, D)
        start = max(lo, write_from)  # tokens before write_from: the engine already holds them
        idx: Any = None
        if start >= hi:
            pass
        elif start % bs == 0 and hi % bs == 0:
            blocks = block_ids[start // bs : hi // bs]
            if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
                # consecutive blocks (the rule for a fresh request): one strided copy, about half
                # the time of an indexed write (the CPU kernel's K is stored transposed)
                idx = slice(blocks[0] * self.ratio, (blocks[-1] + 1) * self.ratio)
            else:
                idx = self.kernel_blocks(blocks)
        else:  # inside blocks: each token's kernel block and offset
            pos = torch.arange(start, hi)
            kb = self.kernel_block
            blk = torch.as_tensor(block_ids, dtype=torch.long)[pos // bs] * self.ratio + (pos % bs) // kb
            idx = (blk.to(self.device), slice(None), (pos % kb).to(self.device))
        whole_blocks = not isinstance(idx, tuple)
        skip, kb, layers, cuda = start - lo, self.kernel_block, self.layers, self.device.type == "cuda"

        def put(section: Section) -> Any:
            x = section.tensor
            if x.shape != want or x.dtype != g.dtype:
                raise FingerprintMismatch(f"artifact section {tuple(x.shape)} {x.dtype} is not this engine's "
                                          f"{want} {g.dtype}")
            if idx is None:
                return None
            paged = layers[section.layer]
            dst = paged.k if section.kind == "k" else paged.v
            if whole_blocks:
                # (H, T, D) -> (H, nkb, kb, D) -> (nkb, H, kb, D): the views' [block, H, token, D] order
                src = x[:, skip:].reshape(H, -1, kb, D).permute(1, 0, 2, 3)
            else:
                src = x[:, skip:].permute(1, 0, 2)  # (H, T, D) -> (T, H, D): what dst[block, :, offset] takes
            if not cuda:
                dst[idx] = src
                return None
            # CUDA (untested here): copy on this thread's stream after the step's earlier work; the
            # returned event lets wait_for_layer_load make the compute stream wait for it
            stream = torch.cuda.current_stream(self.device)
            if after is not None:
                stream.wait_event(after)
            dst[idx] = src.to(self.device, non_blocking=False)
            ev = torch.cuda.Event()
            ev.record(stream)
            return ev

        return put
