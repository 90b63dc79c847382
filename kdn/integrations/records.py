"""What the transformers integration hands out: a prepared model and one generation's result.

Their own module so that both ways of generating — :mod:`kdn.integrations.transformers` (prefix
reuse) and :mod:`kdn.integrations.blend` (documents anywhere) — build the same records without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kdn.blend import BlendStats
from kdn.keys import ModelFingerprint
from kdn.kv import KVShape
from kdn.models import Tokenizer

__all__ = ["KdnModel", "Result", "Timings"]


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
