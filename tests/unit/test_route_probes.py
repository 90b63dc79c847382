"""Adversarial probes of ``kdn route``'s front: bad bodies, bad tokens, lying sizes, hosts that
refuse, hang, break off or answer garbage, clients that leave early. Each probe checks the answer
(a 4xx/5xx with a JSON error body), that nothing reached a host that should not, that the next good
request is served, and that the router's in-flight accounting and upstream connections are left
clean.

Most probes drive the app in process (``httpx.ASGITransport``); the ones about connections (sizes
that lie, clients that disconnect, answers broken off mid-body, a host that hangs) serve the router
(or the host) with uvicorn on a Unix socket (unit tests open no internet socket) and talk real
HTTP/1.1 to it. Hosts are :class:`tests.route_fakes.FakeHost` (a good vLLM)
or ``httpx.MockTransport`` handlers that misbehave on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kdn.route.app import build_app
from kdn.route.config import HostSpec, RouteConfig
from kdn.route.router import Router
from tests.route_fakes import FP, SHAPE, ChatByteTokenizer, FakeHost

Post = Callable[[httpx.Request], Awaitable[httpx.Response]]
MODELS = {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "vllm"}]}


def answer(status: int, body: bytes, content_type: str = "application/json") -> httpx.Response:
    """A host's answer as a transport hands it over: a body not yet read."""
    return httpx.Response(status, stream=Stream([body]), headers={"content-type": content_type})


class Uds(str):
    """A host reached over the Unix socket at this path."""


def vllm(post: Post) -> httpx.MockTransport:
    """A host that passes its health checks and answers every POST with ``post``."""

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/health":
            return httpx.Response(200)
        if request.method == "GET" and request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        return await post(request)

    return httpx.MockTransport(handle)


class Stream(httpx.AsyncByteStream):
    """An upstream body: ``pieces`` (then ``error`` raised, or forever more when ``endless``);
    records whether the router closed it."""

    def __init__(self, pieces: list[bytes], *, error: Exception | None = None, endless: bool = False,
                 pause_s: float = 0.02) -> None:
        self.pieces, self.error, self.endless, self.pause_s = pieces, error, endless, pause_s
        self.closed = asyncio.Event()
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for p in self.pieces:
            self.sent += 1
            yield p
            await asyncio.sleep(self.pause_s)
        while self.endless:
            self.sent += 1
            yield b'data: {"choices": [{"text": "more"}]}\n\n'
            await asyncio.sleep(self.pause_s)
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed.set()


class Rig:
    def __init__(self, router: Router, fakes: dict[str, FakeHost], front: httpx.AsyncClient) -> None:
        self.router, self.fakes, self.front = router, fakes, front

    def host(self, name: str) -> Any:
        return next(h for h in self.router.hosts if h.name == name)

    def reached(self) -> float:
        return sum(f.counters["requests"] for f in self.fakes.values())

    def active(self) -> int:
        return sum(len(h.active) for h in self.router.hosts)

    async def good(self, **headers: str) -> httpx.Response:
        return await self.front.post("/v1/completions", json={"model": "fake-model", "prompt": "still serving",
                                                              "max_tokens": 2}, headers=headers)


@contextlib.asynccontextmanager
async def rig(hosts: dict[str, FakeHost | httpx.AsyncBaseTransport | Uds], **cfg: Any) -> AsyncIterator[Rig]:
    """A router over ``hosts`` (a fake vLLM, a transport, or a server on a Unix socket), no edges."""
    config = RouteConfig.build({
        "hosts": [{"url": f"http://{name}.test:8000", "name": name} for name in hosts],
        "chunk_size": 64, "calibrate_tokens": [], "policy": "round_robin", **cfg})

    def client(spec: HostSpec) -> httpx.AsyncClient:
        h = hosts[spec.name]
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        if isinstance(h, Uds):
            transport: httpx.AsyncBaseTransport = httpx.AsyncHTTPTransport(uds=h)
        else:
            transport = httpx.ASGITransport(app=h.app) if isinstance(h, FakeHost) else h
        return httpx.AsyncClient(transport=transport, base_url=spec.url, timeout=timeout)

    router = Router(config, tokenizer=ChatByteTokenizer(), fingerprint=FP, kv_bytes_per_token=SHAPE.bytes_per_token(),
                    clients=client, edges=lambda spec: None)
    await router.start(background=False)
    for h in router.hosts:
        await router.check(h)
    front = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router), raise_app_exceptions=False),
                              base_url="http://router.test")
    fakes = {n: h for n, h in hosts.items() if isinstance(h, FakeHost)}
    try:
        yield Rig(router, fakes, front)
    finally:
        await front.aclose()
        await router.stop()
        for f in fakes.values():
            await f.close()


