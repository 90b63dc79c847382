"""Whole containers at once: verify, read the header, decode, stream sections, transcode.

Every function here reads through :class:`~kdn.artifact.reader.ArtifactReader`; ``reader_kw``
are its keyword arguments (``expect_fingerprint=``, ``pool=``, ...).
"""

from __future__ import annotations

from typing import Iterable, Iterator

from kdn.artifact.format import HEADER_PART_MAX, MAX_LAYERS, U32, Artifact, ArtifactHeader, Section, encode_artifact
from kdn.artifact.reader import ArtifactReader
from kdn.artifact.trust import header_part
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


def layer_cuts(data: bytes | memoryview) -> list[int]:
    """Where a whole container splits into its layers: ``cuts[l]`` is the offset just past layer
    ``l``'s sections (the last cut is ``len(data)``, the trailer included), so feeding
    ``data[cuts[l-1]:cuts[l]]`` to a reader, in order, hands it layer ``l`` whole and no section
    is ever split (a split one would be copied aside to be completed).

    Found by walking the length fields: nothing is verified here, the reader does that. Where
    the walk cannot go on (a bad header, a length past the end) the cuts stop and the rest is one
    piece, which the reader then refuses with the usual error."""
    view = memoryview(data).cast("B")
    try:
        part = header_part(view)
    except Exception:  # the reader raises the same error, with its checks, when fed
        part = None
    if part is None or not 0 < part[1].num_layers <= MAX_LAYERS:
        return [len(view)]
    pos, header, _ = part
    cuts: list[int] = []
    for _layer in range(header.num_layers - 1):  # the last layer's cut is the end
        for _kind in ("k", "v"):
            if pos + 4 > len(view):
                return [*cuts, len(view)]
            pos += 4 + U32.unpack_from(view, pos)[0] + 8
        if pos > len(view):
            return [*cuts, len(view)]
        cuts.append(pos)
    return [*cuts, len(view)]
