"""The client side of a Fetch: the raw call and the reader of its frames, shared by every client.

A Fetch answer is read with :func:`kdn.wire.frames.decode_chunk` (zero-copy views into the received
messages), never through the generated ``FetchChunk`` class: :func:`fetch_method` opens the call
with an identity deserializer, :func:`collect_fetch` joins the pieces once, bounded by ``limit``.
Everything else a client sends is built by :mod:`kdn.wire.convert` and called through the
generated stubs inside :func:`kdn.wire.errors.rpc_errors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterable

import grpc

from kdn.errors import InvalidInput, MessageTooLarge
from kdn.proto import kdn_pb2 as pb
from kdn.wire.frames import decode_chunk, identity

NO_LIMIT = 1 << 62


def fetch_method(channel: grpc.aio.Channel | grpc.Channel, service: str = "EdgeService") -> Any:
    """``/kdn.v1.<service>/Fetch`` answering raw ``FetchChunk`` bytes (decode with ``decode_chunk``)."""
    return channel.unary_stream(
        f"/kdn.v1.{service}/Fetch", request_serializer=pb.FetchRequest.SerializeToString, response_deserializer=identity
    )


@dataclass(frozen=True, slots=True)
class Fetched:
    """A whole artifact as received: its container bytes (not verified yet), the tier it came from
    (``source``) and the size the sender announced on the first frame."""

    data: bytes
    source: str
    total_size: int


async def collect_fetch(frames: AsyncIterable[bytes], *, peer: str, limit: int = NO_LIMIT) -> Fetched:
    """Join a streamed (not shared-memory) Fetch answer; ``MessageTooLarge`` past ``limit`` bytes,
    announced or sent. Each piece is a view of its message until the one join."""
    pieces: list[memoryview] = []
    got = total = 0
    source = ""
    async for raw in frames:
        chunk = decode_chunk(raw)
        if chunk.shm_name:
            raise InvalidInput(f"{peer} answered with shm although we did not ask for it")
        if not pieces:
            source, total = chunk.source, chunk.total_size
            if total > limit:
                raise MessageTooLarge(f"{peer} offers {total} bytes (limit {limit})")
        got += len(chunk.data)
        if got > limit:
            raise MessageTooLarge(f"{peer} sent more than {limit} bytes")
        pieces.append(chunk.data)
    return Fetched(b"".join(pieces), source, total)