def fake(name: str = "good") -> FakeHost:
    return FakeHost(name, ChatByteTokenizer(), None, s_per_token=0.0, chunk_size=64)


@contextlib.asynccontextmanager
async def served(app: Any) -> AsyncIterator[Uds]:
    """``app`` under uvicorn on a Unix socket."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Uds(Path(tmp) / "http.sock")
        server = uvicorn.Server(uvicorn.Config(app, uds=path, log_level="critical", lifespan="off", access_log=False,
                                                timeout_graceful_shutdown=1))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            yield path
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)


def http(path: Uds) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://router")


async def raw(path: Uds, data: bytes, *, then: str = "read") -> bytes:
    """Send ``data`` on a fresh connection; ``then``: ``read`` (to EOF), ``close`` (at once) or
    ``half`` (shut the write side, read what comes)."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(data)
    await writer.drain()
    if then == "close":
        writer.close()
        return b""
    if then == "half":
        writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


def status_and_json(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        size, _, rest = body.partition(b"\r\n")
        body = rest[: int(size, 16)]
    return status, json.loads(body)


def is_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    return err


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


# -- bodies -----------------------------------------------------------------------------------

DEEP = b"[" * 200_000 + b"]" * 200_000

BAD_BODIES = [
    ("completions", b"{not json"),
    ("completions", b'{"prompt": "\xff\xfe"}'),
    ("completions", b"null"),
    ("completions", b'"prompt"'),
    ("completions", b"5"),
    ("completions", b'{"prompt": ' + DEEP + b"}"),  # nesting deeper than the parser's recursion
    ("completions", b"[" * 100_000),  # ... and unterminated
    ("completions", b'{"prompt": [' + b"7" * 5000 + b"]}"),  # an int longer than Python parses
    ("completions", b'{"prompt": 5}'),
    ("completions", b'{"prompt": [1.5]}'),
    ("completions", b'{"prompt": [-1]}'),
    ("completions", b'{"prompt": [true]}'),
    ("completions", b'{"prompt": []}'),
    ("completions", b'{"prompt": [[]]}'),
    ("completions", b'{"prompt": ["a", [5]]}'),
    ("completions", b'{"prompt": [4294967296]}'),  # past the uint32 token ids keys are made of
    ("completions", b'{"prompt": [5, 18446744073709551616]}'),
    ("completions", b'{"prompt": [[5, 6], [4294967296]]}'),
    ("completions", b'{"prompt": "x", "model": 5}'),
    ("completions", b'{"prompt": "x", "stream": 1}'),
    ("completions", b'{"prompt": "x", "stream": "true"}'),
    ("completions", b'{"prompt": "x", "kv_transfer_params": []}'),
    ("completions", b'{"prompt": "x", "kv_transfer_params": {"kdn_tenant": "a b"}}'),
    ("completions", b'{"prompt": "x", "cache_salt": 5}'),
    ("chat", b'{"messages": {}}'),
    ("chat", b'{"messages": ' + DEEP + b"}"),
    ("chat", b'{"messages": [5]}'),
    ("chat", b'{"messages": [{"role": 5, "content": "x"}]}'),
    ("chat", b'{"messages": [{"role": "user", "content": [5]}]}'),
    ("chat", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    ("chat", b'{"prompt": "a completion body on the chat path"}'),
    ("completions", b'{"prompt": "a \\ud800 lone surrogate"}'),  # valid JSON, no text to tokenize
    ("completions", b'{"prompt": ["\\udfff", "x"]}'),
    ("chat", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("chat", b'{"messages": [{"role": "\\ud800", "content": "x"}]}'),
    ("chat", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),
]


@pytest.mark.parametrize(("endpoint", "body"), BAD_BODIES, ids=[f"{e}-{i}" for i, (e, _) in enumerate(BAD_BODIES)])
def test_a_body_that_is_not_an_openai_request_is_400_and_reaches_no_host(endpoint: str, body: bytes) -> None:
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]

    async def go() -> None:
        async with rig({"a": fake("a"), "b": fake("b")}) as r:
            got = await r.front.post(path, content=body, headers={"content-type": "application/json"})
            assert is_error(got, 400)["type"] == "invalid_request_error"
            explained = await r.front.post(f"/route/explain/{endpoint}", content=body)
            is_error(explained, 400)
            assert r.reached() == 0 and r.active() == 0
            assert r.router.counters["bad_request"] == 1 and r.router.counters["forwarded"] == 0
            assert (await r.good()).status_code == 200

    run(go())


def test_nullable_openai_fields_sent_as_null_are_forwarded() -> None:
    """OpenAI's and vLLM's schemas take ``null`` for ``stream`` and ``model`` (their defaults)."""

    async def go() -> None:
        async with rig({"a": fake("a")}) as r:
            got = await r.front.post("/v1/completions", json={"model": None, "prompt": "x", "stream": None})
            assert got.status_code == 200, got.text
            got = await r.front.post("/v1/chat/completions", json={"model": None, "stream": None,
                                                                   "messages": [{"role": "user", "content": "hi"}]})
            assert got.status_code == 200, got.text
            assert r.reached() == 2 and r.active() == 0

    run(go())


def test_a_mixed_burst_of_bad_and_good_requests_leaves_the_accounting_clean() -> None:
    async def go() -> None:
        async with rig({"a": fake("a"), "b": fake("b")}, max_body_bytes=4096) as r:
            bad = [b"{", b'{"prompt": [4294967296]}', b"[" * 3000, b'{"prompt": "' + b"x" * 5000 + b'"}']
            calls = [r.front.post("/v1/completions", content=b) for b in bad] + [r.good() for _ in range(8)]
            got = await asyncio.gather(*calls)
            assert [g.status_code for g in got[:4]] == [400, 400, 400, 413]
            assert all(g.status_code == 200 for g in got[4:])
            assert r.reached() == 8 and r.active() == 0
            assert all(h.queued().requests == 0 for h in r.router.hosts)

    run(go())


# -- tokens -----------------------------------------------------------------------------------

def test_a_caller_without_a_known_token_gets_401_before_its_body_is_read() -> None:
    """An unauthenticated caller learns nothing from the parser and costs no tokenizing."""

    async def go() -> None:
        async with rig({"a": fake("a")}, tokens={"tok-a": ["tenant-a"]}, max_body_bytes=4096) as r:
            for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic tok-a"},
                            {"authorization": "Bearer "}, {"authorization": "tok-a"}):
                for body in (b"{not json", b'{"prompt": [4294967296]}', b'{"prompt": "hi"}'):
                    got = await r.front.post("/v1/completions", content=body, headers=headers)
                    assert is_error(got, 401)["type"] == "authentication_error", (headers, body)
                    got = await r.front.post("/route/explain/completions", content=body, headers=headers)
                    is_error(got, 401)
            assert r.reached() == 0 and r.router.counters["bad_request"] == 0
            ok = await r.front.post("/v1/completions", json={"prompt": "hi", "cache_salt": "tenant-a"},
                                    headers={"authorization": "bearer  tok-a "})
            assert ok.status_code == 200

    run(go())


@pytest.mark.parametrize("namespace", [
    {"cache_salt": "tenant-b"}, {"cache_salt": "tenant-b:salty"},
    {"kv_transfer_params": {"kdn_tenant": "tenant-b"}},
    {"kv_transfer_params": {"kdn_tenant": "tenant-b"}, "cache_salt": "tenant-a"},
    {"kv_transfer_params": {"kdn_tenant": "tenant-b", "kdn_salt": "x"}, "cache_salt": "tenant-a"},
    {},  # the router's default tenant, not granted either
])
def test_a_token_for_one_tenant_cannot_send_another_tenants_request(namespace: dict[str, Any]) -> None:
    async def go() -> None:
        async with rig({"a": fake("a")}, tokens={"tok-a": ["tenant-a"]}) as r:
            body = {"prompt": "hello", **namespace}
            for path in ("/v1/completions", "/route/explain/completions"):
                got = await r.front.post(path, json=body, headers={"authorization": "Bearer tok-a"})
                assert is_error(got, 403)["type"] == "permission_error"
            assert r.reached() == 0 and r.active() == 0

    run(go())


@pytest.mark.parametrize("params", [{"kdn_tenant": "", "kdn_salt": "x"}, {"kdn": "false"}, {"kdn_tenant": 7},
                                    {"kdn_tenant": "tenant-a", "kdn_salt": 5}])
def test_namespace_parameters_follow_the_engines_rule(params: dict[str, Any]) -> None:
    # the connector refuses these (kdn.keys.request_namespace): the router must not price a chain
    # under a namespace the engine will not use
    async def go() -> None:
        async with rig({"a": fake("a")}, tokens={"tok-a": ["tenant-a"]}) as r:
            body = {"prompt": "hello", "kv_transfer_params": params}
            got = await r.front.post("/v1/completions", json=body, headers={"authorization": "Bearer tok-a"})
            assert is_error(got, 400)["type"] == "invalid_request_error"
            assert r.reached() == 0 and r.active() == 0

    run(go())


def test_the_model_list_needs_a_known_token_when_tokens_are_configured() -> None:
    async def go() -> None:
        async with rig({"a": fake("a")}, tokens={"tok-a": ["tenant-a"]}) as r:
            is_error(await r.front.get("/v1/models"), 401)
            is_error(await r.front.get("/v1/models", headers={"authorization": "Bearer nope"}), 401)
            ok = await r.front.get("/v1/models", headers={"authorization": "Bearer tok-a"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "fake-model"

    run(go())


# -- paths and methods ------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/completions", 405), ("PUT", "/v1/chat/completions", 405), ("DELETE", "/health", 405),
    ("GET", "/route/explain/chat", 405), ("POST", "/route/explain/embeddings", 404),
    ("POST", "/v1/embeddings", 404), ("GET", "/", 404),
])
def test_unknown_paths_and_methods_are_json_errors(method: str, path: str, status: int) -> None:
    async def go() -> None:
        async with rig({"a": fake("a")}) as r:
            is_error(await r.front.request(method, path, content=b'{"prompt": "x"}'), status)
            assert r.reached() == 0

    run(go())


# -- hosts that fail --------------------------------------------------------------------------

def test_every_host_refusing_is_503_and_takes_them_out() -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> None:
        async with rig({"a": vllm(refuse), "b": vllm(refuse)}, fail_after=1) as r:
            got = await r.good()
            assert "no other inference host" in is_error(got, 503)["message"]
            assert r.active() == 0 and r.router.counters["retried"] == 2
            assert [h.status for h in r.router.hosts] == ["down", "down"]
            is_error(await r.good(), 503)
            assert (await r.front.get("/health")).status_code == 503

    run(go())


@pytest.mark.parametrize(("error", "status"), [
    (httpx.ReadTimeout, 504),  # a host that hangs past request_timeout_s before answering
    (httpx.ReadError, 502),  # a host whose connection breaks after the request was sent
    (httpx.WriteError, 502),
])
def test_a_host_failing_after_the_request_was_sent_is_a_json_5xx_and_the_router_goes_on(
        error: type[httpx.TransportError], status: int) -> None:
    async def fail(request: httpx.Request) -> httpx.Response:
        raise error("host failed", request=request)

    async def go() -> None:
        async with rig({"bad": vllm(fail), "good": fake("good")}) as r:
            where = []
            for _ in range(4):  # round robin: two of them go to the failing host
                got = await r.good()
                if got.status_code == 200:
                    where.append(got.headers["x-kdn-route-host"])
                else:
                    assert "bad" in is_error(got, status)["message"]
            assert where == ["good", "good"]
            assert r.active() == 0
            assert r.router.counters["upstream_errors"] == 2 and r.host("bad").counters["failed"] == 2

    run(go())


def test_a_host_that_hangs_is_answered_with_504_within_the_request_timeout() -> None:
    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse(MODELS)

    async def hang(request: Request) -> Response:
        await asyncio.sleep(30)
        return Response(status_code=200)

    host = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/completions", hang, methods=["POST"])])

    async def go() -> None:
        async with served(host) as path:
            async with served_router({"hung": path}, request_timeout_s=0.3) as (r, addr):
                assert r.host("hung").status == "up"
                async with http(addr) as c:
                    got = await asyncio.wait_for(c.post("/v1/completions", json={"prompt": "x"}), 5)
                    assert "hung" in is_error(got, 504)["message"]
                    assert (await c.get("/health")).status_code == 200  # still serving
                assert r.active() == 0

    run(go())


def test_a_host_whose_health_check_hangs_is_taken_out_after_fail_after_checks() -> None:
    hung = {"on": False}

    async def handle(request: httpx.Request) -> httpx.Response:
        if hung["on"]:
            await asyncio.sleep(30)
        if request.url.path == "/v1/models":
            return answer(200, json.dumps(MODELS).encode())
        return answer(200, b"")

    async def go() -> None:
        async with rig({"h": httpx.MockTransport(handle), "good": fake("good")}, fail_after=2,
                       health_timeout_s=0.1) as r:
            h = r.host("h")
            assert h.status == "up"
            hung["on"] = True
            await asyncio.wait_for(r.router.check(h), 1)
            assert h.status == "up" and "0.1s" in h.error  # one late answer is not enough
            await asyncio.wait_for(r.router.check(h), 1)
            assert h.status == "down"
            for _ in range(3):
                got = await r.good()
                assert got.status_code == 200 and got.headers["x-kdn-route-host"] == "good"

    run(go())


def test_a_host_error_answer_and_a_garbage_answer_pass_through_with_clean_accounting() -> None:
    async def odd(request: httpx.Request) -> httpx.Response:
        if b"boom" in request.content:
            return answer(500, b'{"error": {"message": "engine died"}}')
        return answer(200, b"\x00not json at all", "text/plain")

    async def go() -> None:
        async with rig({"odd": vllm(odd)}) as r:
            got = await r.front.post("/v1/completions", json={"prompt": "boom"})
            assert got.status_code == 500 and got.json()["error"]["message"] == "engine died"
            got = await r.front.post("/v1/completions", json={"prompt": "fine"})
            assert got.status_code == 200 and got.content == b"\x00not json at all"
            assert r.active() == 0 and r.router.counters["upstream_errors"] == 1
            assert r.host("odd").status == "up"

    run(go())


def test_a_host_that_is_down_or_not_vllm_is_never_used() -> None:
    async def not_vllm(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return answer(200, b"<html>hello</html>", "text/html")
        return answer(200, b'{"choices": []}')

    async def go() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            gone = Uds(Path(tmp) / "nobody-listens.sock")
            async with rig({"gone": gone, "web": httpx.MockTransport(not_vllm), "good": fake("good")},
                           fail_after=1, connect_timeout_s=0.5) as r:
                assert r.host("gone").status == "down" and r.host("web").status == "not_vllm"
                for _ in range(4):
                    got = await r.good()
                    assert got.status_code == 200 and got.headers["x-kdn-route-host"] == "good"

    run(go())


# -- over a socket: sizes that lie, answers broken off, clients that leave ----------------------

@contextlib.asynccontextmanager
async def served_router(hosts: dict[str, Any], **cfg: Any) -> AsyncIterator[tuple[Rig, Uds]]:
    async with rig(hosts, **cfg) as r:
        async with served(build_app(r.router)) as addr:
            yield r, addr


def post_head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
            f"connection: close\r\n{extra}\r\n").encode()


def test_sizes_that_lie_or_overflow_are_refused_without_reaching_a_host() -> None:
    async def go() -> None:
        async with served_router({"a": fake("a")}, max_body_bytes=1024, body_timeout_s=0.5) as (r, addr):
            # a declared size over the limit: 413 before any of the body is sent
            status, body = status_and_json(await raw(addr, post_head("/v1/completions", "content-length: 5000\r\n")))
            assert status == 413 and body["error"]["code"] == 413
            # a chunked body that grows past the limit
            chunk = b'{"prompt": "' + b"x" * 600
            data = post_head("/v1/completions", "transfer-encoding: chunked\r\n")
            data += b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2 + b"0\r\n\r\n"
            status, body = status_and_json(await raw(addr, data))
            assert status == 413 and body["error"]["type"] == "request_too_large"
            # a declared size the client never sends: the router waits, the client gives up
            short = post_head("/v1/completions", "content-length: 100\r\n") + b'{"prompt": "x"}'
            assert await raw(addr, short, then="half") == b""
            # ... or keeps the connection open without sending the rest: 408 at the body deadline
            t0 = time.monotonic()
            status, body = status_and_json(await raw(addr, short))
            assert status == 408 and body["error"]["type"] == "request_timeout" and time.monotonic() - t0 < 4
            assert r.reached() == 0 and r.active() == 0
            status, _ = status_and_json(await raw(addr, post_head("/v1/completions", "content-length: 17\r\n")
                                                  + b'{"prompt": "ok!"}'))
            assert status == 200 and r.reached() == 1

    run(go())


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_the_host_breaks_off_is_not_passed_on_as_complete(stream: bool) -> None:
    """A host that dies mid-answer: the client must see a broken response (as from the host
    itself), not a clean end of a truncated one."""
    piece = b'data: {"choices": [{"text": "a"}]}\n\n' if stream else b'{"choices": [{"text": "half an ans'

    async def broken(request: httpx.Request) -> httpx.Response:
        body = Stream([piece], error=httpx.RemoteProtocolError("peer closed connection"))
        return httpx.Response(200, stream=body, headers={"content-type": "application/json"})

    async def go() -> None:
        async with served_router({"bad": vllm(broken), "good": fake("good")}) as (r, addr):
            async with http(addr) as c:
                got: list[int | str] = []
                for _ in range(2):
                    try:
                        reply = await c.post("/v1/completions", json={"prompt": "x", "stream": stream})
                        got.append(reply.status_code)
                    except httpx.RemoteProtocolError:
                        got.append("broken")
                assert sorted(got, key=str) == [200, "broken"], got
            assert r.active() == 0 and r.router.counters["upstream_errors"] == 1

    run(go())


def test_a_client_that_leaves_before_the_host_answers_leaves_no_request_in_flight() -> None:
    streams: list[Stream] = []

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.3)  # prefill
        streams.append(Stream([], endless=True))
        return httpx.Response(200, stream=streams[-1], headers={"content-type": "text/event-stream"})

    async def go() -> None:
        async with served_router({"slow": vllm(slow)}) as (r, addr):
            body = b'{"prompt": "x", "stream": true}'
            await raw(addr, post_head("/v1/completions", f"content-length: {len(body)}\r\n") + body, then="close")
            await asyncio.sleep(0.6)
            assert len(streams) == 1
            await asyncio.wait_for(streams[0].closed.wait(), 2)  # the upstream answer is given up
            assert r.active() == 0 and r.host("slow").queued().tokens == 0

    run(go())


def test_a_client_that_leaves_mid_stream_releases_the_host() -> None:
    streams: list[Stream] = []

    async def endless(request: httpx.Request) -> httpx.Response:
        streams.append(Stream([], endless=True))
        return httpx.Response(200, stream=streams[-1], headers={"content-type": "text/event-stream"})

    async def go() -> None:
        async with served_router({"h": vllm(endless)}) as (r, addr):
            async with http(addr) as c:
                async with c.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as got:
                    assert got.status_code == 200
                    async for _ in got.aiter_raw():
                        break
            await asyncio.wait_for(streams[0].closed.wait(), 2)
            sent = streams[0].sent
            await asyncio.sleep(0.2)
            assert streams[0].sent == sent  # nobody reads the host's answer any more
            assert r.active() == 0

    run(go())
