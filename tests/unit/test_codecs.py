"""Codecs: lossless ones are bit-exact on every float pattern, every codec honours its own size
bound, bad payloads raise ArtifactCorrupt, and int8 stays within its stated error."""

from __future__ import annotations

import struct
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdn.codecs import CODECS, Codec, SectionInfo, get_codec, lossless_codecs, register_codec
from kdn.codecs.lossless import merge_planes, shuffle, split_planes, unshuffle
from kdn.errors import ArtifactCorrupt, InvalidInput, UnknownCodec

BUILTIN = ["raw", "lz4", "zstd", "zstd:1", "zstd:9", "int8"]
LOSSLESS = ["raw", "lz4", "zstd", "zstd:1", "zstd:9"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _info(x: torch.Tensor, kind: str = "k") -> SectionInfo:
    return SectionInfo(0, 1, kind, tuple(x.shape), x.dtype)  # type: ignore[arg-type]


def _bits(x: torch.Tensor) -> bytes:
    return x.contiguous().view(torch.uint8).numpy().tobytes()


def _kv_like(dtype: torch.dtype, shape=(4, 64, 32), seed: int = 0) -> torch.Tensor:
    """Section-shaped values with KV-like structure: per-channel scales and a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(1, 1, shape[2], generator=g) * 2 + 0.1
    scale[..., :2] *= 20  # outlier channels, as keys have
    return (torch.randn(*shape, generator=g) * scale).to(dtype)  # (H, T, D)


def test_registry() -> None:
    assert {"raw", "lz4", "zstd"} <= set(lossless_codecs())
    assert "int8" not in lossless_codecs() and CODECS["int8"].lossy
    assert get_codec("zstd:7").level == "7" and get_codec("zstd").level == "3"
    assert get_codec("zstd:7").spec == "zstd:7" and get_codec("raw").spec == "raw"
    with pytest.raises(UnknownCodec, match="brotli"):
        get_codec("brotli")
    with pytest.raises(UnknownCodec):
        get_codec("")
    for bad in ("zstd:0", "zstd:23", "zstd:fast"):
        with pytest.raises(InvalidInput):
            get_codec(bad)


def test_a_codec_name_cannot_be_registered_twice() -> None:
    class Impostor(Codec):
        name = "zstd"

        def encode(self, x, info):  # type: ignore[no-untyped-def]
            return b""

        def decode(self, payload, info):  # type: ignore[no-untyped-def]
            return torch.empty(0)

    with pytest.raises(ValueError, match="twice"):
        register_codec(Impostor)
    assert CODECS["zstd"] is not Impostor


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_round_trip_is_bit_exact(spec: str, dtype: torch.dtype) -> None:
    codec = get_codec(spec)
    for x in (_kv_like(dtype), torch.zeros(2, 16, 8, dtype=dtype), _kv_like(dtype, shape=(1, 1, 1))):
        payload = codec.encode(x, _info(x))
        assert len(payload) <= codec.max_payload(_info(x))
        y = codec.decode(memoryview(payload), _info(x))
        assert y.dtype == dtype and y.shape == x.shape
        assert _bits(y) == _bits(x)


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.max, -info.max, info.tiny, -info.tiny,
            info.tiny / 4, info.eps, 1.0, -1.0]
    return torch.tensor(vals, dtype=torch.float32).to(dtype)


@PROPS
@given(data=st.data())
def test_lossless_codecs_preserve_every_bit_pattern(data: st.DataObject) -> None:
    """Arbitrary bit patterns (NaN payloads, subnormals, -0.0 included) come back identical."""
    dtype = data.draw(st.sampled_from(DTYPES))
    spec = data.draw(st.sampled_from(LOSSLESS))
    h, t, d = data.draw(st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 16)))
    raw = data.draw(st.binary(min_size=h * t * d * dtype.itemsize, max_size=h * t * d * dtype.itemsize))
    if data.draw(st.booleans()):  # make it compressible sometimes: repeat a short pattern
        raw = (raw[: dtype.itemsize * 3] * len(raw))[: len(raw)]
    x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(h, t, d)
    codec = get_codec(spec)
    payload = codec.encode(x, _info(x))
    assert len(payload) <= codec.max_payload(_info(x))
    assert _bits(codec.decode(memoryview(payload), _info(x))) == raw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_survive_every_lossless_codec(dtype: torch.dtype) -> None:
    x = _special_values(dtype).reshape(1, -1, 1)
    for spec in LOSSLESS:
        codec = get_codec(spec)
        assert _bits(codec.decode(memoryview(codec.encode(x, _info(x))), _info(x))) == _bits(x)


@PROPS
@given(width=st.sampled_from([1, 2, 4, 8]), raw=st.binary(max_size=256))
def test_plane_split_and_merge_are_inverse(width: int, raw: bytes) -> None:
    raw = raw[: len(raw) - len(raw) % width]
    arr = np.frombuffer(raw, dtype=np.uint8)
    planes = split_planes(arr, width)
    assert len(planes) == width
    for j, plane in enumerate(planes):
        assert plane.tobytes() == raw[j::width]  # plane j = byte j of every value, in memory order
    assert merge_planes(planes, width).tobytes() == raw
    assert unshuffle(shuffle(arr, width), width).tobytes() == raw


@pytest.mark.parametrize("spec", ["lz4", "zstd"])
def test_noise_planes_are_stored_raw_and_exponent_planes_compressed(spec: str) -> None:
    """bf16 KV: the mantissa plane is noise (stored raw), the sign/exponent plane compresses."""
    x = _kv_like(torch.bfloat16, shape=(4, 256, 64))
    payload = get_codec(spec).encode(x, _info(x))
    assert payload[0] == 1  # byte-plane layout
    modes = [struct.unpack_from("<BI", payload, 1 + 5 * j) for j in range(2)]
    n = x.numel()
    assert modes[0] == (0, n), "low (mantissa) plane should be stored raw"
    assert modes[1][0] == 1 and modes[1][1] < 0.85 * n, "high (sign/exponent) plane should compress"
    assert len(payload) < 0.93 * x.numel() * 2


@pytest.mark.parametrize("spec", ["lz4", "zstd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_incompressible_input_costs_only_the_plane_table(spec: str, dtype: torch.dtype) -> None:
    raw = np.random.default_rng(0).integers(0, 256, 4 * 64 * 32 * dtype.itemsize, dtype=np.uint8)
    x = torch.from_numpy(raw).view(dtype).reshape(4, 64, 32)
    payload = get_codec(spec).encode(x, _info(x))
    assert len(payload) == raw.size + 1 + 5 * dtype.itemsize


def test_constant_input_compresses_a_lot() -> None:
    x = torch.full((4, 256, 64), 0.5, dtype=torch.float16)
    for spec in ("lz4", "zstd"):
        assert len(get_codec(spec).encode(x, _info(x))) < x.numel() * 2 / 50


def test_one_byte_elements_use_a_single_block() -> None:
    x = torch.arange(256, dtype=torch.uint8).repeat(4).reshape(1, 32, 32)
    for spec in ("lz4", "zstd"):
        codec = get_codec(spec)
        payload = codec.encode(x, _info(x))
        assert payload[0] == 0
        assert torch.equal(codec.decode(memoryview(payload), _info(x)), x)


@pytest.mark.parametrize("spec", sorted(CODECS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_registered_codec_round_trips_shape_and_honours_max_payload(spec: str, dtype: torch.dtype) -> None:
    """The artifact reader rejects any section above ``max_payload``; a codec must never exceed it,
    even on incompressible input."""
    codec = get_codec(spec)
    for x in (_kv_like(dtype, shape=(2, 32, 16)),
              torch.from_numpy(np.random.default_rng(1).integers(0, 256, 2 * 32 * 16 * dtype.itemsize,
                                                                   dtype=np.uint8)).view(dtype).reshape(2, 32, 16)):
        if not torch.isfinite(x.float()).all() and codec.lossy:
            x = torch.nan_to_num(x.float(), nan=0.0, posinf=1.0, neginf=-1.0).clamp(-1e4, 1e4).to(dtype)
        for kind in ("k", "v"):
            info = SectionInfo(0, 1, kind, tuple(x.shape), dtype)  # type: ignore[arg-type]
            payload = codec.encode(x, info)
            assert len(payload) <= codec.max_payload(info)
            y = codec.decode(memoryview(payload), info)
            assert y.shape == x.shape and y.dtype == dtype


@PROPS
@given(spec=st.sampled_from(BUILTIN), garbage=st.binary(max_size=3000), dtype=st.sampled_from(DTYPES))
def test_garbage_payload_raises_artifact_corrupt_only(spec: str, garbage: bytes, dtype: torch.dtype) -> None:
    """Codecs see payloads only after their checksum passed, but a buggy writer must still yield a
    clear error, never a crash of another kind or a tensor of the wrong size."""
    info = SectionInfo(0, 1, "k", (2, 16, 8), dtype)
    codec = get_codec(spec)
    try:
        y = codec.decode(memoryview(garbage), info)
    except ArtifactCorrupt:
        return
    assert y.shape == (2, 16, 8) and y.dtype == dtype


@pytest.mark.parametrize("spec", ["lz4", "zstd"])
def test_plane_table_lies_are_detected(spec: str) -> None:
    x = _kv_like(torch.float16)
    info = _info(x)
    good = bytearray(get_codec(spec).encode(x, info))
    cases = {
        "layout": lambda b: b.__setitem__(0, 7),
        "mode": lambda b: b.__setitem__(1, 9),
        "length": lambda b: struct.pack_into("<I", b, 2, struct.unpack_from("<I", b, 2)[0] + 1),
        "stray": lambda b: b.extend(b"\x00"),
        "short": lambda b: b.__delitem__(slice(-1, None)),
        "table": lambda b: b.__delitem__(slice(3, None)),
    }
    for name, mutate in cases.items():
        bad = bytearray(good)
        mutate(bad)
        with pytest.raises(ArtifactCorrupt):
            get_codec(spec).decode(memoryview(bytes(bad)), info)
            pytest.fail(f"{name} not detected")


def test_zstd_codec_is_safe_to_share_between_threads() -> None:
    codec = get_codec("zstd")
    xs = [_kv_like(torch.bfloat16, seed=s) for s in range(4)]
    errors: list[BaseException] = []

    def work(x: torch.Tensor) -> None:
        try:
            for _ in range(20):
                if _bits(codec.decode(memoryview(codec.encode(x, _info(x))), _info(x))) != _bits(x):
                    raise AssertionError("mixed-up output")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_error_within_stated_bound(dtype: torch.dtype) -> None:
    """|x - x̂| <= scale/2 (+ the output dtype's rounding), scale = max|x|/127 per key channel or
    per value token; int8 is 4x smaller than fp32, 2x than fp16."""
    codec = get_codec("int8")
    x = _kv_like(dtype, shape=(4, 64, 32))
    for kind, reduce_dim in (("k", 1), ("v", 2)):
        info = _info(x, kind)
        payload = codec.encode(x, info)
        y = codec.decode(memoryview(payload), info)
        xf = x.float()
        scale = xf.abs().amax(dim=reduce_dim, keepdim=True) / 127
        rounding = xf.abs() * (torch.finfo(dtype).eps if dtype != torch.float32 else 0)
        assert ((y.float() - xf).abs() <= scale / 2 + rounding + 1e-7).all()
        n_scales = 4 * 32 if kind == "k" else 4 * 64  # one per (head, channel) or per (head, token)
        assert len(payload) == x.numel() + 4 * n_scales  # one byte per value plus fp32 scales
        rel = ((y.float() - xf).norm() / xf.norm()).item()
        assert rel < 0.02, f"int8 {kind} relative error {rel}"


def test_int8_on_model_kv_relative_error(tiny_model) -> None:
    """Reconstruction error of int8 on real (tiny, random-init) KV, per kind: stated and bounded."""
    from kdn.kv import split_cache

    tokens = torch.randint(3, 259, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chunk = split_cache(tiny_model.model(tokens, use_cache=True).cache, 64)[0]  # (L, 2, H, T, D)
    codec = get_codec("int8")
    for layer in range(chunk.shape[0]):
        for i, kind in enumerate("kv"):
            x = chunk[layer, i].contiguous()
            y = codec.decode(memoryview(codec.encode(x, _info(x, kind))), _info(x, kind))
            assert ((y - x).norm() / x.norm()).item() < 0.02


def test_int8_refuses_a_payload_of_the_wrong_size() -> None:
    x = _kv_like(torch.float16)
    payload = get_codec("int8").encode(x, _info(x))
    with pytest.raises(ArtifactCorrupt):
        get_codec("int8").decode(memoryview(payload[:-1]), _info(x))


@pytest.mark.parametrize("spec", sorted(CODECS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_into_a_view_equals_decode(spec: str, dtype: torch.dtype) -> None:
    """``decode_into`` writes exactly what ``decode`` returns into a slice of a bigger buffer, and
    touches nothing else (the artifact reader assembles whole chunks this way)."""
    codec = get_codec(spec)
    x = _kv_like(dtype, shape=(2, 32, 16))
    info = _info(x, "v")
    payload = memoryview(codec.encode(x, info))
    big = torch.full((3, 2, 2, 32, 16), 7.0, dtype=dtype)  # (L, 2, H, T, D)
    codec.decode_into(payload, info, big[1, 1])
    assert _bits(big[1, 1]) == _bits(codec.decode(payload, info))
    untouched = torch.ones(3, 2, dtype=torch.bool)
    untouched[1, 1] = False
    assert (big[untouched] == 7.0).all()


@pytest.mark.parametrize("spec", ["raw", "lz4", "zstd"])
def test_decode_into_rejects_a_wrong_size_payload(spec: str) -> None:
    x = _kv_like(torch.float16)
    info = _info(x)
    payload = get_codec(spec).encode(x, info)
    other = _info(torch.empty(4, 65, 32, dtype=torch.float16))
    with pytest.raises(ArtifactCorrupt):
        get_codec(spec).decode_into(memoryview(payload), other, torch.empty(4, 65, 32, dtype=torch.float16))
