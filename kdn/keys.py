"""Chunk keys: content addresses for KV chunks that every process and machine agrees on.

Tokens are cut into chunks of ``chunk_size`` tokens; only full chunks get keys (the tail is
recomputed). Keys are chained over the prefix::

    key_0 = ROOT_KEY
    key_i = BLAKE2b-256(key_{i-1} ‖ fingerprint ‖ namespace ‖ tokens_i as little-endian u32)

A document's tokens after its last full chunk (its tail) are keyed the same way in *pieces* of
:data:`PIECE_TOKENS` tokens, chained from the last full chunk's key (:func:`piece_keys`), so a
request whose prompt carries the whole document reuses all of it but a few tokens, and prefills
little more than its question::

    piece_1 = BLAKE2b-256("kdn/piece/v1" ‖ key_k ‖ fingerprint ‖ namespace ‖ tokens of piece 1)
    piece_j = BLAKE2b-256("kdn/piece/v1" ‖ piece_{j-1} ‖ fingerprint ‖ namespace ‖ tokens of piece j)

Invariants:
- equal keys imply equal prefixes (same model, same namespace, same tokens up to that chunk or
  piece); a piece key never equals a chunk key (the domain tag, and a piece's shorter tokens);
- changing one token, the model fingerprint, the namespace or the chunk size changes the key of
  that chunk and of every chunk after it;
- the hash is cryptographic and seedless: never Python's ``hash()``, so ``PYTHONHASHSEED`` and the
  process do not matter.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, NewType, Sequence

import numpy as np

from kdn.errors import InvalidInput

__all__ = [
    "ChunkKey", "DEFAULT_CHUNK_SIZE", "DEFAULT_NAMESPACE", "KEY_BYTES", "ModelFingerprint", "Namespace",
    "PIECE_TOKENS", "ROOT_KEY", "chunk_keys", "next_key", "parse_fingerprint", "parse_key", "piece_keys",
    "pieces_enabled", "request_namespace", "toggled_bos_key", "tokens_u32",
]

ChunkKey = NewType("ChunkKey", bytes)
"""32-byte chained digest of a chunk and everything before it."""

ModelFingerprint = NewType("ModelFingerprint", bytes)
"""32-byte digest of everything that changes KV (see :mod:`kdn.models`)."""

KEY_BYTES = 32
DEFAULT_CHUNK_SIZE = 256
ROOT_KEY = ChunkKey(hashlib.blake2b(b"kdn/chunk-key/root/v1", digest_size=KEY_BYTES).digest())

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who a chunk belongs to. ``tenant`` is checked against the caller's token; ``salt`` is an
    optional per-tenant secret that makes keys unguessable even to someone who knows the text."""

    tenant: str
    salt: str = ""

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.tenant) or self.tenant in (".", ".."):  # a tenant names store directories
            raise InvalidInput(f"tenant must match {_NAME_RE.pattern} and not be '.' or '..', got {self.tenant!r}")
        if len(self.salt) > 256:
            raise InvalidInput("namespace salt longer than 256 characters")

    def encode(self) -> bytes:
        """Length-prefixed so that ("ab", "c") and ("a", "bc") never collide."""
        t, s = self.tenant.encode(), self.salt.encode()
        return len(t).to_bytes(2, "little") + t + len(s).to_bytes(2, "little") + s

    @classmethod
    def parse(cls, text: str) -> "Namespace":
        """``tenant`` or ``tenant:salt``."""
        tenant, _, salt = text.partition(":")
        return cls(tenant, salt)

    @classmethod
    def from_cache_salt(cls, salt: str) -> "Namespace":
        """An OpenAI ``cache_salt``: ``tenant[:salt]`` when it parses as one, else a tenant of its
        own named by the salt's digest. The vLLM connector and the router both map salts here, so a
        request lands in the same namespace on either side."""
        try:
            return cls.parse(salt)
        except InvalidInput:
            return cls("salt-" + hashlib.blake2b(salt.encode(), digest_size=16).hexdigest())

    def __str__(self) -> str:
        return self.tenant


DEFAULT_NAMESPACE = Namespace("default")


def request_namespace(cache_salt: str | None, params: dict[str, Any] | None, default: Namespace) -> Namespace | None:
    """The namespace of one request, or None when it opted out (``kv_transfer_params: {"kdn": false}``).

    ``kv_transfer_params`` ``{"kdn_tenant": T, "kdn_salt": S}`` wins; else ``cache_salt`` (which
    also separates vLLM's own prefix cache) read as ``tenant`` or ``tenant:salt``, and a salt that
    is no valid tenant name becomes a tenant named by its digest; else ``default``. The vLLM
    connector and the router in front of the engines both apply this one rule, so the router
    prices the chain the engine will ask for.

    Any JSON reaches here from an API caller: a parameter of the wrong type (``"kdn": "false"``, a
    tenant that is a number), an invalid tenant or salt, or a ``kdn_salt`` without the
    ``kdn_tenant`` it belongs to raises :class:`InvalidInput` (the connector then leaves the request
    to vLLM); absent, ``null`` and ``""`` mean "not given"."""
    if params is not None and not isinstance(params, dict):
        raise InvalidInput(f"kv_transfer_params must be an object, got {type(params).__name__}")
    params = params or {}
    opt, tenant, salt = params.get("kdn"), params.get("kdn_tenant"), params.get("kdn_salt")
    if opt is not None and not isinstance(opt, bool):
        raise InvalidInput(f"kdn must be true or false, got {opt!r}")
    if opt is False:
        return None
    for name, value in (("kdn_tenant", tenant), ("kdn_salt", salt), ("cache_salt", cache_salt)):
        if value is not None and not isinstance(value, str):
            raise InvalidInput(f"{name} must be a string, got {type(value).__name__}")
    if tenant:
        return Namespace(tenant, salt or "")
    if salt:
        raise InvalidInput("kdn_salt without kdn_tenant: name the tenant the salt belongs to")
    if cache_salt:
        return Namespace.from_cache_salt(cache_salt)
    return default



