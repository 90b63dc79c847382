"""Every KDN call that hands a model its KV cache, or reads one back, goes through
:func:`kdn.kv.forward` / :func:`kdn.kv.output_cache`.

transformers 5.20 renamed the argument ``past_key_values`` to ``cache`` and vLLM 0.32 pins an
earlier release; a model swallows the name it does not know in ``**kwargs``, so a direct
``model(..., cache=c)`` is silently a computation without the cache under one of the two."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from kdn.kv import forward, output_cache

REPO = Path(__file__).resolve().parents[2]
SOURCES = [*sorted((REPO / "kdn").rglob("*.py")), *sorted((REPO / "benchmarks").glob("*.py")),
           *sorted((REPO / "tests" / "vllm").glob("*.py"))]


def _direct_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "forward"):
            names = {k.arg for k in node.keywords}
            if names & {"cache", "past_key_values"} and "use_cache" in names:  # a model or decoder layer call
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: a call passes cache= directly")
        if isinstance(node, ast.Attribute) and node.attr in ("cache", "past_key_values") and isinstance(node.value, ast.Call):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr} of a call's result")
    return found


def test_no_call_passes_or_reads_a_cache_by_one_release_s_name() -> None:
    bad = [line for p in SOURCES for line in _direct_uses(p)]
    assert not bad, "\n".join(bad)


class _Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return {"got": past_key_values, "kwargs": kwargs}


class _New(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, **kwargs):
        return {"got": cache, "kwargs": kwargs}


def test_forward_names_the_cache_as_each_release_does() -> None:
    c = object()
    for module in (_Old(), _New()):
        out = forward(module, input_ids=1, cache=c)
        assert out["got"] is c and out["kwargs"] == {}, type(module).__name__


def test_output_cache_reads_either_name() -> None:
    class Old:
        past_key_values = "old"

    class New:
        cache = "new"

    assert (output_cache(Old()), output_cache(New())) == ("old", "new")
