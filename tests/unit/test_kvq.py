"""``kvq``: stated error bound, level ladder, bit plan, and the container's refusals.

KV here is synthetic but shaped like the real thing: keys with a few outlier channels, values
varying per token, and (for the delta path) strong locality along tokens.
"""

from __future__ import annotations

import struct

import pytest
import torch

from kdn.artifact import ArtifactReader, decode_artifact, encode_artifact, read_header
from kdn.codecs import SectionInfo, get_codec
from kdn.codecs.kvq import DEFAULT_LEVEL, LEVELS, MODE_DELTA, MODE_DIRECT, BitPlan, KvqCodec, level_format
from kdn.errors import ArtifactCorrupt, FingerprintMismatch, InvalidInput, LossyRefused, UnknownCodec
from kdn.keys import ROOT_KEY, ChunkKey, ModelFingerprint

FP = ModelFingerprint(bytes(range(32)))
OTHER_FP = ModelFingerprint(bytes(range(1, 33)))
KEY = ChunkKey(bytes(range(100, 132)))
_HEAD = struct.Struct("<BBBBHI")


def _smooth(heads: int = 2, tokens: int = 70, dim: int = 32, seed: int = 0) -> torch.Tensor:
    """(H, T, D): a slow random walk along tokens plus outlier channels (delta coding pays off)."""
    g = torch.Generator().manual_seed(seed)
    walk = torch.randn(heads, tokens, dim, generator=g).mul(0.05).cumsum(1)
    walk += torch.randn(heads, 1, dim, generator=g)
    walk[:, :, :3] *= 8  # outlier channels
    return walk


