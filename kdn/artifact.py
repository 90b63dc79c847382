"""The artifact container: one chunk's KV as a versioned, self-describing, checksummed byte string.

Layout (all integers little-endian)::

    prefix    b"KDNA" | version u16 | flags u16 | header_len u32            12 bytes
    header    ArtifactHeader (protobuf, kdn/proto/kdn.proto)               header_len bytes
    hcheck    xxh3_64(prefix ‖ header)                                      8 bytes
    2·L sections, in order layer 0 K, layer 0 V, layer 1 K, ...:
      length u32 | payload (codec bytes) | xxh3_64(length ‖ payload) u64
    trailer   b"KDNE" | xxh3_128(hcheck ‖ every section's check)            20 bytes

Invariants:
- a reader verifies every checksum before it uses the bytes they cover: the header before it is
  parsed, each section before it is decoded, the whole-artifact digest at the end. The checks
  cover every byte (each section's covers its length field too), and the whole-artifact digest
  is taken over the checks, in order: it catches dropped, repeated or reordered sections without
  a second pass over the payload — which keeps verification at one hash pass per byte;
- no length is trusted before it is bounded: the header by ``MAX_HEADER``, a section by what its
  codec can produce for the shape the (already verified) header declares, the whole artifact and
  the KV its header declares (what compressed sections may expand to) by ``max_bytes`` — so a
  hostile length never makes a reader allocate it;
- sections stream: :class:`ArtifactReader` hands out layer 0 as soon as its bytes arrived;
- no pickle anywhere.
"""

from __future__ import annotations

import os
import struct
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Literal

import numpy as np
import torch
import xxhash

from kdn.codecs import Codec, SectionInfo, get_codec
from kdn.codecs.base import same_width_array
from kdn.errors import (
    ArtifactCorrupt,
    FingerprintMismatch,
    InvalidInput,
    LossyRefused,
    MessageTooLarge,
    UnsupportedVersion,
)
from kdn.keys import KEY_BYTES, ChunkKey, ModelFingerprint
from kdn.kv import KV_LAYOUT_VERSION
from kdn.proto import kdn_pb2 as pb

