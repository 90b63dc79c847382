"""The server side of every KDN RPC: one envelope around each handler.

A handler decorated with :func:`rpc` only does its work: it parses its request (with
:mod:`kdn.wire.convert`), authorizes (:meth:`Servicer.authorize`) and raises :mod:`kdn.errors`
exceptions. The envelope, the same for the edge's, the origin's and the hint RPCs:

- turns any exception into a status with :func:`kdn.wire.errors.status_for` (the one mapping) and
  aborts the call with it; the server keeps serving;
- logs an exception that is not a KdnError (a bug: the caller sees ``INTERNAL``, no details);
- lets the servicer translate exceptions of its own first (:meth:`Servicer.translate`: the origin
  turns a compute timeout into ``Unavailable``) and count refusals (:meth:`Servicer.refused`), or
  decide the whole refusal itself (:meth:`Servicer.refusal`: the edge's front).

Streaming handlers (async generators) are covered too: an error before or between pieces aborts
the stream with its status.
"""

from __future__ import annotations

import functools
import inspect
import logging
import traceback
from typing import Any, AsyncIterator, Callable

import grpc

from kdn.errors import KdnError
from kdn.keys import Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pbg
from kdn.wire.auth import TokenAuth
from kdn.wire.channel import bearer_token
from kdn.wire.convert import parse_namespace
from kdn.wire.errors import status_for
from kdn.wire.frames import serialize_chunk

log = logging.getLogger(__name__)

class Servicer:
    """What the envelope needs of a servicer: its token table and a name for the logs."""

    @property
    def auth(self) -> TokenAuth:
        raise NotImplementedError

    @property
    def label(self) -> str:
        """Who is serving, for log lines (a node id)."""
        return type(self).__name__

    def authorize(self, context: grpc.aio.ServicerContext, msg: pb.Namespace) -> tuple[Namespace, str | None]:
        """The request's namespace and the caller's token, once the token is granted that tenant.
        Raises ``InvalidInput`` for a malformed namespace, ``Unauthorized`` for a refused token."""
        ns = parse_namespace(msg)
        token = bearer_token(context.invocation_metadata())
        self.auth.check(token, ns.tenant)
        return ns, token

    def authorizer(self, context: grpc.aio.ServicerContext) -> Callable[[Namespace], None]:
        """The check a request's parser runs once it named its tenant (:meth:`authorize` for the
        parsers of :mod:`kdn.wire.convert` and :mod:`kdn.wire.origin`): the caller's token is
        granted it, else ``Unauthorized``."""
        return lambda ns: self.auth.check(bearer_token(context.invocation_metadata()), ns.tenant)

    def authorize_admin(self, context: grpc.aio.ServicerContext) -> None:
        """Node-wide calls (Stats): any valid token."""
        self.auth.check_admin(bearer_token(context.invocation_metadata()))

    def translate(self, exc: BaseException) -> BaseException:
        """Turn a servicer-specific exception into a KdnError (default: unchanged)."""
        return exc

    def refused(self, rpc: str, code: grpc.StatusCode, exc: BaseException) -> None:
        """Called once per refused call (metrics, counters). Default: nothing."""

    def refusal(self, rpc: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status a failed call answers with. Default: :meth:`translate`, the one mapping
        (:func:`kdn.wire.errors.status_for`), a log line for a non-KdnError, :meth:`refused`.
        A servicer whose refusals are decided elsewhere (the edge's front) overrides this."""
        exc = self.translate(exc)
        code, message = status_for(exc)
        if not isinstance(exc, KdnError):
            log.error("%s: %s crashed", self.label, rpc, exc_info=exc)
        self.refused(rpc, code, exc)
        return code, message

    async def abort(self, context: grpc.aio.ServicerContext, rpc: str, exc: BaseException) -> None:
        code, message = self.refusal(rpc, exc)
        # the finished frames of the failed handler hold its request (a Put's pieces: megabytes);
        # the exception, its traceback and those frames form a cycle that only a full collection
        # would free: drop their locals now
        traceback.clear_frames(exc.__traceback__)
        await context.abort(code, message)


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a servicer method (coroutine or async generator) in the envelope. The RPC's name, for
    logs and metrics, is the method's name."""
    name = fn.__name__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except Exception as exc:
                await self.abort(context, name, exc)

        return stream

    @functools.wraps(fn)
    async def unary(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except Exception as exc:
            await self.abort(context, name, exc)
            raise AssertionError("context.abort returned") from exc

    return unary



def add_servicer(server: grpc.aio.Server, servicer: object, service: str) -> None:
    """Register ``servicer``'s methods for ``service`` (``"EdgeService"``, ``"OriginService"``), as
    the generated ``add_*Servicer_to_server`` does, with one difference: a Fetch handler may yield
    pre-encoded ``FetchChunk`` bytes (:mod:`kdn.wire.frames`); the bytes on the wire are the same."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for m in desc.methods:
        request, response = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        handlers[m.name] = kinds[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name),
            request_deserializer=request.FromString,
            response_serializer=serialize_chunk if response is pb.FetchChunk else response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))
    server.add_registered_method_handlers(desc.full_name, handlers)


def service_stub(channel: Any, service: str) -> Any:
    """The generated client stub of ``service`` (``"EdgeService"``, ``"OriginService"``) on
    ``channel``: callers outside :mod:`kdn.wire` never import the generated modules."""
    stubs = {"EdgeService": pbg.EdgeServiceStub, "OriginService": pbg.OriginServiceStub}
    return stubs[service](channel)
