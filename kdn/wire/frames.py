"""``FetchChunk`` encoded and decoded by hand on the hot path: one copy per byte instead of three.

The protobuf runtime copies a streamed piece when it is sliced, when the message is built and when
it is serialized (and twice more on the client: parse, then join). These functions produce and read
exactly the bytes of ``kdn.v1.FetchChunk`` (proto3 wire format, fields 1-4; unknown fields skipped),
so peers and clients that use the generated stubs interoperate unchanged. Edges and origins send
with :func:`encode_frames`; edges (upstream), hosts and the admin client read with
:func:`decode_chunk`;
``tests/unit/test_edge_wire.py`` checks both directions against the generated class.

    data = 1 (bytes)   total_size = 2 (uint64)   source = 3 (string)   shm_name = 4 (string)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kdn.errors import ArtifactCorrupt

_DATA, _TOTAL, _SOURCE, _SHM = 0x0A, 0x10, 0x1A, 0x22


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_chunk(piece: bytes | memoryview, *, total_size: int = 0, source: str = "", shm_name: str = "") -> bytes:
    """Serialized ``FetchChunk`` (fields in number order, defaults omitted, as protobuf does)."""
    parts: list[bytes | memoryview] = []
    if len(piece):
        parts += [bytes((_DATA,)) + _varint(len(piece)), piece]
    if total_size:
        parts.append(bytes((_TOTAL,)) + _varint(total_size))
    for tag, text in ((_SOURCE, source), (_SHM, shm_name)):
        if text:
            raw = text.encode()
            parts.append(bytes((tag,)) + _varint(len(raw)) + raw)
    return b"".join(parts)


def encode_frames(data: bytes | memoryview, *, piece: int, source: str) -> Iterator[bytes]:
    """A whole artifact as ``FetchChunk`` frames of at most ``piece`` bytes: the first carries
    ``total_size`` and ``source``. Each frame copies its piece once; nothing else is copied."""
    total = len(data)
    view = memoryview(data)
    yield encode_chunk(view[:piece], total_size=total, source=source)
    for start in range(piece, total, piece):
        yield encode_chunk(view[start : start + piece])


@dataclass(frozen=True, slots=True)
class Chunk:
    data: memoryview
    total_size: int
    source: str
    shm_name: str


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ArtifactCorrupt("malformed FetchChunk (varint)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def decode_chunk(raw: bytes) -> Chunk:
    """Parse a serialized ``FetchChunk``; ``data`` is a zero-copy view into ``raw``."""
    buf = memoryview(raw)
    pos = 0
    data = buf[0:0]
    total, source, shm = 0, "", ""
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            if field == 2:
                total = value
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            if pos + n > len(buf):
                raise ArtifactCorrupt("malformed FetchChunk (length past the end)")
            view = buf[pos : pos + n]
            pos += n
            if field == 1:
                data = view
            elif field == 3:
                source = bytes(view).decode(errors="replace")
            elif field == 4:
                shm = bytes(view).decode(errors="replace")
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ArtifactCorrupt(f"malformed FetchChunk (wire type {wire})")
    if pos != len(buf):
        raise ArtifactCorrupt("malformed FetchChunk (truncated field)")
    return Chunk(data, total, source, shm)


def identity(raw: bytes) -> bytes:
    return raw


def serialize_chunk(message: object) -> bytes:
    """Response serializer for Fetch: pre-encoded bytes pass through, messages are serialized."""
    if isinstance(message, (bytes, bytearray)):
        return bytes(message)
    return message.SerializeToString()  # type: ignore[attr-defined]
