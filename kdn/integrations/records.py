"""What the transformers integration hands out: a prepared model and one generation's result.

Their own module so that both ways of generating — :mod:`kdn.integrations.transformers` (prefix
reuse) and :mod:`kdn.integrations.blend` (documents anywhere) — build the same records without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from kdn.blend import BlendStats
from kdn.errors import InvalidInput
from kdn.keys import ModelFingerprint
from kdn.kv import KVShape
from kdn.models import Tokenizer

__all__ = ["KdnModel", "Result", "Timings", "token_ids"]


def token_ids(values: Any, vocab: int, what: str) -> list[int]:
    """``values`` as token ids of a ``vocab``-token model: integers (Python, numpy or 0-d integer
    tensors) in ``0..vocab-1``; otherwise InvalidInput naming ``what`` and the offending value."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise InvalidInput(f"{what} must be a sequence of token ids, got {type(values).__name__}")
    if isinstance(values, list) and all(type(t) is int for t in values) and (
            not values or 0 <= min(values) and max(values) < vocab):
        return list(values)  # a tokenizer's output: plain ints in range (the loop below names what is not)
    out = []
    for t in values:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) and not (
                isinstance(t, torch.Tensor) and t.dim() == 0 and not t.is_floating_point()):
            raise InvalidInput(f"{what} holds {t!r}: token ids must be integers")
        if not 0 <= int(t) < vocab:
            raise InvalidInput(f"{what} holds token id {int(t)}, outside the model's vocabulary (0..{vocab - 1})")
        out.append(int(t))
    return out


@dataclass(frozen=True, slots=True)
class KdnModel:
    """A causal LM with what KDN needs to name its KV."""

    model: Any
    tokenizer: Tokenizer | None
    fingerprint: ModelFingerprint
    chunk_size: int
    kv_shape: KVShape

    @property
    def config(self) -> Any:
        return self.model.config


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds. ``ttft_s`` runs from the call to the first generated token and covers the rest of
    the first group: ``keys_s`` (chunk-key hashing), ``lookup_s``, ``fetch_s`` (wall time of the
    fetch, which includes ``decode_s``: verify + decode + place, overlapped with the transfer),
    ``build_s`` (cache assembly), ``prefill_s`` (forward over the remainder, yields the first
    token's logits) and ``first_token_s`` (choosing it). A fetch layered under the prefill
    (:mod:`kdn.layered`) runs during ``prefill_s``: its ``fetch_s`` overlaps it."""

    ttft_s: float
    keys_s: float = 0.0
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    build_s: float = 0.0
    prefill_s: float = 0.0
    first_token_s: float = 0.0
    total_s: float = 0.0
    blend_s: float = 0.0  # documents: re-placing segments + selective recompute (inside build_s)

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Result:
    """One generation: the new tokens (prompt excluded), their text, and what KDN contributed."""

    tokens: list[int]
    text: str | None
    timings: Timings
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    fetched_bytes: int = 0
    via: str = ""
    written_back: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)
    blend: BlendStats | None = None  # documents: what the blend recomputed
    documents_tokens: int = 0
