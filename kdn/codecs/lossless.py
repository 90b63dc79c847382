"""Lossless codecs: ``raw``, ``lz4`` and ``zstd``, the latter two over byte planes.

Byte-plane shuffle: an ``(N,)`` array of ``w``-byte floats (little-endian) becomes ``w`` planes of
``N`` bytes: plane 0 holds every value's low byte, plane ``w-1`` every high byte. Sign/exponent
bytes of neighbouring KV values are alike, so the high plane holds long runs that entropy coders
squeeze; low (mantissa) planes are close to noise and barely compress at all.

So each plane is compressed on its own and kept compressed only if that saves at least
``_KEEP_IF_BELOW`` of its size; otherwise it is stored raw and costs nothing to decode. Section
payload of ``lz4``/``zstd`` (self-describing; all integers little-endian)::

    layout u8                       0 = one block over the section's bytes (1-byte dtypes)
                                    1 = byte planes
    w × (mode u8, length u32)       per plane: 0 = stored raw, 1 = compressed
    plane bytes, in plane order

Planes are split and merged with integer shifts on ``<u2``/``<u4`` views (one vectorised pass
each), never with a strided byte transpose, which runs at under 1 GB/s.
"""

from __future__ import annotations

import struct
import threading

import lz4.block
import numpy as np
import torch
import zstandard

from kdn.codecs.base import (
    SAME_WIDTH_NP, Codec, SectionInfo, copy_bytes_into, copy_exact, lent_tensor, register_codec,
)
from kdn.errors import ArtifactCorrupt

_LAYOUT_BLOCK, _LAYOUT_PLANES = 0, 1
_PLANE_RAW, _PLANE_PACKED = 0, 1
_PLANE_ENTRY = struct.Struct("<BI")
_KEEP_IF_BELOW = 0.97  # keep a compressed plane only if it is < 97% of the plane's size
_UINT = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


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


def split_planes(raw: np.ndarray, width: int) -> list[np.ndarray]:
    """``(N*w,)`` bytes -> ``w`` planes of ``(N,)``: plane ``j`` is byte ``j`` of every value."""
    if width == 1:
        return [raw]
    words = raw.view(_UINT[width])  # (N,) little-endian words
    return [(words >> np.array(8 * j, dtype=words.dtype)).astype(np.uint8) for j in range(width)]


def merge_planes(planes: list[np.ndarray], width: int) -> np.ndarray:
    """``w`` planes of ``(N,)`` -> ``(N*w,)`` bytes; the inverse of :func:`split_planes`."""
    if width == 1:
        return planes[0]
    words = planes[-1].astype(_UINT[width])  # (N,) high byte first, shifted down as lower ones join
    eight = np.array(8, dtype=words.dtype)
    for plane in reversed(planes[:-1]):
        words <<= eight
        words |= plane
    return words.view(np.uint8)


def merge_planes_into(planes: list[np.ndarray], width: int, out: np.ndarray) -> None:
    """:func:`merge_planes` written into ``out``, a writable ``(N*w,)`` uint8 array."""
    if width == 1:
        np.copyto(out, planes[0])
        return
    words = out.view(_UINT[width])  # (N,)
    np.left_shift(planes[-1], 8 * (width - 1), out=words, dtype=words.dtype)
    for j in range(width - 2, -1, -1):
        if j == 0:
            np.bitwise_or(words, planes[0], out=words)
        else:
            np.bitwise_or(words, np.left_shift(planes[j], 8 * j, dtype=words.dtype), out=words)


def shuffle(raw: np.ndarray, width: int) -> np.ndarray:
    """All planes concatenated: ``(N*w,)`` -> ``(w*N,)``."""
    return np.concatenate(split_planes(raw, width)) if width > 1 else raw


