"""Lossless codecs: ``raw``, ``lz4`` and ``zstd``, the latter two over byte planes.

Byte-plane shuffle: a ``(N,)`` array of ``w``-byte floats becomes ``w`` planes of ``N`` bytes
(all low bytes, then all high bytes ...). Sign/exponent bytes of neighbouring KV values are alike,
so the planes hold long runs that entropy coders squeeze; mantissa planes stay noisy.
"""

from __future__ import annotations

import lz4.block
import numpy as np
import torch
import zstandard

from kdn.codecs.base import Codec, SectionInfo, register_codec
from kdn.errors import ArtifactCorrupt


def tensor_bytes(x: torch.Tensor) -> np.ndarray:
    """A zero-copy ``uint8`` view of a contiguous tensor (any dtype, bf16 included)."""
    return x.contiguous().view(torch.uint8).numpy().reshape(-1)


def bytes_tensor(buf: np.ndarray | bytes | bytearray | memoryview, info: SectionInfo) -> torch.Tensor:
    """A ``(H, T, D)`` tensor of ``info.dtype`` over ``buf`` (copied only when read-only)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.size != info.raw_bytes:
        raise ArtifactCorrupt(f"section decodes to {arr.size} bytes, header says {info.raw_bytes}")
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr).view(info.dtype).reshape(info.shape)


def shuffle(raw: np.ndarray, width: int) -> np.ndarray:
    # (N*w,) -> (N, w) -> (w, N): plane j holds byte j of every value
    return np.ascontiguousarray(raw.reshape(-1, width).T)


def unshuffle(planes: np.ndarray, width: int) -> np.ndarray:
    # (w*N,) -> (w, N) -> (N, w)
    return np.ascontiguousarray(planes.reshape(width, -1).T).reshape(-1)


@register_codec
class RawCodec(Codec):
    """The tensor's bytes as they are."""

    name = "raw"

    def encode(self, x: torch.Tensor, info: SectionInfo) -> bytes:
        return tensor_bytes(x).tobytes()

    def decode(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        return bytes_tensor(bytearray(payload), info)

    def max_payload(self, info: SectionInfo) -> int:
        return info.raw_bytes


class _ShuffledCodec(Codec):
    """Shared by lz4/zstd: optional byte-plane shuffle around a block compressor."""

    shuffled = True

    def _pre(self, x: torch.Tensor) -> np.ndarray:
        raw = tensor_bytes(x)
        w = x.element_size()
        return shuffle(raw, w) if self.shuffled and w > 1 else raw

    def _post(self, out: bytes | bytearray, info: SectionInfo) -> torch.Tensor:
        w = info.dtype.itemsize
        arr = np.frombuffer(out, dtype=np.uint8)
        if arr.size != info.raw_bytes:
            raise ArtifactCorrupt(f"section decodes to {arr.size} bytes, header says {info.raw_bytes}")
        if self.shuffled and w > 1:
            arr = unshuffle(arr, w)
        return bytes_tensor(arr, info)


@register_codec
class Lz4Codec(_ShuffledCodec):
    """LZ4 block compression over byte planes: fast, modest ratio."""

    name = "lz4"

    def encode(self, x: torch.Tensor, info: SectionInfo) -> bytes:
        return lz4.block.compress(self._pre(x), store_size=False)

    def decode(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        try:
            out = lz4.block.decompress(payload, uncompressed_size=info.raw_bytes)
        except lz4.block.LZ4BlockError as exc:
            raise ArtifactCorrupt(f"lz4 section does not decode: {exc}") from exc
        return self._post(out, info)


@register_codec
class ZstdCodec(_ShuffledCodec):
    """Zstandard over byte planes; level 1..19 (default 3)."""

    name = "zstd"
    default_level = "3"

    def __init__(self, level: str = "") -> None:
        super().__init__(level)
        lvl = int(self.level)
        if not 1 <= lvl <= 22:
            raise ValueError("zstd level must be in 1..22")
        self._cctx = zstandard.ZstdCompressor(level=lvl)
        self._dctx = zstandard.ZstdDecompressor()

    def encode(self, x: torch.Tensor, info: SectionInfo) -> bytes:
        return self._cctx.compress(self._pre(x))

    def decode(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        try:
            out = self._dctx.decompress(payload, max_output_size=info.raw_bytes)
        except zstandard.ZstdError as exc:
            raise ArtifactCorrupt(f"zstd section does not decode: {exc}") from exc
        return self._post(out, info)
