"""The engine's paged KV as KDN reads and writes it: slot mapping, block gather and scatter.

Paged layout (vLLM 0.32): every attention layer's cache is allocated as ``[blocks, H, block, 2*D]``,
but what the bytes inside a block mean is the attention backend's business. Artifacts always hold
KDN's layout ``(L, 2, H, T, D)``, so :class:`PagedKV` gives, per backend, K and V as strided views
``[blocks, H, block, D]`` of the engine's own tensor (no copy), and refuses a backend it does not
know at start (a wrong guess would swap numbers between hosts, not fail):

- ``CPU_ATTN`` with the ``vec``/``vec16`` kernels: per block and head, K is stored column-major
  ``[D, block]`` and then V row-major ``[block, D]`` (``csrc/cpu/cpu_attn_vec.hpp``);
- ``CPU_ATTN`` with any other kernel (``amx``, whose bfloat16 K and V are packed for its tiles;
  ``neon``, ...): the layout is learned at start from the engine's own write kernel
  (:func:`learn_layout`: every value's place in a block, found by writing coded values), and used
  only if that kernel places each value exactly once, in the same places in every block
  (:class:`PermutedView` reads and writes through those places);
- ``FLASH_ATTN``, ``TRITON_ATTN`` (CUDA): K is ``[..., :D]`` and V ``[..., D:2D]`` of each token.

:class:`PagedCache` is every layer's views plus the slot mapping: a scheduler block may hold
several kernel blocks (``ratio``), and a token's slot is its kernel block and offset. Nothing
here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kdn.artifact import PB_TO_DTYPE, Section
from kdn.codecs import same_width_array
from kdn.errors import FingerprintMismatch

_CPU_ISAS = ("vec", "vec16")  # their layout is mapped below as strided views; any other is learned
_TOKEN_MAJOR_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")


# writes K and V ``(T, H, D)`` of tokens 0 .. T-1 into slots 0 .. T-1 of a cache shaped as vLLM
# allocates it, ``[blocks, H, block, 2*D]``, the way the engine's attention kernel does
WriteKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
_CODE_BASE = 128  # one digit per probe: 1..128 is exact in every float dtype a cache uses


def learn_layout(write: WriteKernel, heads: int, block: int, head_dim: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the engine's write kernel puts each value of a block: ``(pos_k, pos_v)``, each
    ``(block, H, D)``, the offset of K/V of (token, head, dim) in the block's flat memory.

    Two blocks are written with coded values (a value's index in base 128, one digit per pass, so
    every value written is a small integer any dtype holds exactly) and read back. Refused
    (ValueError) unless every value lands exactly once, nothing lands twice, and block 1 holds
    its tokens where block 0 holds its own (a layout that depends on the block would need more
    than one map)."""
    H, kb, D = heads, block, head_dim
    n = kb * H * D  # values of one kind in one block
    codes = torch.arange(4 * n)  # K of blocks 0 and 1 (tokens 0 .. 2kb-1), then V of both
    found = torch.zeros(2 * 2 * n, dtype=torch.long)  # per block, its flat memory of K and V
    written = torch.ones(2 * 2 * n, dtype=torch.bool)
    scale = 1
    while scale < 4 * n:
        digit = (codes // scale) % _CODE_BASE + 1
        key = digit[: 2 * n].view(2 * kb, H, D).to(dtype)
        value = digit[2 * n :].view(2 * kb, H, D).to(dtype)
        cache = torch.zeros(2, H, kb, 2 * D, dtype=dtype)
        write(key, value, cache)
        got = cache.reshape(-1).to(torch.float32).round().long()
        written &= got > 0
        found += (got.clamp(min=1) - 1) * scale
        scale *= _CODE_BASE
    what = "KDN could not learn the block layout of vLLM's attention kernel: "
    if int(written.sum()) != 4 * n:
        raise ValueError(what + f"it wrote {int(written.sum())} values for {4 * n}")
    per_block = found.view(2, 2 * n)
    # a value's code, in block terms: K of (token t, head h, dim d) -> (t*H + h)*D + d, V -> n + that
    kind, rest = per_block // (2 * n), per_block % (2 * n)  # kind 0: K, 1: V
    blk, within = rest // n, rest % n
    local = kind * n + within  # the value's code within its own block
    if not (bool((blk[0] == 0).all()) and bool((blk[1] == 1).all())):
        raise ValueError(what + "a block holds another block's tokens")
    if not torch.equal(local[0], local[1]):
        raise ValueError(what + "the two blocks are laid out differently")
    pos = torch.full((2 * n,), -1, dtype=torch.long)
    pos[local[0]] = torch.arange(2 * n)
    if bool((pos < 0).any()):
        raise ValueError(what + "some values were not written, or written twice")
    return pos[:n].view(kb, H, D), pos[n:].view(kb, H, D)


class PermutedView:
    """K or V of one layer's paged cache in a learned layout (:func:`learn_layout`), indexed like
    a view ``[kernel_blocks, H, kernel_block, D]``: ``v[blocks]`` reads whole blocks (a copy),
    ``v[blocks] = x`` writes them, ``v[(block_per_token, :, offset_per_token)] = x`` writes single
    tokens ``(T, H, D)``; ``blocks`` is a slice or a tensor of kernel block ids."""

    def __init__(self, kv: torch.Tensor, pos: torch.Tensor) -> None:
        self.flat = kv.view(kv.shape[0], -1)  # (blocks, the block's memory)
        self.pos = pos  # (kb, H, D) -> offset in a block
        found = bits_view(kv, pos)  # whole blocks go through it when the layout allows
        self.bits, self._unit = (found[0], 1 << found[1]) if found is not None else (None, 1)

    def _rows(self, idx: Any) -> torch.Tensor:
        if isinstance(idx, slice):
            return torch.arange(self.flat.shape[0])[idx]
        return torch.as_tensor(idx, dtype=torch.long)

    def __getitem__(self, idx: Any) -> torch.Tensor:
        rows = self._rows(idx)
        kb, H, D = self.pos.shape
        if self.bits is not None:
            words = self.bits[idx].reshape(len(rows), H, kb, D // self._unit)
            return words.view(self.flat.dtype) if self._unit > 1 else words
        vals = self.flat[rows[:, None], self.pos.reshape(1, -1)]  # (n, kb*H*D) in (token, head, dim) order
        return vals.view(len(rows), kb, H, D).permute(0, 2, 1, 3)

    def __setitem__(self, idx: Any, src: torch.Tensor) -> None:
        if isinstance(idx, tuple):  # single tokens: (kernel block per token, :, offset per token), src (T, H, D)
            blk, _, off = idx
            self.flat[blk[:, None], self.pos[off].reshape(len(off), -1)] = src.reshape(len(off), -1)
            return
        rows = self._rows(idx)  # whole blocks, src (n, H, kb, D)
        if self.bits is not None:
            if self._unit > 1:  # side by side values as one word: the last dim must be contiguous
                src = (src if src.stride(-1) == 1 else src.contiguous()).view(self.bits.dtype)
            self.bits[idx] = src.reshape(*src.shape[:2], *self.bits.shape[2:])
            return
        vals = src.permute(0, 2, 1, 3).reshape(len(rows), -1)  # (n, kb*H*D) in (token, head, dim) order
        if isinstance(idx, slice):  # consecutive blocks: a scatter into the slice, a third faster
            self.flat[idx].scatter_(1, self.pos.reshape(1, -1).expand(len(rows), -1), vals)
        else:
            self.flat[rows[:, None], self.pos.reshape(1, -1)] = vals


_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_view(kv: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """A learned layout as a strided view of ``kv``, ``[blocks, H, 2, ..., 2]`` (token's bits, then
    the head dim's, most significant first), when every offset is a sum of one stride per bit
    of the token and of the head dim plus one per head (so are vec's and amx's layouts): copies
    through it are plain strided copies. The head dim's lowest ``w`` bits, where they lie side by
    side in the block as they do in a section, are one word of ``2**w`` values (up to 8 bytes:
    amx's bfloat16 K pairs copy as 32-bit words), returned with ``w``. None otherwise (block or
    head dim not a power of two, another layout, or blocks not contiguous in memory)."""
    kb, H, D = pos.shape
    if kb & (kb - 1) or D & (D - 1) or not kv[0].is_contiguous():
        return None
    tb, db = kb.bit_length() - 1, D.bit_length() - 1
    base = int(pos[0, 0, 0])
    ts = [int(pos[1 << i, 0, 0]) - base for i in range(tb)]
    ds = [int(pos[0, 0, 1 << i]) - base for i in range(db)]
    hs = int(pos[0, 1, 0]) - base if H > 1 else 0
    t, d = torch.arange(kb)[:, None, None], torch.arange(D)[None, None, :]
    model = base + torch.arange(H)[None, :, None] * hs
    for i, st in enumerate(ts):
        model = model + ((t >> i) & 1) * st
    for i, st in enumerate(ds):
        model = model + ((d >> i) & 1) * st
    if min(ts + ds + [hs]) < 0 or not torch.equal(model, pos):
        return None
    w = 0
    while w < db and ds[w] == 1 << w and kv.element_size() << (w + 1) <= 8:
        w += 1
    unit = 1 << w
    rest = [kv.stride(0), hs, *ts, *ds[w:], base, kv.storage_offset()]
    while unit > 1 and any(x % unit for x in rest):  # a word must start on a word
        w, unit = w - 1, unit >> 1
    words = kv.view(_WORDS[kv.element_size() * unit]) if unit > 1 else kv
    view = words.as_strided((kv.shape[0], H, *(2,) * (tb + db - w)),
                            (kv.stride(0) // unit, hs // unit, *(x // unit for x in ts[::-1]),
                             *(x // unit for x in ds[w:][::-1])),
                            (kv.storage_offset() + base) // unit)
    return view, w


def _host_views(layers: Sequence["PagedKV"], device: torch.device) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Every layer's K and V views as same-width integer numpy arrays over the same bytes
    (:func:`kdn.codecs.same_width_array`: copies keep every bit, bfloat16's too), or None where
    the cache is not plain host memory (CUDA, a learned layout). The placer copies through these:
    numpy's copy runs on the calling thread, where torch's would start an OpenMP team per reader
    thread and fight the forward's for the cores (and run a transposed K at half numpy's speed on
    one thread)."""
    if device.type != "cpu" or not all(isinstance(p.k, torch.Tensor) and isinstance(p.v, torch.Tensor) for p in layers):
        return None
    return [(same_width_array(p.k), same_width_array(p.v)) for p in layers]


@dataclass(frozen=True, slots=True)
class PagedKV:
    """One layer's paged cache as two views ``[kernel_blocks, H, kernel_block, D]`` (K, V) into
    vLLM's own tensor: indexing them reads and writes the engine's blocks in place (for a learned
    layout, :class:`PermutedView` does the same through its map)."""

    k: Any  # torch.Tensor, or PermutedView
    v: Any

    @classmethod
    def of(cls, kv: torch.Tensor, backend: str, isa: str | None, head_dim: int,
           layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> "PagedKV":
        nb, H, kb, c = kv.shape
        D = head_dim
        if backend == "CPU_ATTN":
            if c != 2 * D:
                raise ValueError(f"KDN: paged KV of CPU_ATTN has {c} values per token, expected 2*{D}")
            if isa not in _CPU_ISAS:
                if layout is None:
                    raise ValueError(f"KDN does not know the block layout of vLLM's CPU attention kernel {isa!r} "
                                     f"(known: {', '.join(_CPU_ISAS)}) and could not learn it from the kernel; "
                                     "refusing rather than mixing up KV")
                return cls(PermutedView(kv, layout[0]), PermutedView(kv, layout[1]))
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
        self.host = _host_views(self.layers, device)

    @classmethod
    def of(cls, geometry: EngineGeometry, caches: Sequence[torch.Tensor], backend: str, isa: str | None,
           num_blocks: int = 0, write_kernel: WriteKernel | None = None) -> "PagedCache":
        """The views of vLLM's per-layer caches (layer 0 first), checked against ``geometry``;
        ``num_blocks``: the scheduler's block count (0: one kernel block per block);
        ``write_kernel``: the engine's own cache writer, to learn a CPU kernel's layout that is
        not known here (:func:`learn_layout`, once for every layer)."""
        g = geometry
        kv = caches[0]
        if kv.dim() != 4 or kv.shape[1] != g.num_kv_heads:
            raise ValueError(f"KDN: unsupported paged KV shape {tuple(kv.shape)} (want [blocks, {g.num_kv_heads}, block, 2*D])")
        if kv.dtype != g.dtype:
            raise ValueError(f"KDN: KV cache dtype {kv.dtype} differs from the model dtype {g.dtype}")
        for i, c in enumerate(caches):  # what is learned and checked of layer 0 must hold for every layer
            if c.shape != kv.shape or c.dtype != kv.dtype or c.device != kv.device:
                raise ValueError(f"KDN: layer {i}'s KV cache {tuple(c.shape)} {c.dtype} on {c.device} differs from "
                                 f"layer 0's {tuple(kv.shape)} {kv.dtype} on {kv.device}")
        layout = None
        if backend == "CPU_ATTN" and isa not in _CPU_ISAS and write_kernel is not None:
            layout = learn_layout(write_kernel, g.num_kv_heads, int(kv.shape[2]), g.head_dim, g.dtype)
        layers = [PagedKV.of(c, backend, isa, g.head_dim, layout) for c in caches]
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
        host = self.host
        if host is not None and idx is not None:  # the same places, as numpy indexes
            np_idx = (idx if isinstance(idx, slice) else idx.numpy() if whole_blocks
                      else (idx[0].numpy(), idx[1], idx[2].numpy()))

        def put(section: Section) -> Any:
            a = section.array if host is not None else None
            x = a if a is not None else section.tensor  # bytes lent as numpy: no tensor is made
            if tuple(x.shape) != want or section.dtype != g.dtype:
                raise FingerprintMismatch(f"artifact section {tuple(x.shape)} {section.dtype} is not this engine's "
                                          f"{want} {g.dtype}")
            if idx is None:
                return None
            if a is not None:
                assert host is not None
                s = a[:, skip:]
                # the same views as below, in numpy
                src_np = s.reshape(H, -1, kb, D).transpose(1, 0, 2, 3) if whole_blocks else s.transpose(1, 0, 2)
                host[section.layer][0 if section.kind == "k" else 1][np_idx] = src_np
                return None
            if whole_blocks:
                # (H, T, D) -> (H, nkb, kb, D) -> (nkb, H, kb, D): the views' [block, H, token, D] order
                src = x[:, skip:].reshape(H, -1, kb, D).permute(1, 0, 2, 3)
            else:
                src = x[:, skip:].permute(1, 0, 2)  # (H, T, D) -> (T, H, D): what dst[block, :, offset] takes
            if host is not None:
                host[section.layer][0 if section.kind == "k" else 1][np_idx] = same_width_array(src)
                return None
            paged = layers[section.layer]
            dst = paged.k if section.kind == "k" else paged.v
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
