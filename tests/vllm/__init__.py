"""Tests of the vLLM connector. They need vLLM (``deploy/install-vllm.sh``); see :func:`require_vllm`."""

from __future__ import annotations

import os


def require_vllm() -> None:
    """Skip when vLLM is absent, unless ``KDN_REQUIRE_VLLM=1`` (the vLLM CI stage): then fail."""
    import pytest

    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or the torchvision operator error of a bad install
        if os.environ.get("KDN_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM cannot be imported in the vLLM stage: {type(exc).__name__}: {exc}", pytrace=False)
        pytest.skip(f"vLLM not installed ({type(exc).__name__}: {exc}); run deploy/install-vllm.sh")
