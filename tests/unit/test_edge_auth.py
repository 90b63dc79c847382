"""Bearer tokens -> tenants; refusals that do not depend on whether an artifact exists."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kdn.wire.auth import TokenAuth
from kdn.edge.compose import compose_edge
from kdn.edge.front import EdgeFront
from kdn.edge.server import EdgeServicer
from kdn.wire.frames import decode_chunk
from kdn.testing import Aborted, FakeServicerContext, InMemoryOverlay, make_chain, origin_with
from kdn.errors import Unauthorized
from kdn.keys import Namespace
from kdn.proto import kdn_pb2 as pb



def _front(node: Any, auth: TokenAuth) -> EdgeFront:
    return compose_edge(node.config, address=node.address, auth=auth, clock=node.clock, node=node, hints_dir=None,
                        shm=False).front

def test_token_grants() -> None:
    auth = TokenAuth.from_config({"tok-a": ["acme"], "tok-ops": ["*"]})
    auth.check("tok-a", "acme")
    auth.check("tok-ops", "anyone")
    for token, tenant in [("tok-a", "globex"), ("nope", "acme"), (None, "acme"), ("", "acme")]:
        with pytest.raises(Unauthorized):
            auth.check(token, tenant)
    auth.check_admin("tok-a")
    with pytest.raises(Unauthorized):
        auth.check_admin("nope")
    TokenAuth().check(None, "whoever")  # no tokens configured: auth off


def _fetch_req(chain: Any, i: int, tenant: str) -> pb.FetchRequest:
    return pb.FetchRequest(fingerprint=bytes(chain.fingerprint), namespace=pb.Namespace(tenant=tenant), key=bytes(chain.keys[i]))


def test_foreign_namespace_refused_identically_whether_or_not_it_exists() -> None:
    acme = make_chain(2, namespace=Namespace("acme"))
    origin = origin_with([acme])

    async def call(servicer: EdgeServicer, req: pb.FetchRequest, token: str | None) -> tuple[Any, str, list[bytes]]:
        ctx = FakeServicerContext(token)
        out: list[bytes] = []
        try:
            async for chunk in servicer.Fetch(req, ctx):  # type: ignore[arg-type]
                out.append(bytes(decode_chunk(chunk).data))
        except Aborted:
            pass
        return ctx.code, ctx.details, out

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin, tokens={"tok-acme": ["acme"], "tok-globex": ["globex"]}) as ov:
            node = ov.nodes["e0"]
            node.store.put(acme.blobs[0], tenant="acme")  # chunk 0 exists here, chunk 1 only at the origin
            cfg = node.config
            servicer = EdgeServicer(_front(node, TokenAuth.from_config(cfg.tokens)))

            code, _, out = await call(servicer, _fetch_req(acme, 0, "acme"), "tok-acme")
            assert code is None and b"".join(out) == acme.blobs[0]

            answers = set()
            for i in (0, 1):  # exists locally / exists upstream / never existed -> the same answer
                answers.add((await call(servicer, _fetch_req(acme, i, "acme"), "tok-globex"))[:2])
            never = make_chain(1, namespace=Namespace("acme"), seed=9)
            answers.add((await call(servicer, _fetch_req(never, 0, "acme"), "tok-globex"))[:2])
            assert len(answers) == 1
            code, details = answers.pop()
            assert code == grpc.StatusCode.UNAUTHENTICATED and "acme" in details
            assert origin.fetches == 0  # refused before anything was looked up

            for token in (None, "wrong"):
                code, details, _ = await call(servicer, _fetch_req(acme, 0, "acme"), token)
                assert code == grpc.StatusCode.UNAUTHENTICATED
            # a granted tenant asking for another tenant's key: absent, exactly like a missing key
            globex_req = _fetch_req(acme, 0, "globex")
            code, _, _ = await call(servicer, globex_req, "tok-globex")
            assert code == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())


def test_malformed_input_is_invalid_argument() -> None:
    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin_with([])) as ov:
            node = ov.nodes["e0"]
            servicer = EdgeServicer(_front(node, TokenAuth()))
            chain = make_chain(1)
            bad = [
                pb.FetchRequest(fingerprint=bytes(chain.fingerprint), namespace=pb.Namespace(tenant="default"), key=b"short"),
                pb.FetchRequest(fingerprint=b"x" * 5, namespace=pb.Namespace(tenant="default"), key=bytes(chain.keys[0])),
                pb.FetchRequest(fingerprint=bytes(chain.fingerprint), namespace=pb.Namespace(tenant="bad/tenant"), key=bytes(chain.keys[0])),
                pb.FetchRequest(fingerprint=bytes(chain.fingerprint), namespace=pb.Namespace(tenant="default"), key=bytes(chain.keys[0]),
                                next_keys=[b"\x00" * 32] * 5000),
            ]
            codes = []
            for req in bad:
                ctx = FakeServicerContext(None)
                try:
                    async for _ in servicer.Fetch(req, ctx):  # type: ignore[arg-type]
                        pass
                except Aborted:
                    pass
                codes.append(ctx.code)
            assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED]

    asyncio.run(main())
