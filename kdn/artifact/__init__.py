"""The artifact container: one chunk's KV as a versioned, self-describing, checksummed byte string.

- :mod:`kdn.artifact.format` — the layout (prefix, header, sections, trailer), its constants and
  the writer, :func:`encode_artifact`; the only module here that imports :mod:`kdn.proto`;
- :mod:`kdn.artifact.reader` — :class:`ArtifactReader`, the trust boundary: every checksum and
  bound verified before a byte is used (its invariants are stated there);
- :mod:`kdn.artifact.trust` — what a header must be to be accepted;
- :mod:`kdn.artifact.landing` — receiving sections in place into a caller's buffer;
- :mod:`kdn.artifact.digest` — section checksums over KV where it lies, raw layers copied and
  verified in one pass (split onto a caller-owned executor, never a thread of this package);
- :mod:`kdn.artifact.verify` — whole containers at once: verify, read the header, decode,
  stream sections, transcode.
"""

from kdn.artifact.format import (
    DEFAULT_MAX_BYTES,
    DTYPE_TO_PB,
    MAGIC,
    MAX_HEADER,
    PB_TO_DTYPE,
    TRAILER_BYTES,
    TRAILER_MAGIC,
    VERSION,
    Artifact,
    ArtifactHeader,
    Section,
    SectionInfo,
    encode_artifact,
    section_infos,
)
from kdn.artifact.reader import ArtifactReader
from kdn.artifact.verify import decode_artifact, iter_sections, layer_cuts, read_header, transcode, verify_artifact

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DTYPE_TO_PB",
    "MAGIC",
    "MAX_HEADER",
    "PB_TO_DTYPE",
    "TRAILER_BYTES",
    "TRAILER_MAGIC",
    "VERSION",
    "Artifact",
    "ArtifactHeader",
    "ArtifactReader",
    "Section",
    "SectionInfo",
    "decode_artifact",
    "encode_artifact",
    "iter_sections",
    "layer_cuts",
    "read_header",
    "section_infos",
    "transcode",
    "verify_artifact",
]
