"""Whole containers at once: verify, read the header, decode, stream sections, transcode.

Every function here reads through :class:`~kdn.artifact.reader.ArtifactReader`; ``reader_kw``
are its keyword arguments (``expect_fingerprint=``, ``pool=``, ...).
"""

from __future__ import annotations

from typing import Iterable, Iterator

from kdn.artifact.format import HEADER_PART_MAX, Artifact, ArtifactHeader, Section, encode_artifact
from kdn.artifact.reader import ArtifactReader
from kdn.codecs import Codec
from kdn.errors import ArtifactCorrupt, LossyRefused
from kdn.keys import ChunkKey, ModelFingerprint


def iter_sections(pieces: Iterable[bytes], **reader_kw: object) -> Iterator[Section]:
    """Decode sections from an iterable of byte pieces as they arrive; verifies the end too."""
    reader = ArtifactReader(**reader_kw)  # type: ignore[arg-type]
    for piece in pieces:
        yield from reader.feed(piece)
    reader.finish()


def decode_artifact(data: bytes | memoryview, **reader_kw: object) -> Artifact:
    """Verify and decode a whole container into ``(L, 2, H, T, D)``."""
    reader = ArtifactReader(assemble=True, **reader_kw)  # type: ignore[arg-type]
    reader.feed(data)
    header = reader.finish()
    assert reader.kv is not None  # a verified header declares at least one layer
    return Artifact(header, reader.kv)


def transcode(data: bytes | memoryview, codec: Codec | str, **reader_kw: object) -> bytes:
    """The same chunk framed in another codec: every checksum of ``data`` is verified, its KV
    decoded and framed again with the same key, parent, fingerprint, chunk index and steered
    variant. Only a lossless container is transcoded (KV that a lossy codec already changed must
    not come out labelled lossless): a lossy one is ``LossyRefused``."""
    art = decode_artifact(data, **reader_kw)
    h = art.header
    if h.lossy:
        raise LossyRefused(f"artifact in {h.codec} is lossy: it is not transcoded")
    return encode_artifact(
        art.kv,  # (L, 2, H, T, D)
        key=ChunkKey(bytes(h.key)),
        parent_key=ChunkKey(bytes(h.parent_key)),
        fingerprint=ModelFingerprint(bytes(h.fingerprint)),
        codec=codec,
        chunk_index=h.chunk_index,
        steer=h.steer,
    )


def verify_artifact(data: bytes | memoryview, **reader_kw: object) -> ArtifactHeader:
    """Check every checksum and bound without decoding payloads; return the header."""
    reader = ArtifactReader(decode=False, **reader_kw)  # type: ignore[arg-type]
    reader.feed(data)
    return reader.finish()


def read_header(data: bytes | memoryview) -> ArtifactHeader:
    """Parse and verify only the header of a container (the rest may be missing)."""
    reader = ArtifactReader(decode=False)
    reader.feed(data[:HEADER_PART_MAX] if len(data) > HEADER_PART_MAX else data)
    if reader.header is None:
        raise ArtifactCorrupt("artifact truncated inside its header")
    return reader.header
