"""Model shapes, GPU types and codec size ratios, loaded from the YAML files in ``kdn/simulator/data``.

The cost model in one place:

* KV bytes per token = 2 (K, V) x layers x kv_heads x head_dim x dtype bytes; a codec multiplies
  the bytes that move or sit in a cache by its ``ratio`` and costs ``raw_bytes / decode_gbps`` to
  decode at the receiver.
* Prefill of tokens ``[start, start + n)`` costs ``2 * params * n`` FLOPs for the weights plus
  ``4 * layers * q_heads * head_dim * (n * start + n**2 / 2)`` for attention over the context, at
  ``tflops * mfu`` of the GPU.
* The first output token costs one decode step, memory-bound: ``params * dtype_bytes / hbm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from kdn.errors import ConfigError

__all__ = ["CodecSpec", "GpuSpec", "ModelShape", "Presets", "load_presets"]

DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A transformer's shape, as far as KV size and prefill FLOPs care."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    params: float

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops(self, start: int, n: int) -> float:
        """FLOPs to prefill ``n`` tokens that follow ``start`` tokens of cached context."""
        attn = 4.0 * self.layers * self.q_heads * self.head_dim * (n * start + 0.5 * n * n)
        return 2.0 * self.params * n + attn


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    tflops: float  # dense BF16 peak
    hbm_tbps: float
    mfu: float
    usd_per_hour: float

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12 * self.mfu


@dataclass(frozen=True, slots=True)
class CodecSpec:
    name: str
    ratio: float  # bytes after / bytes of raw fp16 KV
    decode_gbps: float  # GB/s of raw KV produced by the decoder
    lossy: bool
    agreement: float

    def decode_s(self, raw_bytes: float) -> float:
        return 0.0 if self.name == "raw" else raw_bytes / (self.decode_gbps * 1e9)


@dataclass(frozen=True, slots=True)
class Presets:
    models: dict[str, ModelShape]
    gpus: dict[str, GpuSpec]
    codecs: dict[str, CodecSpec]


def _read(name: str, data_dir: Path) -> dict:
    path = data_dir / name
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read preset file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"preset file {path} must hold a mapping")
    return data


def load_presets(data_dir: Path = DATA_DIR) -> Presets:
    """Read ``models.yaml``, ``gpus.yaml`` and ``codecs.yaml``."""
    try:
        models = {
            k: ModelShape(name=k, **{**v, "params": float(v["params"])})  # YAML 1.1 reads 8.03e9 as a string
            for k, v in _read("models.yaml", data_dir).items()
        }
        gpus = {k: GpuSpec(name=k, **v) for k, v in _read("gpus.yaml", data_dir).items()}
        codecs = {k: CodecSpec(name=k, **v) for k, v in _read("codecs.yaml", data_dir).items()}
    except (TypeError, KeyError, ValueError) as exc:
        raise ConfigError(f"bad preset entry in {data_dir}: {exc}") from exc
    return Presets(models=models, gpus=gpus, codecs=codecs)
