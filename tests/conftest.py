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


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts with the process's torch threads: a CLI under test that sets them (the
    evals' ``--threads``) must not change what later tests run with (a layered fetch's choice,
    kdn.layered.pays, and the suite's time)."""
    import torch

    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture
def namespace() -> Namespace:
    return Namespace("tenant-a", "salt-1")
