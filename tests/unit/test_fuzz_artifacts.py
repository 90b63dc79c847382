"""Fuzz the artifact readers with checksum-valid mutants (issue 19, "Must show").

Mutating bytes of an artifact only exercises the checksum checks: every such mutant is refused
before any parser sees it. Here every mutant is re-framed with its checksums recomputed
(:mod:`tests.reframe`), so the mutations reach the header validation, every codec's metadata
parser and every decoder (raw, lz4, zstd, int8, kvq) — the way a buggy or hostile writer's
artifacts would. Each mutant goes to :func:`verify_artifact`, :func:`decode_artifact` and the
streaming :class:`ArtifactReader` (fed in random pieces, and into a caller's tensor). The only
acceptable failure is a project error (:class:`~kdn.errors.KdnError`); anything else fails.

Seeded and bounded: a fixed number of mutants per seed, with a wall-clock cap as a safety net
(the cap only shortens the run; it never decides the outcome). Longer runs: ``KDN_FUZZ_SCALE=10``
multiplies both, ``KDN_FUZZ_SEEDS=20`` runs that many seeds (the two defaults first)::

    KDN_FUZZ_SCALE=10 KDN_FUZZ_SEEDS=20 .venv/bin/python -m pytest -q tests/unit/test_fuzz_artifacts.py
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
from collections import Counter

import lz4.frame
import pytest
import torch
import zstandard

from kdn.artifact import ArtifactReader, decode_artifact, encode_artifact, verify_artifact
from kdn.errors import KdnError
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint
from tests.reframe import frame, split

CODECS = ["raw", "lz4", "zstd:3", "int8", "kvq:q2", "kvq:q5"]
_SCALE = float(os.environ.get("KDN_FUZZ_SCALE", "1"))
MUTANTS = int(5000 * _SCALE)
CAP_S = 20.0 * _SCALE
SEEDS = [19, 2026, *range(1, 1000)][: max(2, int(os.environ.get("KDN_FUZZ_SEEDS", "2")))]

_INTS = [0, 1, 2, 3, 7, 16, 255, 256, 1 << 20, (1 << 20) + 1, (1 << 31) - 1, (1 << 32) - 1]
_STRS = ["", "raw", "lz4", "zstd", "int8", "kvq", "q2", "q8", "q9", "3", "-1", "22", "99", "1e9", "x" * 300, "kvq:q2", "\u00e9"]


def _base(codec: str, dtype: torch.dtype) -> bytes:
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(2, 2, 2, 16, 8, generator=g).to(dtype)  # (L, 2, H, T, D)
    return encode_artifact(kv, key=ChunkKey(b"\x01" * 32), parent_key=ROOT_KEY,
                           fingerprint=ModelFingerprint(b"\x02" * 32), codec=codec, chunk_index=0)


def _meta_mutant(rng: random.Random, meta: bytes) -> bytes:
    """Odd kvq (or any) codec metadata: JSON with bad values, non-finite numbers, deep nesting."""
    try:
        d = json.loads(meta) if meta else {}
    except (ValueError, RecursionError):  # an earlier mutation of this one
        d = {}
    if not isinstance(d, dict):
        d = {}
    choice = rng.randrange(7)
    if choice == 0:
        return rng.randbytes(rng.randrange(0, 64))
    if choice == 1:
        depth = rng.choice([10, 100, 5000, 100_000])
        return ("[" * depth + "]" * depth).encode()
    if choice == 2:
        key = rng.choice(["k_bits", "v_bits", "group", "anchor_bits", "early_frac", "early_bonus", "v", "table"])
        d[key] = rng.choice([0, 1, 2, 8, 9, -1, 1 << 40, 0.5, 1e308, "x", None, [], {}, [[2, 2]], [[9, 9], [2, 2]]])
        return json.dumps(d).encode()
    if choice == 3:  # non-finite numbers (json writes Infinity / NaN), in a field or in the bit table
        bad = rng.choice([float("inf"), float("-inf"), float("nan")])
        if rng.random() < 0.5:
            d[rng.choice(["k_bits", "v_bits", "group", "anchor_bits", "early_frac", "early_bonus"])] = bad
        else:
            d["table"] = [[bad, 2], [2, 2]]
        return json.dumps(d).encode()
    if choice == 4:
        d["table"] = [[rng.randrange(0, 10), rng.randrange(0, 10)] for _ in range(rng.choice([0, 1, 2, 3, 100]))]
        return json.dumps(d).encode()
    if choice == 5:
        d["extra"] = 1
        return json.dumps(d).encode()
    return b"null" if rng.random() < 0.5 else b"[1, 2]"


def _payload_mutant(rng: random.Random, payloads: list[bytes], codec: str) -> list[bytes]:
    out = list(payloads)
    i = rng.randrange(len(out))
    p = out[i]
    choice = rng.randrange(9)
    if choice == 0 and p:  # flip bytes
        b = bytearray(p)
        for _ in range(rng.randrange(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        out[i] = bytes(b)
    elif choice == 1:  # truncate
        out[i] = p[: rng.randrange(len(p) + 1)]
    elif choice == 2:  # extend
        out[i] = p + rng.randbytes(rng.randrange(1, 64))
    elif choice == 3:  # random bytes of the same or another length
        out[i] = rng.randbytes(rng.choice([0, 1, 4, len(p), max(0, len(p) - 1), len(p) + 1]))
    elif choice == 4:  # validly compressed garbage or a wrong amount of data
        raw = rng.randbytes(rng.choice([0, 1, 100, 1024, 2048, 4096, 1 << 16]))
        out[i] = lz4.frame.compress(raw) if codec.startswith("lz4") else zstandard.ZstdCompressor().compress(raw)
    elif choice == 5:  # drop, repeat or swap sections
        how = rng.randrange(3)
        if how == 0:
            del out[i]
        elif how == 1:
            out.insert(i, p)
        else:
            j = rng.randrange(len(out))
            out[i], out[j] = out[j], out[i]
    elif choice == 6:  # all 0xff / 0x00
        out[i] = bytes([rng.choice([0, 255])]) * len(p)
    elif choice == 7 and p:  # decompress a compressed section, mutate the plain bytes, compress again
        try:
            plain = zstandard.ZstdDecompressor().decompress(p) if not codec.startswith("lz4") else lz4.frame.decompress(p)
        except Exception:
            plain = p
        b = bytearray(plain)
        for _ in range(rng.randrange(1, 16)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        out[i] = zstandard.ZstdCompressor().compress(bytes(b)) if not codec.startswith("lz4") else lz4.frame.compress(bytes(b))
    else:  # one section of another codec's artifact
        out[i] = rng.randbytes(len(p))
    return out


def _mutant(rng: random.Random, blob: bytes, codec: str, bases: list[tuple[str, bytes]]) -> bytes:
    (version, flags), h, payloads = split(blob)
    if rng.random() < 0.1:  # another artifact's sections under this header (codec or dtype mixed up)
        payloads = split(rng.choice(bases)[1])[2]
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        what = rng.randrange(6)
        if what == 0:
            payloads = _payload_mutant(rng, payloads, codec)
        elif what == 1:
            h.codec_meta = _meta_mutant(rng, h.codec_meta)
        elif what == 2:
            field = rng.choice(["token_count", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_index", "layout_version"])
            setattr(h, field, rng.choice(_INTS) if field != "dtype" else rng.randrange(0, 6))
        elif what == 3:
            field = rng.choice(["codec", "codec_level"])
            setattr(h, field, rng.choice(_STRS))
            if rng.random() < 0.5:
                h.lossy = not h.lossy
        elif what == 4:
            h.created_unix = rng.choice([float("nan"), float("inf"), -1.0, 1e308])
            h.lossy = not h.lossy
        else:
            version, flags = rng.choice([(0, 0), (1, 0), (1, 0xFFFF), (2, 0)])
    if rng.random() < 0.03:
        return frame(rng.randbytes(rng.randrange(0, 200)), payloads, version=version, flags=flags)
    return frame(h, payloads, version=version, flags=flags)


def _feed_all(rng: random.Random, m: bytes) -> str | None:
    """The three ways in: verify, decode, and stream (random pieces; half into a caller's tensor).
    Returns the codec of a mutant that decoded whole (its mutations reached that decoder)."""
    decoded = None
    for i, run in enumerate((
        lambda: verify_artifact(m),
        lambda: decode_artifact(m),
        lambda: _stream(rng, m),
    )):
        try:
            art = run()
            if i == 1:
                decoded = art.header.codec
        except KdnError:
            pass
    return decoded


def _stream(rng: random.Random, m: bytes) -> None:
    out = torch.empty(2, 2, 2, 16, 8) if rng.random() < 0.5 else None  # (L, 2, H, T, D)
    r = ArtifactReader(out=out)
    pos = 0
    while pos < len(m):
        n = rng.choice([1, 3, 12, 100, 1000, len(m)])
        r.feed(m[pos : pos + n])
        pos += n
    r.finish()


@pytest.mark.parametrize("seed", SEEDS)
def test_checksum_valid_mutants_raise_only_project_errors(seed):
    rng = random.Random(seed)
    bases = [(c, _base(c, dt)) for c in CODECS for dt in (torch.float32, torch.float16, torch.bfloat16)]
    for _, b in bases:  # the unmutated artifacts decode
        decode_artifact(b)
    bad: dict[str, str] = {}
    reached: Counter[str] = Counter()  # mutants that passed every check and decoded, by codec family
    deadline = time.monotonic() + CAP_S / 2
    done = 0
    for done in range(1, MUTANTS + 1):
        codec, blob = rng.choice(bases)
        m = _mutant(rng, blob, codec, bases)
        try:
            if (name := _feed_all(rng, m)) is not None and m != blob:
                reached[name.split(":")[0]] += 1  # a mutated header may spell the codec "kvq:q2"
        except Exception as exc:  # anything that is not a KdnError
            bad.setdefault(f"{type(exc).__name__} ({codec})", f"{exc!s:.200}")
        if time.monotonic() > deadline:
            break
    assert done >= 200, f"only {done} mutants in the time cap: the fuzz loop is too slow to mean much"
    families = {c.split(":")[0] for c in CODECS}
    assert families <= set(reached), f"mutants that reached a decoder: {dict(reached)}"
    assert not bad, "non-project exceptions from checksum-valid artifacts:\n" + "\n".join(f"  {k}: {v}" for k, v in bad.items())


def _zstd_frame_declaring(size: int, body: bytes = b"\0") -> bytes:
    """A zstd frame whose header declares ``size`` content bytes (8-byte field, single segment)
    and holds one raw block of ``body``."""
    block = struct.pack("<I", (len(body) << 3) | 1)[:3]  # last block, raw, len(body) bytes
    return b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", size) + block + body


def test_a_zstd_plane_declaring_an_exabyte_is_corrupt_not_a_memory_error():
    """A checksum-valid 2 KB artifact whose zstd plane declares 1.39e18 bytes: zstandard would
    allocate what the frame declares; the codec refuses it against the section's own size."""
    blob = _base("zstd:3", torch.float16)
    (version, flags), h, payloads = split(blob)
    n = 2 * 16 * 8  # values per section (H, T, D); float16: two byte planes of n bytes
    frame_ = _zstd_frame_declaring(1_390_000_000_000_000_000)
    section = bytes([1]) + struct.pack("<BI", 1, len(frame_)) + struct.pack("<BI", 0, n) + frame_ + bytes(n)
    m = frame(h, [section, *payloads[1:]], version=version, flags=flags)
    assert len(m) < 4096
    for run in (lambda: decode_artifact(m), lambda: _stream(random.Random(0), m)):
        with pytest.raises(KdnError, match="declares 1390000000000000000 bytes"):
            run()