def unshuffle(planes: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`shuffle`: ``(w*N,)`` -> ``(N*w,)``."""
    return merge_planes(list(planes.reshape(width, -1)), width) if width > 1 else planes


@register_codec
class RawCodec(Codec):
    """The tensor's bytes as they are."""

    name = "raw"
    stores_raw = True

    def encode(self, x: torch.Tensor, info: SectionInfo) -> bytes:
        return tensor_bytes(x).tobytes()

    def decode(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        return bytes_tensor(bytearray(payload), info)

    @staticmethod
    def _payload(payload: memoryview, info: SectionInfo) -> np.ndarray:
        """The section's bytes as ``uint8``, refused unless exactly the tensor's size."""
        arr = np.frombuffer(payload, dtype=np.uint8)
        if arr.size != info.raw_bytes:
            raise ArtifactCorrupt(f"section decodes to {arr.size} bytes, header says {info.raw_bytes}")
        return arr

    def borrow(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        return lent_tensor(self.borrow_array(payload, info), info.dtype)

    def borrow_array(self, payload: memoryview, info: SectionInfo) -> np.ndarray:
        arr = self._payload(payload, info)
        return arr.view(SAME_WIDTH_NP[info.dtype.itemsize]).reshape(info.shape)

    def decode_into(self, payload: memoryview, info: SectionInfo, out: torch.Tensor) -> None:
        src = self._payload(payload, info)
        if tuple(out.shape) != info.shape or out.dtype != info.dtype:
            raise ValueError(f"decode_into needs a {info.shape} {info.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
        copy_exact(out, src)  # one copy, straight from the payload, whatever out's strides

    def decode_into_array(self, payload: memoryview, info: SectionInfo, target: np.ndarray) -> bool:
        src = self._payload(payload, info)
        if target.shape != info.shape or target.itemsize != info.dtype.itemsize:
            raise ValueError(f"decode_into_array needs a {info.shape} array of {info.dtype}'s width, got {target.shape}")
        copy_bytes_into(target, src)  # one copy, straight from the payload, whatever the strides
        return True

    def max_payload(self, info: SectionInfo) -> int:
        return info.raw_bytes


class _PlaneCodec(Codec):
    """Shared by lz4/zstd: byte planes, each compressed or stored raw, around a block compressor."""

    def _compress(self, plane: np.ndarray) -> bytes:
        raise NotImplementedError

    def _decompress(self, data: memoryview, size: int) -> bytes:
        """Exactly ``size`` bytes or ArtifactCorrupt; never allocates more than ``size``."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, info: SectionInfo) -> bytes:
        raw = tensor_bytes(x)
        width = x.element_size()
        if width == 1:
            return bytes([_LAYOUT_BLOCK]) + self._compress(raw)
        table, blobs = [bytes([_LAYOUT_PLANES])], []
        for plane in split_planes(raw, width):
            packed = self._compress(plane)
            if len(packed) < _KEEP_IF_BELOW * plane.size:
                table.append(_PLANE_ENTRY.pack(_PLANE_PACKED, len(packed)))
                blobs.append(packed)
            else:
                table.append(_PLANE_ENTRY.pack(_PLANE_RAW, plane.size))
                blobs.append(plane.data)
        return b"".join(table + blobs)

    def decode(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        planes = self._planes(payload, info)
        if len(planes) == 1:
            return bytes_tensor(planes[0], info)
        return bytes_tensor(merge_planes(planes, info.dtype.itemsize), info)

    def decode_into(self, payload: memoryview, info: SectionInfo, out: torch.Tensor) -> None:
        planes = self._planes(payload, info)
        if out.dtype != info.dtype or tuple(out.shape) != info.shape:
            raise ValueError(f"decode_into needs a {info.shape} {info.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
        if not out.is_contiguous():
            copy_exact(out, self.decode(payload, info))
            return
        merge_planes_into(planes, info.dtype.itemsize, out.view(torch.uint8).numpy().reshape(-1))

    def _planes(self, payload: memoryview, info: SectionInfo) -> list[np.ndarray]:
        """The section's byte planes (one block for 1-byte dtypes), each ``(N,)`` uint8, checked."""
        payload = memoryview(payload).cast("B")
        width = info.dtype.itemsize
        if len(payload) < 1:
            raise ArtifactCorrupt(f"{self.name} section is empty")
        layout = payload[0]
        if layout == _LAYOUT_BLOCK and width == 1:
            return [np.frombuffer(self._decompress(payload[1:], info.raw_bytes), dtype=np.uint8)]
        if layout != _LAYOUT_PLANES or width == 1:
            raise ArtifactCorrupt(f"{self.name} section has unknown layout {layout} for {info.dtype}")
        n = info.raw_bytes // width
        pos = 1 + width * _PLANE_ENTRY.size
        if len(payload) < pos:
            raise ArtifactCorrupt(f"{self.name} section too short for its plane table")
        planes = []
        for j in range(width):
            mode, length = _PLANE_ENTRY.unpack_from(payload, 1 + j * _PLANE_ENTRY.size)
            if pos + length > len(payload):
                raise ArtifactCorrupt(f"{self.name} plane {j} runs past the end of its section")
            data = payload[pos : pos + length]
            pos += length
            if mode == _PLANE_RAW:
                if length != n:
                    raise ArtifactCorrupt(f"{self.name} raw plane {j} is {length} bytes, expected {n}")
                planes.append(np.frombuffer(data, dtype=np.uint8))
            elif mode == _PLANE_PACKED:
                planes.append(np.frombuffer(self._decompress(data, n), dtype=np.uint8))
            else:
                raise ArtifactCorrupt(f"{self.name} plane {j} has unknown mode {mode}")
        if pos != len(payload):
            raise ArtifactCorrupt(f"{self.name} section has {len(payload) - pos} stray bytes after its planes")
        return planes

    def max_payload(self, info: SectionInfo) -> int:
        return info.raw_bytes + info.raw_bytes // 4 + 4096


@register_codec
class Lz4Codec(_PlaneCodec):
    """LZ4 block compression per byte plane: fast, modest ratio (no entropy coding)."""

    name = "lz4"

    def _compress(self, plane: np.ndarray) -> bytes:
        return lz4.block.compress(plane, store_size=False)

    def _decompress(self, data: memoryview, size: int) -> bytes:
        try:
            out = lz4.block.decompress(data, uncompressed_size=size)
        except (lz4.block.LZ4BlockError, ValueError, OverflowError) as exc:
            raise ArtifactCorrupt(f"lz4 plane does not decode: {exc}") from exc
        if len(out) != size:
            raise ArtifactCorrupt(f"lz4 plane decodes to {len(out)} bytes, expected {size}")
        return out


@register_codec
class ZstdCodec(_PlaneCodec):
    """Zstandard per byte plane; level 1..22 (default 3)."""

    name = "zstd"
    default_level = "3"

    def __init__(self, level: str = "") -> None:
        super().__init__(level)
        self._level = int(self.level)
        if not 1 <= self._level <= 22:
            raise ValueError("zstd level must be in 1..22")
        self._local = threading.local()  # zstd contexts are not thread-safe; one pair per thread

    def _contexts(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = (zstandard.ZstdCompressor(level=self._level), zstandard.ZstdDecompressor())
        return ctx

    def _compress(self, plane: np.ndarray) -> bytes:
        return self._contexts()[0].compress(plane)

    def _decompress(self, data: memoryview, size: int) -> bytes:
        # zstandard allocates the size a frame header declares and ignores max_output_size when
        # one is declared: a declared size is checked against the section's before anything is
        # allocated (an undeclared one is bounded by max_output_size)
        try:
            declared = zstandard.frame_content_size(data)
            if declared > size:
                raise ArtifactCorrupt(f"zstd plane declares {declared} bytes, the section holds {size}")
            out = self._contexts()[1].decompress(data, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise ArtifactCorrupt(f"zstd plane does not decode: {exc}") from exc
        if len(out) != size:
            raise ArtifactCorrupt(f"zstd plane decodes to {len(out)} bytes, expected {size}")
        return out