def _noise(heads: int = 2, tokens: int = 70, dim: int = 32, seed: int = 1) -> torch.Tensor:
    """(H, T, D): independent tokens (deltas do not pay off)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, tokens, dim, generator=g) * torch.linspace(0.5, 3, tokens)[None, :, None]


def _kv(layers: int = 4, tokens: int = 64, dtype=torch.float16, seed: int = 0) -> torch.Tensor:
    """(L, 2, H, T, D) with smooth keys and values."""
    return torch.stack(
        [torch.stack((_smooth(tokens=tokens, seed=seed + 2 * l), _smooth(tokens=tokens, seed=seed + 2 * l + 1)))
         for l in range(layers)]
    ).to(dtype)


def _bound(x: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    """The stated per-element error bound, recomputed independently (fp32, before output rounding)."""
    rd = 1 if kind == "k" else 2
    return x.abs().amax(rd, keepdim=True) / ((1 << (bits - 1)) - 1) / 2


Q_LEVELS = [lvl for lvl in LEVELS if level_format(lvl) == 1]
K_LEVELS = [lvl for lvl in LEVELS if level_format(lvl) == 2]


@pytest.mark.parametrize("level", Q_LEVELS)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("data,smooth", [(_smooth, True), (_noise, False)])
def test_round_trip_within_stated_error(level: str, kind: str, data, smooth: bool) -> None:
    x = data()  # (H, T, D) fp32; T=70 is not a multiple of the group
    info = SectionInfo(layer=3, num_layers=4, kind=kind, shape=tuple(x.shape), dtype=torch.float32)
    codec = get_codec(f"kvq:{level}")
    payload = codec.encode(x, info)
    mode, bits = payload[1], payload[2]
    assert bits == LEVELS[level][0 if kind == "k" else 1]  # layer 3 of 4 is not an early layer
    y = codec.decode(memoryview(payload), info)
    assert y.shape == x.shape and y.dtype == x.dtype
    bound = _bound(x, kind, bits)  # the same in both forms
    if not smooth:
        assert mode == MODE_DIRECT  # independent tokens: anchors would be waste
    # fp16 scales: allow the scale's own rounding (2^-11 relative) on top of the bound
    assert ((y - x).abs() <= bound * (1 + 2e-3) + 1e-6).all()
    assert len(payload) <= codec.max_payload(info)


def test_deltas_chosen_where_they_pay() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 256, 64, generator=g).mul(0.3).cumsum(1)  # (H, T, D): wanders far, moves little per token
    noise = _noise(tokens=256, dim=64)
    info = SectionInfo(3, 4, "k", tuple(x.shape), torch.float32)
    codec = KvqCodec("q5")
    assert codec.encode(x, info)[1] == MODE_DELTA  # a slow walk: deltas need far fewer symbols
    assert codec.encode(noise, info)[1] == MODE_DIRECT  # independent tokens: anchors would be waste
    blob = codec.encode(x, info)
    forced_direct = codec._encode_direct(x.numpy(), 1, 5)
    assert len(blob) < 0.95 * len(forced_direct)  # same steps, fewer bits
    y = codec.decode(memoryview(blob), info)
    assert ((y - x).abs() <= _bound(x, "k", 5) * (1 + 2e-3) + 1e-6).all()


def test_ladder_is_monotone_in_size_and_error() -> None:
    kv = torch.stack([torch.stack((_noise(tokens=64, seed=2 * l), _noise(tokens=64, seed=2 * l + 1))) for l in range(4)])
    kv = kv.to(torch.float16)  # (L, 2, H, T, D), Gaussian-like like real KV
    sizes, errors = [], []
    for level in Q_LEVELS:
        blob = encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec=f"kvq:{level}")
        out = decode_artifact(blob, expect_fingerprint=FP).kv
        sizes.append(len(blob))
        errors.append(float((out.float() - kv.float()).norm() / kv.float().norm()))
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert errors == sorted(errors) and errors[0] < 0.03
    # q5: keys 5 bits, values 3 (+2 in the first layer), packed and entropy coded
    assert kv.numel() * 2 / sizes[Q_LEVELS.index("q5")] >= 3.0  # small Gaussian sections; real KV: docs/codecs.md


def test_early_layers_get_more_bits_and_plan_travels_in_meta() -> None:
    codec = KvqCodec("q3")  # keys 3 bits, values 2
    plan = BitPlan.from_bytes(codec.meta())
    assert plan == codec.plan
    bits = [plan.bits(layer, 8, "k") for layer in range(8)]
    assert bits == [5, 5, 3, 3, 3, 3, 3, 3]  # ceil(0.25 * 8) early layers get +2
    # the rule follows the model's shape, not its name
    assert [plan.bits(layer, 12, "v") for layer in range(12)] == [4, 4, 4] + [2] * 9
    assert [KvqCodec("q8").plan.bits(layer, 4, "k") for layer in range(4)] == [8, 8, 8, 8]  # capped


def test_explicit_table_from_calibration_round_trips() -> None:
    kv = _kv(layers=2)
    codec = KvqCodec("q4", BitPlan(4, 4, table=((6, 5), (3, 2))))
    blob = encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec=codec)
    h = read_header(blob)
    assert BitPlan.from_bytes(h.codec_meta).table == ((6, 5), (3, 2))
    out = decode_artifact(blob).kv
    err = (out.float() - kv.float()).abs()  # (L, 2, H, T, D)
    assert err[0].mean() < err[1].mean()  # layer 0 got more bits


def test_level_recorded_in_header() -> None:
    blob = encode_artifact(_kv(), key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq:q3")
    h = read_header(blob)
    assert (h.codec, h.codec_level, h.lossy) == ("kvq", "q3", True)
    assert BitPlan.from_bytes(h.codec_meta).k_bits == 3
    h = read_header(encode_artifact(_kv(), key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq"))
    assert h.codec_level == DEFAULT_LEVEL and BitPlan.from_bytes(h.codec_meta).format == 2


@pytest.mark.parametrize("spec", ["kvq:q9", "kvq:hi", "kvq:q1", "kvq:Q4"])
def test_unknown_level_is_a_clear_error(spec: str) -> None:
    with pytest.raises(InvalidInput, match="unknown kvq level"):
        get_codec(spec)
    with pytest.raises(InvalidInput):
        encode_artifact(_kv(), key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec=spec)


def test_unknown_codec_is_a_clear_error() -> None:
    with pytest.raises(UnknownCodec):
        get_codec("kvqq:q4")


def test_other_model_fingerprint_refused() -> None:
    blob = encode_artifact(_kv(), key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq:q4")
    with pytest.raises(FingerprintMismatch):
        ArtifactReader(expect_fingerprint=OTHER_FP).feed(blob)
    assert decode_artifact(blob, expect_fingerprint=FP).kv.shape == (4, 2, 2, 64, 32)


def _spy_decode(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    calls: list[tuple[int, str]] = []
    real = KvqCodec.decode

    def spy(self: KvqCodec, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        calls.append((info.layer, info.kind))
        return real(self, payload, info)

    monkeypatch.setattr(KvqCodec, "decode", spy)
    return calls


def test_corrupted_payload_caught_by_checksum_before_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = bytearray(encode_artifact(_kv(), key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq:q4"))
    (hlen,) = struct.unpack_from("<I", blob, 8)
    first_section = 12 + hlen + 8  # prefix, header, header checksum
    (slen,) = struct.unpack_from("<I", blob, first_section)
    layer0_v = first_section + 4 + slen + 8  # layer 0 K framed; next is layer 0 V
    blob[layer0_v + 4 + 20] ^= 0x10  # flip a bit inside layer 0 V's payload
    calls = _spy_decode(monkeypatch)
    reader = ArtifactReader(expect_fingerprint=FP)
    with pytest.raises(ArtifactCorrupt, match="layer 0 V section checksum"):
        reader.feed(bytes(blob))
    assert calls == [(0, "k")]  # the intact section before it decoded; the corrupted one never did


def test_lossless_client_never_gets_kvq_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = encode_artifact(_kv(), key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq:q8")
    calls = _spy_decode(monkeypatch)
    with pytest.raises(LossyRefused, match="kvq:q8"):
        decode_artifact(blob, require_lossless=True)
    with pytest.raises(LossyRefused):
        (hlen,) = struct.unpack_from("<I", blob, 8)
        ArtifactReader(require_lossless=True, expect_fingerprint=FP).feed(blob[: 12 + hlen + 8])  # at the header
    assert calls == []


def test_hostile_section_fields_rejected() -> None:
    x = _smooth()
    info = SectionInfo(3, 4, "k", tuple(x.shape), torch.float32)
    codec = KvqCodec("q4")
    payload = bytearray(codec.encode(x, info))
    bad_bits = bytearray(payload)
    bad_bits[2] = 2  # claims fewer bits than the header's plan
    with pytest.raises(ArtifactCorrupt, match="plan says"):
        codec.decode(memoryview(bad_bits), info)
    bad_len = bytearray(payload)
    struct.pack_into("<I", bad_len, 6, 1 << 30)  # scale block "longer" than the section
    with pytest.raises(ArtifactCorrupt):
        codec.decode(memoryview(bad_len), info)
    with pytest.raises(ArtifactCorrupt):
        codec.decode(memoryview(payload[:-7]), info)  # truncated symbols
    with pytest.raises(ArtifactCorrupt):
        codec.decode(memoryview(payload[:5]), info)
    with pytest.raises(ArtifactCorrupt, match="meta"):
        codec.with_meta(b"{not json")
    with pytest.raises(ArtifactCorrupt, match="meta"):
        codec.with_meta(b'{"v":1,"k_bits":12,"v_bits":4,"group":16,"anchor_bits":8,"early_frac":0.25,"early_bonus":1}')


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_and_odd_shapes(dtype: torch.dtype) -> None:
    kv = _kv(layers=1, tokens=1, dtype=dtype)  # a single token: no deltas possible
    info = SectionInfo(0, 1, "k", tuple(kv.shape[2:]), dtype)
    assert KvqCodec("q6").encode(kv[0, 0], info)[1] == MODE_DIRECT
    out = decode_artifact(encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq:q6")).kv
    assert out.dtype == dtype and out.shape == kv.shape
    step = kv.float().abs().amax() / 31  # 6 bits; one token, so every scale is at most this
    assert ((out.float() - kv.float()).abs() <= step / 2 * 1.01 + 0.01).all()
    zeros = torch.zeros(1, 2, 1, 5, 3, dtype=dtype)
    assert torch.equal(decode_artifact(encode_artifact(zeros, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq")).kv, zeros)


# -- format 2 (the k?v? ladder) -----------------------------------------------------------------


def _head_step(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Format 2's key step, recomputed independently: per head, the geometric mean over channels of
    max|x_c| / qmax, at least max|x| / 127. ``x``: (H, T, D) -> (H, 1, 1)."""
    qmax = (1 << (bits - 1)) - 1
    r = x.abs().amax(1)  # (H, D)
    geo = (r / qmax).log().mean(-1).exp()
    return torch.maximum(geo, r.amax(-1) / 127)[:, None, None]


