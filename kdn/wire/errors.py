"""The one place where gRPC status codes and KDN's exception tree (kdn.errors) meet.

Servers raise KdnError subclasses; :func:`status_for` turns them into a status (the servicer
envelope in :mod:`kdn.wire.service` applies it to every handler). Clients wrap calls in
:func:`rpc_errors`, which turns ``grpc.RpcError`` into the matching KdnError with
``raise ... from exc`` (:func:`from_rpc_error` builds it).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import grpc

from kdn import errors as e

_TO_STATUS: tuple[tuple[type[e.KdnError], grpc.StatusCode], ...] = (
    (e.MessageTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (e.ArtifactError, grpc.StatusCode.DATA_LOSS),
    (e.FingerprintMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (e.LossyRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (e.NotFound, grpc.StatusCode.NOT_FOUND),
    (e.Unauthorized, grpc.StatusCode.UNAUTHENTICATED),
    (e.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (e.StorageFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
)

# Prefix of the status message that tells which KdnError subclass to rebuild on the client.
_TAG = "kdn:"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status code and message for an exception raised inside a servicer."""
    if isinstance(exc, e.KdnError):
        for cls, code in _TO_STATUS:
            if isinstance(exc, cls):
                return code, f"{_TAG}{type(exc).__name__}: {exc}"
        return grpc.StatusCode.UNKNOWN, f"{_TAG}{type(exc).__name__}: {exc}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


_BY_NAME: dict[str, type[e.KdnError]] = {
    cls.__name__: cls for cls in vars(e).values() if isinstance(cls, type) and issubclass(cls, e.KdnError)
}

_FROM_STATUS: dict[grpc.StatusCode, type[e.KdnError]] = {
    grpc.StatusCode.NOT_FOUND: e.NotFound,
    grpc.StatusCode.UNAUTHENTICATED: e.Unauthorized,
    grpc.StatusCode.PERMISSION_DENIED: e.Unauthorized,
    grpc.StatusCode.INVALID_ARGUMENT: e.InvalidInput,
    grpc.StatusCode.RESOURCE_EXHAUSTED: e.MessageTooLarge,
    grpc.StatusCode.DATA_LOSS: e.ArtifactCorrupt,
    grpc.StatusCode.FAILED_PRECONDITION: e.FingerprintMismatch,
    grpc.StatusCode.UNAVAILABLE: e.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: e.Unavailable,
    grpc.StatusCode.CANCELLED: e.Unavailable,
}


def from_rpc_error(exc: grpc.RpcError, *, peer: str = "") -> e.KdnError:
    """The KdnError a failed call stands for (use as ``raise from_rpc_error(exc) from exc``)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    return _error(code, details, peer)


_BY_VALUE: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def status_value(code: grpc.StatusCode) -> int:
    """The status's number, as the bulk byte path (:mod:`kdn.wire.bulk`) carries it."""
    return int(code.value[0])


def error_from_status(value: int, details: str, *, peer: str = "") -> e.KdnError:
    """The KdnError for a status carried as a number (the bulk byte path): the same rebuilding as
    :func:`from_rpc_error`, so a refusal reads the same whichever path carried it."""
    return _error(_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN), details, peer)


def _error(code: grpc.StatusCode, details: str, peer: str) -> e.KdnError:
    where = f" ({peer})" if peer else ""
    if details.startswith(_TAG):
        name, _, msg = details[len(_TAG):].partition(": ")
        cls = _BY_NAME.get(name)
        if cls is not None:
            return cls(msg + where)
    cls = _FROM_STATUS.get(code, e.Unavailable if code == grpc.StatusCode.INTERNAL else e.KdnError)
    return cls(f"{code.name}: {details}{where}")


@contextmanager
def rpc_errors(peer: str = "") -> Iterator[None]:
    """Client side of the mapping: ``with rpc_errors("edge 10.0.0.5:50061"): await stub.Lookup(...)``
    turns a failed call into the matching KdnError (``raise ... from exc``). Works around awaits
    and around the body of an ``async for`` over a streaming call."""
    try:
        yield
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, peer=peer) from exc
