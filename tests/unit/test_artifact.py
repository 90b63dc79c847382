"""The artifact container: round trips, streaming, and hostile input.

Every corrupted, truncated or hostile container must raise one of the project's own exceptions
(``kdn.errors.KdnError`` subclasses) and never return wrong KV; a declared length is never
allocated before it is bounded. Containers are crafted here by an independent implementation of
the layout documented in :mod:`kdn.artifact.format`, so the tests check the documented format too.
"""

from __future__ import annotations

import struct
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdn.artifact import (
    MAX_HEADER,
    Artifact,
    ArtifactReader,
    decode_artifact,
    encode_artifact,
    iter_sections,
    layer_cuts,
    read_header,
    verify_artifact,
)
from kdn.codecs import CODECS, lossless_codecs
from kdn import errors as kerr
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint
from kdn.proto import kdn_pb2 as pb

FP = ModelFingerprint(bytes(range(32)))
KEY = ChunkKey(bytes(range(100, 132)))
BUILTIN_CODECS = ["raw", "lz4", "zstd", "int8"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _kv(layers: int = 2, heads: int = 2, tokens: int = 8, dim: int = 4, dtype=torch.float16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, heads, tokens, dim, generator=g).to(dtype)  # (L, 2, H, T, D)


def _encode(kv: torch.Tensor, codec: str = "raw") -> bytes:
    return encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec=codec, chunk_index=3)


# -- an independent writer of the documented layout, for crafting hostile containers -------------


def _frame(header: bytes, sections: list[bytes], *, version: int = 1, flags: int = 0, header_len: int | None = None,
           magic: bytes = b"KDNA") -> bytes:
    prefix = struct.pack("<4sHHI", magic, version, flags, len(header) if header_len is None else header_len)
    checks = [struct.pack("<Q", xxhash.xxh3_64_intdigest(prefix + header))]
    body = prefix + header + checks[0]
    for payload in sections:
        framed = struct.pack("<I", len(payload)) + payload
        checks.append(struct.pack("<Q", xxhash.xxh3_64_intdigest(framed)))
        body += framed + checks[-1]
    # the whole-artifact digest is taken over the checks, in order
    return body + b"KDNE" + xxhash.xxh3_128_digest(b"".join(checks))


def _split(blob: bytes) -> tuple[pb.ArtifactHeader, list[bytes]]:
    """Parse a container with the documented layout (no verification)."""
    _, _, _, hlen = struct.unpack_from("<4sHHI", blob)
    header = pb.ArtifactHeader.FromString(blob[12 : 12 + hlen])
    pos, sections = 12 + hlen + 8, []
    for _ in range(2 * header.num_layers):
        (n,) = struct.unpack_from("<I", blob, pos)
        sections.append(blob[pos + 4 : pos + 4 + n])
        pos += 4 + n + 8
    assert blob[pos : pos + 4] == b"KDNE" and len(blob) == pos + 20
    return header, sections


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", BUILTIN_CODECS)
def test_round_trip(codec: str, dtype: torch.dtype) -> None:
    kv = _kv(dtype=dtype)
    blob = _encode(kv, codec)
    art = decode_artifact(blob, expect_fingerprint=FP, expect_key=KEY)
    assert isinstance(art, Artifact)
    h = art.header
    assert (h.key, h.parent_key, h.fingerprint) == (bytes(KEY), bytes(ROOT_KEY), bytes(FP))
    assert (h.num_layers, h.num_kv_heads, h.token_count, h.head_dim, h.chunk_index) == (2, 2, 8, 4, 3)
    assert h.codec == codec and h.lossy == CODECS[codec].lossy
    assert art.kv.dtype == dtype and art.kv.shape == kv.shape
    if codec in lossless_codecs():
        assert torch.equal(art.kv.view(torch.uint8), kv.view(torch.uint8)), "lossless codec changed bits"
    else:
        assert (art.kv.float() - kv.float()).abs().max() < 0.05