@pytest.mark.parametrize("level", K_LEVELS)
@pytest.mark.parametrize("kind", ["k", "v"])
def test_format2_round_trip_within_stated_error(level: str, kind: str) -> None:
    x = _smooth(tokens=70)  # (H, T, D) fp32, outlier channels 0..2
    codec = KvqCodec(level)
    later = SectionInfo(layer=1, num_layers=4, kind=kind, shape=tuple(x.shape), dtype=torch.float32, chunk_index=3)
    payload = codec.encode(x, later)
    assert payload[0] == 2 and payload[1] == LEVELS[level][0 if kind == "k" else 1]
    y = codec.decode(memoryview(payload), later)
    bits = LEVELS[level][0 if kind == "k" else 1]
    bound = _head_step(x, bits) / 2 if kind == "k" else _bound(x, "v", bits)
    assert ((y - x).abs() <= bound * (1 + 2e-3) + 1e-6).all()
    assert len(payload) <= codec.max_payload(later)


def test_format2_keys_share_one_step_per_head() -> None:
    """Large channels get as fine a step as small ones, so their relative error is far smaller than
    in a per-channel scheme of the same bits (they carry most of q·k)."""
    x = _noise(tokens=256, dim=64)
    x[:, :, :4] *= 20  # outlier channels
    info = SectionInfo(1, 4, "k", tuple(x.shape), torch.float32, chunk_index=1)
    new = KvqCodec("k4v4").decode(memoryview(KvqCodec("k4v4").encode(x, info)), info)
    old_codec = KvqCodec("q4")
    old = old_codec.decode(memoryview(old_codec.encode(x, info)), info)
    err_new, err_old = (new - x).abs(), (old - x).abs()
    assert err_new[:, :, :4].mean() < 0.3 * err_old[:, :, :4].mean()
    assert float(err_new[:, :, :4].mean() / err_new[:, :, 4:].mean()) == pytest.approx(1.0, rel=0.15)


