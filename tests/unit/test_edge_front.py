"""The edge's one front door (kdn.edge.front): its structure, and refusals and hits through it.

Structure (read off the source): nothing in kdn/ outside kdn/wire/, kdn/proto/ and the artifact
container's format imports the generated protobuf or health modules (kdn.wire converts every
message); one function composes an edge, and both the served edge and the in-process one use it;
the three transports ask the front and decide no refusal of their own. Behaviour: a refused Fetch reads the same, and is counted the same, over gRPC, the
bulk socket, a data channel and the front itself; a hit returns the same bytes through each.
"""

from __future__ import annotations

import ast
import asyncio
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from kdn import errors as e
from kdn.edge.admin import AsyncEdgeClient
from kdn.edge.bulk import BulkConnection, BulkListener
from kdn.edge.rtc import EdgeRtcHandler
from kdn.testing import InProcessEdge, make_chain
from kdn.wire import bulk as wb
from kdn.wire import rtc as wr
from kdn.wire.convert import FetchAsk, fetch_request
from kdn.wire.errors import error_from_status

ROOT = Path(__file__).resolve().parents[2]
KDN = ROOT / "kdn"
TRANSPORTS = ["kdn/edge/server.py", "kdn/edge/bulk.py", "kdn/edge/rtc.py", "kdn/wire/rtc.py"]


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text())


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for sub in node.body:
                for inner in ast.walk(sub):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        lines.add(inner.lineno)
    return lines


def _imports(tree: ast.Module) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _functions_calling(tree: ast.Module, name: str) -> list[str]:
    """Qualified names of the functions whose bodies call ``name(...)``."""
    found: list[str] = []

    def visit(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*where, child.name])
                continue
            if isinstance(child, ast.Call):
                f = child.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if called == name and where:
                    found.append(".".join(where))
            visit(child, where)

    visit(tree, [])
    return found


def _edge_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (KDN / "edge").rglob("*.py"))


def _kdn_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in KDN.rglob("*.py"))


# where generated messages may be imported: the wire converts them, the stubs are them, and the
# artifact container's header is one; an edge store tier annotates with the header (typing only)
MESSAGE_HOMES = ("kdn/wire/", "kdn/proto/")
MESSAGE_FILES = {"kdn/artifact/format.py"}
TYPING_ONLY_FILES = {"kdn/edge/store/tiers.py"}


