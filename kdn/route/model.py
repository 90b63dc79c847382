"""What the router needs of the hosts' model: its tokenizer, its fingerprint, its KV bytes per token.

The fingerprint is the engines' (:func:`kdn.models.dir_fingerprint` of the directory vLLM loads, in
the engines' dtype and the connectors' chunk size), so the router's chunk keys are theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kdn.errors import UnknownModel
from kdn.keys import ModelFingerprint
from kdn.models import DTYPES, dir_fingerprint, is_model_dir
from kdn.pretrained import is_pretrained, model_dir
from kdn.prompts import HFTokenizer, Tokenizer

__all__ = ["RouteModel", "load_route_model"]


@dataclass(frozen=True, slots=True)
class RouteModel:
    directory: Path
    tokenizer: Tokenizer
    fingerprint: ModelFingerprint
    kv_bytes_per_token: int


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * DTYPES[dtype].itemsize


def load_route_model(spec: str, *, dtype: str, chunk_size: int) -> RouteModel:
    """``spec``: a trained built-in name (converted once per machine) or a model directory."""
    if is_pretrained(spec):
        path = model_dir(spec)
    elif is_model_dir(spec):
        path = Path(spec)
    else:
        raise UnknownModel(f"the router needs the hosts' model directory or a trained built-in name, not {spec!r}")
    try:
        config = json.loads((path / "config.json").read_text())
        bpt = kv_bytes_per_token(config, dtype)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UnknownModel(f"{path / 'config.json'} does not describe a decoder's KV: {exc}") from exc
    from transformers import AutoTokenizer

    try:
        tok = HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError) as exc:
        raise UnknownModel(f"model directory {path} has no usable tokenizer: {exc}") from exc
    return RouteModel(path, tok, dir_fingerprint(path, dtype=dtype, chunk_size=chunk_size), bpt)
