"""A setting's default is written once, on its config field: no constructor in ``kdn/edge``
(``kdn/route``) restates, as a literal default, the default of the ``EdgeConfig``
(``RouteConfig``) field it stands for.

A parameter ``p`` stands for the field ``p``, ``p_bytes`` or ``<anything>_p`` (``fsync`` for
``disk_fsync``, ``max_artifact`` for ``max_artifact_bytes``). ``None`` is never a restatement
(it means "not given"). Only ``def __init__`` signatures are read.
"""

from __future__ import annotations

import ast
import operator
from pathlib import Path
from typing import Any, Iterator

import pytest

from kdn.config import RoleConfig
from kdn.edge.config import EdgeConfig
from kdn.route.config import RouteConfig

ROOT = Path(__file__).resolve().parents[2]
_FOLD = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
         ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.LShift: operator.lshift}
_NOT_LITERAL = object()


def _literal(node: ast.expr) -> Any:
    """The value of a default written as a literal (``1 << 30`` and ``-1.0`` included), else ``_NOT_LITERAL``."""
    if isinstance(node, ast.BinOp) and type(node.op) in _FOLD:
        left, right = _literal(node.left), _literal(node.right)
        if left is _NOT_LITERAL or right is _NOT_LITERAL:
            return _NOT_LITERAL
        return _FOLD[type(node.op)](left, right)
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _NOT_LITERAL


def _defaults(config: type[RoleConfig]) -> dict[str, Any]:
    return {name: config.default(name) for name, f in config.model_fields.items() if not f.is_required()}


def _fields_for(param: str, defaults: dict[str, Any]) -> list[str]:
    return [f for f in defaults if f in (param, f"{param}_bytes") or f.endswith(f"_{param}")]


def _same(value: Any, default: Any) -> bool:
    return isinstance(value, bool) == isinstance(default, bool) and value == default


def restatements(source: str, config: type[RoleConfig]) -> Iterator[str]:
    """``line: param=value restates field`` for every such default in ``source``'s ``__init__``s."""
    defaults = _defaults(config)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or node.name != "__init__":
            continue
        a = node.args
        positional = a.posonlyargs + a.args
        pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
        pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
        for arg, default in pairs:
            value = _literal(default)
            if value is _NOT_LITERAL or value is None:
                continue
            for field in _fields_for(arg.arg, defaults):
                if _same(value, defaults[field]):
                    yield f"{default.lineno}: {arg.arg}={value!r} restates {config.__name__}.{field}"


@pytest.mark.parametrize(("package", "config"), [("kdn/edge", EdgeConfig), ("kdn/route", RouteConfig)])
def test_no_constructor_restates_a_config_default(package: str, config: type[RoleConfig]) -> None:
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in sorted((ROOT / package).rglob("*.py"))
             for hit in restatements(path.read_text(), config)]
    assert not found, "take these from the config instead:\n" + "\n".join(found)


def test_the_check_sees_a_restated_default() -> None:
    source = '''
class Pool:
    def __init__(self, node: str, *, max_segments: int = 256, max_bytes: int = 1 << 30, fsync: bool = True,
                 replicas: int = 3, origin: str | None = None, directory: str = "/tmp") -> None:
        pass

def helper(replicas: int = 2) -> None:
    pass
'''
    found = [hit.split(" restates ")[1] for hit in restatements(source, EdgeConfig)]
    assert found == ["EdgeConfig.shm_max_segments", "EdgeConfig.shm_max_bytes", "EdgeConfig.disk_fsync"]
