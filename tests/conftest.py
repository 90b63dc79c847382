"""Fixtures shared by unit and integration tests.

Models are session-scoped: building one costs about a second (mostly the transformers import),
and tests only ever read them (eval mode, no grad), so one instance per process is safe.
"""

from __future__ import annotations

import pytest

from kdn.keys import Namespace


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny``: ~0.3M parameters, Llama-shaped with grouped-query attention, fp32."""
    from kdn.models import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def tiny_mha_model():
    """``tiny-mha``: ``tiny`` with plain multi-head attention (as many KV heads as query heads)."""
    from kdn.models import load_model

    return load_model("tiny-mha")


@pytest.fixture
def namespace() -> Namespace:
    return Namespace("tenant-a", "salt-1")
