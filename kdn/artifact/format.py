"""The container's layout and its writer: constants, header and trailer framing, dtype maps.

Layout (all integers little-endian)::

    prefix    b"KDNA" | version u16 | flags u16 | header_len u32            12 bytes
    header    ArtifactHeader (protobuf, kdn/proto/kdn.proto)               header_len bytes
    hcheck    xxh3_64(prefix ‖ header)                                      8 bytes
    2·L sections, in order layer 0 K, layer 0 V, layer 1 K, ...:
      length u32 | payload (codec bytes) | xxh3_64(length ‖ payload) u64
    trailer   b"KDNE" | xxh3_128(hcheck ‖ every section's check)            20 bytes

This is the only module of :mod:`kdn.artifact` that imports :mod:`kdn.proto`; other packages
annotate with :data:`ArtifactHeader` from here.
"""

from __future__ import annotations

import functools

import struct
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import xxhash

from kdn.codecs import Codec, SectionInfo, get_codec
from kdn.codecs.base import lent_tensor
from kdn.errors import ArtifactCorrupt, InvalidInput
from kdn.keys import KEY_BYTES, ChunkKey, ModelFingerprint
from kdn.kv import KV_LAYOUT_VERSION
from kdn.proto import kdn_pb2 as pb

ArtifactHeader = pb.ArtifactHeader

MAGIC = b"KDNA"
TRAILER_MAGIC = b"KDNE"
VERSION = 1
MAX_HEADER = 64 * 1024
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB per artifact
PREFIX = struct.Struct("<4sHHI")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
TRAILER_BYTES = 4 + 16
HEADER_PART_MAX = PREFIX.size + MAX_HEADER + 8
"""The most bytes a container's prefix, header and header check can take."""

DTYPE_TO_PB = {torch.float32: pb.FLOAT32, torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16}
PB_TO_DTYPE = {v: k for k, v in DTYPE_TO_PB.items()}

# Bounds on the declared geometry, far above any real model, far below what could exhaust memory.
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM, MAX_TOKENS = 1024, 1024, 4096, 1 << 20


