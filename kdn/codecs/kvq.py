"""``kvq``: a CacheGen-style lossy KV codec — token-locality deltas, per-layer bits, entropy coding.

KV has structure that plain quantisation ignores; ``kvq`` uses four pieces of it:

1. **Locality along tokens.** Tokens are cut into groups of ``group`` tokens; the first token of a
   group is its *anchor*, stored at ``anchor_bits`` (8), and the others are stored as deltas
   against the *decoded* anchor, so errors never accumulate. Whether deltas pay off is decided per
   section by the encoder (smaller quantisation steps win) and recorded in the section, so a layer
   whose neighbouring tokens are not alike is stored directly instead.
2. **Layers differ.** Early layers get more bits (CacheGen finds shallow layers more sensitive):
   ``bits(layer) = base + early_bonus`` for the first ``ceil(early_frac · num_layers)`` layers,
   ``base`` after — derived from the model's shape, never from its name. An explicit per-layer
   table (from a calibration run, :mod:`kdn.quality`) may replace the rule.
3. **Keys have outlier channels, values vary per token**: keys get one scale per
   ``(head, channel)``, values one per ``(head, token)`` — for the anchors and for the deltas.
4. **Entropy coding.** Symbols (one signed byte each) go through zstd, whose Huffman literal coder
   brings them close to their order-0 entropy; scales (fp16) go through a second zstd frame.

Levels form a ladder ``q8 > q6 > q5 > q4 > q3 > q2`` (the base bits of keys/values); the level is
recorded in the artifact header (``codec_level``) and the full bit schedule in ``codec_meta``.

Stated error, per element, before rounding to the output dtype::

    direct mode:  |x - x̂| <= s / 2                       (s: the element's scale)
    delta mode:   |x - x̂| <= s_anchor / 2 + s_delta / 2

Section payload (little-endian)::

    u8 format | u8 mode (0 direct, 1 delta) | u8 bits | u8 anchor_bits | u16 group | u32 scales_len
    zstd(scales as fp16) | zstd(symbols as int8)
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from kdn.codecs.base import Codec, SectionInfo, register_codec
from kdn.errors import ArtifactCorrupt

FORMAT = 1
_HEAD = struct.Struct("<BBBBHI")
MODE_DIRECT, MODE_DELTA = 0, 1

# level -> (key bits, value bits) for the non-early layers
LEVELS: dict[str, tuple[int, int]] = {
    "q8": (8, 8),
    "q6": (6, 6),
    "q5": (5, 5),
    "q4": (4, 4),
    "q3": (3, 3),
    "q2": (2, 2),
}
DEFAULT_LEVEL = "q4"


@dataclass(frozen=True, slots=True)
class BitPlan:
    """How many bits each layer's K and V get. Written to ``codec_meta`` as JSON."""

    k_bits: int
    v_bits: int
    group: int = 16
    anchor_bits: int = 8
    early_frac: float = 0.25
    early_bonus: int = 1
    table: tuple[tuple[int, int], ...] | None = None  # explicit (k, v) bits per layer, overrides the rule

    def __post_init__(self) -> None:
        bits = [self.k_bits, self.v_bits, self.anchor_bits]
        if self.table is not None:
            bits += [b for kv in self.table for b in kv]
        if not all(2 <= b <= 8 for b in bits):
            raise ValueError(f"kvq bits must be within 2..8, got {bits}")
        if not 2 <= self.group <= 4096:
            raise ValueError(f"kvq group must be within 2..4096, got {self.group}")
        if not (0.0 <= self.early_frac <= 1.0 and 0 <= self.early_bonus <= 4):
            raise ValueError("kvq early_frac must be in [0, 1] and early_bonus in 0..4")

    def bits(self, layer: int, num_layers: int, kind: str) -> int:
        if self.table is not None:
            if len(self.table) != num_layers:
                raise ArtifactCorrupt(f"kvq bit table has {len(self.table)} layers, artifact has {num_layers}")
            return self.table[layer][0 if kind == "k" else 1]
        base = self.k_bits if kind == "k" else self.v_bits
        early = math.ceil(self.early_frac * num_layers)
        return min(8, base + (self.early_bonus if layer < early else 0))

    def to_bytes(self) -> bytes:
        d = {
            "v": FORMAT, "k_bits": self.k_bits, "v_bits": self.v_bits, "group": self.group,
            "anchor_bits": self.anchor_bits, "early_frac": self.early_frac, "early_bonus": self.early_bonus,
        }
        if self.table is not None:
            d["table"] = [list(kv) for kv in self.table]
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, meta: bytes) -> "BitPlan":
        try:
            d = json.loads(meta)
            if d.pop("v") != FORMAT:
                raise ValueError("unknown kvq meta format")
            table = d.pop("table", None)
            if table is not None:
                table = tuple((int(k), int(v)) for k, v in table)
            return cls(table=table, **d)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ArtifactCorrupt(f"kvq codec_meta is malformed: {exc}") from exc


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _quantise(x: torch.Tensor, reduce_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric max-scaled quantisation of ``x`` with one scale per slice along ``reduce_dim``.

    Scales are rounded to fp16 first, so the decoder multiplies by exactly what the encoder used.
    """
    qmax = _qmax(bits)
    scale = (x.abs().amax(dim=reduce_dim, keepdim=True) / qmax).to(torch.float16)
    scale = scale.clamp_min(torch.finfo(torch.float16).tiny)  # no zero, no subnormals
    q = torch.round(x / scale.float()).clamp_(-qmax, qmax)
    return q.to(torch.int8), scale


@register_codec
class KvqCodec(Codec):
    """CacheGen-style lossy KV codec; see the module docstring."""

    name = "kvq"
    lossy = True
    default_level = DEFAULT_LEVEL

    def __init__(self, level: str = "", plan: BitPlan | None = None, *, zstd_level: int = 3) -> None:
        super().__init__(level)
        if self.level not in LEVELS:
            raise ValueError(f"unknown kvq level {self.level!r}; choose one of {', '.join(LEVELS)}")
        k_bits, v_bits = LEVELS[self.level]
        self.plan = plan or BitPlan(k_bits, v_bits)
        self._cctx = zstandard.ZstdCompressor(level=zstd_level)
        self._dctx = zstandard.ZstdDecompressor()

    def meta(self) -> bytes:
        return self.plan.to_bytes()

    def with_meta(self, meta: bytes) -> "KvqCodec":
        if not meta:
            return self
        return KvqCodec(self.level, BitPlan.from_bytes(meta))

    # -- geometry --------------------------------------------------------------------------------

    @staticmethod
    def _reduce_dim(kind: str) -> int:
        return 1 if kind == "k" else 2  # keys: over tokens (one scale per channel); values: over channels

    @staticmethod
    def _scale_counts(info: SectionInfo, mode: int, group: int) -> tuple[int, int]:
        """(anchor scales, delta-or-direct scales) for a section."""
        h, t, d = info.shape
        if mode == MODE_DIRECT:
            return 0, h * d if info.kind == "k" else h * t
        n_groups = -(-t // group)
        anchors = h * d if info.kind == "k" else h * n_groups
        return anchors, h * d if info.kind == "k" else h * t

    # -- encode ------------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor, info: SectionInfo) -> bytes:
        bits = self.plan.bits(info.layer, info.num_layers, info.kind)
        group, abits = self.plan.group, self.plan.anchor_bits
        rd = self._reduce_dim(info.kind)
        xf = x.float()  # (H, T, D)
        t = xf.shape[1]
        anchors = xf[:, ::group]  # (H, G, D), G = ceil(T / group)
        qa, sa = _quantise(anchors, rd, abits)  # (H, G, D) int8; keys (H, 1, D), values (H, G, 1) fp16
        a_hat = qa.float() * sa.float()  # (H, G, D)
        base = a_hat.repeat_interleave(group, dim=1)[:, :t]  # (H, T, D)
        delta = xf - base  # (H, T, D)
        # one scale per slice either way: pick the mode with the smaller steps (smaller error, peakier symbols)
        use_delta = t > 1 and float(delta.abs().amax(dim=rd).sum()) < float(xf.abs().amax(dim=rd).sum())
        if use_delta:
            q, s = _quantise(delta, rd, bits)
            scales = torch.cat([sa.reshape(-1), s.reshape(-1)])
            symbols = torch.cat([qa.reshape(-1), q.reshape(-1)])
        else:
            q, s = _quantise(xf, rd, bits)
            scales, symbols = s.reshape(-1), q.reshape(-1)
        zs = self._cctx.compress(scales.numpy().astype("<f2").tobytes())
        zq = self._cctx.compress(symbols.numpy().tobytes())
        mode = MODE_DELTA if use_delta else MODE_DIRECT
        return _HEAD.pack(FORMAT, mode, bits, abits, group, len(zs)) + zs + zq

    # -- decode ------------------------------------------------------------------------------------

    def decode(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        if len(payload) < _HEAD.size:
            raise ArtifactCorrupt(f"kvq section of {len(payload)} bytes is shorter than its header")
        fmt, mode, bits, abits, group, zs_len = _HEAD.unpack_from(payload, 0)
        want_bits = self.plan.bits(info.layer, info.num_layers, info.kind)
        if fmt != FORMAT or mode not in (MODE_DIRECT, MODE_DELTA):
            raise ArtifactCorrupt(f"kvq section has unknown format {fmt} or mode {mode}")
        if bits != want_bits or abits != self.plan.anchor_bits or group != self.plan.group:
            raise ArtifactCorrupt(
                f"kvq layer {info.layer} {info.kind.upper()} section says bits={bits} anchor={abits} group={group}, "
                f"the header's plan says bits={want_bits} anchor={self.plan.anchor_bits} group={self.plan.group}"
            )
        if _HEAD.size + zs_len > len(payload):
            raise ArtifactCorrupt("kvq section's scale block runs past its end")
        h, t, d = info.shape
        n_groups = -(-t // group) if mode == MODE_DELTA else 0
        n_as, n_s = self._scale_counts(info, mode, group)
        n_sym = n_groups * h * d + h * t * d
        scales = self._unzstd(payload[_HEAD.size : _HEAD.size + zs_len], 2 * (n_as + n_s))
        symbols = self._unzstd(payload[_HEAD.size + zs_len :], n_sym)
        sc = np.frombuffer(scales, dtype="<f2").astype(np.float32)  # (n_as + n_s,)
        sym = np.frombuffer(symbols, dtype=np.int8)  # (n_sym,)
        qmax = _qmax(bits)
        if np.abs(sym[n_groups * h * d :].astype(np.int16)).max(initial=0) > qmax:
            raise ArtifactCorrupt(f"kvq symbols exceed the {bits}-bit range")
        key = info.kind == "k"
        s = sc[n_as:].reshape((h, 1, d) if key else (h, t, 1))
        out = sym[n_groups * h * d :].reshape(h, t, d).astype(np.float32) * s  # (H, T, D)
        if mode == MODE_DELTA:
            sa = sc[:n_as].reshape((h, 1, d) if key else (h, n_groups, 1))
            a_hat = sym[: n_groups * h * d].reshape(h, n_groups, d).astype(np.float32) * sa  # (H, G, D)
            out += np.repeat(a_hat, group, axis=1)[:, :t]  # (H, T, D)
        return torch.from_numpy(out).to(info.dtype)

    def _unzstd(self, blob: memoryview, size: int) -> bytes:
        try:
            declared = zstandard.frame_content_size(blob)
            if declared not in (size, -1):  # -1: not declared; never allocate what a frame claims
                raise ArtifactCorrupt(f"kvq block declares {declared} bytes, expected {size}")
            out = self._dctx.decompress(blob, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise ArtifactCorrupt(f"kvq section does not decode: {exc}") from exc
        if len(out) != size:
            raise ArtifactCorrupt(f"kvq block decodes to {len(out)} bytes, expected {size}")
        return out

    def max_payload(self, info: SectionInfo) -> int:
        h, t, d = info.shape
        n_as, n_s = self._scale_counts(info, MODE_DELTA, self.plan.group)
        raw = 2 * (n_as + n_s) + (-(-t // self.plan.group) + t) * h * d
        return _HEAD.size + raw + raw // 64 + 1024  # zstd's worst case expansion is far below this
