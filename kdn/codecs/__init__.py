"""Codecs for KV sections: a registry of small classes (see :mod:`kdn.codecs.base`).

Importing this package registers the built-in codecs: ``raw``, ``lz4``, ``zstd`` (lossless) and
``int8`` (lossy). Further codecs register themselves on import of their module.
"""

from kdn.codecs.base import CODECS, Codec, SectionInfo, copy_exact, get_codec, register_codec, same_width_array
from kdn.codecs import int8, lossless  # noqa: F401  (registration)
from kdn.codecs import kvq  # noqa: F401  (registration)

__all__ = ["CODECS", "Codec", "SectionInfo", "copy_exact", "get_codec", "register_codec", "lossless_codecs",
           "same_width_array"]


def lossless_codecs() -> list[str]:
    return sorted(name for name, cls in CODECS.items() if not cls.lossy)
