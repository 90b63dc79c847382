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

# Each ordered floor's modules, lowest first: a module imports only those that stand before it in
# its floor's list (or lower floors). A package (``kdn.codecs``, ``kdn.blend``) is one place; the
# files inside it are held to no order but the no-cycle rule.
CONTRACTS_ORDER = [
    "kdn.errors", "kdn.console", "kdn.procs", "kdn.proto", "kdn.config", "kdn.blobstore", "kdn.keys", "kdn.kv",
    "kdn.prompts", "kdn.codecs", "kdn.placement", "kdn.pretrained", "kdn.models", "kdn.prefill", "kdn.artifact",
]  # fmt: skip
WIRE_ORDER = [
    "kdn.wire", "kdn.wire.errors", "kdn.wire.frames", "kdn.wire.auth", "kdn.wire.tls", "kdn.wire.health",
    "kdn.wire.inproc", "kdn.wire.shm", "kdn.wire.channel", "kdn.wire.convert", "kdn.wire.calls", "kdn.wire.bulk",
    "kdn.wire.client_calls", "kdn.wire.service", "kdn.wire.origin", "kdn.wire.signal", "kdn.wire.rtc",
]  # fmt: skip
KVOPS_ORDER = ["kdn.segments", "kdn.blend", "kdn.steer"]
CONTRACTS = set(CONTRACTS_ORDER)
WIRE = {"kdn.wire"}
KVOPS = set(KVOPS_ORDER)
CLIENT = {"kdn.client", "kdn.layered", "kdn.transport"}
ORDER: dict[str, list[str]] = {"contracts": CONTRACTS_ORDER, "wire": WIRE_ORDER, "kvops": KVOPS_ORDER}

