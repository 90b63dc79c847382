"""Where the lab's trained models live and what every one of their directories holds.

A trained model is a standard Hugging Face directory plus :data:`META_FILE` (how it was made, its
losses), under :func:`cache_root` — never inside the repository. Its tokenizer knows the two
special tokens below. Shared by every trainer (:mod:`kdn.lab.reference`, :mod:`kdn.lab.retrieval`).
"""

from __future__ import annotations

import os
from pathlib import Path

META_FILE = "kdn_reference.json"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def cache_root(env: dict[str, str] | None = None) -> Path:
    """``$KDN_CACHE`` or ``~/.cache/kdn``; never inside the repository."""
    env = os.environ if env is None else env
    return Path(env.get("KDN_CACHE") or Path.home() / ".cache" / "kdn").expanduser()
