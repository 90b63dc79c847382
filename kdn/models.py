"""Model specs, loading, and the model fingerprint.

A *model spec* is either the name of a built-in spec (seeded random init from a config, with an
offline byte-level tokenizer) or the path of a local Hugging Face model directory (config +
safetensors weights + tokenizer). Built-in specs:

- ``tiny``       ~0.3M parameters, Llama-shaped with grouped-query attention (tests)
- ``tiny-mha``   the same with plain multi-head attention (tests)
- ``small-125m`` ~125M parameters, Llama-shaped with GQA (timing, the demo)

The fingerprint is a digest of everything that changes KV: architecture config, weights identity,
dtype, KV layout version and chunk size. Origin and inference host compute it independently and
must agree; changing any input changes every chunk key (that is the invalidation story).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from kdn.errors import InvalidInput, UnknownModel
from kdn.keys import DEFAULT_CHUNK_SIZE, KEY_BYTES, ModelFingerprint
from kdn.kv import KV_LAYOUT_VERSION, KVShape

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class Tokenizer(Protocol):
    """What KDN needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 3..258; 0 = pad, 1 = bos, 2 = eos. Works offline, never fails."""

    vocab_size = 259
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    _OFFSET = 3

    def encode(self, text: str) -> list[int]:
        return [b + self._OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        raw = bytes(i - self._OFFSET for i in ids if self._OFFSET <= i < 256 + self._OFFSET)
        return raw.decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter for a ``transformers`` tokenizer loaded from a local directory."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


@dataclass(frozen=True, slots=True)
class BuiltinSpec:
    """A seeded random-init Llama-shaped model."""

    name: str
    config: dict[str, Any]
    seed: int = 0
    description: str = ""


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, max_pos: int) -> dict[str, Any]:
    return dict(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
        pad_token_id=ByteTokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


BUILTIN_SPECS: dict[str, BuiltinSpec] = {
    s.name: s
    for s in (
        BuiltinSpec("tiny", _llama(128, 2, 4, 2, 256, 8192), description="~0.3M params, GQA, for tests"),
        BuiltinSpec("tiny-mha", _llama(128, 2, 4, 4, 256, 8192), description="~0.3M params, multi-head"),
        BuiltinSpec(
            "small-125m", _llama(768, 12, 12, 4, 3840, 16384), description="~125M params, GQA, for timing"
        ),
    )
}


@dataclass(slots=True)
class LoadedModel:
    """A model ready for prefill, with the fingerprint that names its KV."""

    spec: str
    model: torch.nn.Module
    tokenizer: Tokenizer
    fingerprint: ModelFingerprint
    dtype: str
    chunk_size: int
    kv_shape: KVShape = field(init=False)

    def __post_init__(self) -> None:
        self.kv_shape = KVShape.from_config(self.model.config, DTYPES[self.dtype])

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)


def resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InvalidInput(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


def is_model_dir(spec: str) -> bool:
    p = Path(spec)
    return p.is_dir() and (p / "config.json").is_file()


def load_model(
    spec: str, *, dtype: str = "float32", chunk_size: int = DEFAULT_CHUNK_SIZE, attn: str = "sdpa"
) -> LoadedModel:
    """Load a built-in spec or a local Hugging Face model directory, in eval mode on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch_dtype = resolve_dtype(dtype)
    if chunk_size <= 0:
        raise InvalidInput(f"chunk_size must be positive, got {chunk_size}")
    if spec in BUILTIN_SPECS:
        b = BUILTIN_SPECS[spec]
        cfg = LlamaConfig(**b.config)
        cfg._attn_implementation = attn
        with torch.random.fork_rng(devices=[]):  # seeded init that leaves the caller's RNG as it was
            torch.manual_seed(b.seed)
            model = LlamaForCausalLM(cfg)
        tokenizer: Tokenizer = ByteTokenizer()
        weights_id = f"builtin:{b.name}:seed={b.seed}:torch={torch.__version__.split('+')[0]}"
    elif is_model_dir(spec):
        path = Path(spec)
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, config=cfg, local_files_only=True, attn_implementation=attn, dtype=torch.float32
        )
        tokenizer = _load_dir_tokenizer(path)
        weights_id = "sha:" + _weights_digest(path)
    else:
        raise UnknownModel(
            f"unknown model spec {spec!r}: not a built-in ({', '.join(BUILTIN_SPECS)}) "
            "and not a directory with a config.json"
        )
    model = model.to(torch_dtype).eval()
    fp = model_fingerprint(model.config, weights_id=weights_id, dtype=dtype, chunk_size=chunk_size)
    return LoadedModel(spec, model, tokenizer, fp, dtype, chunk_size)


def model_fingerprint(config: Any, *, weights_id: str, dtype: str, chunk_size: int) -> ModelFingerprint:
    """Digest of architecture config, weights identity, dtype, KV layout version and chunk size."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "_attn_implementation",
                     "_attn_implementation_autoset", "architectures", "output_attentions", "use_cache"):
        cfg.pop(volatile, None)
    doc = {
        "config": cfg,
        "weights": weights_id,
        "dtype": dtype,
        "kv_layout": KV_LAYOUT_VERSION,
        "chunk_size": chunk_size,
    }
    blob = json.dumps(doc, sort_keys=True, default=str).encode()
    return ModelFingerprint(hashlib.blake2b(blob, digest_size=KEY_BYTES).digest())


def _weights_digest(path: Path) -> str:
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise UnknownModel(f"model directory {path} holds no *.safetensors weights")
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def _load_dir_tokenizer(path: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError) as exc:
        raise UnknownModel(f"model directory {path} has no usable tokenizer: {exc}") from exc
