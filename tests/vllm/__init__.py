"""Tests of the vLLM connector. They need vLLM (``deploy/install-vllm.sh``); see :func:`require_vllm`."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator


def require_vllm() -> None:
    """Skip when vLLM is absent, unless ``KDN_REQUIRE_VLLM=1`` (the vLLM CI stage): then fail."""
    import pytest

    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or the torchvision operator error of a bad install
        if os.environ.get("KDN_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM cannot be imported in the vLLM stage: {type(exc).__name__}: {exc}", pytrace=False)
        pytest.skip(f"vLLM not installed ({type(exc).__name__}: {exc}); run deploy/install-vllm.sh")


@contextlib.contextmanager
def engine_output(prefix: str, *, tail: int | None = None) -> Iterator[Path]:
    """Fds 1 and 2 into a fresh file for the block, whose path it yields: the engine's processes
    inherit them, and the connector logs where vLLM logs (stdout), so every line of the engine and
    the connector lands there for the cases to read. After the block both fds are restored and the
    file (its last ``tail`` characters) is copied to stdout."""
    path = Path(tempfile.mkstemp(prefix=prefix, suffix=".log")[1])
    sys.stdout.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        yield path
    finally:
        sys.stdout.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
        text = path.read_text(errors="replace")
        sys.stdout.write(text if tail is None else text[-tail:])
        sys.stdout.flush()
