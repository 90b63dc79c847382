"""The codec interface and registry.

A codec turns one *section* (the K or the V of one layer of one chunk, a ``(H, T, D)`` tensor)
into bytes and back. Each codec is one small class registered by name; a codec spec on the
command line or in a config is ``NAME`` or ``NAME:LEVEL`` (``zstd:9``, ``kvq:q2``).

Invariants:
- lossless codecs (``lossy = False``) decode to bit-identical tensors;
- ``decode`` never allocates more than ``max_payload``/``raw_bytes`` of the section's declared
  shape, so a hostile length field cannot make a reader allocate gigabytes.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from kdn.errors import InvalidInput, UnknownCodec


@dataclass(frozen=True, slots=True)
class SectionInfo:
    """Where a section sits in its artifact, and its decoded geometry."""

    layer: int
    num_layers: int
    kind: Literal["k", "v"]
    shape: tuple[int, int, int]  # (H, T, D)
    dtype: torch.dtype
    chunk_index: int = 0  # the chunk's place in its chain: 0 holds the sequence's first tokens

    @property
    def raw_bytes(self) -> int:
        h, t, d = self.shape
        return h * t * d * self.dtype.itemsize


class Codec(ABC):
    """Encode/decode one ``(H, T, D)`` KV section."""

    name: ClassVar[str]
    lossy: ClassVar[bool] = False
    default_level: ClassVar[str] = ""
    stores_raw: ClassVar[bool] = False
    """A section's payload is exactly the tensor's bytes (so it can be received in place)."""

    def __init__(self, level: str = "") -> None:
        self.level = level or self.default_level

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.level}" if self.level else self.name

    def meta(self) -> bytes:
        """Codec-private parameters stored once in the artifact header."""
        return b""

    def with_meta(self, meta: bytes) -> "Codec":
        """The codec configured by a header's ``codec_meta`` (decoding side)."""
        return self

    @abstractmethod
    def encode(self, x: torch.Tensor, info: SectionInfo) -> bytes:
        """``x``: contiguous ``(H, T, D)`` tensor of ``info.dtype``."""

    @abstractmethod
    def decode(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        """Back to a ``(H, T, D)`` tensor of ``info.dtype``. Raises ArtifactCorrupt on bad bytes."""

    def borrow(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        """The section as a ``(H, T, D)`` tensor that may share ``payload``'s memory (valid only as
        long as ``payload`` is, and read-only): codecs that store the tensor's bytes as they are
        return a view, so a caller that copies the section into its own layout copies once.
        Default: :meth:`decode` (a new tensor)."""
        return self.decode(payload, info)

    def borrow_array(self, payload: memoryview, info: SectionInfo) -> np.ndarray | None:
        """The section as a ``(H, T, D)`` same-width integer array over ``payload``'s own bytes
        (:func:`same_width_array`'s types; read-only, valid only as long as ``payload`` is), for
        codecs that store the tensor's bytes as they are; None for any other (then the caller
        uses :meth:`borrow`). Raises ArtifactCorrupt when the payload is not the tensor's size."""
        return None

    def decode_into(self, payload: memoryview, info: SectionInfo, out: torch.Tensor) -> None:
        """Decode into ``out``, a ``(H, T, D)`` tensor of ``info.dtype`` (a view into a larger
        buffer, e.g. one layer's K of a whole chunk). Codecs that can write in place override
        this to skip the intermediate tensor; the default decodes and copies."""
        copy_exact(out, self.decode(payload, info))

    def decode_into_array(self, payload: memoryview, info: SectionInfo, target: np.ndarray) -> bool:
        """Decode into ``target``, the same-width integer numpy view (:func:`same_width_array`) of a
        ``(H, T, D)`` destination, and return True; False when this codec cannot (then the caller
        uses :meth:`decode_into`). Saves the tensor-to-array conversion per section."""
        return False

    def max_payload(self, info: SectionInfo) -> int:
        """Upper bound on an encoded section's size; larger declared lengths are rejected."""
        return info.raw_bytes + info.raw_bytes // 4 + 4096


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_exact(dst: torch.Tensor, src: torch.Tensor | np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (any strides) bit for bit, on the calling thread only.

    ``src`` is a tensor of ``dst``'s dtype and shape, or a ``uint8`` array holding the raw bytes of
    one. numpy's copy, not ``Tensor.copy_``: torch hands copies of this size to its intra-op
    thread pool, and a second OpenMP team on a client's or edge's I/O thread fights the model's
    own team for the same cores (measured 3-10x slower on 2 busy cores). Same-width integer views
    keep bf16 (unknown to numpy) and every float bit pattern exact.
    """
    target = same_width_array(dst)
    if isinstance(src, torch.Tensor):
        np.copyto(target, same_width_array(src), casting="no")
    else:
        copy_bytes_into(target, src)


def same_width_array(x: torch.Tensor) -> np.ndarray:
    """``x``'s memory as a numpy array of the same-width integer type (same shape and strides)."""
    return x.view(_SAME_WIDTH_INT[x.element_size()]).numpy()


def lent_tensor(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` tensor over ``arr``'s own memory (``arr``: its same-width integers, possibly
    read-only: the caller copies out of it and keeps no reference)."""
    with warnings.catch_warnings():  # torch warns of a read-only array: read-only on purpose
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr).view(dtype)


SAME_WIDTH_NP = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}
"""numpy's side of :func:`same_width_array`: the integer type per element width in bytes."""


def copy_bytes_into(target: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src``, a ``uint8`` array of exactly ``target``'s bytes, into ``target`` (any strides)."""
    if target.flags.c_contiguous:
        # a flat byte copy, whatever the payload's alignment (a payload at an odd offset viewed
        # as int16 takes numpy's unaligned path: ~1.5x slower)
        np.copyto(target.reshape(-1).view(np.uint8), src.reshape(-1), casting="no")
    else:
        np.copyto(target, src.view(target.dtype).reshape(target.shape), casting="no")


CODECS: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec available by its ``name``."""
    if cls.name in CODECS and CODECS[cls.name] is not cls:
        raise ValueError(f"codec name {cls.name!r} registered twice")
    CODECS[cls.name] = cls
    return cls


def get_codec(spec: str) -> Codec:
    """A codec instance from ``NAME`` or ``NAME:LEVEL``."""
    name, _, level = (spec or "").partition(":")
    cls = CODECS.get(name)
    if cls is None:
        raise UnknownCodec(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}")
    try:
        return cls(level)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"bad level {level!r} for codec {name!r}: {exc}") from exc
