"""KDN's exception tree. Every error that crosses a public boundary is one of these.

    KdnError                      base of everything KDN raises on purpose
    ├── InvalidInput              a caller gave us something malformed (ValueError too)
    │   ├── UnknownCodec          codec name/id not in the registry
    │   ├── UnknownModel          model spec that is neither built in nor a model directory
    │   │   └── ModelInstallError a trained built-in whose package is missing or whose files are unusable
    │   ├── UnsupportedModel      a model an operation cannot serve correctly (e.g. a RoPE variant blend can't move)
    │   └── MessageTooLarge       a declared or received size above the configured bound
    ├── ArtifactError             bytes of an artifact container are unusable
    │   ├── ArtifactCorrupt       checksum mismatch, bad magic, truncated, inconsistent header
    │   └── UnsupportedVersion    container version newer than this reader understands
    ├── FingerprintMismatch       artifact made by another model/dtype/chunk size than expected
    ├── LossyRefused              a lossless reader was offered a lossy artifact
    ├── NotFound                  no such artifact (also what a foreign tenant sees)
    ├── Unauthorized              missing or wrong bearer token / namespace not granted
    ├── Unavailable               a peer, edge or origin cannot be reached or timed out
    ├── StorageFull               a byte budget or the disk is exhausted
    └── ConfigError               a config file or flag is invalid (ValueError too)

gRPC status codes map to this tree in exactly one place: :mod:`kdn.wire.errors`.
"""

from __future__ import annotations

__all__ = [
    "ArtifactCorrupt", "ArtifactError", "ConfigError", "FingerprintMismatch", "InvalidInput", "KdnError",
    "LossyRefused", "MessageTooLarge", "ModelInstallError", "NotFound", "StorageFull", "Unauthorized",
    "Unavailable", "UnknownCodec", "UnknownModel", "UnsupportedModel", "UnsupportedVersion",
]


class KdnError(Exception):
    """Base class of every error KDN raises on purpose."""


class InvalidInput(KdnError, ValueError):
    """A caller gave us something malformed."""


class UnknownCodec(InvalidInput):
    """The codec name or id is not in the registry."""


class UnknownModel(InvalidInput):
    """A model spec that is neither a built-in name nor a local model directory."""


class ModelInstallError(UnknownModel):
    """A trained built-in model whose package is not installed, or whose installed or converted
    files are unusable (the message says how to install or repair it)."""


class UnsupportedModel(InvalidInput):
    """A model an operation refuses because it cannot serve it correctly (e.g. a RoPE variant
    whose keys cannot be moved to another position by a rotation)."""


class MessageTooLarge(InvalidInput):
    """A declared or received size is above the configured bound."""


class ArtifactError(KdnError):
    """The bytes of an artifact container are unusable."""


class ArtifactCorrupt(ArtifactError):
    """Checksum mismatch, bad magic, truncation or an inconsistent header."""


class UnsupportedVersion(ArtifactError):
    """The container version is newer than this reader understands."""


class FingerprintMismatch(KdnError):
    """The artifact was made for another model fingerprint than the reader expects."""


class LossyRefused(KdnError):
    """A reader that demands lossless KV was offered a lossy artifact."""


class NotFound(KdnError, KeyError):
    """No such artifact. A tenant probing another tenant's namespace sees this too."""

    def __str__(self) -> str:  # KeyError quotes its message; we do not want that
        return Exception.__str__(self)


class Unauthorized(KdnError):
    """Missing or wrong bearer token, or the namespace is not granted to the token."""


class Unavailable(KdnError):
    """A peer, edge or origin cannot be reached, or did not answer before the deadline."""


class StorageFull(KdnError):
    """A byte budget or the disk is exhausted."""


class ConfigError(KdnError, ValueError):
    """A config file or flag is invalid."""
