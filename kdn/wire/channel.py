"""Channel and server options every KDN gRPC endpoint uses.

Messages are bounded: artifacts are streamed in pieces of at most ``STREAM_PIECE`` bytes, and no
single message may exceed ``MAX_MESSAGE``. Tokens travel as ``authorization: Bearer <token>``.
"""

from __future__ import annotations

import socket

import grpc

from kdn.wire.tls import TlsFiles

STREAM_PIECE = 1 << 20  # 1 MiB per streamed message
MAX_MESSAGE = 8 << 20  # hard bound on any single message, either direction
DEFAULT_DEADLINE_S = 10.0
AUTH_HEADER = "authorization"


def free_port(host: str = "") -> int:
    """A TCP port that is free right now (for services that must know their port before binding)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_bindable(listen: str) -> None:
    """Raise a one-line OSError when ``listen``'s fixed port is taken (port 0 always binds):
    before gRPC tries, which logs its own complaint on stderr first."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # let gRPC say what it makes of the host
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                raise OSError(f"cannot bind {listen}: {exc.strerror or exc}") from None


def grpc_options(max_message: int = MAX_MESSAGE) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message),
        ("grpc.max_receive_message_length", max_message),
        ("grpc.so_reuseport", 0),
        ("grpc.enable_retries", 0),
        ("grpc.keepalive_time_ms", 20_000),
    ]


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def bearer_token(metadata: object) -> str | None:
    """The bearer token from invocation metadata, or None."""
    for key, value in metadata or ():  # type: ignore[union-attr]
        if key.lower() == AUTH_HEADER and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def aio_channel(address: str, *, tls: TlsFiles | None = None, max_message: int = MAX_MESSAGE) -> grpc.aio.Channel:
    opts = grpc_options(max_message)
    if tls is not None:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.aio.insecure_channel(address, options=opts)


def sync_channel(address: str, *, tls: TlsFiles | None = None, max_message: int = MAX_MESSAGE) -> grpc.Channel:
    opts = grpc_options(max_message)
    if tls is not None:
        return grpc.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.insecure_channel(address, options=opts)


def split_pieces(data: bytes | memoryview, piece: int = STREAM_PIECE):
    """Yield consecutive memoryview pieces of at most ``piece`` bytes."""
    view = memoryview(data)
    for start in range(0, len(view), piece):
        yield view[start : start + piece]
