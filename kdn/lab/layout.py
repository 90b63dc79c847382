"""Where the lab's trained models live and what every one of their directories holds.

A trained model is a standard Hugging Face directory plus :data:`META_FILE` (how it was made, its
losses), under :func:`cache_root` — never inside the repository. Its tokenizer knows the two
special tokens below. Shared by every trainer (:mod:`kdn.lab.reference`, :mod:`kdn.lab.retrieval`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kdn.config import cache_root  # noqa: F401  (where the trained models live; part of this module's API)

META_FILE = "kdn_reference.json"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def publish(tmp: Path, out: Path, meta: dict[str, Any]) -> None:
    """Write :data:`META_FILE` into the finished directory ``tmp`` and move it to ``out`` in one
    rename, so ``out`` is always a whole model (a previous one is swapped out, then removed)."""
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def save_model(out: Path, model: Any, tokenizer: Any, meta: dict[str, Any]) -> None:
    """Save ``model`` (in eval mode) and ``tokenizer`` into a fresh directory next to ``out`` and
    :func:`publish` it there with ``meta``; a failure leaves no half-written directory behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.eval()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        publish(tmp, out, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
