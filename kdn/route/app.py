"""The OpenAI-compatible HTTP front (Starlette): parse, authenticate, plan, forward, stream back.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (forwarded to the chosen host,
streamed or not, its answer passed through byte for byte with the header ``x-kdn-route-host``
naming the host); ``GET /v1/models`` (the first usable host's); ``GET /health`` (200 while a host
is up, else 503); ``GET /route/stats`` (hosts, rates, counters: an operator token's, one granted
``*``, when tokens are configured); ``POST /route/explain/{endpoint}``
(the plan for a body, not forwarded).

Bad input never reaches a host and never stops the router: when tokens are configured, a missing
or unknown token is 401 before the body is read (``/v1/models`` too) and a token that does not
grant the request's tenant 403; a body over ``max_body_bytes`` is 413 (read no further), one
not whole within ``body_timeout_s`` is 408 (the connection closed), a body that is not an
OpenAI request is 400, no usable host is 503; every error is JSON,
``{"error": {"message", "type", "code"}}``. A host that cannot be reached before it answered is
counted against its health and the request goes to the next best host; one that fails after the
request reached it and before it answered is 504 (no answer within ``request_timeout_s``) or 502
(its connection broke), not retried (it may have taken the request). Once a host has answered,
its answer (an error too) is the client's; an answer the host breaks off is broken off to the
client too (the connection is dropped before the body's end), never passed on as complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kdn.errors import InvalidInput, Unauthorized, Unavailable
from kdn.route.openai import Endpoint, ParsedRequest, parse_body
from kdn.route.router import Plan, Router
from kdn.wire.auth import TokenAuth

__all__ = ["build_app"]

log = logging.getLogger("kdn.route")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade",
        "proxy-authorization", "proxy-authenticate"}
_PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class _TooLarge(Exception):
    pass


class _SlowBody(Exception):
    pass


class _Forbidden(Exception):
    """A known token that does not grant the request's tenant (403, where an unknown one is 401)."""


