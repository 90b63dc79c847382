"""gRPC without sockets: a server and a channel that live in one event loop (httpx ``MockTransport``).

:class:`InProcessServer` collects servicers exactly as a ``grpc.aio.Server`` does
(``add_generic_rpc_handlers``: :func:`kdn.wire.service.add_servicer`, the generated
``add_*_to_server`` functions and the health service all work unchanged); :meth:`channel`
returns an :class:`InProcessChannel` that the generated stubs and every KDN client accept in place
of a ``grpc.aio.Channel``. A call runs the real handler in the caller's loop, and every message
crosses as bytes through the same serializers a socket would use — so the conversions, the
hand-encoded Fetch frames, the servicer envelope and the client's error mapping all run as in
production. A refused call raises :class:`InProcessRpcError` (a ``grpc.RpcError`` with ``code()``
and ``details()``), which :func:`kdn.wire.errors.rpc_errors` maps like any other.

What it does not model: flow control, message-size limits, TLS, and cancellation racing a handler
that ignores it. Those stay in the integration tests over loopback.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable

import grpc

__all__ = ["InProcessRpcError", "InProcessServer"]


class InProcessRpcError(grpc.RpcError):
    """A failed in-process call: the status code and details a socket would have carried."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """The part of ``grpc.aio.ServicerContext`` KDN's servicers use."""

    def __init__(self, metadata: Iterable[tuple[str, str]] | None) -> None:
        self._md = tuple(metadata or ())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._md

    def peer(self) -> str:
        return "inproc"

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: object = ()) -> None:
        raise _Abort(code, details)


@dataclass(frozen=True, slots=True)
class _CallDetails:
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


def _status(exc: BaseException) -> InProcessRpcError:
    if isinstance(exc, _Abort):
        return InProcessRpcError(exc.code, exc.details)
    if isinstance(exc, asyncio.TimeoutError):
        return InProcessRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    return InProcessRpcError(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")


class InProcessServer:
    """Servicers registered as on a ``grpc.aio.Server``; calls arrive through :meth:`channel`."""

    def __init__(self) -> None:
        self._generic: list[Any] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        return None  # the generic handlers registered alongside already route these

    def handler(self, method: str, metadata: tuple[tuple[str, str], ...]) -> Any:
        details = _CallDetails(method, metadata)
        for generic in self._generic:
            found = generic.service(details)
            if found is not None:
                return found
        raise InProcessRpcError(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")

    def channel(self) -> "InProcessChannel":
        return InProcessChannel(self)


class InProcessChannel:
    """Stands in for a ``grpc.aio.Channel``: ``unary_unary`` / ``unary_stream`` / ``stream_unary``."""

    def __init__(self, server: InProcessServer) -> None:
        self._server = server

    def unary_unary(self, method: str, request_serializer: Callable | None = None,
                    response_deserializer: Callable | None = None, **_: object) -> Any:
        return _Method(self._server, method, request_serializer, response_deserializer, _unary)

    def stream_unary(self, method: str, request_serializer: Callable | None = None,
                     response_deserializer: Callable | None = None, **_: object) -> Any:
        return _Method(self._server, method, request_serializer, response_deserializer, _unary)

    def unary_stream(self, method: str, request_serializer: Callable | None = None,
                     response_deserializer: Callable | None = None, **_: object) -> Any:
        return _Method(self._server, method, request_serializer, response_deserializer, _StreamCall)

    async def close(self, grace: float | None = None) -> None:
        return None


def _identity(x: Any) -> Any:
    return x


class _Method:
    def __init__(self, server: InProcessServer, method: str, ser: Callable | None, deser: Callable | None,
                 kind: Callable[..., Any]) -> None:
        self._server, self._method, self._kind = server, method, kind
        self._ser, self._deser = ser or _identity, deser or _identity

    def __call__(self, request: Any, *, timeout: float | None = None,
                 metadata: Iterable[tuple[str, str]] | None = None, **_: object) -> Any:
        md = tuple(metadata or ())
        return self._kind(self._server.handler(self._method, md), request, self._ser, self._deser,
                          _Context(md), timeout)


async def _requests(handler: Any, request: Any, ser: Callable) -> AsyncIterator[Any]:
    if hasattr(request, "__aiter__"):
        async for r in request:
            yield handler.request_deserializer(ser(r))
    else:
        for r in request:
            yield handler.request_deserializer(ser(r))


async def _unary(handler: Any, request: Any, ser: Callable, deser: Callable, ctx: _Context,
                 timeout: float | None) -> Any:
    if handler.request_streaming:
        call = handler.stream_unary(_requests(handler, request, ser), ctx)
    else:
        call = handler.unary_unary(handler.request_deserializer(ser(request)), ctx)
    try:
        response = await asyncio.wait_for(call, timeout)
    except Exception as exc:
        raise _status(exc) from exc
    return deser(handler.response_serializer(response))


class _StreamCall:
    """A server-streaming call: async-iterable, with ``done()`` and ``cancel()`` like grpc.aio's."""

    def __init__(self, handler: Any, request: Any, ser: Callable, deser: Callable, ctx: _Context,
                 timeout: float | None) -> None:
        self._responses = handler.unary_stream(handler.request_deserializer(ser(request)), ctx)
        self._ser, self._deser = handler.response_serializer, deser
        self._deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        self._done = False

    def __aiter__(self) -> "_StreamCall":
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        left = None if self._deadline is None else self._deadline - asyncio.get_running_loop().time()
        try:
            item = await asyncio.wait_for(self._responses.__anext__(), left)
        except StopAsyncIteration:
            self._done = True
            raise
        except Exception as exc:
            self._done = True
            raise _status(exc) from exc
        return self._deser(self._ser(item))

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        if self._done:
            return False
        self._done = True
        asyncio.ensure_future(self._responses.aclose())
        return True
