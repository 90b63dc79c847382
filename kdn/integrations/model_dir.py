"""Save a built-in model spec as a local Hugging Face model directory that any engine can load.

    python -m kdn.integrations.model_dir small-125m /tmp/small-125m --dtype bfloat16

No model hub is reachable here, so an engine such as vLLM gets its model from a directory. This
writes ``config.json``, ``model.safetensors`` (the spec's seeded weights, cast to ``--dtype``) and
a ``tokenizer.json`` that tokenizes exactly as :class:`kdn.models.ByteTokenizer` does (UTF-8 bytes
as ids 3..258, 0/1/2 = pad/bos/eos, no special tokens added): a BPE model with no merges whose
only entries are the 256 byte tokens, reached through byte fallback, the way Llama's tokenizer
spells unknown characters.

Invariants:
- the origin (``kdn ingest --model DIR``), an inference host and vLLM all read the same
  directory, so they derive the same model fingerprint (weights named by the digest of the
  ``*.safetensors`` bytes, see :func:`kdn.models.model_fingerprint`) and the same token ids;
- the weights are written in ``dtype``: an engine that runs in that dtype loads them unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kdn.models import BUILTIN_SPECS, ByteTokenizer, load_model, resolve_dtype

__all__ = ["save_builtin", "byte_tokenizer_json"]


def byte_tokenizer_json() -> dict:
    """``tokenizer.json`` (the ``tokenizers`` library's format) equal to :class:`ByteTokenizer`."""
    off = ByteTokenizer._OFFSET
    specials = {"<pad>": ByteTokenizer.pad_token_id, "<s>": ByteTokenizer.bos_token_id, "</s>": ByteTokenizer.eos_token_id}
    vocab = dict(specials)
    vocab.update({f"<0x{b:02X}>": b + off for b in range(256)})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for t, i in specials.items()
        ],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True, "ignore_merges": False,
            "vocab": vocab, "merges": [],
        },
    }


def save_builtin(spec: str, directory: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write built-in ``spec`` to ``directory`` (created) as config + safetensors + tokenizer."""
    if spec not in BUILTIN_SPECS:
        raise SystemExit(f"unknown built-in spec {spec!r}; choose one of {', '.join(BUILTIN_SPECS)}")
    resolve_dtype(dtype)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_model(spec, dtype=dtype)
    lm.model.config.architectures = ["LlamaForCausalLM"]
    lm.model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "add_bos_token": False, "add_eos_token": False,
        "model_max_length": int(lm.max_positions),
    }))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kdn.integrations.model_dir", description=__doc__.split("\n")[0])
    p.add_argument("spec", help=f"built-in spec: {', '.join(BUILTIN_SPECS)}")
    p.add_argument("directory", help="where to write the model directory")
    p.add_argument("--dtype", default="bfloat16", help="weights dtype: float32, float16, bfloat16")
    args = p.parse_args(argv)
    print(save_builtin(args.spec, args.directory, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
