"""What a container's header must be for a reader to accept it: the format's own rules, then
the caller's (model, key, steered variant, lossless, size, destination geometry).

A header is parsed only once its checksum matched, and accepted only if every rule here holds;
nothing after it (a section's length, the KV it decodes to) is trusted beyond what it declares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from kdn.artifact.format import (
    MAGIC, MAX_HEAD_DIM, MAX_HEADER, MAX_HEADS, MAX_LAYERS, MAX_TOKENS, PB_TO_DTYPE, PREFIX, U64, VERSION,
    ArtifactHeader, header_shape, parse_header,
)
from kdn.codecs import Codec, get_codec
from kdn.errors import ArtifactCorrupt, FingerprintMismatch, LossyRefused, MessageTooLarge, UnsupportedVersion
from kdn.keys import KEY_BYTES, ChunkKey, ModelFingerprint
from kdn.kv import KV_LAYOUT_VERSION


def header_part(b: memoryview) -> tuple[int, ArtifactHeader, memoryview] | None:
    """The verified header at the start of ``b`` (prefix, header, its check): ``(bytes it takes,
    header, check)``, or None while more bytes are needed. Garbage fails as soon as its magic
    arrived; a header length over ``MAX_HEADER`` as soon as the prefix did."""
    if len(b) < PREFIX.size:
        if len(b) >= 4 and bytes(b[:4]) != MAGIC:
            raise ArtifactCorrupt("not a KDN artifact (bad magic)")
        return None
    magic, version, _flags, hlen = PREFIX.unpack_from(b, 0)
    if magic != MAGIC:
        raise ArtifactCorrupt("not a KDN artifact (bad magic)")
    if version > VERSION:
        raise UnsupportedVersion(f"artifact version {version} is newer than this reader ({VERSION})")
    if version == 0:
        raise ArtifactCorrupt("artifact version 0 is invalid")
    if hlen > MAX_HEADER:
        raise ArtifactCorrupt(f"artifact header declares {hlen} bytes (limit {MAX_HEADER})")
    end = PREFIX.size + hlen
    if len(b) < end + 8:
        return None
    check = b[end : end + 8]
    if xxhash.xxh3_64_intdigest(b[:end]) != U64.unpack(check)[0]:
        raise ArtifactCorrupt("artifact header checksum mismatch")
    return end + 8, parse_header(bytes(b[PREFIX.size : end])), check


@dataclass(frozen=True, slots=True)
class Expect:
    """A reader caller's expectations (None: anything)."""

    fingerprint: ModelFingerprint | None = None
    key: ChunkKey | None = None
    require_lossless: bool = False
    steer: str | None = None
    max_bytes: int = 0

    def codec_for(self, h: ArtifactHeader, out: torch.Tensor | None) -> Codec:
        """The codec (configured by the header) of a header that is accepted; raises otherwise.
        ``out``: the tensor the sections will be decoded into, if the caller gave one."""
        if h.layout_version != KV_LAYOUT_VERSION:
            raise UnsupportedVersion(f"KV layout version {h.layout_version}, this reader knows {KV_LAYOUT_VERSION}")
        if len(h.fingerprint) != KEY_BYTES or len(h.key) != KEY_BYTES or len(h.parent_key) != KEY_BYTES:
            raise ArtifactCorrupt("artifact header has malformed key or fingerprint")
        if h.dtype not in PB_TO_DTYPE:
            raise ArtifactCorrupt(f"artifact header has unknown dtype {h.dtype}")
        if not (0 < h.num_layers <= MAX_LAYERS and 0 < h.num_kv_heads <= MAX_HEADS
                and 0 < h.head_dim <= MAX_HEAD_DIM and 0 < h.token_count <= MAX_TOKENS):
            raise ArtifactCorrupt(
                f"artifact header declares an implausible shape: layers={h.num_layers} "
                f"heads={h.num_kv_heads} head_dim={h.head_dim} tokens={h.token_count}"
            )
        decoded = 2 * h.num_layers * h.num_kv_heads * h.token_count * h.head_dim * PB_TO_DTYPE[h.dtype].itemsize
        if decoded > self.max_bytes:
            # bounds what a tiny compressed section could expand to (a decompression bomb)
            raise MessageTooLarge(
                f"artifact header declares {decoded} bytes of KV; this reader accepts at most {self.max_bytes}"
            )
        if self.fingerprint is not None and h.fingerprint != bytes(self.fingerprint):
            raise FingerprintMismatch(
                f"artifact was made for model {h.fingerprint.hex()[:16]}…, expected {bytes(self.fingerprint).hex()[:16]}…"
            )
        if self.key is not None and h.key != bytes(self.key):
            raise ArtifactCorrupt(f"artifact holds key {h.key.hex()[:16]}…, expected {bytes(self.key).hex()[:16]}…")
        if self.steer is not None and h.steer != self.steer:
            raise ArtifactCorrupt(
                f"artifact is steered variant {h.steer[:120]!r}, expected {self.steer[:120] or 'plain KV'!r}"
                if h.steer else f"artifact is plain KV, expected steered variant {self.steer[:120]!r}"
            )
        if self.require_lossless and h.lossy:
            raise LossyRefused(f"artifact is lossy ({h.codec}:{h.codec_level}) but lossless was required")
        codec = get_codec(f"{h.codec}:{h.codec_level}" if h.codec_level else h.codec)
        if codec.lossy != h.lossy:
            raise ArtifactCorrupt(f"header says lossy={h.lossy} but codec {h.codec} is lossy={codec.lossy}")
        codec = codec.with_meta(h.codec_meta)
        if out is not None:
            want = header_shape(h)
            if tuple(out.shape) != want or out.dtype != PB_TO_DTYPE[h.dtype]:
                # checksummed and fingerprinted, yet not the KV the reader's model makes
                raise FingerprintMismatch(
                    f"artifact holds KV {want} {PB_TO_DTYPE[h.dtype]}, this model needs {tuple(out.shape)} {out.dtype}"
                )
        return codec
