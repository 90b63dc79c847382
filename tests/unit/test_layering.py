"""The layering stated in ``kdn/__init__.py``, checked over every import in the tree.

Every ``import``/``from ... import`` under ``kdn/`` counts, inside function bodies too (a lazy
import is still a dependency). Generated protobuf stubs are contracts. A test here fails on the
first import that climbs a floor, crosses between parts, or closes a cycle between files.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

KDN = Path(__file__).resolve().parents[2] / "kdn"

CONTRACTS = {
    "kdn.errors", "kdn.keys", "kdn.kv", "kdn.models", "kdn.prefill", "kdn.artifact", "kdn.codecs",
    "kdn.placement", "kdn.config", "kdn.blobstore", "kdn.procs", "kdn.console", "kdn.proto", "kdn.segments",
    "kdn.blend", "kdn.steer", "kdn.pretrained", "kdn.prompts",
}  # fmt: skip
WIRE = {"kdn.wire"}
CLIENT = {"kdn.client", "kdn.transport"}

# part -> what it may import besides itself (contracts and the wire are open to every part)
ALLOWED: dict[str, set[str]] = {
    "contracts": set(),
    "wire": {"contracts"},
    "client": {"contracts", "wire"},
    "integrations": {"contracts", "wire", "client"},
    "edge": {"contracts", "wire"},
    "origin": {"contracts", "wire"},
    "lab": {"contracts", "wire"},
    "route": {"contracts", "wire", "client"},
    "simulator": {"contracts", "wire", "edge", "route"},
    "ops": {"contracts", "wire", "client", "integrations", "edge", "origin", "lab", "simulator", "route"},
}


def part_of(module: str) -> str:
    if module == "kdn":
        return "contracts"
    parts = module.split(".")
    for depth in range(len(parts), 1, -1):
        prefix = ".".join(parts[:depth])
        if prefix in CONTRACTS:
            return "contracts"
        if prefix in WIRE:
            return "wire"
        if prefix in CLIENT:
            return "client"
    if len(parts) >= 2 and parts[1] in ALLOWED:
        return parts[1]
    raise AssertionError(f"{module} belongs to no floor: add it to kdn/__init__.py's layering and to this test")


@cache
def modules() -> dict[str, Path]:
    found = {}
    for path in KDN.rglob("*.py"):
        name = ".".join(path.relative_to(KDN.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def resolve(target: str) -> str | None:
    """The file a dotted import lands in (``kdn.codecs.get_codec`` -> ``kdn.codecs``)."""
    parts = target.split(".")
    for depth in range(len(parts), 0, -1):
        if ".".join(parts[:depth]) in modules():
            return ".".join(parts[:depth])
    return None


@cache
def imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{name}: relative import; use the absolute kdn.* name")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kdn":
                targets |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == "kdn"}
        graph[name] = {r for t in targets if (r := resolve(t)) and r != name}
    return graph


def test_every_module_sits_on_a_floor() -> None:
    assert len(modules()) > 50
    for name in modules():
        part_of(name)


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        src_part = part_of(src)
        for dst in sorted(targets):
            dst_part = part_of(dst)
            if dst_part != src_part and dst_part not in ALLOWED[src_part]:
                bad.append(f"{src} ({src_part}) imports {dst} ({dst_part})")
    return bad


def test_imports_only_go_down_or_sideways_as_allowed() -> None:
    bad = violations(imports())
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_nothing_imports_ops() -> None:
    users = {src for src, targets in imports().items() if part_of(src) != "ops" and any(part_of(t) == "ops" for t in targets)}
    assert not users


def test_no_import_cycles_between_files() -> None:
    graph = imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize(
    ("src", "dst"),
    [("kdn.keys", "kdn.edge.server"), ("kdn.wire.errors", "kdn.client"), ("kdn.edge.node", "kdn.origin.store"),
     ("kdn.origin.server", "kdn.ops.cli"), ("kdn.client", "kdn.edge.shm")],
)
def test_the_checker_catches_a_forbidden_import(src: str, dst: str) -> None:
    assert violations({src: {dst}}) == [f"{src} ({part_of(src)}) imports {dst} ({part_of(dst)})"]
    assert violations({dst: {"kdn.keys"}}) == []