class Section:
    """One decoded section: the K (``kind='k'``) or V of one layer, ``(H, T, D)``.

    A section decoded into a larger ``(L, 2, H, T, D)`` tensor (``whole``) makes its view there on
    first use of :attr:`tensor`: callers that passed ``out=`` rarely look, and a view per section
    is a measurable part of reading a small artifact.

    A section lent straight from received bytes (:meth:`kdn.codecs.Codec.borrow_array`) holds them
    as :attr:`array`, the same-width integer numpy view of a ``dtype`` tensor (read-only, valid
    only while the sink runs): a caller that copies into numpy views of its own memory takes it
    as it is, and :attr:`tensor` is made only if asked for."""

    __slots__ = ("layer", "kind", "_tensor", "_whole", "array", "_dtype")

    def __init__(self, layer: int, kind: Literal["k", "v"], tensor: torch.Tensor | None = None, *,
                 whole: torch.Tensor | None = None, array: np.ndarray | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if tensor is None and whole is None and (array is None or dtype is None):
            raise ValueError("a Section needs its tensor, the tensor it lies in, or its bytes and dtype")
        self.layer = layer
        self.kind = kind
        self._tensor = tensor
        self._whole = whole
        self.array = array
        self._dtype = dtype

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            if self._whole is not None:
                self._tensor = self._whole[self.layer, 0 if self.kind == "k" else 1]  # (H, T, D) view
            else:
                assert self.array is not None and self._dtype is not None
                self._tensor = lent_tensor(self.array, self._dtype)
        return self._tensor

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype if self._dtype is not None else self.tensor.dtype

    def __repr__(self) -> str:
        return f"Section(layer={self.layer}, kind={self.kind!r}, shape={tuple(self.tensor.shape)})"


@dataclass(frozen=True, slots=True)
class Artifact:
    """A fully decoded artifact: its header and the chunk's KV ``(L, 2, H, T, D)``."""

    header: ArtifactHeader
    kv: torch.Tensor


def section_infos(header: ArtifactHeader) -> tuple[SectionInfo, ...]:
    """The sections a header declares, in order (layer 0 K, layer 0 V, ...). Shared between
    readers of containers of one geometry: a ``SectionInfo`` is immutable."""
    return _section_infos(header.num_layers, header.num_kv_heads, header.token_count, header.head_dim,
                          header.dtype, header.chunk_index)


@functools.lru_cache(maxsize=256)
def _section_infos(layers: int, heads: int, tokens: int, head_dim: int, dtype: int,
                   chunk_index: int) -> tuple[SectionInfo, ...]:
    # building them took ~20 us a container, a tenth of reading a verified 1 MiB one
    shape = (heads, tokens, head_dim)
    return tuple(
        SectionInfo(layer, layers, kind, shape, PB_TO_DTYPE[dtype], chunk_index)
        for layer in range(layers)
        for kind in ("k", "v")
    )


def header_shape(header: ArtifactHeader) -> tuple[int, int, int, int, int]:
    """The ``(L, 2, H, T, D)`` geometry a header declares."""
    return (header.num_layers, 2, header.num_kv_heads, header.token_count, header.head_dim)


def parse_header(data: bytes) -> ArtifactHeader:
    """The header message of bytes whose checksum matched; ArtifactCorrupt if they do not parse."""
    header = pb.ArtifactHeader()
    try:
        header.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError; checksum passed, so the writer was wrong
        raise ArtifactCorrupt(f"artifact header does not parse: {exc}") from exc
    return header


def encode_artifact(
    kv: torch.Tensor,
    *,
    key: ChunkKey,
    parent_key: ChunkKey,
    fingerprint: ModelFingerprint,
    codec: Codec | str = "raw",
    chunk_index: int = 0,
    steer: str = "",
) -> bytes:
    """Frame one chunk's KV ``(L, 2, H, T, D)`` as a container."""
    codec = get_codec(codec) if isinstance(codec, str) else codec
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise InvalidInput(f"chunk KV must be (L, 2, H, T, D), got {tuple(kv.shape)}")
    if kv.dtype not in DTYPE_TO_PB:
        raise InvalidInput(f"unsupported KV dtype {kv.dtype}")
    for name, value in (("key", key), ("parent_key", parent_key), ("fingerprint", fingerprint)):
        if len(value) != KEY_BYTES:
            raise InvalidInput(f"{name} must be {KEY_BYTES} bytes, got {len(value)}")
    L, _, H, T, D = kv.shape
    header = pb.ArtifactHeader(
        layout_version=KV_LAYOUT_VERSION,
        fingerprint=bytes(fingerprint),
        key=bytes(key),
        parent_key=bytes(parent_key),
        token_count=T,
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        dtype=DTYPE_TO_PB[kv.dtype],
        codec=codec.name,
        codec_level=codec.level,
        lossy=codec.lossy,
        codec_meta=codec.meta(),
        chunk_index=chunk_index,
        created_unix=time.time(),
        steer=steer,
    )
    hbytes = header.SerializeToString()
    if len(hbytes) > MAX_HEADER:
        raise InvalidInput(f"artifact header of {len(hbytes)} bytes exceeds {MAX_HEADER}")
    parts = [PREFIX.pack(MAGIC, VERSION, 0, len(hbytes)), hbytes]
    parts.append(U64.pack(xxhash.xxh3_64_intdigest(parts[0] + hbytes)))
    tree = xxhash.xxh3_128(parts[-1])  # digest over the checks, in order
    for info in section_infos(header):
        x = kv[info.layer, 0 if info.kind == "k" else 1].contiguous()  # (H, T, D)
        payload = codec.encode(x, info)
        length = U32.pack(len(payload))
        h = xxhash.xxh3_64(length)
        h.update(payload)
        check = U64.pack(h.intdigest())
        tree.update(check)
        parts += [length, payload, check]
    parts += [TRAILER_MAGIC, tree.digest()]
    return b"".join(parts)
