"""Take an artifact apart and put it back together with every checksum recomputed.

Tests use it to make artifacts that pass every integrity check yet carry what a writer of another
version (or a hostile one) could put there: an unknown codec, odd codec metadata, mutated payloads.
Parses without the reader (so it also takes apart what the reader would refuse).
"""

from __future__ import annotations

import struct

import xxhash

from kdn.artifact import MAGIC, TRAILER_MAGIC
from kdn.proto import kdn_pb2 as pb

_PREFIX = struct.Struct("<4sHHI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def split(blob: bytes) -> tuple[tuple[int, int], pb.ArtifactHeader, list[bytes]]:
    """(version, flags), the parsed header and each section's payload, in order."""
    magic, version, flags, hlen = _PREFIX.unpack_from(blob, 0)
    assert magic == MAGIC
    header = pb.ArtifactHeader()
    header.ParseFromString(blob[_PREFIX.size : _PREFIX.size + hlen])
    pos = _PREFIX.size + hlen + 8
    payloads = []
    while blob[pos : pos + 4] != TRAILER_MAGIC or pos + 20 != len(blob):
        (n,) = _U32.unpack_from(blob, pos)
        payloads.append(blob[pos + 4 : pos + 4 + n])
        pos += 4 + n + 8
    return (version, flags), header, payloads


def frame(header: pb.ArtifactHeader | bytes, payloads: list[bytes], *, version: int = 1, flags: int = 0) -> bytes:
    """A container of ``header`` (a message, or raw bytes) and ``payloads`` with valid checksums."""
    hbytes = header if isinstance(header, bytes) else header.SerializeToString()
    prefix = _PREFIX.pack(MAGIC, version, flags, len(hbytes))
    hcheck = _U64.pack(xxhash.xxh3_64_intdigest(prefix + hbytes))
    tree = xxhash.xxh3_128(hcheck)
    parts = [prefix, hbytes, hcheck]
    for p in payloads:
        framed = _U32.pack(len(p)) + p
        check = _U64.pack(xxhash.xxh3_64_intdigest(framed))
        tree.update(check)
        parts += [framed, check]
    parts += [TRAILER_MAGIC, tree.digest()]
    return b"".join(parts)