def test_writer_follows_the_documented_layout() -> None:
    kv = _kv()
    blob = _encode(kv, "raw")
    header, sections = _split(blob)
    assert blob == _frame(header.SerializeToString(), sections)
    # raw sections are the (H, T, D) tensors' bytes, in order layer 0 K, layer 0 V, layer 1 K ...
    for i, payload in enumerate(sections):
        assert payload == kv[i // 2, i % 2].contiguous().view(torch.uint8).numpy().tobytes()


def test_streaming_yields_layer_0_before_the_last_byte() -> None:
    kv = _kv(layers=4)
    blob = _encode(kv, "zstd")
    reader = ArtifactReader(expect_fingerprint=FP)
    seen: list[tuple[int, int, str]] = []  # (bytes fed so far, layer, kind)
    for i in range(len(blob)):
        for section in reader.feed(blob[i : i + 1]):
            seen.append((i + 1, section.layer, section.kind))
            assert torch.equal(section.tensor, kv[section.layer, 0 if section.kind == "k" else 1])
        if i + 1 < len(blob):
            assert not reader.complete
    assert reader.complete
    assert reader.finish().num_layers == 4
    assert [(layer, kind) for _, layer, kind in seen] == [(l, k) for l in range(4) for k in "kv"]
    first_at = seen[0][0]
    assert first_at < len(blob) // 4, f"layer 0 K arrived only after {first_at} of {len(blob)} bytes"
    # each section is handed out the moment its checksum's last byte arrives, not later
    _, sections = _split(blob)
    hlen = struct.unpack_from("<I", blob, 8)[0]
    assert first_at == 12 + hlen + 8 + 4 + len(sections[0]) + 8


@pytest.mark.parametrize("codec", BUILTIN_CODECS)
def test_layer_cuts_hand_a_reader_each_layer_whole(codec: str) -> None:
    """Fed piece by piece at ``layer_cuts``, a reader yields exactly layer l's K and V from piece l
    (none split, none early) and verifies the whole container, as it does fed at once."""
    kv = _kv(layers=4)
    blob = _encode(kv, codec)
    cuts = layer_cuts(blob)
    header, sections = _split(blob)
    hlen = struct.unpack_from("<I", blob, 8)[0]
    ends = [12 + hlen + 8 + sum(4 + len(p) + 8 for p in sections[: 2 * (l + 1)]) for l in range(4)]
    assert cuts == [*ends[:-1], len(blob)]  # the last piece carries the trailer too
    reader = ArtifactReader(expect_fingerprint=FP)
    prev = 0
    for layer, cut in enumerate(cuts):
        got = reader.feed(memoryview(blob)[prev:cut])
        assert [(s.layer, s.kind) for s in got] == [(layer, "k"), (layer, "v")]
        prev = cut
    assert reader.finish().num_layers == 4


@pytest.mark.parametrize("what", ["garbage", "truncated header", "truncated in layer 1", "huge length"])
def test_layer_cuts_of_a_bad_container_end_early_and_the_reader_refuses_it(what: str) -> None:
    """The walk verifies nothing: where it cannot go on, the rest is one piece, and the reader
    fed those pieces raises the project's error, never returns wrong KV."""
    blob = bytearray(_encode(_kv(layers=4)))
    hlen = struct.unpack_from("<I", blob, 8)[0]
    first = 12 + hlen + 8  # layer 0 K's length field
    if what == "garbage":
        blob = bytearray(b"not a container at all")
    elif what == "truncated header":
        blob = blob[:20]
    elif what == "truncated in layer 1":
        blob = blob[: layer_cuts(bytes(blob))[0] + 30]
    else:
        struct.pack_into("<I", blob, first, 1 << 31)
    cuts = layer_cuts(bytes(blob))
    assert cuts[-1] == len(blob) and cuts == sorted(cuts) and len(cuts) <= 4
    reader = ArtifactReader(expect_fingerprint=FP)
    with pytest.raises(kerr.KdnError):
        prev = 0
        for cut in cuts:
            reader.feed(memoryview(bytes(blob))[prev:cut])
            prev = cut
        reader.finish()


def test_iter_sections_and_verify_and_read_header() -> None:
    kv = _kv()
    blob = _encode(kv, "lz4")
    pieces = [blob[i : i + 7] for i in range(0, len(blob), 7)]
    assert len(list(iter_sections(pieces, expect_fingerprint=FP))) == 4
    assert verify_artifact(blob).codec == "lz4"
    assert read_header(blob[:200]).key == bytes(KEY)
    with pytest.raises(kerr.ArtifactCorrupt):
        read_header(blob[:20])
    with pytest.raises(kerr.ArtifactCorrupt, match="truncated"):
        list(iter_sections(pieces[:-1]))


# -- what a reader expects -----------------------------------------------------------------------


def test_wrong_fingerprint_key_or_lossiness_is_refused() -> None:
    blob = _encode(_kv(), "int8")
    with pytest.raises(kerr.FingerprintMismatch):
        decode_artifact(blob, expect_fingerprint=ModelFingerprint(b"\x01" * 32))
    with pytest.raises(kerr.ArtifactCorrupt, match="expected"):
        decode_artifact(blob, expect_key=ChunkKey(b"\x02" * 32))
    with pytest.raises(kerr.LossyRefused):
        decode_artifact(blob, require_lossless=True)
    decode_artifact(_encode(_kv(), "zstd"), require_lossless=True)


def test_encoder_refuses_bad_input() -> None:
    with pytest.raises(kerr.InvalidInput):
        encode_artifact(torch.zeros(2, 3, 2, 8, 4), key=KEY, parent_key=ROOT_KEY, fingerprint=FP)
    with pytest.raises(kerr.InvalidInput):
        encode_artifact(torch.zeros(2, 2, 8, 4), key=KEY, parent_key=ROOT_KEY, fingerprint=FP)
    with pytest.raises(kerr.InvalidInput):
        encode_artifact(torch.zeros(1, 2, 1, 2, 2, dtype=torch.int32), key=KEY, parent_key=ROOT_KEY, fingerprint=FP)
    with pytest.raises(kerr.InvalidInput):
        encode_artifact(_kv(), key=ChunkKey(b"short"), parent_key=ROOT_KEY, fingerprint=FP)
    with pytest.raises(kerr.UnknownCodec):
        encode_artifact(_kv(), key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="nope")


# -- hostile input -------------------------------------------------------------------------------


def _must_fail(blob: bytes | bytearray, **kw: object) -> kerr.KdnError:
    with pytest.raises(kerr.KdnError) as exc:
        decode_artifact(bytes(blob), **kw)
    return exc.value


@pytest.mark.parametrize("codec", BUILTIN_CODECS)
def test_every_single_bit_flip_is_detected(codec: str) -> None:
    """Exhaustive over header, sections, checksums and trailer of a small container."""
    blob = _encode(_kv(layers=1, heads=1, tokens=2, dim=4), codec)
    assert len(blob) < 400
    kinds: dict[str, int] = {}
    for bit in range(len(blob) * 8):
        bad = bytearray(blob)
        bad[bit // 8] ^= 1 << (bit % 8)
        err = _must_fail(bad, expect_fingerprint=FP)
        assert isinstance(err, (kerr.ArtifactError, kerr.MessageTooLarge, kerr.UnknownCodec, kerr.FingerprintMismatch)), repr(err)
        kinds[type(err).__name__] = kinds.get(type(err).__name__, 0) + 1
    assert kinds.get("ArtifactCorrupt", 0) > len(blob) * 7, kinds


def test_every_truncation_is_detected() -> None:
    blob = _encode(_kv(layers=1, heads=1, tokens=2, dim=4), "zstd")
    for n in range(len(blob)):
        err = _must_fail(blob[:n])
        assert isinstance(err, kerr.ArtifactCorrupt), (n, err)
    reader = ArtifactReader()
    reader.feed(blob[:-1])
    with pytest.raises(kerr.ArtifactCorrupt, match="truncated"):
        reader.finish()


def test_trailing_garbage_is_detected() -> None:
    blob = _encode(_kv(), "raw")
    with pytest.raises(kerr.ArtifactCorrupt, match="after the artifact trailer"):
        decode_artifact(blob + b"\x00")
    reader = ArtifactReader()
    reader.feed(blob)
    with pytest.raises(kerr.ArtifactCorrupt):
        reader.feed(b"x")


@FUZZ
@given(data=st.data())
def test_random_corruption_is_detected(data: st.DataObject) -> None:
    codec = data.draw(st.sampled_from(BUILTIN_CODECS))
    original = _encode(_kv(layers=2, heads=2, tokens=4, dim=8, seed=1), codec)
    blob = bytearray(original)
    n_edits = data.draw(st.integers(1, 8))
    for _ in range(n_edits):
        op = data.draw(st.sampled_from(["xor", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if not blob:
            break
        if op == "xor":
            blob[pos] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del blob[pos : pos + data.draw(st.integers(1, 16))]
        else:
            del blob[pos:]
    if bytes(blob) == original:  # edits that cancel out
        return
    _must_fail(blob)


@FUZZ
@given(garbage=st.binary(max_size=600))
def test_arbitrary_bytes_never_decode(garbage: bytes) -> None:
    _must_fail(garbage)
    _must_fail(b"KDNA\x01\x00\x00\x00" + garbage)


def test_wrong_magic() -> None:
    blob = bytearray(_encode(_kv(), "raw"))
    blob[:4] = b"KDNX"
    with pytest.raises(kerr.ArtifactCorrupt, match="magic"):
        decode_artifact(bytes(blob))
    with pytest.raises(kerr.ArtifactCorrupt, match="magic"):
        ArtifactReader().feed(b"GIF8")  # fails fast, before a whole prefix arrived


def test_future_version_with_valid_checksums() -> None:
    header, sections = _split(_encode(_kv(), "raw"))
    with pytest.raises(kerr.UnsupportedVersion, match="version 2"):
        decode_artifact(_frame(header.SerializeToString(), sections, version=2))
    header.layout_version = 99
    with pytest.raises(kerr.UnsupportedVersion, match="layout"):
        decode_artifact(_frame(header.SerializeToString(), sections))
    with pytest.raises(kerr.ArtifactCorrupt):
        decode_artifact(_frame(header.SerializeToString(), sections, version=0))


def test_unknown_codec_with_valid_checksums() -> None:
    header, sections = _split(_encode(_kv(), "raw"))
    header.codec = "from-the-future"
    with pytest.raises(kerr.UnknownCodec, match="from-the-future"):
        decode_artifact(_frame(header.SerializeToString(), sections))


def test_lossy_flag_that_lies_is_refused() -> None:
    header, sections = _split(_encode(_kv(), "int8"))
    header.lossy = False
    with pytest.raises(kerr.ArtifactCorrupt, match="lossy"):
        decode_artifact(_frame(header.SerializeToString(), sections), require_lossless=True)


def test_section_that_decodes_to_the_wrong_size() -> None:
    header, sections = _split(_encode(_kv(), "raw"))
    sections[1] = sections[1][:-2]
    with pytest.raises(kerr.ArtifactCorrupt):
        decode_artifact(_frame(header.SerializeToString(), sections))
    header, sections = _split(_encode(_kv(), "zstd"))
    import zstandard

    sections[0] = zstandard.ZstdCompressor().compress(b"\x00" * 10)  # valid zstd, wrong size
    with pytest.raises(kerr.ArtifactCorrupt):
        decode_artifact(_frame(header.SerializeToString(), sections))


def _peak_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


HUGE = 0xFFFF_FFFF  # a u32 length field at its maximum: 4 GiB


def test_huge_header_length_is_refused_without_allocating() -> None:
    prefix = struct.pack("<4sHHI", b"KDNA", 1, 0, HUGE)

    def attempt() -> None:
        with pytest.raises(kerr.ArtifactCorrupt, match="header declares"):
            decode_artifact(prefix + b"\x00" * 64)

    assert _peak_bytes(attempt) < 1 << 20
    assert MAX_HEADER < 1 << 20


@pytest.mark.parametrize("codec", BUILTIN_CODECS)
def test_huge_section_length_is_refused_without_allocating(codec: str) -> None:
    header, _ = _split(_encode(_kv(), codec))
    hbytes = header.SerializeToString()
    prefix = struct.pack("<4sHHI", b"KDNA", 1, 0, len(hbytes))
    blob = prefix + hbytes + struct.pack("<Q", xxhash.xxh3_64_intdigest(prefix + hbytes))
    blob += struct.pack("<I", HUGE) + b"\x00" * 64

    def attempt() -> None:
        with pytest.raises(kerr.ArtifactCorrupt, match="declares"):
            decode_artifact(blob)

    assert _peak_bytes(attempt) < 1 << 20


@pytest.mark.parametrize("codec", ["raw", "lz4", "zstd"])
def test_header_declaring_a_huge_shape_is_refused_without_allocating(codec: str) -> None:
    """A checksummed header whose shape decodes to terabytes: refused before any section is
    decompressed (a tiny zstd/lz4 payload could otherwise expand to the declared size)."""
    header, sections = _split(_encode(_kv(), codec))
    header.num_layers, header.num_kv_heads, header.token_count, header.head_dim = 2, 1024, 1 << 20, 4096
    blob = _frame(header.SerializeToString(), sections)

    def attempt() -> None:
        with pytest.raises((kerr.MessageTooLarge, kerr.ArtifactCorrupt)):
            decode_artifact(blob)

    assert _peak_bytes(attempt) < 1 << 20


def test_decompression_bomb_is_bounded_by_max_bytes() -> None:
    """A zstd section of zeros that would decode far past the reader's budget is refused."""
    import zstandard

    kv = torch.zeros(1, 2, 64, 4096, 64, dtype=torch.float16)  # 64 MiB of zeros, ~ few KiB of zstd
    blob = encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="zstd:1")
    assert len(blob) < 1 << 20
    assert zstandard is not None

    def attempt() -> None:
        with pytest.raises(kerr.MessageTooLarge):
            decode_artifact(blob, max_bytes=8 << 20)

    assert _peak_bytes(attempt) < 4 << 20


def test_oversized_stream_is_refused() -> None:
    blob = _encode(_kv(tokens=64), "raw")
    reader = ArtifactReader(max_bytes=len(blob) - 1)
    with pytest.raises(kerr.MessageTooLarge):
        for i in range(0, len(blob), 100):
            reader.feed(blob[i : i + 100])


def test_assembling_reader_yields_views_of_one_chunk_tensor() -> None:
    kv = _kv(layers=3, dtype=torch.bfloat16)
    blob = _encode(kv, "zstd")
    reader = ArtifactReader(assemble=True)
    sections = []
    for i in range(0, len(blob), 64):
        sections += reader.feed(blob[i : i + 64])
    reader.finish()
    assert reader.kv is not None and torch.equal(reader.kv, kv)
    assert all(s.tensor.data_ptr() == reader.kv[s.layer, "kv".index(s.kind)].data_ptr() for s in sections)
    plain = ArtifactReader()
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(plain.feed(blob), sections))


@pytest.mark.parametrize("assemble", [False, True])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_multi_megabyte_stream_in_pieces(codec: str, assemble: bool) -> None:
    """Past 1 MiB the reader compacts its buffer while sections stream out; nothing may break."""
    kv = _kv(layers=8, heads=4, tokens=256, dim=64, dtype=torch.float16)  # 2 MiB
    blob = _encode(kv, codec)
    reader = ArtifactReader(assemble=assemble)
    sections = []
    for i in range(0, len(blob), 65536):
        sections += reader.feed(blob[i : i + 65536])
    reader.finish()
    assert len(sections) == 16
    for s in sections:
        assert torch.equal(s.tensor, kv[s.layer, "kv".index(s.kind)])


_STREAM_BLOB = encode_artifact(_kv(layers=3, seed=5), key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="zstd")


@FUZZ
@given(cuts=st.lists(st.integers(0, len(_STREAM_BLOB)), max_size=30))
def test_any_split_of_the_stream_gives_the_same_sections(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(_STREAM_BLOB)]
    reader = ArtifactReader(expect_fingerprint=FP)
    got = []
    for a, b in zip(bounds, bounds[1:]):
        got += reader.feed(_STREAM_BLOB[a:b])
    reader.finish()
    kv = _kv(layers=3, seed=5)
    assert [(s.layer, s.kind) for s in got] == [(l, k) for l in range(3) for k in "kv"]
    assert all(torch.equal(s.tensor, kv[s.layer, "kv".index(s.kind)]) for s in got)


def test_reader_decodes_into_a_strided_caller_buffer() -> None:
    kv = _kv()  # (L, 2, H, T, D)
    L, _, H, T, D = kv.shape
    whole = torch.zeros((L, 2, H, 3 * T, D), dtype=kv.dtype)  # a prefix of three chunks
    for codec in ("raw", "zstd"):
        whole.zero_()
        reader = ArtifactReader(expect_fingerprint=FP, out=whole[:, :, :, T : 2 * T])  # chunk 1's range
        reader.feed(_encode(kv, codec))
        reader.finish()
        assert torch.equal(whole[:, :, :, T : 2 * T], kv)
        assert not whole[:, :, :, :T].any() and not whole[:, :, :, 2 * T :].any()  # nothing else touched


def test_reader_refuses_a_geometry_other_than_its_buffer_before_writing() -> None:
    kv = _kv()
    L, _, H, T, D = kv.shape
    out = torch.zeros((L, 2, H, T + 1, D), dtype=kv.dtype)
    with pytest.raises(kerr.FingerprintMismatch):
        ArtifactReader(out=out).feed(_encode(kv, "raw"))
    assert not out.any()


def test_sink_gets_verified_sections_borrowed_from_the_fed_bytes() -> None:
    """``sink``: each verified section goes to the caller as it completes, a view of the fed bytes
    for the raw codec (the caller's one copy), and the fed buffer is free again after ``feed``."""
    import torch

    from kdn.artifact import ArtifactReader, decode_artifact
    from kdn.testing import make_chain

    blob = make_chain(1, shape=(3, 2, 8, 4)).blobs[0]
    whole = decode_artifact(blob).kv  # (L, 2, H, T, D)
    got: dict[tuple[int, str], torch.Tensor] = {}
    buf = bytearray(blob)
    src = np.frombuffer(buf, dtype=np.uint8)

    def sink(s) -> None:
        # lent as numpy over the fed bytes (no tensor made unless asked), its dtype kept apart
        assert s.array is not None and np.shares_memory(s.array, src) and s.dtype == whole.dtype
        got[(s.layer, s.kind)] = s.tensor.clone()

    reader = ArtifactReader(sink=sink)
    assert reader.feed(memoryview(buf)) == []
    del src
    reader.finish()
    assert sorted(got) == [(layer, kind) for layer in range(3) for kind in "kv"]
    for (layer, kind), t in got.items():
        assert torch.equal(t, whole[layer, 0 if kind == "k" else 1])
    buf.extend(b"x")  # no view of the buffer is left exported (a bytearray cannot resize while one is)

    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x08
    seen: list[tuple[int, str]] = []
    with pytest.raises(kerr.ArtifactCorrupt):
        ArtifactReader(sink=lambda s: seen.append((s.layer, s.kind))).feed(bad)
    assert len(seen) < 6  # the corrupt section never reached the sink


def _payload_offsets(blob: bytes) -> list[int]:
    """Where each section's payload starts in a container (documented layout, no verification)."""
    _, _, _, hlen = struct.unpack_from("<4sHHI", blob)
    header = pb.ArtifactHeader.FromString(blob[12 : 12 + hlen])
    pos, out = 12 + hlen + 8, []
    for _ in range(2 * header.num_layers):
        (n,) = struct.unpack_from("<I", blob, pos)
        out.append(pos + 4)
        pos += 4 + n + 8
    return out


class _CountingPool(ThreadPoolExecutor):
    """A caller-owned executor that counts the work handed to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="test-verify")
        self.submitted = 0

    def submit(self, *args, **kwargs):  # type: ignore[override]
        self.submitted += 1
        return super().submit(*args, **kwargs)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "token range of a prefix"])
def test_a_raw_run_split_onto_the_callers_pool_gives_the_same_kv_and_names_the_first_bad_section(
    monkeypatch: pytest.MonkeyPatch, strided: bool
) -> None:
    """Whole raw layers fed at once are copied into ``out`` and verified there, the second half
    on the executor the caller lends: the KV is bit for bit the artifact's, and a flipped bit
    anywhere is the error of its own section; with bad sections in both halves, the first one in
    order."""
    from kdn.artifact import digest

    monkeypatch.setattr(digest, "RAW_RUN_BYTES", 1)  # a step per layer
    monkeypatch.setattr(digest, "SPLIT_RUN_BYTES", 0)  # every run of two steps or more is split
    kv = _kv(layers=6, heads=2, tokens=8, dim=4)
    blob = _encode(kv, "raw")
    L, _, H, T, D = kv.shape

    with _CountingPool() as pool:

        def read(data: bytes) -> torch.Tensor:
            whole = torch.zeros((L, 2, H, 3 * T, D), dtype=kv.dtype)
            out = whole[:, :, :, T : 2 * T] if strided else whole[:, :, :, :T].contiguous()
            reader = ArtifactReader(expect_fingerprint=FP, out=out, pool=pool)
            reader.feed(data)
            reader.finish()
            if strided:
                assert not whole[:, :, :, :T].any() and not whole[:, :, :, 2 * T :].any()  # nothing else touched
            return out

        assert torch.equal(read(blob), kv)
        assert pool.submitted == 1  # the split ran on the caller's pool

        offsets = _payload_offsets(blob)
        for j, at in enumerate(offsets):
            bad = bytearray(blob)
            bad[at + 5] ^= 0x10
            with pytest.raises(kerr.ArtifactCorrupt, match=f"layer {j // 2} {'KV'[j % 2]} section checksum mismatch"):
                read(bytes(bad))
        bad = bytearray(blob)
        bad[offsets[10] + 1] ^= 0x01  # layer 5 K: the pool's half
        bad[offsets[3] + 2] ^= 0x80  # layer 1 V: this thread's half, and first in order
        with pytest.raises(kerr.ArtifactCorrupt, match="layer 1 V section checksum mismatch"):
            read(bytes(bad))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "token range of a prefix"])
def test_a_large_raw_run_is_bit_identical_with_and_without_a_pool_and_makes_no_thread(strided: bool) -> None:
    """At the default thresholds a 4 MiB chunk is split onto a pool when one is given, hashed on
    the calling thread when not: the same bytes either way, through every reading entry point,
    and the artifact package never starts a thread of its own."""
    import threading

    kv = _kv(layers=4, heads=8, tokens=512, dim=64, seed=5)  # (L, 2, H, T, D): 4 MiB of fp16
    blob = _encode(kv, "raw")
    L, _, H, T, D = kv.shape

    def read(pool: ThreadPoolExecutor | None) -> torch.Tensor:
        whole = torch.zeros((L, 2, H, 2 * T, D), dtype=kv.dtype)
        out = whole[:, :, :, T:] if strided else whole[:, :, :, :T].contiguous()
        reader = ArtifactReader(expect_fingerprint=FP, out=out, pool=pool)
        reader.feed(blob)
        reader.finish()
        return out

    threads = {t.ident for t in threading.enumerate()}
    alone = read(None)
    assert {t.ident for t in threading.enumerate()} == threads  # no pool: no thread
    with _CountingPool() as pool:
        lent = read(pool)
        assert pool.submitted == 1
        assembled = decode_artifact(blob, pool=pool).kv
        streamed = [s.tensor.clone() for s in iter_sections([blob], assemble=True, pool=pool)]
        assert pool.submitted == 3  # the pool reaches the reader through every entry point
    bits = kv.view(torch.int16)
    assert torch.equal(alone.view(torch.int16), bits) and torch.equal(lent.view(torch.int16), bits)
    assert torch.equal(assembled.view(torch.int16), bits)
    assert all(torch.equal(s.view(torch.int16), bits[i // 2, i % 2]) for i, s in enumerate(streamed))


def test_transcode_keeps_the_chunk_and_its_variant_and_refuses_lossy_input() -> None:
    from kdn.artifact import transcode

    kv = _kv(layers=3, seed=7)
    blob = encode_artifact(kv, key=KEY, parent_key=ChunkKey(bytes(range(32))), fingerprint=FP, codec="raw",
                           chunk_index=4, steer='{"method":"key-edit"}')
    z = transcode(blob, "zstd:1")
    zh = read_header(z)
    h = read_header(blob)
    assert (zh.codec, zh.codec_level, zh.lossy) == ("zstd", "1", False)
    for field in ("key", "parent_key", "fingerprint", "chunk_index", "steer", "num_layers", "token_count"):
        assert getattr(zh, field) == getattr(h, field), field
    assert torch.equal(decode_artifact(z).kv, kv)  # lossless: bit for bit
    assert decode_artifact(transcode(z, "raw")).kv.equal(kv)
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(kerr.ArtifactCorrupt):
        transcode(bytes(bad), "zstd")  # every checksum is verified first
    with pytest.raises(kerr.LossyRefused):
        transcode(_encode(kv, "int8"), "raw")
