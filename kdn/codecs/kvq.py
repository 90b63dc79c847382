"""``kvq``: lossy KV codec — quantisation fitted to what attention reads, then entropy coding.

Two formats share the codec name; the level names the format and the header's ``codec_meta``
carries the whole bit plan, so any reader decodes either without knowing the model.

**Format 2** (levels ``k6v6 > k6v5 > k5v5 > k5v4 > k4v4 > k4v3 > k3v3``, ``kNvM``: keys N bits,
values M bits; the default ``k6v5``):

1. **Attention sinks stay exact.** The first ``sink`` (4) tokens of a chain's first chunk
   (``SectionInfo.chunk_index == 0``) are stored as they are: nearly every query puts much of its
   attention there, so their error reaches every output, while their own K and V are unlike the
   other tokens'. They set no step and cost no symbols.
2. **Keys: one step per head.** ``s_h`` = the geometric mean over channels of ``max|x_c| / qmax``
   (raised where needed so that every symbol fits in ``[-127, 127]``). Large-magnitude key
   channels carry most of ``q·k``; one step for all channels gives them more levels, where a
   per-channel step (format 1) gives every channel the same relative error and lets the large ones
   move attention most. Symbols are stored channel by channel, channels grouped by the bit width
   their symbols need, each group its own zstd frame.
3. **Values: one step per (head, token)**, ``max|x| / qmax`` over the token's channels, symbols
   packed base-``(2·qmax+1)`` several to a byte and zstd-coded; steps fp16.
4. **Bits per layer**: the level's bits everywhere, or an explicit per-layer table (a calibration
   run, :func:`kdn.lab.quality.calibrate_kvq`). No rule from the shape: on the real model the
   sensitive layers are not the early ones.

Stated error, per element, before rounding to the output dtype: keys ``|x - x̂| <= s_h / 2``,
values ``|x - x̂| <= s / 2`` with ``s = max|x| / qmax`` over the token's channels (fp16-rounded);
sink tokens exact. Section payload (little-endian)::

    u8 format=2 | u8 bits | u8 sink tokens | u8 frames | u32 side_len | u32 sink_len
    zstd(side) ‖ sink tokens' bytes (H, sink, D) ‖ frames × (u8 width, u32 length, zstd(symbols))

    side: keys f32 step per head ‖ u8 symbol width per (head, channel); values fp16 step per (head, token)

**Format 1** (levels ``q8 > q6 > q5 > q4 > q3 > q2``, CacheGen-style), kept so that stored
artifacts stay readable and for comparison:

1. **Locality along tokens.** Tokens are cut into groups of ``group`` tokens; the first token of a
   group is its *anchor*, stored at ``anchor_bits`` (8), and the others are stored as deltas
   against the *decoded* anchor, so errors never accumulate. Whether deltas pay off is decided per
   scale slice (a key channel, a value token) by the encoder — smaller residuals win — and recorded
   as a bit mask.
2. **Layers differ.** ``bits(layer) = base + early_bonus`` for the first ``ceil(early_frac ·
   num_layers)`` layers, ``base`` after, or an explicit per-layer table.
3. **Keys per channel, values per token**: keys get one scale per ``(head, channel)``, values one
   per ``(head, token)`` — for the anchors and for the deltas.
4. **Entropy coding** as in format 2's values; scales (fp16) and anchors in their own frames; the
   delta form is kept only when it is no larger than the direct form.

Stated error of format 1: ``|x - x̂| <= s / 2`` with ``s = max|x| / qmax`` over the element's
slice (fp16-rounded), in both forms. Section payload::

    u8 format | u8 mode (0 direct, 1 delta) | u8 bits | u8 anchor_bits | u16 group
    | u32 side_len | u32 anchors_len
    zstd(delta mask bits ‖ anchor scales ‖ scales, fp16) ‖ zstd(anchor symbols, int8) ‖ zstd(packed symbols)

In direct mode (every slice direct, or a single token) the mask and the anchors are left out.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from kdn.codecs.base import Codec, SectionInfo, register_codec
from kdn.errors import ArtifactCorrupt

FORMAT = 1
FORMAT_2 = 2
_HEAD = struct.Struct("<BBBBHII")
_HEAD2 = struct.Struct("<BBBBII")  # format, bits, sink tokens, groups, side_len, sink_len
_GROUP = struct.Struct("<BI")  # group id (symbol bit length), frame length
MODE_DIRECT, MODE_DELTA = 0, 1

# level -> (key bits, value bits). The ``q`` ladder is format 1 (non-early layers' bits; early
# layers get a bonus, token-locality deltas where they pay); the ``k?v?`` ladder is format 2.
LEVELS: dict[str, tuple[int, int]] = {
    "q8": (8, 6),
    "q6": (6, 4),
    "q5": (5, 3),
    "q4": (4, 3),
    "q3": (3, 2),
    "q2": (2, 2),
    "k6v6": (6, 6),
    "k6v5": (6, 5),
    "k5v5": (5, 5),
    "k5v4": (5, 4),
    "k4v4": (4, 4),
    "k4v3": (4, 3),
    "k3v3": (3, 3),
}
DEFAULT_LEVEL = "k6v5"
SINK_TOKENS = 4  # format 2: the sequence's first tokens, stored exactly


def level_format(level: str) -> int:
    return 1 if level.startswith("q") else 2


@dataclass(frozen=True, slots=True)
class BitPlan:
    """How many bits each layer's K and V get. Written to ``codec_meta`` as JSON."""

    k_bits: int
    v_bits: int
    group: int = 16
    anchor_bits: int = 8
    early_frac: float = 0.25
    early_bonus: int = 2
    table: tuple[tuple[int, int], ...] | None = None  # explicit (k, v) bits per layer, overrides the rule
    format: int = 1
    sink: int = 0  # format 2: first tokens of a chain's first chunk stored exactly

    @classmethod
    def for_level(cls, level: str) -> "BitPlan":
        k_bits, v_bits = LEVELS[level]
        if level_format(level) == 1:
            return cls(k_bits, v_bits)
        return cls(k_bits, v_bits, early_bonus=0, format=2, sink=SINK_TOKENS)

    def __post_init__(self) -> None:
        if self.format not in (1, 2) or not 0 <= self.sink <= 64:
            raise ValueError(f"kvq format must be 1 or 2 and sink within 0..64, got {self.format}, {self.sink}")
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
            "v": self.format, "k_bits": self.k_bits, "v_bits": self.v_bits, "group": self.group,
            "anchor_bits": self.anchor_bits, "early_frac": self.early_frac, "early_bonus": self.early_bonus,
        }
        if self.format == 2:
            d["sink"] = self.sink
        if self.table is not None:
            d["table"] = [list(kv) for kv in self.table]
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, meta: bytes) -> "BitPlan":
        # meta comes from a checksummed but unkeyed header: anyone can write it. Refuse what JSON
        # allows and the plan cannot hold (Infinity/NaN, floats or bools for bit counts, deep
        # nesting, huge numbers) as ArtifactCorrupt, never OverflowError/RecursionError/TypeError.
        def no_constant(name: str) -> Any:
            raise ValueError(f"{name} is not a number kvq accepts")

        def int_field(v: Any) -> int:
            if type(v) is not int:
                raise ValueError(f"expected an integer, got {type(v).__name__}")
            return v

        try:
            d = json.loads(meta, parse_constant=no_constant)
            fmt = d.pop("v", None) if isinstance(d, dict) else None
            if type(fmt) is not int or fmt not in (1, 2) or (fmt == 1 and "sink" in d):
                raise ValueError("unknown kvq meta format")
            d["format"] = fmt
            table = d.pop("table", None)
            if table is not None:
                if not isinstance(table, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in table):
                    raise ValueError("kvq bit table must be a list of [k, v] pairs")
                table = tuple((int_field(k), int_field(v)) for k, v in table)
            for name in ("k_bits", "v_bits", "group", "anchor_bits", "early_bonus", "sink"):
                if name in d:
                    int_field(d[name])
            if "early_frac" in d and (type(d["early_frac"]) not in (int, float) or not math.isfinite(d["early_frac"])):
                raise ValueError("early_frac must be a finite number")
            return cls(table=table, **d)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
            raise ArtifactCorrupt(f"kvq codec_meta is malformed: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


@dataclass(frozen=True, slots=True)
class _Packing:
    """``per`` symbols of ``2·qmax + 1`` values in one byte (base-``nv`` digits), and the inverse table.

    Huffman codes (zstd's literal coder) spend a whole number of bits per byte, which wastes up to
    a third of a bit per symbol on the flat distributions of 2- to 4-bit symbols; coding 2 to 5
    symbols per byte spreads that waste over all of them (and lets neighbours share statistics).
    """

    nv: int
    per: int
    values: np.ndarray  # (256, per) float32: the signed symbols a byte holds (rows >= nv**per invalid)

    @classmethod
    def for_bits(cls, bits: int) -> "_Packing":
        nv = 2 * _qmax(bits) + 1
        per = max(1, int(math.floor(math.log(256) / math.log(nv) + 1e-9)))
        codes = np.arange(256)
        digits = np.stack([(codes // nv ** (per - 1 - j)) % nv for j in range(per)], axis=1)
        return cls(nv, per, (digits - nv // 2).astype(np.float32))

    def pack(self, q: np.ndarray) -> np.ndarray:
        """``(n,)`` int8 symbols in ``[-qmax, qmax]`` -> ``(ceil(n / per),)`` uint8."""
        u = (q.astype(np.int16) + self.nv // 2).astype(np.uint16)  # 0 .. nv-1
        pad = (-u.size) % self.per
        if pad:
            u = np.concatenate([u, np.zeros(pad, np.uint16)])
        u = u.reshape(-1, self.per)  # (m, per)
        out = u[:, 0].copy()
        for j in range(1, self.per):
            out *= self.nv
            out += u[:, j]
        return out.astype(np.uint8)

    def unpack(self, packed: np.ndarray, n: int) -> np.ndarray:
        """The inverse of :meth:`pack`, as ``(n,)`` float32. Raises ArtifactCorrupt on impossible bytes."""
        if int(packed.max(initial=0)) >= self.nv**self.per:
            raise ArtifactCorrupt(f"kvq packed symbol out of range for {self.nv}-valued symbols")
        return np.take(self.values, packed, axis=0).reshape(-1)[:n]  # one table row per byte (take: ~10x fancy indexing)


_PACKINGS = {bits: _Packing.for_bits(bits) for bits in range(2, 9)}


def _scale(x: np.ndarray, axis: int, bits: int) -> np.ndarray:
    """One fp16 step per slice along ``axis``: ``max|x| / qmax`` (fp16-rounded, so the decoder
    multiplies by exactly what the encoder divided by; never zero or subnormal)."""
    scale = (np.abs(x).max(axis=axis, keepdims=True) / _qmax(bits)).astype(np.float16)
    np.maximum(scale, np.finfo(np.float16).smallest_normal, out=scale)
    return scale


_BIT_LENGTH = np.array([v.bit_length() for v in range(129)], dtype=np.uint8)


def _head_step(x: np.ndarray, bits: int) -> np.ndarray:
    """Format 2 keys: one step per head, ``(H, 1, 1)`` float32 — the geometric mean over channels
    of ``max|x_c| / qmax``, raised where needed so that every symbol fits in ``[-127, 127]``.

    One step for every channel of a head (not one per channel) gives the large-magnitude channels
    more levels: they carry most of ``q·k``, so their error moves attention most."""
    qmax = _qmax(bits)
    r = np.abs(x).max(axis=1)  # (H, D)
    tiny = np.float32(np.finfo(np.float16).smallest_normal)
    live = r > 0
    logs = np.where(live, np.log(np.maximum(r, tiny) / qmax), 0.0)
    geo = np.exp(logs.sum(axis=1) / np.maximum(live.sum(axis=1), 1))  # (H,)
    step = np.maximum(np.maximum(geo, r.max(axis=1) / 127), tiny).astype(np.float32)
    return step.reshape(-1, 1, 1)


def _quantise(x: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """``round(x / scale)`` clipped to ``[-qmax, qmax]``, as int8.

    numpy, not torch: single-threaded elementwise work is faster on small sections than waking
    (and, on a busy machine, waiting for) an intra-op thread pool.
    """
    qmax = _qmax(bits)
    q = np.rint(x / scale.astype(np.float32))
    np.clip(q, -qmax, qmax, out=q)
    return q.astype(np.int8)


def _as_f32(x: torch.Tensor) -> np.ndarray:
    """``(H, T, D)`` as a float32 numpy array (numpy has no bfloat16: torch converts that one)."""
    if x.dtype in (torch.float16, torch.float32):
        return x.numpy().astype(np.float32, copy=False)
    return x.float().numpy()


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
        self.plan = plan or BitPlan.for_level(self.level)
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
    def _slices(info: SectionInfo) -> int:
        """Scale slices of a section: keys one per (head, channel), values one per (head, token)."""
        h, t, d = info.shape
        return h * d if info.kind == "k" else h * t

    def _anchor_scales(self, info: SectionInfo) -> int:
        h, t, d = info.shape
        return h * d if info.kind == "k" else h * -(-t // self.plan.group)

    # -- encode ------------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor, info: SectionInfo) -> bytes:
        bits = self.plan.bits(info.layer, info.num_layers, info.kind)
        if self.plan.format == 2:
            return self._encode_v2(x.contiguous(), info, bits)
        rd = self._reduce_dim(info.kind)
        xf = _as_f32(x.contiguous())  # (H, T, D)
        direct = self._encode_direct(xf, rd, bits)
        if xf.shape[1] < 2:
            return direct
        delta = self._encode_delta(xf, rd, bits)
        # both forms have the same steps, so the same error bound: keep whichever is smaller
        return delta if delta is not None and len(delta) <= len(direct) else direct

    def _frame(self, mode: int, bits: int, side: bytes, anchors: bytes, packed: np.ndarray) -> bytes:
        zs = self._cctx.compress(side)
        za = self._cctx.compress(anchors) if anchors else b""
        zq = self._cctx.compress(packed.tobytes())
        head = _HEAD.pack(FORMAT, mode, bits, self.plan.anchor_bits, self.plan.group, len(zs), len(za))
        return head + zs + za + zq

    def _encode_direct(self, xf: np.ndarray, rd: int, bits: int) -> bytes:
        s = _scale(xf, rd, bits)  # keys (H, 1, D), values (H, T, 1)
        q = _quantise(xf, s, bits)  # (H, T, D)
        return self._frame(MODE_DIRECT, bits, s.astype("<f2").tobytes(), b"", _PACKINGS[bits].pack(q.reshape(-1)))

    def _encode_delta(self, xf: np.ndarray, rd: int, bits: int) -> bytes | None:
        group, t = self.plan.group, xf.shape[1]
        anchors = xf[:, ::group]  # (H, G, D), G = ceil(T / group)
        sa = _scale(anchors, rd, self.plan.anchor_bits)  # keys (H, 1, D), values (H, G, 1)
        qa = _quantise(anchors, sa, self.plan.anchor_bits)  # (H, G, D)
        a_hat = qa.astype(np.float32) * sa.astype(np.float32)  # (H, G, D)
        base = np.repeat(a_hat, group, axis=1)[:, :t]  # (H, T, D)
        r = xf - base  # (H, T, D)
        # The step stays the direct form's (same error bound); a slice (key channel / value token)
        # takes the delta where that is smaller on average — fewer, peakier symbols — and never larger
        # than the step's range allows.
        ax, ar = np.abs(xf), np.abs(r)
        use = (ar.mean(axis=rd, keepdims=True) < ax.mean(axis=rd, keepdims=True)) & (
            ar.max(axis=rd, keepdims=True) <= ax.max(axis=rd, keepdims=True)
        )  # keys (H, 1, D), values (H, T, 1)
        if use.mean() < 0.25:  # anchors would cost more than so few deltas save: skip the second encode
            return None
        s = _scale(xf, rd, bits)
        q = _quantise(xf - base * use, s, bits)  # (H, T, D)
        side = np.packbits(use.reshape(-1)).tobytes() + sa.astype("<f2").tobytes() + s.astype("<f2").tobytes()
        return self._frame(MODE_DELTA, bits, side, qa.tobytes(), _PACKINGS[bits].pack(q.reshape(-1)))

    # -- decode ------------------------------------------------------------------------------------

    def decode(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        if len(payload) >= 1 and payload[0] == FORMAT_2:
            return self._decode_v2(payload, info)
        if self.plan.format != FORMAT:
            raise ArtifactCorrupt("kvq section is format 1, the header's plan is format 2")
        if len(payload) < _HEAD.size:
            raise ArtifactCorrupt(f"kvq section of {len(payload)} bytes is shorter than its header")
        fmt, mode, bits, abits, group, zs_len, za_len = _HEAD.unpack_from(payload, 0)
        want_bits = self.plan.bits(info.layer, info.num_layers, info.kind)
        if fmt != FORMAT or mode not in (MODE_DIRECT, MODE_DELTA):
            raise ArtifactCorrupt(f"kvq section has unknown format {fmt} or mode {mode}")
        if bits != want_bits or abits != self.plan.anchor_bits or group != self.plan.group:
            raise ArtifactCorrupt(
                f"kvq layer {info.layer} {info.kind.upper()} section says bits={bits} anchor={abits} group={group}, "
                f"the header's plan says bits={want_bits} anchor={self.plan.anchor_bits} group={self.plan.group}"
            )
        if _HEAD.size + zs_len + za_len > len(payload):
            raise ArtifactCorrupt("kvq section's side blocks run past its end")
        h, t, d = info.shape
        key = info.kind == "k"
        n_sl = self._slices(info)
        delta = mode == MODE_DELTA
        n_groups = -(-t // group) if delta else 0
        n_mask = -(-n_sl // 8) if delta else 0
        n_as = self._anchor_scales(info) if delta else 0
        n = h * t * d
        pk = _PACKINGS[bits]
        o = _HEAD.size
        side = self._unzstd(payload[o : o + zs_len], n_mask + 2 * (n_as + n_sl))
        o += zs_len
        packed = np.frombuffer(self._unzstd(payload[o + za_len :], -(-n // pk.per)), dtype=np.uint8)
        sc = np.frombuffer(side, dtype="<f2", offset=n_mask).astype(np.float32)  # (n_as + n_sl,)
        s = sc[n_as:].reshape((h, 1, d) if key else (h, t, 1))
        out = pk.unpack(packed, n).reshape(h, t, d) * s  # (H, T, D)
        if delta:
            qa = np.frombuffer(self._unzstd(payload[o : o + za_len], n_groups * h * d), dtype=np.int8)
            use = np.unpackbits(np.frombuffer(side, np.uint8, count=n_mask), count=n_sl).astype(bool)
            sa = sc[:n_as].reshape((h, 1, d) if key else (h, n_groups, 1))
            a_hat = qa.reshape(h, n_groups, d).astype(np.float32) * sa  # (H, G, D)
            base = np.repeat(a_hat, group, axis=1)[:, :t]  # (H, T, D)
            out += base * use.reshape((h, 1, d) if key else (h, t, 1))
        return torch.from_numpy(out).to(info.dtype)

    # -- format 2 ----------------------------------------------------------------------------------

    def _sinks(self, info: SectionInfo) -> int:
        return min(self.plan.sink, info.shape[1]) if info.chunk_index == 0 else 0

    def _encode_v2(self, x: torch.Tensor, info: SectionInfo, bits: int) -> bytes:
        h, t, d = info.shape
        n_sink = self._sinks(info)
        sink_raw = x[:, :n_sink].contiguous().view(torch.uint8).numpy().tobytes() if n_sink else b""
        xf = _as_f32(x)  # (H, T, D)
        if n_sink:
            xf = xf.copy()
            xf[:, :n_sink] = 0.0  # stored exactly: they neither set a step nor cost symbols
        frames: list[tuple[int, bytes]] = []
        if info.kind == "k":
            step = _head_step(xf, bits)  # (H, 1, 1) float32
            q = np.clip(np.rint(xf / step), -127, 127).astype(np.int8)  # (H, T, D)
            rows = np.ascontiguousarray(q.transpose(0, 2, 1)).reshape(h * d, t)  # (H*D, T): one row per channel
            width = _BIT_LENGTH[np.abs(rows.astype(np.int16)).max(axis=1)]  # (H*D,) bits each channel's symbols need
            for g in np.unique(width):
                frames.append((int(g), self._cctx.compress(rows[width == g].tobytes())))
            side = step.astype("<f4").tobytes() + width.astype(np.uint8).tobytes()
        else:
            sc = _scale(xf, 2, bits)  # (H, T, 1) fp16
            q = _quantise(xf, sc, bits)  # (H, T, D)
            frames.append((bits, self._cctx.compress(_PACKINGS[bits].pack(q.reshape(-1)).tobytes())))
            side = sc.astype("<f2").tobytes()
        zs = self._cctx.compress(side)
        parts = [_HEAD2.pack(FORMAT_2, bits, n_sink, len(frames), len(zs), len(sink_raw)), zs, sink_raw]
        for g, blob in frames:
            parts += [_GROUP.pack(g, len(blob)), blob]
        return b"".join(parts)

    def _decode_v2(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        if self.plan.format != 2:
            raise ArtifactCorrupt("kvq section is format 2, the header's plan is format 1")
        if len(payload) < _HEAD2.size:
            raise ArtifactCorrupt(f"kvq section of {len(payload)} bytes is shorter than its header")
        _, bits, n_sink, n_frames, zs_len, sink_len = _HEAD2.unpack_from(payload, 0)
        want_bits = self.plan.bits(info.layer, info.num_layers, info.kind)
        h, t, d = info.shape
        if bits != want_bits:
            raise ArtifactCorrupt(f"kvq layer {info.layer} {info.kind.upper()} section says bits={bits}, "
                                  f"the header's plan says bits={want_bits}")
        if n_sink > min(self.plan.sink, t) or sink_len != h * n_sink * d * info.dtype.itemsize:
            raise ArtifactCorrupt(f"kvq section holds {n_sink} exact tokens in {sink_len} bytes, which its shape "
                                  "and plan do not allow")
        key = info.kind == "k"
        if not 1 <= n_frames <= (8 if key else 1):
            raise ArtifactCorrupt(f"kvq section has {n_frames} symbol frames")
        o = _HEAD2.size
        if o + zs_len + sink_len > len(payload):
            raise ArtifactCorrupt("kvq section's side blocks run past its end")
        side = self._unzstd(payload[o : o + zs_len], 4 * h + h * d if key else 2 * h * t)
        o += zs_len
        sink = bytes(payload[o : o + sink_len])
        o += sink_len
        frames = []
        for _ in range(n_frames):
            if o + _GROUP.size > len(payload):
                raise ArtifactCorrupt("kvq section's symbol frames run past its end")
            g, length = _GROUP.unpack_from(payload, o)
            o += _GROUP.size
            if o + length > len(payload):
                raise ArtifactCorrupt("kvq section's symbol frames run past its end")
            frames.append((g, payload[o : o + length]))
            o += length
        if o != len(payload):
            raise ArtifactCorrupt(f"kvq section has {len(payload) - o} stray bytes after its symbols")
        if key:
            step = np.frombuffer(side, dtype="<f4", count=h).reshape(h, 1, 1)
            if not np.isfinite(step).all():
                raise ArtifactCorrupt("kvq key step is not finite")
            width = np.frombuffer(side, dtype=np.uint8, offset=4 * h)  # (H*D,)
            if [g for g, _ in frames] != [int(g) for g in np.unique(width)]:
                raise ArtifactCorrupt("kvq key frames do not match the channels' symbol widths")
            rows = np.empty((h * d, t), dtype=np.int8)  # (H*D, T)
            for g, blob in frames:
                sel = width == g
                n_rows = int(sel.sum())
                rows[sel] = np.frombuffer(self._unzstd(blob, n_rows * t), dtype=np.int8).reshape(n_rows, t)
            out = rows.reshape(h, d, t).transpose(0, 2, 1) * step  # (H, T, D) float32
        else:
            if frames[0][0] != bits:
                raise ArtifactCorrupt("kvq value frame does not match the section's bits")
            pk = _PACKINGS[bits]
            packed = np.frombuffer(self._unzstd(frames[0][1], -(-h * t * d // pk.per)), dtype=np.uint8)
            sc = np.frombuffer(side, dtype="<f2").astype(np.float32).reshape(h, t, 1)
            out = pk.unpack(packed, h * t * d).reshape(h, t, d) * sc  # (H, T, D)
        y = torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(info.dtype)
        if n_sink:
            y[:, :n_sink] = torch.frombuffer(bytearray(sink), dtype=info.dtype).reshape(h, n_sink, d)
        return y

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
        if self.plan.format == 2:
            raw = 4 * h + h * d + 2 * h * t + h * min(self.plan.sink, t) * d * info.dtype.itemsize + h * t * d
            return _HEAD2.size + 8 * _GROUP.size + raw + raw // 64 + 4096
        n_sl = self._slices(info)
        raw = -(-n_sl // 8) + 2 * (self._anchor_scales(info) + n_sl) + (-(-t // self.plan.group) + t) * h * d
        return _HEAD.size + raw + raw // 64 + 1024  # zstd's worst case expansion is far below this
