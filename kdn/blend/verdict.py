"""The per-model blend verdict: did blending keep this model's answers, and at what recompute ratio.

``kdn eval-blend`` measures a model on held-out prompts and writes one verdict per model
fingerprint; the inference host reads it before blending. No verdict, or a failing one, means the
host does not blend for that model: it falls back to prefix reuse and says so. A verdict is
written atomically (temporary file, then rename) under ``$KDN_CACHE/blend-verdicts/<fp>.json``.

The built-in models' verdicts ship with KDN (``kdn/blend/verdicts/<fp>.json``, written by
``python benchmarks/blend.py --parts quality``: the fingerprint of the model at the dtype and chunk
size measured). Where ``$KDN_CACHE`` holds none for a fingerprint, the shipped one answers; one
there, passing or failing (a user's own ``kdn eval-blend``), always wins. An explicit ``root``
reads that directory only.

Gate: at the chosen ratio blend keeps ``>= min_accuracy_kept`` of full-prefill accuracy and
``>= min_agreement`` top-1 agreement with full prefill on the answer tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kdn.blobstore import write_file_atomic
from kdn.config import cache_root, measured_file
from kdn.errors import InvalidInput
from kdn.keys import ModelFingerprint

VERDICT_DIRNAME = "blend-verdicts"
SHIPPED_ROOT = Path(__file__).with_name("verdicts")  # the built-in models' verdicts, measured here
MIN_ACCURACY_KEPT = 0.98
MIN_AGREEMENT = 0.95


def verdict_root(env: dict[str, str] | None = None) -> Path:
    return cache_root(env) / VERDICT_DIRNAME


@dataclass(frozen=True, slots=True)
class Verdict:
    """What ``kdn eval-blend`` concluded for one model fingerprint."""

    fingerprint: str  # hex
    passed: bool
    ratio: float  # recompute ratio the host should use (the smallest that passed)
    check_layer: int = 1
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def verdict_path(fingerprint: ModelFingerprint, root: Path | None = None) -> Path:
    return (root or verdict_root()) / f"{bytes(fingerprint).hex()}.json"


def write_verdict(v: Verdict, root: Path | None = None) -> Path:
    path = (root or verdict_root()) / f"{v.fingerprint}.json"
    write_file_atomic(path, (json.dumps(v.as_dict(), indent=2) + "\n").encode())
    return path


def verdict_file(fingerprint: ModelFingerprint, root: Path | None = None) -> Path:
    """The file the model's verdict is read from. ``root`` None: ``$KDN_CACHE``'s, else the one
    shipped for a built-in model (module docstring); it may not exist."""
    return measured_file(f"{bytes(fingerprint).hex()}.json", root, verdict_root(), SHIPPED_ROOT)


def read_verdict(fingerprint: ModelFingerprint, root: Path | None = None) -> Verdict | None:
    """The model's verdict (from :func:`verdict_file`), or None when it has none. A malformed file
    raises InvalidInput."""
    path = verdict_file(fingerprint, root)
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        v = Verdict(**d)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"blend verdict {path} is malformed: {exc}") from exc
    if v.fingerprint != bytes(fingerprint).hex():
        raise InvalidInput(f"blend verdict {path} names another model")
    return v


def verdict_summary(fingerprint: ModelFingerprint) -> dict[str, Any]:
    """What an operator sees of a model's blending (``kdn model info``): whether the host and the
    store blend documents for it, at what ratio, why, and whose measurement says so."""
    path = verdict_file(fingerprint)
    try:
        v = read_verdict(fingerprint, path.parent)
    except InvalidInput as exc:
        return {"blends": False, "problem": str(exc)}
    if v is None:
        return {"blends": False, "problem": "no blend verdict for this model (kdn eval-blend --model MODEL)"}
    shipped = path.parent == SHIPPED_ROOT
    return {"blends": v.passed, "ratio": v.ratio if v.passed else None, "check_layer": v.check_layer,
            "reason": v.reason, "verdict": str(path),
            "source": "shipped with KDN" if shipped else "measured on this machine (kdn eval-blend)"}
