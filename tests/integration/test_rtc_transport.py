"""The WebRTC data-channel transport (kdn.wire.rtc) between two endpoints on loopback.

aioice offers no loopback candidates by default; these tests patch its host-address list to
127.0.0.1 (the NAT lab, test_rtc_nat.py, uses real interfaces). Signalling is a real
``SignalService`` on loopback gRPC. Checks: artifact bytes arrive whole and verify; Lookup and
Fetch carry the same auth rules as gRPC (a wrong token or another tenant is refused over the
channel); errors map to the same KdnErrors; a peer that does not answer in time is Unavailable;
an artifact larger than the channel buffer crosses with back-pressure.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

pytest.importorskip("aiortc")

from kdn.errors import NotFound, Unauthorized, Unavailable  # noqa: E402
from kdn.proto import kdn_pb2 as pb  # noqa: E402
from kdn.wire.auth import TokenAuth  # noqa: E402
from kdn.wire.errors import status_for, status_value  # noqa: E402
from kdn.wire.rtc import HIGH_WATER, RtcEndpoint  # noqa: E402
from kdn.wire.service import add_servicer  # noqa: E402
from kdn.wire.signal import SignalBoard, SignalClient, SignalServicer  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def loopback_candidates(monkeypatch):
    import aioice.ice

    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])


class Handler:
    """A tiny peer edge: artifacts by (tenant, key), tokens checked like the edge's."""

    def __init__(self, auth: TokenAuth, artifacts: dict[tuple[str, bytes], bytes]) -> None:
        self.auth, self.artifacts = auth, artifacts
        self.forwarded: list[bool] = []

    async def lookup(self, request: pb.LookupRequest, token: str | None) -> pb.LookupResponse:
        self.auth.check(token, request.namespace.tenant)
        n = 0
        for k in request.keys:
            if (request.namespace.tenant, bytes(k)) not in self.artifacts:
                break
            n += 1
        return pb.LookupResponse(available=n, node_id="b")

    async def fetch(
        self, request: pb.FetchRequest, token: str | None, *, forwarded: bool, link_codec: bool = False
    ) -> tuple[bytes, str]:
        self.auth.check(token, request.namespace.tenant)
        self.forwarded.append(forwarded)
        data = self.artifacts.get((request.namespace.tenant, bytes(request.key)))
        if data is None:
            raise NotFound(f"no artifact {bytes(request.key).hex()[:16]}")
        return data, "memory"

    def refuse(self, rpc: str, exc: BaseException) -> tuple[int, str]:
        code, message = status_for(exc)  # the one mapping, as the edge's front applies it
        return status_value(code), message


async def _pair(artifacts, *, tokens=None, timeout_s: float = 10.0):
    from kdn.wire.auth import SIGNAL_NODE, EdgeKey

    auth = TokenAuth.from_config(tokens or {})
    server = grpc.aio.server()
    key = "rtc-transport-cluster-key"  # signalling takes edge tokens only
    add_servicer(server, SignalServicer(SignalBoard(), auth, edges=EdgeKey(key, SIGNAL_NODE)), "SignalService")
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    addr = f"127.0.0.1:{port}"
    ca, cb = SignalClient(addr, edge=EdgeKey(key, "a")), SignalClient(addr, edge=EdgeKey(key, "b"))
    await ca.announce("a", "10.0.0.1:1")
    await cb.announce("b", "10.0.0.2:1")
    handler = Handler(auth, artifacts)
    a = RtcEndpoint("a", ca, connect_timeout_s=timeout_s)
    b = RtcEndpoint("b", cb, handler=handler, connect_timeout_s=timeout_s)
    a.start()
    b.start()

    async def close():
        await a.close()
        await b.close()
        await ca.close()
        await cb.close()
        await server.stop(None)

    return a, b, handler, close


def _fetch_req(key: bytes, tenant: str = "t1") -> pb.FetchRequest:
    return pb.FetchRequest(key=key, namespace=pb.Namespace(tenant=tenant), fingerprint=b"\0" * 32)


@pytest.mark.timeout(60)
def test_fetch_and_lookup_over_a_data_channel_with_back_pressure():
    big = os.urandom(3 * HIGH_WATER + 12345)  # several times the channel's high-water mark

    async def main():
        a, b, handler, close = await _pair({("t1", b"k1"): big, ("t1", b"k2"): b"small"})
        try:
            client = await a.connect("b")
            assert client.path == "direct" and client.setup_s > 0
            assert (await a.connect("b")) is client  # reused while open
            resp = await client.lookup(pb.LookupRequest(keys=[b"k1", b"k2", b"k3"], namespace=pb.Namespace(tenant="t1")),
                                       token=None, timeout_s=5)
            assert resp.available == 2
            # two fetches at once on one channel: answers are matched by request id
            (d1, s1), (d2, _) = await asyncio.gather(
                client.fetch(_fetch_req(b"k1"), token=None, timeout_s=20, limit=64 << 20, forwarded=True),
                client.fetch(_fetch_req(b"k2"), token=None, timeout_s=20, limit=64 << 20),
            )
            assert d1 == big and s1 == "memory" and d2 == b"small"
            assert sorted(handler.forwarded) == [False, True]
            with pytest.raises(NotFound):
                await client.fetch(_fetch_req(b"nope"), token=None, timeout_s=5, limit=1 << 20)
            from kdn.errors import MessageTooLarge

            with pytest.raises(MessageTooLarge):
                await client.fetch(_fetch_req(b"k1"), token=None, timeout_s=20, limit=1 << 20)
            d, _ = await client.fetch(_fetch_req(b"k2"), token=None, timeout_s=5, limit=1 << 20)
            assert d == b"small"  # the channel still serves after refusals
        finally:
            await close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_the_channel_is_not_a_way_around_auth():
    async def main():
        tokens = {"tok-a": ["t1"], "tok-b": ["t2"]}
        a, b, handler, close = await _pair({("t1", b"k1"): b"secret"}, tokens=tokens)
        try:
            client = await a.connect("b")
            d, _ = await client.fetch(_fetch_req(b"k1"), token="tok-a", timeout_s=5, limit=1 << 20)
            assert d == b"secret"
            for token in (None, "wrong", "tok-b"):  # missing, unknown, and another tenant's token
                with pytest.raises(Unauthorized):
                    await client.fetch(_fetch_req(b"k1"), token=token, timeout_s=5, limit=1 << 20)
                with pytest.raises(Unauthorized):
                    await client.lookup(pb.LookupRequest(keys=[b"k1"], namespace=pb.Namespace(tenant="t1")),
                                        token=token, timeout_s=5)
        finally:
            await close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_peer_that_never_answers_is_unavailable_in_time():
    async def main():
        a, b, handler, close = await _pair({}, timeout_s=1.5)
        await b.close()  # announced, but nobody reads its mailbox
        try:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(Unavailable, match="timed out"):
                await a.connect("b")
            assert asyncio.get_running_loop().time() - t0 < 5
            with pytest.raises(Unavailable, match="failed"):  # fails fast until retry_after_s passes
                await a.connect("b")
            with pytest.raises(Unavailable):
                await a.connect("nobody")  # never announced: the signalling service says so
        finally:
            await close()

    asyncio.run(main())