def _is_message_module(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return name.startswith("kdn.proto") or leaf in {"kdn_pb2", "kdn_pb2_grpc", "health_pb2", "health_pb2_grpc"}


def _message_imports(rel: str, tree: ast.Module) -> list[str]:
    """``rel``'s imports of generated messages that its place does not allow."""
    if rel.startswith(MESSAGE_HOMES) or rel in MESSAGE_FILES:
        return []
    typing_only = _type_checking_only(tree) if rel in TYPING_ONLY_FILES else set()
    return [f"{rel}:{line} {name}" for line, name in _imports(tree) if _is_message_module(name) and line not in typing_only]


# -- structure ---------------------------------------------------------------------------------


def test_nothing_outside_the_wire_imports_generated_messages() -> None:
    bad = [hit for rel in _kdn_files() for hit in _message_imports(rel, _tree(rel))]
    assert not bad, f"kdn.wire converts messages; these import them: {bad}"


@pytest.mark.parametrize("src", [
    "from kdn.proto import kdn_pb2 as pb",
    "import kdn.proto.kdn_pb2_grpc",
    "from grpc_health.v1 import health_pb2",
    "from grpc_health.v1 import health_pb2_grpc as hg",
    "def f():\n    from kdn.proto.kdn_pb2 import BlendRequest",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kdn.proto.kdn_pb2 import ArtifactHeader",
])
def test_the_message_check_catches_a_new_importer(src: str) -> None:
    assert _message_imports("kdn/origin/new.py", ast.parse(src))
    assert not _message_imports("kdn/wire/new.py", ast.parse(src))
    assert not _message_imports("kdn/artifact/format.py", ast.parse(src))


def test_the_message_check_lets_only_the_named_file_import_for_typing() -> None:
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kdn.proto.kdn_pb2 import ArtifactHeader"
    assert not _message_imports("kdn/edge/store/tiers.py", ast.parse(src))
    assert _message_imports("kdn/edge/store/tiers.py", ast.parse("from kdn.proto import kdn_pb2"))
    assert _message_imports("kdn/edge/store/other.py", ast.parse(src))


def test_one_function_composes_an_edge_and_both_edges_use_it() -> None:
    composers = {rel: _functions_calling(_tree(rel), "EdgeFront") for rel in _edge_files()}
    composers = {rel: fns for rel, fns in composers.items() if fns}
    assert composers == {"kdn/edge/compose.py": ["compose_edge"]}
    for rel, name in (("kdn/edge/compose.py", "HintService"), ("kdn/edge/compose.py", "ShmPool")):
        assert all(not _functions_calling(_tree(f), name) for f in _edge_files() if f != rel), name
    assert "EdgeServer.start" in _functions_calling(_tree("kdn/edge/server.py"), "compose_edge")
    assert "InProcessEdge.__init__" in _functions_calling(_tree("kdn/testing/edge.py"), "compose_edge")


def test_the_transports_ask_the_front_and_map_no_refusal_of_their_own() -> None:
    for rel in TRANSPORTS:
        text = (ROOT / rel).read_text()
        names = {n.id for n in ast.walk(_tree(rel)) if isinstance(n, ast.Name)}
        attrs = {n.attr for n in ast.walk(_tree(rel)) if isinstance(n, ast.Attribute)}
        assert "status_for" not in names | attrs, f"{rel} maps errors to statuses itself"
        assert ".refused.labels" not in text, f"{rel} counts refusals itself"
        assert "refuse" in attrs, f"{rel} does not hand its refusals to the front"
    for rel in TRANSPORTS[:3]:
        assert "front" in {n.attr for n in ast.walk(_tree(rel)) if isinstance(n, ast.Attribute)}, rel
    # the one place a refusal is decided and counted
    assert _functions_calling(_tree("kdn/edge/front.py"), "status_for") == ["EdgeFront.refuse"]
    counted = [rel for rel in _edge_files() if ".refused.labels" in (ROOT / rel).read_text()]
    assert counted == ["kdn/edge/front.py"]


# -- behaviour ---------------------------------------------------------------------------------


class _Channel:
    """A data channel's sending side, kept: what the answering edge sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send(self, msg: bytes) -> None:
        self.sent.append(msg)


async def _over_rtc(handler: EdgeRtcHandler, request: Any) -> tuple[bytes, str]:
    """One Fetch over a data channel's framing (:func:`kdn.wire.rtc.serve_request`), no aiortc."""
    channel = _Channel()
    body = request if isinstance(request, bytes) else request.SerializeToString()
    msg = wr._request(wr.FETCH, 7, None, 0, body)
    await wr.serve_request(handler, "peer", channel, msg, lambda n: None)  # type: ignore[arg-type]
    kind, rid = wr._HDR.unpack_from(channel.sent[0])
    assert rid == 7
    if kind == wr.ERROR:
        (status,) = struct.unpack_from("!I", channel.sent[0], wr._HDR.size)
        raise error_from_status(status, channel.sent[0][wr._HDR.size + 4 :].decode())
    data = b"".join(m[wr._HDR.size :] for m in channel.sent if wr._HDR.unpack_from(m)[0] == wr.DATA)
    head = channel.sent[0][wr._HDR.size :]
    return data, head[8:].decode()


async def _over_bulk(front: Any, body: bytes) -> bytes:
    """One Fetch over a bulk connection (a socket pair: no network), served by the edge's own
    :class:`BulkConnection` on its thread, read with the client's own answer parsing."""
    loop = asyncio.get_running_loop()
    listener = BulkListener(front, "127.0.0.1", 0)  # never started: only its connection serves
    listener._loop = loop
    ours, theirs = socket.socketpair()
    theirs.settimeout(5.0)
    thread = threading.Thread(target=BulkConnection(listener, theirs, None).serve, daemon=True)
    thread.start()
    ours.setblocking(False)
    head = bytearray(wb.ANSWER.size)
    try:
        assert (await wb.recv_answer(loop, ours, head))[0] == 0  # the hello was accepted
        await loop.sock_sendall(ours, wb.REQUEST.pack(wb.FETCH, len(body)) + body)
        status, text, size = await wb.recv_answer(loop, ours, head)
        if status:
            raise error_from_status(status, text)
        data = bytearray(size)
        await wb.recv_exactly(loop, ours, memoryview(data))
        return bytes(data)
    finally:
        ours.close()
        await asyncio.to_thread(thread.join, 5.0)


def test_a_refusal_and_a_hit_read_the_same_over_every_transport() -> None:
    chain = make_chain(2, seed=31)
    held, missing = 0, 1

    async def main() -> None:
        async with InProcessEdge() as edge:
            front, refused = edge.front, edge.node.metrics.refused.labels("Fetch", "NOT_FOUND")
            edge.node.store.put(chain.blobs[held], tenant=chain.namespace.tenant)

            def request(i: int) -> Any:
                return fetch_request(chain.keys[i], fingerprint=chain.fingerprint, namespace=chain.namespace)

            async def grpc_fetch(i: int) -> bytes:
                async with AsyncEdgeClient("inproc:e0", channel=edge.channel()) as client:
                    return await client.fetch(chain.keys[i], fingerprint=chain.fingerprint, namespace=chain.namespace)

            async def bulk_fetch(i: int) -> bytes:
                return await _over_bulk(front, request(i).SerializeToString())

            async def front_fetch(i: int) -> bytes:
                try:
                    data, _source = await front.fetch(FetchAsk(chain.spec(i), []), None)
                except e.KdnError as exc:
                    front.refuse("Fetch", exc, via="test")
                    raise
                return data

            async def rtc_fetch(i: int) -> bytes:
                return (await _over_rtc(EdgeRtcHandler(front), request(i)))[0]

            for fetch in (grpc_fetch, bulk_fetch, front_fetch, rtc_fetch):
                assert await fetch(held) == chain.blobs[held], fetch.__name__
                before = refused._value.get()
                with pytest.raises(e.NotFound):
                    await fetch(missing)
                assert refused._value.get() == before + 1, fetch.__name__

    asyncio.run(main())


def test_a_request_a_transport_cannot_read_is_refused_by_the_front_too() -> None:
    async def main() -> None:
        async with InProcessEdge() as edge:
            counter = edge.node.metrics.refused.labels("Fetch", "INVALID_ARGUMENT")
            with pytest.raises(e.InvalidInput):
                await _over_bulk(edge.front, b"\xff\xff not a FetchRequest")
            assert counter._value.get() == 1
            with pytest.raises(e.InvalidInput):
                await _over_rtc(EdgeRtcHandler(edge.front), b"\xff\xff not a FetchRequest")
            assert counter._value.get() == 2

    asyncio.run(main())