def next_key(
    parent: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace, tokens: Sequence[int] | np.ndarray
) -> ChunkKey:
    """The key of one chunk given its parent's key."""
    return _step(parent, bytes(fingerprint), namespace.encode(), tokens_u32(tokens).tobytes())


def _step(parent: bytes, fingerprint: bytes, namespace: bytes, tokens_le_u32: bytes) -> ChunkKey:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(parent)
    h.update(fingerprint)
    h.update(namespace)
    h.update(tokens_le_u32)
    return ChunkKey(h.digest())


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    *,
    fingerprint: ModelFingerprint,
    namespace: Namespace,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    root: ChunkKey = ROOT_KEY,
) -> list[ChunkKey]:
    """Keys of every *full* chunk of ``tokens``, in order. A trailing partial chunk has no key.

    ``root``: the chain's first parent; :data:`ROOT_KEY` for plain KV, a steered variant's own
    root (:func:`kdn.steer.steer_root`) otherwise, so no steered key equals a plain one."""
    if chunk_size <= 0:
        raise InvalidInput(f"chunk_size must be positive, got {chunk_size}")
    if len(fingerprint) != KEY_BYTES:
        raise InvalidInput(f"model fingerprint must be {KEY_BYTES} bytes, got {len(fingerprint)}")
    arr = tokens_u32(tokens)
    if len(root) != KEY_BYTES:
        raise InvalidInput(f"chain root must be {KEY_BYTES} bytes, got {len(root)}")
    fp, ns = bytes(fingerprint), namespace.encode()
    keys: list[ChunkKey] = []
    parent = bytes(root)
    for start in range(0, len(arr) - chunk_size + 1, chunk_size):
        parent = _step(parent, fp, ns, arr[start : start + chunk_size].tobytes())
        keys.append(parent)
    return keys


PIECE_TOKENS = 32  # tokens per tail piece; pieces exist where the chunk size is a larger multiple of it
_PIECE_TAG = b"kdn/piece/v1"


def pieces_enabled(chunk_size: int) -> bool:
    return chunk_size > PIECE_TOKENS and chunk_size % PIECE_TOKENS == 0


def piece_keys(
    tokens: Sequence[int] | np.ndarray,
    *,
    after: ChunkKey,
    fingerprint: ModelFingerprint,
    namespace: Namespace,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> list[ChunkKey]:
    """Keys of the full pieces of ``tokens``, the tokens that follow the chunk keyed ``after``
    (:data:`ROOT_KEY`, or a steered variant's root, for a tail with no full chunk before it).
    At most the pieces of one partial chunk: ``chunk_size // PIECE_TOKENS - 1`` of them; none
    where the chunk size has no pieces (:func:`pieces_enabled`)."""
    if not pieces_enabled(chunk_size):
        return []
    arr = tokens_u32(tokens[: chunk_size - PIECE_TOKENS])
    fp, ns = bytes(fingerprint), namespace.encode()
    keys: list[ChunkKey] = []
    parent = bytes(after)
    for start in range(0, len(arr) - PIECE_TOKENS + 1, PIECE_TOKENS):
        parent = _step(_PIECE_TAG + parent, fp, ns, arr[start : start + PIECE_TOKENS].tobytes())
        keys.append(parent)
    return keys


def toggled_bos_key(
    tokens: Sequence[int] | np.ndarray,
    bos_token_id: int | None,
    *,
    fingerprint: ModelFingerprint,
    namespace: Namespace,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    root: ChunkKey = ROOT_KEY,
) -> ChunkKey | None:
    """The first chunk's key of ``tokens`` with its leading BOS removed, or with one added when
    it has none: what the chain would start with had the documents been tokenized the other way.
    None without a BOS id, or when the toggled tokens hold no full chunk."""
    if bos_token_id is None:
        return None
    toks = [int(t) for t in tokens[: chunk_size + 1]]
    alt = toks[1:] if toks[:1] == [bos_token_id] else [bos_token_id, *toks]
    keys = chunk_keys(alt[:chunk_size], fingerprint=fingerprint, namespace=namespace, chunk_size=chunk_size, root=root)
    return keys[0] if keys else None


def parse_key(value: bytes | str) -> ChunkKey:
    """A key from the wire (32 raw bytes) or from a human (64 hex digits)."""
    if isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError as exc:
            raise InvalidInput(f"malformed chunk key {value[:80]!r}: not hex") from exc
    else:
        raw = bytes(value)
    if len(raw) != KEY_BYTES:
        raise InvalidInput(f"malformed chunk key: {len(raw)} bytes, expected {KEY_BYTES}")
    return ChunkKey(raw)


def parse_fingerprint(value: bytes | str) -> ModelFingerprint:
    """A fingerprint from the wire (32 bytes) or hex."""
    try:
        return ModelFingerprint(parse_key(value))
    except InvalidInput as exc:
        raise InvalidInput(str(exc).replace("chunk key", "model fingerprint")) from None


def tokens_u32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """``tokens`` as a one-dimensional uint32 array (what keys hash); refuses other shapes and values."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidInput(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise InvalidInput("tokens must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False)
