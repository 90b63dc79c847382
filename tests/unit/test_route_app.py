"""The router end to end without sockets: its Starlette app driven through ``httpx.ASGITransport``,
two fake vLLM hosts (``tests/route_fakes.py``: a real KDN client, a prefill that costs time), each
beside a real edge node served by its real servicer on an in-process channel, the two edges peers
of one overlay (``InMemoryOverlay``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import httpx
import pytest

from kdn.transport import GrpcEdgeTransport
from kdn.testing import InMemoryOverlay, InProcessEdge
from kdn.route.app import build_app
from kdn.route.config import RouteConfig
from kdn.route.edges import GrpcEdgeView
from kdn.route.router import Router
from tests.route_fakes import FP, SHAPE, ChatByteTokenizer, FakeHost

C = 64  # tokens per chunk (pieces of 32 after the last full one)
S_PER_TOKEN = 0.002
DOC = ("The lease runs for twelve months from the first of March; rent is due on the fifth; bins are emptied on "
       "Mondays and Thursdays; the garden is shared; pets need the landlord's written consent; notice is two months "
       "for either side; the deposit is held by the county scheme; keys are returned at the end.")  # ~290 tokens


class Fleet:
    def __init__(self, router: Router, hosts: dict[str, FakeHost], edges: list[InProcessEdge], front: httpx.AsyncClient):
        self.router, self.hosts, self.edges, self.front = router, hosts, edges, front

    async def complete(self, prompt: str, **body: Any) -> httpx.Response:
        return await self.front.post("/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 4,
                                                              **body})

    def edge_counter(self, i: int, name: str) -> float:
        return self.edges[i].node.metrics.counters().get(name, 0.0)


@contextlib.asynccontextmanager
async def fleet(policy: str = "cost", *, owned_by: tuple[str, str] = ("vllm", "vllm"), connect_fails: str = "",
                s_per_byte_loaded: float = 0.0, **cfg: Any) -> AsyncIterator[Fleet]:
    overlay = InMemoryOverlay(2, replicas=2)
    await overlay.start()
    edges = [InProcessEdge(node=overlay.nodes[f"e{i}"]) for i in range(2)]
    tok = ChatByteTokenizer()
    hosts = {f"h{i}": FakeHost(f"h{i}", tok, GrpcEdgeTransport(f"inproc:e{i}", channel=edges[i].channel(), bulk=False),
                               s_per_token=S_PER_TOKEN, chunk_size=C, owned_by=owned_by[i],
                               s_per_byte_loaded=s_per_byte_loaded) for i in range(2)}
    config = RouteConfig.build({
        "hosts": [{"url": f"http://h{i}.test:8000", "edge": f"inproc:e{i}", "name": f"h{i}"} for i in range(2)],
        "chunk_size": C, "policy": policy, "calibrate_tokens": [], "prior_s_per_token": S_PER_TOKEN,
        "prior_link_bytes_per_s": {"memory": 1e9, "disk": 1e8, "peer": 1e6, "origin": 1e5}, **cfg})

    def client(spec: Any) -> httpx.AsyncClient:
        if spec.name == connect_fails:  # answers its health checks, refuses the requests themselves
            def refuse(request: httpx.Request) -> httpx.Response:
                if request.method == "POST":
                    raise httpx.ConnectError("connection refused", request=request)
                if request.url.path == "/v1/models":
                    return httpx.Response(200, json={"data": [{"id": "fake-model", "owned_by": "vllm"}]})
                return httpx.Response(200)
            return httpx.AsyncClient(transport=httpx.MockTransport(refuse), base_url=spec.url)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=hosts[spec.name].app), base_url=spec.url)

    router = Router(config, tokenizer=tok, fingerprint=FP, kv_bytes_per_token=SHAPE.bytes_per_token(), clients=client,
                    edges=lambda spec: GrpcEdgeView(spec.edge, channel=edges[int(spec.name[1])].channel()))
    await router.start(background=False)
    for h in router.hosts:
        await router.check(h)
    front = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://router.test")
    try:
        yield Fleet(router, hosts, edges, front)
    finally:
        await front.aclose()
        for h in hosts.values():
            await h.close()
        await router.stop()
        await overlay.stop()


async def ingest_at(f: Fleet, host: str) -> None:
    """The document computed once by ``host`` (not through the router): its edge holds it."""
    h = f.hosts[host]
    await h.prefill(ChatByteTokenizer().encode_prompt(DOC), True)
    await h.client.flush(5)


def test_document_requests_go_to_the_holder_then_to_the_peer_fetching_host_when_it_is_saturated() -> None:
    async def go() -> None:
        async with fleet("cost") as f:
            await ingest_at(f, "h0")
            assert f.hosts["h0"].counters["computed_tokens"] == len(DOC)
            # one request at a time: the host whose edge holds the document wins every time
            for q in range(3):
                r = await f.complete(DOC + f" Question {q}: when are bins emptied?")
                assert r.status_code == 200, r.text
                assert r.headers["x-kdn-route-host"] == "h0"
            assert f.hosts["h1"].counters["requests"] == 0
            assert f.edge_counter(1, "kdn_edge_upstream_fetches_total{outcome=ok,target=peer}") == 0
            # a burst: h0's queue grows, and the score moves requests to h1, which fetches the
            # document from h0's edge (a peer) instead of recomputing it
            h1_view = next(h for h in f.router.hosts if h.name == "h1")
            h1_view.links.min_bytes = 1024  # this test's KV is tiny
            await f.router.read_rates(h1_view)  # the edge's counters before
            burst = await asyncio.gather(*(f.complete(DOC + f" Burst question {q}?") for q in range(8)))
            assert all(r.status_code == 200 for r in burst)
            where = [r.headers["x-kdn-route-host"] for r in burst]
            assert where[0] == "h0" and "h1" in where, where
            h1 = f.hosts["h1"].counters
            assert h1["requests"] == where.count("h1")
            assert h1["reused_chunks"] >= 4 and h1["reused_pieces"] >= 1
            assert h1["computed_tokens"] < h1["requests"] * 64  # the question, never the document
            assert f.edge_counter(1, "kdn_edge_upstream_fetches_total{outcome=ok,target=peer}") >= 4
            assert f.edge_counter(1, "kdn_edge_bytes_in_total{source=peer}") > 0
            assert f.edge_counter(1, "kdn_edge_upstream_fetches_total{outcome=ok,target=origin}") == 0
            # ... and those fetches measured h1's peer link: the prior is replaced
            await f.router.read_rates(h1_view)
            assert "peer" in h1_view.links.measured and h1_view.links.rates()["peer"] != 1e6

    asyncio.run(go())


def test_the_engines_cost_of_loading_kv_is_measured_and_priced() -> None:
    """Hosts whose engines take time to take in loaded KV (beyond the link time the edges measure):
    the first bytes of streamed answers that loaded KV teach the router that cost, and its
    estimates then include it."""
    load_s = 0.3  # what taking in the document's KV costs an engine (recomputing it: ~0.58 s)
    per_byte = load_s / (len(DOC) * SHAPE.bytes_per_token())

    async def stream(f: Fleet, prompt: str) -> str:
        async with f.front.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True}) as r:
            assert r.status_code == 200
            async for _ in r.aiter_raw():
                pass
            return r.headers["x-kdn-route-host"]

    async def go() -> None:
        async with fleet("cost", s_per_byte_loaded=per_byte) as f:
            await ingest_at(f, "h0")
            h0, h1 = f.router.hosts[:2]
            h1.status = "down"  # h0 serves every request (no health loop runs here to bring h1 back)
            assert h0.fit.load_s_per_byte == 0.0
            for q in range(6):  # one at a time, alternately a fresh prompt and the document
                assert await stream(f, f"fresh prompt number {q} " * (q + 1)) == "h0"
                h0.record.clear()  # so the document is loaded from the edge, not found in the engine
                assert await stream(f, DOC + f" Question {q}?") == "h0"
            assert f.hosts["h0"].counters["reused_chunks"] >= 6 * 4
            assert h0.fit.load_s_per_byte == pytest.approx(per_byte, rel=0.3)
            h0.record.clear()
            r = await f.front.post("/route/explain/completions", json={"prompt": DOC + " Next?"})
            c = {c["host"]: c for c in r.json()["candidates"]}["h0"]
            assert c["fetch_s"] - c["link_s"] == pytest.approx(load_s * c["loaded_tokens"] / len(DOC), rel=0.3)

    asyncio.run(go())


def test_prefix_overlap_piles_a_burst_onto_the_holder() -> None:
    async def go() -> None:
        async with fleet("prefix_overlap") as f:
            await ingest_at(f, "h0")
            burst = await asyncio.gather(*(f.complete(DOC + f" Burst question {q}?") for q in range(6)))
            assert [r.headers["x-kdn-route-host"] for r in burst] == ["h0"] * 6
            assert f.hosts["h1"].counters["requests"] == 0

    asyncio.run(go())


def test_round_robin_alternates_whatever_is_held() -> None:
    async def go() -> None:
        async with fleet("round_robin") as f:
            await ingest_at(f, "h0")
            where = [(await f.complete(DOC + f" Q{q}?")).headers["x-kdn-route-host"] for q in range(4)]
            assert sorted(where) == ["h0", "h0", "h1", "h1"] and where[0] != where[1]

    asyncio.run(go())


def test_equal_scores_spread_over_hosts() -> None:
    async def go() -> None:
        async with fleet("cost") as f:
            where = [(await f.complete(f"Fresh prompt number {q} that nobody holds.")).headers["x-kdn-route-host"]
                     for q in range(4)]
            assert sorted(where) == ["h0", "h0", "h1", "h1"]

    asyncio.run(go())


def test_a_conversation_sticks_to_the_host_that_served_its_last_turn() -> None:
    async def go() -> None:
        async with fleet("cost") as f:
            messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "When are bins emptied?"}]
            first = await f.front.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages})
            assert first.status_code == 200, first.text
            host = first.headers["x-kdn-route-host"]
            for turn in range(3):
                messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"And {turn}?"}]
                r = await f.front.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages})
                assert r.status_code == 200 and r.headers["x-kdn-route-host"] == host
            other = f.hosts["h1" if host == "h0" else "h0"]
            assert other.counters["requests"] == 0
            assert f.hosts[host].counters["reused_chunks"] >= 3 * 4  # each turn reused the history so far

    asyncio.run(go())


def test_streamed_answers_pass_through_and_measure_the_host() -> None:
    async def go() -> None:
        async with fleet("cost") as f:
            async with f.front.stream("POST", "/v1/completions", json={"prompt": "stream me please", "stream": True}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                text = b"".join([piece async for piece in r.aiter_raw()]).decode()
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            assert events and events[0]["choices"][0]["text"] == "ok"
            assert text.rstrip().endswith("data: [DONE]")
            host = next(h for h in f.router.hosts if h.name == r.headers["x-kdn-route-host"])
            assert host.counters["first_bytes"] == 1 and host.fit.n == 1
            assert not host.active  # its accounting ended with the stream
            # what was predicted beside what came, in the stats: where a pick went wrong shows there
            stats = (await f.front.get("/route/stats")).json()
            pred = next(h for h in stats["hosts"] if h["name"] == host.name)["predictions"]
            assert pred["n"] == 1 and pred["mean_observed_s"] > 0.0
            assert pred["median_error_s"] == pytest.approx(pred["mean_observed_s"] - pred["mean_predicted_s"])
            assert pred["mean_predicted_s"] == pytest.approx(pred["mean_queue_s"] + pred["mean_fetch_s"]
                                                             + pred["mean_prefill_s"], rel=1e-6, abs=1e-9)

    asyncio.run(go())


@pytest.mark.parametrize(("body", "status", "says"), [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "m"}', 400, "prompt"),
    (b'{"prompt": {"a": 1}}', 400, "prompt"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    (b'{"prompt": "x", "kv_transfer_params": {"kdn_tenant": "bad tenant!"}}', 400, "tenant"),
    (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "bytes"),
])
def test_bad_requests_get_a_json_error_and_reach_no_host(body: bytes, status: int, says: str) -> None:
    async def go() -> None:
        async with fleet("cost", max_body_bytes=4096) as f:
            r = await f.front.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status
            assert says in r.json()["error"]["message"]
            assert r.json()["error"]["code"] == status
            assert all(h.counters["requests"] == 0 for h in f.hosts.values())
            ok = await f.complete("the router still serves")
            assert ok.status_code == 200

    asyncio.run(go())


def test_bad_chat_messages_are_refused() -> None:
    async def go() -> None:
        async with fleet("cost") as f:
            for messages in ([], "hi", [{"content": "no role"}], [{"role": "user", "content": 5}]):
                r = await f.front.post("/v1/chat/completions", json={"messages": messages})
                assert r.status_code == 400, messages
            assert all(h.counters["requests"] == 0 for h in f.hosts.values())

    asyncio.run(go())


def test_tenant_tokens() -> None:
    async def go() -> None:
        async with fleet("cost", tokens={"tok-a": ["tenant-a"], "tok-ops": ["*"]}) as f:
            body = {"prompt": "hello", "kv_transfer_params": {"kdn_tenant": "tenant-a"}}
            assert (await f.front.post("/v1/completions", json=body)).status_code == 401
            bad = await f.front.post("/v1/completions", json=body, headers={"authorization": "Bearer nope"})
            assert bad.status_code == 401
            other = {"prompt": "hello", "kv_transfer_params": {"kdn_tenant": "tenant-b"}}
            r = await f.front.post("/v1/completions", json=other, headers={"authorization": "Bearer tok-a"})
            assert r.status_code == 403 and "tenant-b" in r.json()["error"]["message"]
            salted = {"prompt": "hello", "cache_salt": "tenant-b"}
            r = await f.front.post("/v1/completions", json=salted, headers={"authorization": "Bearer tok-a"})
            assert r.status_code == 403
            assert all(h.counters["requests"] == 0 for h in f.hosts.values())
            ok = await f.front.post("/v1/completions", json=body, headers={"authorization": "Bearer tok-a"})
            assert ok.status_code == 200
            # the tenant's token is the router's business: the host does not see it
            assert all("authorization" not in json.dumps(b) for h in f.hosts.values() for b in h.bodies)
            assert (await f.front.get("/route/stats")).status_code == 401
            # every tenant's traffic: a tenant's token is refused, an operator's (granted *) is not
            r = await f.front.get("/route/stats", headers={"authorization": "Bearer tok-a"})
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
            assert (await f.front.get("/route/stats", headers={"authorization": "Bearer tok-ops"})).status_code == 200

    asyncio.run(go())


def test_a_host_that_is_not_vllm_is_never_used() -> None:
    async def go() -> None:
        async with fleet("round_robin", owned_by=("vllm", "someone-else")) as f:
            h1 = next(h for h in f.router.hosts if h.name == "h1")
            assert h1.status == "not_vllm" and "vLLM" in h1.error
            where = {(await f.complete(f"q{q}")).headers["x-kdn-route-host"] for q in range(4)}
            assert where == {"h0"}
            assert f.hosts["h1"].counters["requests"] == 0

    asyncio.run(go())


def test_a_host_that_stops_answering_is_taken_out_and_comes_back() -> None:
    async def go() -> None:
        async with fleet("round_robin", fail_after=2) as f:
            f.hosts["h1"].down = True
            h1 = next(h for h in f.router.hosts if h.name == "h1")
            await f.router.check(h1)
            assert h1.status == "up"  # one failed check is not enough
            await f.router.check(h1)
            assert h1.status == "down"
            where = {(await f.complete(f"q{q}")).headers["x-kdn-route-host"] for q in range(4)}
            assert where == {"h0"}
            f.hosts["h1"].down = False
            await f.router.check(h1)
            assert h1.status == "up"
            where = {(await f.complete(f"again {q}")).headers["x-kdn-route-host"] for q in range(4)}
            assert where == {"h0", "h1"}
            f.hosts["h0"].down = True
            for h in f.router.hosts:
                await f.router.check(h)
                await f.router.check(h)
            f.hosts["h1"].down = True
            for h in f.router.hosts:
                await f.router.check(h)
                await f.router.check(h)
            r = await f.complete("nobody home")
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            assert (await f.front.get("/health")).status_code == 503

    asyncio.run(go())


def test_a_host_that_refuses_connections_is_skipped_without_losing_the_request() -> None:
    async def go() -> None:
        async with fleet("round_robin", connect_fails="h1", fail_after=1) as f:
            for q in range(4):
                r = await f.complete(f"q{q}")
                assert r.status_code == 200 and r.headers["x-kdn-route-host"] == "h0"
            h1 = next(h for h in f.router.hosts if h.name == "h1")
            assert h1.status == "down" and "ConnectError" in h1.error
            assert f.router.counters["retried"] >= 1
            assert f.hosts["h0"].counters["requests"] == 4

    asyncio.run(go())


def test_explain_prices_every_host_without_forwarding() -> None:
    async def go() -> None:
        async with fleet("cost") as f:
            await ingest_at(f, "h0")
            r = await f.front.post("/route/explain/completions", json={"prompt": DOC + " Which day?"})
            assert r.status_code == 200
            plan = r.json()
            by = {c["host"]: c for c in plan["candidates"]}
            assert plan["host"] == "h0"
            assert by["h0"]["chunks"] == ["memory"] * 4 and by["h0"]["pieces"] == ["memory"]
            assert by["h1"]["chunks"] == ["peer"] * 4 and by["h1"]["pieces"] == ["peer"]
            assert by["h1"]["fetch_bytes"]["peer"] == (4 * C + 32) * SHAPE.bytes_per_token()
            assert by["h0"]["ttft_s"] < by["h1"]["ttft_s"]
            assert all(h.counters["requests"] == 0 for h in f.hosts.values())
            assert all(not h.active for h in f.router.hosts)

    asyncio.run(go())
