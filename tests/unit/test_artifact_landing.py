"""ArtifactReader's in-place receive (``landing``/``landed``): what a socket fills, the reader checks.

What must hold: the KV that lands is bit for bit what ``feed`` decodes, whatever the codec and
whatever the destination's strides; a raw section's payload is received straight into ``out``
(no copy) and is handed out only after its checksum matched; every flipped bit and every
truncation is caught; a geometry other than ``out``'s is refused before a byte lands in it.
"""

from __future__ import annotations

import pytest
import torch

from kdn.artifact import landing as artifact_landing
from kdn import errors as kerr
from kdn.artifact import ArtifactReader, decode_artifact, encode_artifact
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint

FP = ModelFingerprint(bytes(range(32)))
KEY = ChunkKey(bytes(range(100, 132)))


def _kv(layers: int = 3, heads: int = 2, tokens: int = 8, dim: int = 16, dtype=torch.float16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, heads, tokens, dim, generator=g).to(dtype)  # (L, 2, H, T, D)


def _encode(kv: torch.Tensor, codec: str = "raw") -> bytes:
    return encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec=codec, chunk_index=0)


@pytest.fixture(params=["in place", "in place, one by one", "in scratch"], autouse=True)
def section_threshold(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with raw payloads received in place (threshold 0), in runs of every
    section or one section per landing, and in the scratch buffer (a threshold above every
    section here): every path must give the same answers."""
    monkeypatch.setattr(artifact_landing, "LAND_MIN_SECTION", 1 << 30 if request.param == "in scratch" else 0)
    if request.param == "in place, one by one":
        monkeypatch.setattr(artifact_landing, "RUN_BYTES", 0)
    return request.param


def land(reader: ArtifactReader, blob: bytes) -> tuple[int, int]:
    """Fill the reader's landings from ``blob`` as a socket would; returns (landings, views)."""
    pos = landings = views = 0
    while True:
        want = reader.landing()
        if not want:
            break
        n = sum(len(v) for v in want)
        if pos + n > len(blob):
            raise kerr.ArtifactCorrupt("artifact truncated")  # what the bulk client says
        for v in want:
            v[:] = blob[pos : pos + len(v)]
            pos += len(v)
        landings += 1
        views += len(want)
        reader.landed()
    assert pos == len(blob), "the reader completed before the bytes ended"
    reader.finish()
    return landings, views


@pytest.mark.parametrize("codec", ["raw", "lz4", "zstd", "int8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_landed_kv_equals_fed_kv(codec: str, dtype: torch.dtype) -> None:
    kv = _kv(dtype=dtype)
    blob = _encode(kv, codec)
    expected = decode_artifact(blob).kv
    out = torch.full_like(kv, 7)
    reader = ArtifactReader(expect_fingerprint=FP, expect_key=KEY, out=out)
    land(reader, blob)
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       expected.view(torch.int16 if dtype != torch.float32 else torch.int32))
    # assemble without out: the reader allocates, same bytes
    r2 = ArtifactReader(assemble=True)
    land(r2, blob)
    assert r2.kv is not None and torch.equal(r2.kv, expected)


def test_raw_sections_land_in_place_even_in_a_token_range_of_a_longer_prefix(section_threshold: str) -> None:
    kv = _kv(layers=2, heads=4, tokens=8, dim=16)
    blob = _encode(kv, "raw")
    prefix = torch.zeros(2, 2, 4, 24, 16, dtype=torch.float16)  # (L, 2, H, T_total, D)
    out = prefix[:, :, :, 8:16]  # chunk 1's token range: one contiguous run per head
    reader = ArtifactReader(expect_fingerprint=FP, out=out)
    landings, views = land(reader, blob)
    assert torch.equal(prefix[:, :, :, 8:16], kv)
    assert not prefix[:, :, :, :8].any() and not prefix[:, :, :, 16:].any()  # nothing written outside
    if section_threshold == "in place":
        # 2 (header) + the first length + one run of the 4 sections (each: 4 head runs, then its
        # check and the next length; the last check with the trailer)
        assert landings == 2 + 1 + 1 and views == 2 + 1 + 4 * (4 + 1)
    elif section_threshold == "in place, one by one":  # a landing per section, the trailer with the last
        assert landings == 2 + 1 + 4 and views == 2 + 1 + 4 * (4 + 1)
    else:  # small sections: length, then payload and check together into the scratch buffer
        assert landings == views == 2 + 4 * 2 + 1


def test_a_payload_is_in_out_before_its_check_but_never_handed_out_unverified(section_threshold: str) -> None:
    kv = _kv(layers=1, heads=1, tokens=4, dim=8)
    blob = bytearray(_encode(kv, "raw"))
    blob[-20 - 8 - 3] ^= 0x40  # a bit in the last section's payload
    out = torch.zeros_like(kv)
    reader = ArtifactReader(out=out)
    sections = []
    pos = 0
    with pytest.raises(kerr.ArtifactCorrupt, match="layer 0 V section checksum mismatch"):
        while want := reader.landing():
            for v in want:
                v[:] = blob[pos : pos + len(v)]
                pos += len(v)
            sections += reader.landed()
    # the corrupt V was never returned (in one run with K, neither was: the landing raised)
    assert [s.kind for s in sections] == ([] if section_threshold == "in place" else ["k"])
    assert torch.equal(out[0, 0], kv[0, 0])  # K verified; V's bytes landed, then were refused


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_every_single_bit_flip_is_caught_when_landing(codec: str) -> None:
    blob = _encode(_kv(layers=1, heads=1, tokens=2, dim=4), codec)
    caught = 0
    for bit in range(len(blob) * 8):
        bad = bytearray(blob)
        bad[bit // 8] ^= 1 << (bit % 8)
        out = torch.zeros(1, 2, 1, 2, 4, dtype=torch.float16)
        with pytest.raises((kerr.ArtifactError, kerr.MessageTooLarge, kerr.UnknownCodec, kerr.FingerprintMismatch)):
            land(ArtifactReader(expect_fingerprint=FP, out=out), bytes(bad))
        caught += 1
    assert caught == len(blob) * 8


def test_every_truncation_and_trailing_garbage_is_caught() -> None:
    blob = _encode(_kv(layers=1, heads=1, tokens=2, dim=4), "raw")
    for n in range(len(blob)):
        with pytest.raises(kerr.ArtifactCorrupt):
            land(ArtifactReader(out=torch.zeros(1, 2, 1, 2, 4, dtype=torch.float16)), blob[:n])
    reader = ArtifactReader(out=torch.zeros(1, 2, 1, 2, 4, dtype=torch.float16))
    with pytest.raises(AssertionError, match="completed before the bytes ended"):
        land(reader, blob + b"x")
    assert reader.landing() == []  # complete: nothing more may land


def test_another_geometry_is_refused_before_a_byte_lands_in_out() -> None:
    blob = _encode(_kv(layers=2, heads=2, tokens=8, dim=16), "raw")
    out = torch.full((2, 2, 2, 4, 16), 3.0, dtype=torch.float16)  # 4 tokens, not 8
    with pytest.raises(kerr.FingerprintMismatch):
        land(ArtifactReader(out=out), blob)
    assert bool((out == 3.0).all())
    with pytest.raises(kerr.FingerprintMismatch):
        land(ArtifactReader(expect_fingerprint=ModelFingerprint(bytes(32)), out=torch.zeros(2, 2, 2, 8, 16,
                                                                                            dtype=torch.float16)), blob)


def test_the_size_bound_holds_for_landed_bytes() -> None:
    blob = _encode(_kv(layers=2, heads=2, tokens=64, dim=16), "raw")
    with pytest.raises(kerr.MessageTooLarge):
        land(ArtifactReader(max_bytes=len(blob) // 2), blob)


def test_a_length_field_inside_a_run_that_is_not_the_raw_size_is_refused(section_threshold: str) -> None:
    kv = _kv(layers=2, heads=2, tokens=8, dim=16)
    blob = bytearray(_encode(kv, "raw"))
    raw = 2 * 8 * 16 * 2  # one section's payload: (H, T, D) fp16
    hlen = int.from_bytes(blob[8:12], "little")
    second = 12 + hlen + 8 + (4 + raw + 8)  # the second section's length field
    assert int.from_bytes(blob[second : second + 4], "little") == raw
    blob[second : second + 4] = (raw - 2).to_bytes(4, "little")
    out = torch.zeros_like(kv)
    # landed in one run, the length is checked against the size it was received as; one by one
    # or fed, the section's checksum (which covers its length) refuses it
    with pytest.raises(kerr.ArtifactCorrupt, match="declares 510 bytes; a raw section of this shape is 512"
                       if section_threshold == "in place" else "checksum mismatch"):
        land(ArtifactReader(expect_fingerprint=FP, out=out), bytes(blob))


def test_a_reader_that_received_in_place_is_freed_without_the_garbage_collector() -> None:
    """A destination is handed to the next request once nothing refers to it (``DestinationPool``
    counts references): a reader whose landing kept it in a cycle held it until a collection."""
    import gc
    import weakref

    kv = _kv()
    out = torch.empty_like(kv)
    reader = ArtifactReader(expect_fingerprint=FP, expect_key=KEY, out=out)
    land(reader, _encode(kv))
    assert torch.equal(out, kv)
    gone = weakref.ref(reader)
    was = gc.isenabled()
    gc.disable()
    try:
        del reader
        assert gone() is None
    finally:
        if was:
            gc.enable()
