"""Model specs, loading, and the model fingerprint.

A *model spec* is the name of a built-in model or the path of a local Hugging Face model
directory (config + safetensors weights + tokenizer). Built-in models:

- ``smollm2-135m`` SmolLM2-135M-Instruct, trained and instruction-tuned (:mod:`kdn.pretrained`:
  installed from a registry package, converted once into a cached directory): what users meet
  first and what every quality figure is measured on
- ``tiny``         ~0.3M parameters, seeded random init, Llama-shaped with GQA (tests)
- ``tiny-mha``     the same with plain multi-head attention (tests)
- ``small-125m``   ~125M parameters, seeded random init, Llama-shaped with GQA (timing and
  exactness: the cost of a real model of its size, with answers that are noise)

Random-init specs have an offline byte-level tokenizer; the others bring their own.

The fingerprint is a digest of everything that changes KV: architecture config, weights identity,
dtype, KV layout version and chunk size. Origin and inference host compute it independently and
must agree; changing any input changes every chunk key (that is the invalidation story).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from kdn.errors import InvalidInput, UnknownModel
from kdn.pretrained import DEFAULT_MODEL  # noqa: F401  (part of this module's API)
from kdn.prompts import ByteTokenizer, HFTokenizer, Tokenizer
from kdn.keys import DEFAULT_CHUNK_SIZE, KEY_BYTES, ModelFingerprint
from kdn.kv import KV_LAYOUT_VERSION, KVShape

__all__ = [
    "BUILTIN_SPECS", "ByteTokenizer", "DEFAULT_MODEL", "DTYPES", "HFTokenizer", "LoadedModel", "Tokenizer",
    "check_spec", "describe", "dir_fingerprint", "is_model_dir", "load_model", "model_fingerprint",
    "resolve_dtype", "resolve_spec",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


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

    @property
    def directory(self) -> Path | None:
        """The model directory an engine loads (None for a random-init spec)."""
        from kdn.pretrained import installed_dir, is_pretrained

        if is_pretrained(self.spec):
            return installed_dir(self.spec)
        return Path(self.spec) if is_model_dir(self.spec) else None

    @property
    def untrained(self) -> bool:
        """Random weights: the timings are real, the text is noise."""
        return self.spec in BUILTIN_SPECS


def describe(lm: LoadedModel) -> dict[str, Any]:
    """What ``kdn model info`` shows: shape, KV bytes per token and chunk, fingerprint, where it lives."""
    from kdn.prompts import check_chat_template

    shape = lm.kv_shape
    try:
        check_chat_template(lm.tokenizer, lm.spec)
        chat = True
    except InvalidInput:
        chat = False
    directory = lm.directory
    return {
        "spec": lm.spec,
        "trained": not lm.untrained,
        "directory": str(directory) if directory is not None else None,
        "architecture": type(lm.model).__name__,
        "parameters": sum(p.numel() for p in lm.model.parameters()),
        "layers": shape.num_layers,
        "attention_heads": lm.config.num_attention_heads,
        "kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": lm.config.vocab_size,
        "max_positions": lm.max_positions,
        "dtype": lm.dtype,
        "kv_bytes_per_token": shape.bytes_per_token(),
        "kv_bytes_per_chunk": shape.bytes_per_token() * lm.chunk_size,
        "chunk_size": lm.chunk_size,
        "chat_template": chat,
        "bos_token_id": lm.tokenizer.bos_token_id,
        "prompt_adds_bos": bool(lm.tokenizer.encode_prompt("a")[:1] == [lm.tokenizer.bos_token_id]),
        "fingerprint": bytes(lm.fingerprint).hex(),
    }


def resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InvalidInput(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


def is_model_dir(spec: str) -> bool:
    p = Path(spec)
    return p.is_dir() and (p / "config.json").is_file()


def builtin_names() -> list[str]:
    from kdn.pretrained import PRETRAINED

    return [*PRETRAINED, *BUILTIN_SPECS]


def check_spec(spec: str) -> None:
    """Refuse a spec :func:`load_model` would refuse, without loading weights (a trained built-in
    is converted here if this machine has no directory for it yet)."""
    if spec in BUILTIN_SPECS:
        return
    if not is_model_dir(resolve_spec(spec)):
        raise UnknownModel(f"unknown model spec {spec!r}: not a built-in ({', '.join(builtin_names())}) "
                           "and not a directory with a config.json")


def resolve_spec(spec: str) -> str:
    """The directory a trained built-in name stands for (converting it on first use), or ``spec``."""
    from kdn.pretrained import is_pretrained, model_dir

    return str(model_dir(spec)) if is_pretrained(spec) else spec


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
        fp = model_fingerprint(cfg, weights_id=weights_id, dtype=dtype, chunk_size=chunk_size)
    elif is_model_dir(resolved := resolve_spec(spec)):
        path = Path(resolved)
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        with _quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(
                path, config=cfg, local_files_only=True, attn_implementation=attn, dtype=torch.float32
            )
        tokenizer = _load_dir_tokenizer(path)
        fp = dir_fingerprint(path, dtype=dtype, chunk_size=chunk_size)
    else:
        raise UnknownModel(
            f"unknown model spec {spec!r}: not a built-in ({', '.join(builtin_names())}) "
            "and not a directory with a config.json"
        )
    model = model.to(torch_dtype).eval()
    return LoadedModel(spec, model, tokenizer, fp, dtype, chunk_size)


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """No progress bar for a load of a second or two (transformers draws one per load)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def dir_fingerprint(path: str | Path, *, dtype: str, chunk_size: int) -> ModelFingerprint:
    """The fingerprint of a model directory: its ``config.json`` as written (not as one
    transformers release re-reads it, so an origin and an engine on different releases agree),
    the digest of its ``*.safetensors`` bytes, dtype and chunk size."""
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UnknownModel(f"{path / 'config.json'} is unreadable: {exc}") from exc
    if not isinstance(cfg, dict):
        raise UnknownModel(f"{path / 'config.json'} does not hold a mapping")
    return model_fingerprint(cfg, weights_id="sha:" + _weights_digest(path), dtype=dtype, chunk_size=chunk_size)


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