# floor or part -> what it may import besides itself (contracts, the wire and the KV operations are
# open to every part; the KV operations stand on contracts alone)
ALLOWED: dict[str, set[str]] = {
    "contracts": set(),
    "wire": {"contracts"},
    "kvops": {"contracts"},
    "client": {"contracts", "wire", "kvops"},
    "integrations": {"contracts", "wire", "kvops", "client"},
    "edge": {"contracts", "wire", "kvops"},
    "origin": {"contracts", "wire", "kvops"},
    "lab": {"contracts", "wire", "kvops"},
    "route": {"contracts", "wire", "kvops", "client"},
    "simulator": {"contracts", "wire", "kvops", "edge", "route"},
    "ops": {"contracts", "wire", "kvops", "client", "integrations", "edge", "origin", "lab", "simulator", "route"},
    # the test doubles stand beside the parts they stand in for; no part, and not ops, imports them
    "testing": {"contracts", "wire", "kvops", "client", "edge"},
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
        if prefix in KVOPS:
            return "kvops"
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


def test_nothing_a_user_runs_imports_the_test_doubles() -> None:
    users = {src for src, targets in imports().items()
             if part_of(src) != "testing" and any(part_of(t) == "testing" for t in targets)}
    assert not users, f"imports kdn.testing outside tests: {sorted(users)}"
    assert violations({"kdn.ops.demo": {"kdn.testing.edge"}}) == [
        "kdn.ops.demo (ops) imports kdn.testing.edge (testing)"]


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


def place_in_order(module: str) -> int:
    """Where ``module`` stands in its floor's order: the index of the longest listed name it is or lies in."""
    floor = ORDER[part_of(module)]
    # a listed package holds its files, except a floor's own root (``kdn.wire``): its files are listed one by one
    places = [i for i, name in enumerate(floor)
              if module == name or (module.startswith(name + ".") and name not in WIRE)]
    if not places:
        raise AssertionError(f"{module} has no place in the {part_of(module)} order: add it to this test's list "
                             "and to kdn/__init__.py's line for that floor")
    return max(places, key=lambda i: len(floor[i]))


def order_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        floor = part_of(src)
        if floor not in ORDER or src == "kdn":
            continue
        for dst in sorted(targets):
            if part_of(dst) == floor and place_in_order(dst) > place_in_order(src):
                bad.append(f"{src} imports {dst}, which does not stand below it in the {floor} order")
    return bad


def test_within_a_floor_imports_only_go_down_its_order() -> None:
    for name in modules():
        if part_of(name) in ORDER and name != "kdn":
            place_in_order(name)
    bad = order_violations(imports())
    assert not bad, "order within a floor broken:\n" + "\n".join(bad)


def test_the_orders_are_the_ones_kdn_init_states() -> None:
    import kdn

    stated = dict(line[2:].split(": ", 1) for line in (kdn.__doc__ or "").splitlines() if line.startswith("- "))
    floors = {"contracts": "contracts", "wire": "wire", "KV operations": "kvops"}
    for title, floor in floors.items():
        root = "kdn.wire." if floor == "wire" else "kdn."
        assert [root + name for name in stated[title].split(", ")] == [n for n in ORDER[floor] if n != "kdn.wire"]


def test_the_import_root_imports_nothing() -> None:
    assert imports()["kdn"] == set()


@pytest.mark.parametrize(
    ("src", "dst"),
    [("kdn.errors", "kdn.keys"), ("kdn.config", "kdn.models"), ("kdn.codecs.int8", "kdn.artifact"),
     ("kdn.segments", "kdn.blend"), ("kdn.blend.rope", "kdn.steer.methods"), ("kdn.wire.errors", "kdn.wire.service")],
)
def test_the_order_checker_catches_an_import_up_the_order(src: str, dst: str) -> None:
    assert order_violations({src: {dst}}) == [
        f"{src} imports {dst}, which does not stand below it in the {part_of(src)} order"]
    assert order_violations({dst: {src}}) == []


def test_the_order_checker_leaves_files_inside_one_package_alone() -> None:
    assert order_violations({"kdn.blend.rope": {"kdn.blend.verdict"}, "kdn.codecs.base": {"kdn.codecs.int8"}}) == []


@pytest.mark.parametrize(
    ("src", "dst"),
    [("kdn.keys", "kdn.edge.server"), ("kdn.wire.errors", "kdn.client"), ("kdn.edge.node", "kdn.origin.store"),
     ("kdn.origin.server", "kdn.ops.cli"), ("kdn.client", "kdn.edge.shm"), ("kdn.keys", "kdn.blend"),
     ("kdn.wire.convert", "kdn.steer"), ("kdn.segments", "kdn.wire.convert"), ("kdn.blend", "kdn.origin.blend")],
)
def test_the_checker_catches_a_forbidden_import(src: str, dst: str) -> None:
    assert violations({src: {dst}}) == [f"{src} ({part_of(src)}) imports {dst} ({part_of(dst)})"]
    assert violations({dst: {"kdn.keys"}}) == []


def exported(path: Path) -> tuple[list[str] | None, set[str]]:
    """A module's ``__all__`` (None without one) and the names its top level binds."""
    listed, bound = None, set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.col_offset == 0:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.col_offset == 0:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                bound |= {n.id for n in names if isinstance(n, ast.Name)}
                if isinstance(target, ast.Name) and target.id == "__all__":
                    listed = list(ast.literal_eval(node.value))
    return listed, bound


def test_every_all_lists_public_names_its_module_binds() -> None:
    bad = []
    for name, path in sorted(modules().items()):
        listed, bound = exported(path)
        for n in listed or ():
            if n.startswith("_") or n not in bound:
                bad.append(f"{name}.__all__ names {n}")
    assert not bad, "\n".join(bad)


def test_no_class_grows_past_300_lines() -> None:
    """A class past 300 lines has grown by accretion: split what it does (generated stubs aside)."""
    long = []
    for name, path in sorted(modules().items()):
        if name.startswith("kdn.proto"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > 300:  # type: ignore[operator]
                long.append(f"{name}.{node.name}: {n} lines")
    assert not long, long