MAGIC = b"KDNA"
TRAILER_MAGIC = b"KDNE"
VERSION = 1
MAX_HEADER = 64 * 1024
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB per artifact
_PREFIX = struct.Struct("<4sHHI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
TRAILER_BYTES = 4 + 16

DTYPE_TO_PB = {torch.float32: pb.FLOAT32, torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16}
PB_TO_DTYPE = {v: k for k, v in DTYPE_TO_PB.items()}

RAW_RUN_BYTES = 1 << 20
"""Raw layers copied and then verified together by ``feed`` (see ``_parse_raw_run``): about what stays in cache."""
SPLIT_RUN_BYTES = 4 << 20
"""Whole raw layers fed at once from this size on are copied and verified by two threads, each
its own half (both the copy and the hash release the GIL): a 32 MiB chunk read from a shared-
memory mapping, say."""
LAND_MIN_SECTION = 64 << 10
"""A raw section's payload is received in place (``landing``) from this size on; a smaller one
lands in the scratch buffer with its length and check (one receive instead of three, and a copy
that stays in cache)."""

# Bounds on the declared geometry, far above any real model, far below what could exhaust memory.
_MAX_LAYERS, _MAX_HEADS, _MAX_HEAD_DIM, _MAX_TOKENS = 1024, 1024, 4096, 1 << 20


class Section:
    """One decoded section: the K (``kind='k'``) or V of one layer, ``(H, T, D)``.

    A section decoded into a larger ``(L, 2, H, T, D)`` tensor (``whole``) makes its view there on
    first use of :attr:`tensor`: callers that passed ``out=`` rarely look, and a view per section
    is a measurable part of reading a small artifact."""

    __slots__ = ("layer", "kind", "_tensor", "_whole")

    def __init__(self, layer: int, kind: Literal["k", "v"], tensor: torch.Tensor | None = None, *,
                 whole: torch.Tensor | None = None) -> None:
        if tensor is None and whole is None:
            raise ValueError("a Section needs its tensor or the tensor it lies in")
        self.layer = layer
        self.kind = kind
        self._tensor = tensor
        self._whole = whole

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            assert self._whole is not None
            self._tensor = self._whole[self.layer, 0 if self.kind == "k" else 1]  # (H, T, D) view
        return self._tensor

    def __repr__(self) -> str:
        return f"Section(layer={self.layer}, kind={self.kind!r}, shape={tuple(self.tensor.shape)})"


@dataclass(frozen=True, slots=True)
class Artifact:
    """A fully decoded artifact: its header and the chunk's KV ``(L, 2, H, T, D)``."""

    header: pb.ArtifactHeader
    kv: torch.Tensor


def section_infos(header: pb.ArtifactHeader) -> list[SectionInfo]:
    dtype = PB_TO_DTYPE[header.dtype]
    shape = (header.num_kv_heads, header.token_count, header.head_dim)
    return [
        SectionInfo(layer, header.num_layers, kind, shape, dtype, header.chunk_index)
        for layer in range(header.num_layers)
        for kind in ("k", "v")
    ]


def encode_artifact(
    kv: torch.Tensor,
    *,
    key: ChunkKey,
    parent_key: ChunkKey,
    fingerprint: ModelFingerprint,
    codec: Codec | str = "raw",
    chunk_index: int = 0,
    steer: str = "",
) -> bytes:
    """Frame one chunk's KV ``(L, 2, H, T, D)`` as a container."""
    codec = get_codec(codec) if isinstance(codec, str) else codec
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise InvalidInput(f"chunk KV must be (L, 2, H, T, D), got {tuple(kv.shape)}")
    if kv.dtype not in DTYPE_TO_PB:
        raise InvalidInput(f"unsupported KV dtype {kv.dtype}")
    for name, value in (("key", key), ("parent_key", parent_key), ("fingerprint", fingerprint)):
        if len(value) != KEY_BYTES:
            raise InvalidInput(f"{name} must be {KEY_BYTES} bytes, got {len(value)}")
    L, _, H, T, D = kv.shape
    header = pb.ArtifactHeader(
        layout_version=KV_LAYOUT_VERSION,
        fingerprint=bytes(fingerprint),
        key=bytes(key),
        parent_key=bytes(parent_key),
        token_count=T,
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        dtype=DTYPE_TO_PB[kv.dtype],
        codec=codec.name,
        codec_level=codec.level,
        lossy=codec.lossy,
        codec_meta=codec.meta(),
        chunk_index=chunk_index,
        created_unix=time.time(),
        steer=steer,
    )
    hbytes = header.SerializeToString()
    if len(hbytes) > MAX_HEADER:
        raise InvalidInput(f"artifact header of {len(hbytes)} bytes exceeds {MAX_HEADER}")
    parts = [_PREFIX.pack(MAGIC, VERSION, 0, len(hbytes)), hbytes]
    parts.append(_U64.pack(xxhash.xxh3_64_intdigest(parts[0] + hbytes)))
    tree = xxhash.xxh3_128(parts[-1])  # digest over the checks, in order
    for info in section_infos(header):
        x = kv[info.layer, 0 if info.kind == "k" else 1].contiguous()  # (H, T, D)
        payload = codec.encode(x, info)
        length = _U32.pack(len(payload))
        h = xxhash.xxh3_64(length)
        h.update(payload)
        check = _U64.pack(h.intdigest())
        tree.update(check)
        parts += [length, payload, check]
    parts += [TRAILER_MAGIC, tree.digest()]
    return b"".join(parts)


@dataclass(slots=True)
class _Direct:
    """A raw section's payload being received in place: its place in ``kv`` and that place's
    contiguous runs as bytes (one, or one per head)."""

    info: SectionInfo
    length: int
    target: np.ndarray  # (H, T, D), same-width ints
    views: list[memoryview]


def _digest_from(seed: "xxhash.xxh3_64", section: np.ndarray) -> int:
    """xxh3_64 of ``seed``'s bytes followed by ``section``'s, read where it lies: whole when it
    is contiguous, else run by run (a token range of a longer prefix: one run per head)."""
    h = seed.copy()
    if section.flags.c_contiguous:
        h.update(section)
    else:
        for run in section:
            h.update(run if run.flags.c_contiguous else np.ascontiguousarray(run))
    return h.intdigest()


_helper: tuple[int, ThreadPoolExecutor] | None = None


def _split_helper() -> ThreadPoolExecutor | None:
    """The one thread that takes half of a large raw run, made per process (a forked child
    has the executor but not its thread); None on a single CPU."""
    global _helper
    if (os.cpu_count() or 1) < 2:
        return None
    if _helper is None or _helper[0] != os.getpid():
        _helper = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdn-verify"))
    return _helper[1]


class ArtifactReader:
    """Incremental, verifying decoder: feed bytes as they arrive, get sections as they complete.

    >>> r = ArtifactReader(expect_fingerprint=fp)
    >>> for piece in stream: for section in r.feed(piece): use(section)
    >>> r.finish()   # verifies the whole-artifact digest; raises if bytes are missing
    """

    def __init__(
        self,
        *,
        expect_fingerprint: ModelFingerprint | None = None,
        expect_key: ChunkKey | None = None,
        require_lossless: bool = False,
        expect_steer: str | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        decode: bool = True,
        assemble: bool = False,
        out: torch.Tensor | None = None,
        sink: Callable[[Section], None] | None = None,
    ) -> None:
        """``assemble``: decode every section straight into one ``(L, 2, H, T, D)`` tensor,
        :attr:`kv` (allocated when the first section has been verified); the yielded sections
        are views into it. Saves a copy per section when the whole chunk is wanted.

        ``out``: decode into this caller-owned ``(L, 2, H, T, D)`` tensor instead (any strides,
        e.g. chunk i's token range of a whole prefix's KV); the header must declare exactly that
        geometry and dtype, or the artifact is refused (FingerprintMismatch) before any byte is
        written to ``out``.

        ``sink``: called with each verified section instead of returning it, its tensor borrowed
        from the bytes being fed where the codec allows (:meth:`kdn.codecs.base.Codec.borrow`:
        the raw codec's section is a read-only view, no copy). The sink must copy what it needs
        and keep no reference to the tensor (the fed buffer is reused after ``feed`` returns)."""
        self._expect_fp = expect_fingerprint
        self._expect_key = expect_key
        self._require_lossless = require_lossless
        self._expect_steer = expect_steer
        self._max_bytes = max_bytes
        self._decode = decode
        self._assemble = (assemble or out is not None) and decode
        self.kv: torch.Tensor | None = out  # (L, 2, H, T, D) when assembling
        self._sink = sink if not self._assemble and decode else None
        self._buf = bytearray()  # bytes that arrived but belong to an unfinished part
        self._view: memoryview = memoryview(b"")  # what the current feed() parses
        self._pos = 0  # bytes of _view consumed
        self._total = 0
        self._tree = xxhash.xxh3_128()
        self.header: pb.ArtifactHeader | None = None
        self._codec: Codec | None = None
        self._infos: list[SectionInfo] = []
        self._bounds: list[int] = []
        self._next = 0
        self._done = False
        self._kv_array: np.ndarray | None = None  # kv's memory as a numpy array, made once
        # receiving in place (landing / landed): a scratch buffer for everything but raw payloads
        self._scratch = bytearray(64 << 10)
        self._scr_n = 0  # bytes of the part being received that are in _scratch
        self._land_to = 0  # where the last landing in _scratch ends
        self._direct: _Direct | None = None  # a raw payload being received into kv

    @property
    def complete(self) -> bool:
        return self._done

    @property
    def received(self) -> int:
        """Bytes of the container given to this reader so far (fed or landed)."""
        return self._total

    # -- receiving in place ------------------------------------------------------------------
    #
    # A transport that can receive into given buffers (the bulk socket) asks ``landing()`` where
    # the next bytes go, fills those views exactly, and calls ``landed()``; it knows nothing of the
    # container's layout. A raw section's payload lands straight in its place in ``kv`` (``out``),
    # so the socket's copy is the only copy of those bytes in this process; the section is then
    # hashed where it landed (hot in cache) and nothing of it is handed out before its checksum
    # matched. Everything else (header, lengths, checks, compressed sections) lands in a scratch
    # buffer and is parsed by the same code as ``feed``.

    def landing(self) -> list[memoryview]:
        """Writable views the next bytes of the container should be received into, in order
        (fill every one, then call :meth:`landed`); ``[]`` once the artifact is complete."""
        if self._done:
            return []
        d = self._direct
        if d is not None:
            # the payload's runs, its check, and the next section's length: one receive call
            more = self._next + 1 < len(self._infos)
            return [*d.views, memoryview(self._scratch)[4 : 16 if more else 12]]
        need = self._need(memoryview(self._scratch)[: self._scr_n])
        if need > len(self._scratch):
            grown = bytearray(need)
            grown[: self._scr_n] = self._scratch[: self._scr_n]
            self._scratch = grown
        self._land_to = need
        return [memoryview(self._scratch)[self._scr_n : need]]

    def landed(self) -> list[Section]:
        """The views of the last :meth:`landing` are filled: parse (verify) what they completed."""
        done: list[Section] = []
        d = self._direct
        if d is not None:
            self._direct = None
            done.append(self._verify_landed(d))
            if self._next == len(self._infos):
                return done  # the trailer comes next
            self._scratch[0:4] = self._scratch[12:16]  # the next section's length came along
            self._land_to = 4
        self._scr_n = self._land_to
        part = memoryview(self._scratch)[: self._scr_n]
        if self.header is not None and self._next < len(self._infos) and self._scr_n == 4:
            d = self._land_direct(_U32.unpack_from(part, 0)[0])
            if d is not None:
                self._direct = d
                return done
        if self._need(part) > self._scr_n:
            return done  # a length arrived: the rest of this part comes next
        self._scr_n = 0
        return done + self.feed(part)

    def _land_direct(self, length: int) -> "_Direct | None":
        """Views of the next section's place in ``kv`` if its payload can be received there."""
        assert self._codec is not None
        info = self._infos[self._next]
        if not (self._assemble and self._codec.stores_raw and length == info.raw_bytes >= LAND_MIN_SECTION):
            return None
        which = 0 if info.kind == "k" else 1
        target = self._kv_array_for(info)[info.layer, which]  # (H, T, D), same-width ints
        if target.flags.c_contiguous:
            runs = [target]
        elif target.ndim == 3 and target[0].flags.c_contiguous:
            runs = list(target)  # one (T, D) run per head: a token range of a longer prefix
        else:
            return None
        if self._total + 4 + length + 8 > self._max_bytes:
            return None  # feed() refuses it with the usual error
        return _Direct(info, length, target, [memoryview(r.reshape(-1).view(np.uint8)) for r in runs])

    def _verify_landed(self, d: "_Direct") -> Section:
        check = bytes(self._scratch[4:12])
        info = d.info
        # the length that arrived (it equals the raw size: _land_direct checked), then the payload
        if _digest_from(xxhash.xxh3_64(bytes(self._scratch[:4])), d.target) != _U64.unpack(check)[0]:
            raise ArtifactCorrupt(f"layer {info.layer} {info.kind.upper()} section checksum mismatch")
        self._tree.update(check)
        self._total += 4 + d.length + 8
        self._scr_n = 0
        self._next += 1
        assert self.kv is not None
        return Section(info.layer, info.kind, whole=self.kv)

    def _kv_array_for(self, info: SectionInfo) -> np.ndarray:
        if self.kv is None:
            assert self.header is not None
            h = self.header
            self.kv = torch.empty(
                (h.num_layers, 2, h.num_kv_heads, h.token_count, h.head_dim), dtype=info.dtype
            )  # (L, 2, H, T, D)
        if self._kv_array is None:
            self._kv_array = same_width_array(self.kv)  # one conversion per reader, not per section
        return self._kv_array

    def feed(self, data: bytes | memoryview) -> list[Section]:
        if self._done:
            if data:
                raise ArtifactCorrupt("bytes after the artifact trailer")
            return []
        self._total += len(data)
        if self._total > self._max_bytes:
            raise MessageTooLarge(f"artifact exceeds {self._max_bytes} bytes")
        src = memoryview(data).cast("B")
        out: list[Section] = []
        try:
            # A part (header, section, trailer) that began in an earlier piece: copy into the
            # buffer only the bytes that part still needs, parse it, and go on in place.
            while self._buf:
                need = self._need(memoryview(self._buf))
                if len(self._buf) < need:
                    take = min(need - len(self._buf), len(src))
                    self._buf += src[:take]
                    src = src[take:]
                    if len(self._buf) < need:
                        return out  # all of this piece went into the pending part
                    continue  # a length field may have arrived: the need can grow
                self._view, self._pos = memoryview(self._buf), 0
                out += self._parse_steps(max_steps=1)
                self._view = memoryview(b"")
                self._buf = bytearray()
            if self._done:
                if src:
                    raise ArtifactCorrupt("bytes after the artifact trailer")
                return out
            self._view, self._pos = src, 0  # the rest of this piece, parsed where it lies
            out += self._parse_steps()
            self._buf = bytearray(self._view[self._pos :])  # an unfinished part waits for more
        except BaseException as exc:
            # the failed step's frames hold slices of the caller's buffer; drop them so the caller
            # can close an mmap or resize a bytearray right away
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            self._view = memoryview(b"")
            self._pos = 0
            src.release()  # nothing of the caller's buffer stays exported once feed() returns
        return out

    def _parse_steps(self, max_steps: int | None = None) -> list[Section]:
        """Parse complete parts from ``_view`` at ``_pos``; stop at the first incomplete one."""
        out: list[Section] = []
        steps = 0
        while not self._done and (max_steps is None or steps < max_steps):
            steps += 1
            if self.header is None:
                if not self._parse_header():
                    break
            elif self._next < len(self._infos):
                if max_steps is None and self._next % 2 == 0:
                    run = self._parse_raw_run()
                    if run:
                        out += run
                        continue
                section = self._parse_section()
                if section is None:
                    break
                if section is not True:
                    out.append(section)
            else:
                self._parse_trailer()
                break
        return out

    def _parse_raw_run(self) -> list[Section]:
        """Raw KV into a destination, for every whole layer that lies in ``_view``: each step of
        up to ``RAW_RUN_BYTES`` of layers is copied into ``kv`` with one strided copy and then
        hashed where it landed, still in cache (one read of the source, as a plain copy makes;
        and what is verified is what the caller gets, even if the source changed meanwhile).
        From ``SPLIT_RUN_BYTES`` on, a helper thread takes the second half of the steps. Same
        checks and errors as section by section (the first bad section in order is the error);
        nothing is handed out before every checksum matched, and a refused run leaves bytes in
        ``kv`` that the caller never uses. ``[]`` when the run does not apply (the slow path then
        parses the next section, and says what is wrong with it)."""
        assert self._codec is not None
        if not (self._assemble and self._codec.stores_raw):
            return []
        info = self._infos[self._next]
        size = info.raw_bytes
        stride = 4 + size + 8
        layers = min((len(self._infos) - self._next) // 2, self._avail() // (2 * stride))
        if layers < 1 or size % info.dtype.itemsize:
            return []
        rows = 2 * layers
        region = np.frombuffer(self._view, dtype=np.uint8, count=rows * stride, offset=self._pos).reshape(rows, stride)
        if not bool((region[:, :4].copy().view("<u4") == size).all()):
            return []  # a length that is not the raw size: the slow path refuses it
        checks = [int(c) for c in region[:, 4 + size :].copy().view("<u8").ravel()]
        first = info.layer
        dst = self._kv_array_for(info)[first : first + layers]  # (layers, 2, H, T, D), same-width ints
        src = region[:, 4 : 4 + size].view(dst.dtype).reshape(dst.shape)
        seed = xxhash.xxh3_64(_U32.pack(size))  # every section's check starts with its length
        per = max(1, RAW_RUN_BYTES // (2 * stride))
        steps = [(a, min(a + per, layers)) for a in range(0, layers, per)]

        def run(lo: int, hi: int) -> int | None:
            """Copy and verify steps ``lo:hi``; the first bad row, or None."""
            for a, b in steps[lo:hi]:
                np.copyto(dst[a:b], src[a:b], casting="no")
                for j in range(2 * a, 2 * b):
                    if _digest_from(seed, dst[j // 2, j % 2]) != checks[j]:
                        return j
            return None

        helper = _split_helper() if rows * stride >= SPLIT_RUN_BYTES and len(steps) > 1 else None
        if helper is None:
            bad = run(0, len(steps))
        else:
            half = helper.submit(run, len(steps) // 2, len(steps))
            try:
                bad = run(0, len(steps) // 2)
            finally:
                later = half.result()  # the helper writes into kv: never leave it running
            bad = bad if bad is not None else later
        if bad is not None:
            b = self._infos[self._next + bad]
            raise ArtifactCorrupt(f"layer {b.layer} {b.kind.upper()} section checksum mismatch")
        self._tree.update(region[:, 4 + size :].tobytes())  # the checks, in order
        self._pos += rows * stride
        self._next += rows
        assert self.kv is not None
        return [Section(i.layer, i.kind, whole=self.kv) for i in self._infos[self._next - rows : self._next]]

    def _need(self, b: memoryview) -> int:
        """Bytes the next part needs in all, as far as ``b`` (its first bytes) tells. A length
        that is out of bounds asks for no more: the parser then refuses it."""
        if self.header is None:
            if len(b) < _PREFIX.size:
                return _PREFIX.size
            hlen = _PREFIX.unpack_from(b, 0)[3]
            return _PREFIX.size + hlen + 8 if hlen <= MAX_HEADER else _PREFIX.size
        if self._next < len(self._infos):
            if len(b) < 4:
                return 4
            (length,) = _U32.unpack_from(b, 0)
            assert self._codec is not None
            return 4 + length + 8 if length <= self._bounds[self._next] else 4
        return TRAILER_BYTES

    def finish(self) -> pb.ArtifactHeader:
        if not self._done:
            raise ArtifactCorrupt(f"artifact truncated after {self._total} bytes")
        assert self.header is not None
        return self.header

    # -- parsing steps: each returns None when more bytes are needed ---------------------------

    def _avail(self) -> int:
        return len(self._view) - self._pos

    def _take(self, n: int) -> memoryview:
        view = self._view[self._pos : self._pos + n]
        self._pos += n
        return view

    def _parse_header(self) -> bool:
        avail = self._avail()
        if avail < _PREFIX.size:
            # check the magic early so garbage fails fast
            if avail >= 4 and bytes(self._view[self._pos : self._pos + 4]) != MAGIC:
                raise ArtifactCorrupt("not a KDN artifact (bad magic)")
            return False
        magic, version, _flags, hlen = _PREFIX.unpack_from(self._view, self._pos)
        if magic != MAGIC:
            raise ArtifactCorrupt("not a KDN artifact (bad magic)")
        if version > VERSION:
            raise UnsupportedVersion(f"artifact version {version} is newer than this reader ({VERSION})")
        if version == 0:
            raise ArtifactCorrupt("artifact version 0 is invalid")
        if hlen > MAX_HEADER:
            raise ArtifactCorrupt(f"artifact header declares {hlen} bytes (limit {MAX_HEADER})")
        if avail < _PREFIX.size + hlen + 8:
            return False
        prefix_and_header = self._take(_PREFIX.size + hlen)
        check = self._take(8)
        if xxhash.xxh3_64_intdigest(prefix_and_header) != _U64.unpack(check)[0]:
            raise ArtifactCorrupt("artifact header checksum mismatch")
        self._tree.update(check)
        header = pb.ArtifactHeader()
        try:
            header.ParseFromString(bytes(prefix_and_header[_PREFIX.size :]))
        except Exception as exc:  # protobuf's DecodeError; checksum passed, so the writer was wrong
            raise ArtifactCorrupt(f"artifact header does not parse: {exc}") from exc
        self._validate_header(header)
        self.header = header
        return True

    def _validate_header(self, h: pb.ArtifactHeader) -> None:
        if h.layout_version != KV_LAYOUT_VERSION:
            raise UnsupportedVersion(f"KV layout version {h.layout_version}, this reader knows {KV_LAYOUT_VERSION}")
        if len(h.fingerprint) != KEY_BYTES or len(h.key) != KEY_BYTES or len(h.parent_key) != KEY_BYTES:
            raise ArtifactCorrupt("artifact header has malformed key or fingerprint")
        if h.dtype not in PB_TO_DTYPE:
            raise ArtifactCorrupt(f"artifact header has unknown dtype {h.dtype}")
        if not (0 < h.num_layers <= _MAX_LAYERS and 0 < h.num_kv_heads <= _MAX_HEADS
                and 0 < h.head_dim <= _MAX_HEAD_DIM and 0 < h.token_count <= _MAX_TOKENS):
            raise ArtifactCorrupt(
                f"artifact header declares an implausible shape: layers={h.num_layers} "
                f"heads={h.num_kv_heads} head_dim={h.head_dim} tokens={h.token_count}"
            )
        decoded = 2 * h.num_layers * h.num_kv_heads * h.token_count * h.head_dim * PB_TO_DTYPE[h.dtype].itemsize
        if decoded > self._max_bytes:
            # bounds what a tiny compressed section could expand to (a decompression bomb)
            raise MessageTooLarge(
                f"artifact header declares {decoded} bytes of KV; this reader accepts at most {self._max_bytes}"
            )
        if self._expect_fp is not None and h.fingerprint != bytes(self._expect_fp):
            raise FingerprintMismatch(
                f"artifact was made for model {h.fingerprint.hex()[:16]}…, expected {bytes(self._expect_fp).hex()[:16]}…"
            )
        if self._expect_key is not None and h.key != bytes(self._expect_key):
            raise ArtifactCorrupt(f"artifact holds key {h.key.hex()[:16]}…, expected {bytes(self._expect_key).hex()[:16]}…")
        if self._expect_steer is not None and h.steer != self._expect_steer:
            raise ArtifactCorrupt(
                f"artifact is steered variant {h.steer[:120]!r}, expected {self._expect_steer[:120] or 'plain KV'!r}"
                if h.steer else f"artifact is plain KV, expected steered variant {self._expect_steer[:120]!r}"
            )
        if self._require_lossless and h.lossy:
            raise LossyRefused(f"artifact is lossy ({h.codec}:{h.codec_level}) but lossless was required")
        codec = get_codec(f"{h.codec}:{h.codec_level}" if h.codec_level else h.codec)
        if codec.lossy != h.lossy:
            raise ArtifactCorrupt(f"header says lossy={h.lossy} but codec {h.codec} is lossy={codec.lossy}")
        self._codec = codec.with_meta(h.codec_meta)
        self._infos = section_infos(h)
        self._bounds = [self._codec.max_payload(info) for info in self._infos]  # what each may declare
        if self.kv is not None:
            want = (h.num_layers, 2, h.num_kv_heads, h.token_count, h.head_dim)
            if tuple(self.kv.shape) != want or self.kv.dtype != PB_TO_DTYPE[h.dtype]:
                # checksummed and fingerprinted, yet not the KV the reader's model makes
                raise FingerprintMismatch(
                    f"artifact holds KV {want} {PB_TO_DTYPE[h.dtype]}, this model needs "
                    f"{tuple(self.kv.shape)} {self.kv.dtype}"
                )

    def _parse_section(self) -> Section | bool | None:
        info = self._infos[self._next]
        avail = self._avail()
        if avail < 4:
            return None
        (length,) = _U32.unpack_from(self._view, self._pos)
        assert self._codec is not None
        bound = self._bounds[self._next]
        if length > bound:
            raise ArtifactCorrupt(
                f"layer {info.layer} {info.kind.upper()} section declares {length} bytes; "
                f"codec {self._codec.name} produces at most {bound} for this shape"
            )
        if avail < 4 + length + 8:
            return None
        framed = self._take(4 + length)
        check = self._take(8)
        if xxhash.xxh3_64_intdigest(framed) != _U64.unpack(check)[0]:
            raise ArtifactCorrupt(f"layer {info.layer} {info.kind.upper()} section checksum mismatch")
        self._tree.update(check)
        self._next += 1
        if not self._decode:
            return True
        if self._sink is not None:
            self._sink(Section(info.layer, info.kind, self._codec.borrow(framed[4:], info)))
            return True  # the section (and its view of the fed bytes) is gone once the sink returns
        if not self._assemble:
            return Section(info.layer, info.kind, self._codec.decode(framed[4:], info))
        which = 0 if info.kind == "k" else 1
        target = self._kv_array_for(info)[info.layer, which]
        assert self.kv is not None
        if self._codec.decode_into_array(framed[4:], info, target):
            return Section(info.layer, info.kind, whole=self.kv)
        out = self.kv[info.layer, which]  # (H, T, D) view
        self._codec.decode_into(framed[4:], info, out)
        return Section(info.layer, info.kind, out)

    def _parse_trailer(self) -> None:
        if self._avail() < TRAILER_BYTES:
            return
        tail = bytes(self._take(TRAILER_BYTES))
        if tail[:4] != TRAILER_MAGIC or tail[4:] != self._tree.digest():
            raise ArtifactCorrupt("artifact digest mismatch")
        if self._avail() > 0:
            raise ArtifactCorrupt("bytes after the artifact trailer")
        self._done = True


def iter_sections(pieces: Iterable[bytes], **reader_kw: object) -> Iterator[Section]:
    """Decode sections from an iterable of byte pieces as they arrive; verifies the end too."""
    reader = ArtifactReader(**reader_kw)  # type: ignore[arg-type]
    for piece in pieces:
        yield from reader.feed(piece)
    reader.finish()


def decode_artifact(data: bytes | memoryview, **reader_kw: object) -> Artifact:
    """Verify and decode a whole container into ``(L, 2, H, T, D)``."""
    reader = ArtifactReader(assemble=True, **reader_kw)  # type: ignore[arg-type]
    reader.feed(data)
    header = reader.finish()
    assert reader.kv is not None  # a verified header declares at least one layer
    return Artifact(header, reader.kv)


def transcode(data: bytes | memoryview, codec: Codec | str, **reader_kw: object) -> bytes:
    """The same chunk framed in another codec: every checksum of ``data`` is verified, its KV
    decoded and framed again with the same key, parent, fingerprint, chunk index and steered
    variant. Only a lossless container is transcoded (KV that a lossy codec already changed must
    not come out labelled lossless): a lossy one is ``LossyRefused``."""
    art = decode_artifact(data, **reader_kw)
    h = art.header
    if h.lossy:
        raise LossyRefused(f"artifact in {h.codec} is lossy: it is not transcoded")
    return encode_artifact(
        art.kv,  # (L, 2, H, T, D)
        key=ChunkKey(bytes(h.key)),
        parent_key=ChunkKey(bytes(h.parent_key)),
        fingerprint=ModelFingerprint(bytes(h.fingerprint)),
        codec=codec,
        chunk_index=h.chunk_index,
        steer=h.steer,
    )


def verify_artifact(data: bytes | memoryview, **reader_kw: object) -> pb.ArtifactHeader:
    """Check every checksum and bound without decoding payloads; return the header."""
    reader = ArtifactReader(decode=False, **reader_kw)  # type: ignore[arg-type]
    reader.feed(data)
    return reader.finish()


def read_header(data: bytes | memoryview) -> pb.ArtifactHeader:
    """Parse and verify only the header of a container (the rest may be missing)."""
    reader = ArtifactReader(decode=False)
    reader.feed(data[: _PREFIX.size + MAX_HEADER + 8] if len(data) > _PREFIX.size + MAX_HEADER + 8 else data)
    if reader.header is None:
        raise ArtifactCorrupt("artifact truncated inside its header")
    return reader.header