def error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _slow_body(timeout_s: float) -> JSONResponse:
    r = error(408, f"the request body did not arrive within {timeout_s:g}s", "request_timeout")
    r.headers["connection"] = "close"  # the rest of that body may still come: the connection ends here
    return r


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body: ``_TooLarge`` past ``limit`` bytes, ``_SlowBody`` when it has not all
    arrived ``timeout_s`` after it was first read from."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise _TooLarge
        except ValueError:
            raise InvalidInput("Content-Length is not a number") from None
    got = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for piece in request.stream():
                got += piece
                if len(got) > limit:
                    raise _TooLarge
    except TimeoutError:
        raise _SlowBody from None
    return bytes(got)


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def build_app(router: Router) -> Starlette:
    config = router.config
    auth = TokenAuth.from_config(config.tokens)

    def authorize(token: str | None, parsed: ParsedRequest) -> None:
        """``_Forbidden`` unless ``token`` (already known: :meth:`TokenAuth.check_admin`) grants
        the request's tenant."""
        if not auth.enabled:
            return
        tenant = (parsed.namespace or config.namespace).tenant
        try:
            auth.check(token, tenant)
        except Unauthorized as exc:
            raise _Forbidden(str(exc)) from None  # a known token, another tenant (403)

    async def forward(endpoint: Endpoint, request: Request) -> Response:
        router.counters["requests"] += 1
        token = _bearer(request)
        try:
            auth.check_admin(token)  # missing or unknown (401), before anything of the body is read
        except Unauthorized as exc:
            router.counters["unauthorized"] += 1
            return error(401, str(exc), "authentication_error")
        try:
            raw = await _read_body(request, config.max_body_bytes, config.body_timeout_s)
        except _TooLarge:
            router.counters["too_large"] += 1
            return error(413, f"request body over {config.max_body_bytes} bytes", "request_too_large")
        except _SlowBody:
            router.counters["bad_request"] += 1
            return _slow_body(config.body_timeout_s)
        except ClientDisconnect:
            return error(400, "the client closed before its body arrived", "invalid_request_error")
        except InvalidInput as exc:
            router.counters["bad_request"] += 1
            return error(400, str(exc), "invalid_request_error")
        try:
            parsed = parse_body(raw, endpoint, router.tokenizer, config.namespace)
        except InvalidInput as exc:
            router.counters["bad_request"] += 1
            return error(400, str(exc), "invalid_request_error")
        try:
            authorize(token, parsed)
        except _Forbidden as exc:
            router.counters["unauthorized"] += 1
            return error(403, str(exc), "permission_error")
        tried: list[str] = []
        last = ""
        while True:
            try:
                plan = await router.plan(parsed, token=token, exclude=tried)
            except Unavailable as exc:
                router.counters["no_host"] += 1
                why = f"{exc}" + (f" (last: {last})" if last else "")
                return error(503, why, "service_unavailable")
            except InvalidInput as exc:
                router.counters["bad_request"] += 1
                return error(400, str(exc), "invalid_request_error")
            try:
                return await _send(plan, parsed, raw, request)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                # nothing was answered: the host is counted as failing and the next best one tried
                plan.host.counters["failed"] += 1
                plan.host.failed_check(f"forward: {type(exc).__name__}: {exc}", config.fail_after)
                router.counters["retried"] += 1
                tried.append(plan.host.name)
                last = f"{plan.host.name}: {type(exc).__name__}"
            except httpx.HTTPError as exc:
                # the request reached the host, which may have taken it: no other host is tried
                plan.host.counters["failed"] += 1
                router.counters["upstream_errors"] += 1
                if isinstance(exc, httpx.TimeoutException):
                    return error(504, f"host {plan.host.name} did not answer within {config.request_timeout_s:g}s "
                                 f"({type(exc).__name__})", "upstream_timeout")
                return error(502, f"host {plan.host.name} failed before answering: {type(exc).__name__}: {exc}",
                             "upstream_error")

    async def _send(plan: Plan, parsed: ParsedRequest, raw: bytes, request: Request) -> Response:
        host = plan.host
        client = router.clients[host.name]
        headers = {"content-type": "application/json", **router.host_headers()}
        inflight = plan.inflight
        assert inflight is not None
        t0 = time.monotonic()
        try:
            upstream = await client.send(client.build_request("POST", _PATHS[parsed.endpoint], content=raw,
                                                              headers=headers), stream=True)
        except BaseException:
            host.end(inflight)
            raise
        router.counters["forwarded"] += 1
        if upstream.status_code == 200:
            router.remember(plan)
        elif upstream.status_code >= 500:
            router.counters["upstream_errors"] += 1

        async def body() -> AsyncIterator[bytes]:
            try:
                async for piece in upstream.aiter_raw():
                    if inflight.first_byte is None and piece:
                        inflight.first_byte = time.monotonic()
                        if parsed.stream and upstream.status_code == 200:
                            router.observe_first_byte(plan, inflight.first_byte - t0)
                    yield piece
            except httpx.HTTPError as exc:
                log.warning("host %s broke off an answer: %s", host.name, exc)
                host.counters["failed"] += 1
                router.counters["upstream_errors"] += 1
                raise  # the client's connection is dropped mid-body: it must not see the end of an answer
            finally:
                host.end(inflight)
                await upstream.aclose()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        out_headers["x-kdn-route-host"] = host.name
        return StreamingResponse(body(), status_code=upstream.status_code, headers=out_headers)

    async def completions(request: Request) -> Response:
        return await forward("completions", request)

    async def chat(request: Request) -> Response:
        return await forward("chat", request)

    async def explain(request: Request) -> Response:
        endpoint = request.path_params["endpoint"]
        if endpoint not in ("completions", "chat"):
            return error(404, "explain/completions or explain/chat", "not_found")
        token = _bearer(request)
        try:
            auth.check_admin(token)
            raw = await _read_body(request, config.max_body_bytes, config.body_timeout_s)
            parsed = parse_body(raw, endpoint, router.tokenizer, config.namespace)
            authorize(token, parsed)
            plan = await router.plan(parsed, token=token, reserve=False)
        except _TooLarge:
            return error(413, f"request body over {config.max_body_bytes} bytes", "request_too_large")
        except _SlowBody:
            return _slow_body(config.body_timeout_s)
        except InvalidInput as exc:
            return error(400, str(exc), "invalid_request_error")
        except Unauthorized as exc:
            return error(401, str(exc), "authentication_error")
        except _Forbidden as exc:
            return error(403, str(exc), "permission_error")
        except Unavailable as exc:
            return error(503, str(exc), "service_unavailable")
        return JSONResponse(plan.describe())

    async def models(request: Request) -> Response:
        try:
            auth.check_admin(_bearer(request))
        except Unauthorized as exc:
            return error(401, str(exc), "authentication_error")
        for host in router.usable():
            try:
                r = await router.clients[host.name].get("/v1/models", headers=router.host_headers())
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return Response(r.content, media_type="application/json")
        return error(503, "no inference host is up", "service_unavailable")

    async def health(request: Request) -> Response:
        up = [h.name for h in router.usable()]
        return JSONResponse({"status": "ok" if up else "no host up", "hosts_up": up}, status_code=200 if up else 503)

    async def stats(request: Request) -> Response:
        token = _bearer(request)
        try:
            auth.check_admin(token)
        except Unauthorized as exc:
            return error(401, str(exc), "authentication_error")
        if not auth.is_operator(token):  # every tenant's traffic: an operator's view, as an edge's node-wide Stats
            return error(403, "/route/stats counts every tenant's requests: it needs an operator token (granted '*')",
                         "permission_error")
        return JSONResponse(router.describe())

    async def not_found(request: Request, exc: Exception) -> Response:
        return error(404, f"no route {request.method} {request.url.path}", "not_found")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return error(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")

    async def crashed(request: Request, exc: Exception) -> Response:
        log.exception("router error on %s", request.url.path)
        return error(500, f"router error: {type(exc).__name__}", "internal_error")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/route/stats", stats, methods=["GET"]),
        Route("/route/explain/{endpoint}", explain, methods=["POST"]),
    ]
    handlers: dict[Any, Any] = {404: not_found, 405: not_allowed, 500: crashed, Exception: crashed}
    return Starlette(routes=routes, exception_handlers=handlers)