def test_format2_first_chunk_keeps_its_first_tokens_exactly() -> None:
    kv = _kv(layers=2, tokens=64)  # (L, 2, H, T, D) fp16
    first = decode_artifact(encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq:k3v3")).kv
    later_blob = encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq:k3v3", chunk_index=2)
    later = decode_artifact(later_blob).kv
    sink = BitPlan.for_level("k3v3").sink
    assert sink > 0 and torch.equal(first[:, :, :, :sink], kv[:, :, :, :sink])  # attention sinks: bit-exact
    assert not torch.equal(later[:, :, :, :sink], kv[:, :, :, :sink])  # elsewhere they are ordinary tokens
    assert not torch.equal(first[:, :, :, sink:], kv[:, :, :, sink:])


def test_format2_ladder_is_monotone() -> None:
    kv = torch.stack([torch.stack((_noise(tokens=64, seed=2 * l), _noise(tokens=64, seed=2 * l + 1))) for l in range(4)])
    kv = kv.to(torch.float16)  # (L, 2, H, T, D)
    sizes, errors = [], []
    for level in sorted(K_LEVELS, key=lambda lvl: -sum(LEVELS[lvl])):
        blob = encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec=f"kvq:{level}", chunk_index=1)
        out = decode_artifact(blob, expect_fingerprint=FP).kv
        sizes.append(len(blob))
        errors.append(float((out.float() - kv.float()).norm() / kv.float().norm()))
    assert sizes == sorted(sizes, reverse=True) and errors == sorted(errors)


def test_format_and_plan_must_agree() -> None:
    x = _smooth()
    info = SectionInfo(1, 4, "k", tuple(x.shape), torch.float32, chunk_index=1)
    v1, v2 = KvqCodec("q4"), KvqCodec("k4v4")
    with pytest.raises(ArtifactCorrupt, match="format 2"):
        v1.decode(memoryview(v2.encode(x, info)), info)
    with pytest.raises(ArtifactCorrupt, match="format 1"):
        v2.decode(memoryview(v1.encode(x, info)), info)
    assert BitPlan.from_bytes(v2.meta()) == v2.plan and BitPlan.from_bytes(v1.meta()) == v1.plan
    with pytest.raises(ArtifactCorrupt, match="meta"):
        BitPlan.from_bytes(b'{"v":1,"k_bits":4,"v_bits":4,"sink":4}')  # sinks are format 2's
    with pytest.raises(ArtifactCorrupt, match="meta"):
        BitPlan.from_bytes(b'{"v":2,"k_bits":4,"v_bits":4,"sink":65}')


@pytest.mark.parametrize("kind", ["k", "v"])
def test_format2_hostile_fields_rejected(kind: str) -> None:
    x = _smooth()
    info = SectionInfo(1, 4, kind, tuple(x.shape), torch.float32, chunk_index=0)
    codec = KvqCodec("k4v4")
    payload = bytes(codec.encode(x, info))

    def bad(offset: int, fmt: str, value: int) -> memoryview:
        b = bytearray(payload)
        struct.pack_into(fmt, b, offset, value)
        return memoryview(b)

    for edit, match in [((1, "<B", 3), "plan says"), ((2, "<B", 9), "exact tokens"), ((3, "<B", 0), "frames"),
                        ((4, "<I", 1 << 30), "past its end"), ((8, "<I", 7), "exact tokens")]:
        with pytest.raises(ArtifactCorrupt, match=match):
            codec.decode(bad(*edit), info)
    for cut in (payload[:-3], payload[:5], payload + b"\0"):
        with pytest.raises(ArtifactCorrupt):
            codec.decode(memoryview(cut), info)


def test_format1_artifacts_still_decode() -> None:
    kv = _kv()
    blob = encode_artifact(kv, key=KEY, parent_key=ROOT_KEY, fingerprint=FP, codec="kvq:q5")
    out = decode_artifact(blob).kv
    assert read_header(blob).codec_level == "q5" and BitPlan.from_bytes(read_header(blob).codec_meta).format == 1
    assert out.shape == kv.shape and float((out.float() - kv.float()).norm() / kv.float().norm()) < 0.3
