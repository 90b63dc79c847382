"""Receiving sections in place into a caller's buffer: the destination KV and the landing buffers.

A transport that can receive into given buffers (the bulk socket) asks the reader's ``landing()``
where the next bytes go, fills those views exactly, and calls ``landed()``; it knows nothing of
the container's layout. A raw section's payload lands straight in its place in ``kv`` (``out``),
so the socket's copy is the only copy of those bytes in this process; the section is then hashed
where it landed (hot in cache) and nothing of it is handed out before its checksum matched.
Everything else (header, lengths, checks, compressed sections) lands in a scratch buffer and is
parsed by the same code as ``feed``. Every check is the reader's (:mod:`kdn.artifact.reader`):
this module only says where bytes go.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from kdn.artifact.format import TRAILER_BYTES, U32, Section
from kdn.codecs import Codec, SectionInfo
from kdn.codecs.base import same_width_array
from kdn.errors import ArtifactCorrupt

LAND_MIN_SECTION = 64 << 10
"""A raw section's payload is received in place (``landing``) from this size on; a smaller one
lands in the scratch buffer with its length and check (one receive instead of three, and a copy
that stays in cache)."""

RUN_BYTES = 256 << 10
"""Consecutive raw sections received in place by one landing, up to this many payload bytes (at
least one section): one receive call and one pass of Python for the run instead of one per
section (a 1 MiB chunk of 16 sections), while the run is still in cache when it is hashed."""


@dataclass(slots=True)
class Direct:
    """A raw section's payload being received in place: its place in ``kv`` as contiguous runs
    of bytes (one, or one per head), in the payload's order."""

    info: SectionInfo
    length: int
    views: list[memoryview]


class Destination:
    """The ``(L, 2, H, T, D)`` tensor an assembling reader decodes into: the caller's ``out``
    (any strides), or one allocated when the first section has been verified."""

    __slots__ = ("kv", "_array", "_flat")

    def __init__(self, out: torch.Tensor | None) -> None:
        self.kv = out
        self._array: np.ndarray | None = None  # kv's memory as a numpy array, made once
        self._flat: memoryview | None = None  # kv's bytes, when kv is one contiguous run

    def array(self, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
        """``kv`` as same-width ints (allocated as ``shape``/``dtype`` if there is none yet)."""
        if self.kv is None:
            self.kv = torch.empty(shape, dtype=dtype)  # (L, 2, H, T, D)
        if self._array is None:
            self._array = same_width_array(self.kv)  # one conversion per reader, not per section
        return self._array

    def decode(self, codec: Codec, payload: memoryview, info: SectionInfo, shape: tuple[int, ...]) -> Section:
        """Decode one verified section into its place."""
        which = 0 if info.kind == "k" else 1
        target = self.array(shape, info.dtype)[info.layer, which]
        assert self.kv is not None
        if codec.decode_into_array(payload, info, target):
            return Section(info.layer, info.kind, whole=self.kv)
        out = self.kv[info.layer, which]  # (H, T, D) view
        codec.decode_into(payload, info, out)
        return Section(info.layer, info.kind, out)

    def direct(self, info: SectionInfo, length: int, shape: tuple[int, ...]) -> Direct | None:
        """Views of a raw section's place in ``kv`` if its payload of ``length`` bytes can be
        received there: large enough, and its place is one run or one run per head."""
        if length < LAND_MIN_SECTION:
            return None
        which = 0 if info.kind == "k" else 1
        whole = self.array(shape, info.dtype)  # (L, 2, H, T, D)
        if self._flat is None and whole.flags.c_contiguous:
            self._flat = memoryview(whole.reshape(-1).view(np.uint8))
        if self._flat is not None:  # one chunk's own tensor: the section is a slice of its bytes
            size = self._flat.nbytes // (2 * whole.shape[0])
            at = (2 * info.layer + which) * size
            return Direct(info, length, [self._flat[at : at + size]])
        target = whole[info.layer, which]  # (H, T, D)
        if target.flags.c_contiguous:
            runs = [target]
        elif target.ndim == 3 and target[0].flags.c_contiguous:
            runs = list(target)  # one (T, D) run per head: a token range of a longer prefix
        else:
            return None
        return Direct(info, length, [memoryview(r.reshape(-1).view(np.uint8)) for r in runs])


    def run(self, infos: Sequence[SectionInfo], length: int, budget: int, room: int,
            shape: tuple[int, ...]) -> list[Direct]:
        """Where the next raw sections ``infos`` are received in place: the first, whose length
        field arrived as ``length``, if that is its raw size; then those after it, each predicted
        at its raw size (:meth:`Landing.landed` refuses one whose length field says otherwise),
        while their payloads stay within ``budget`` bytes and their framed sections within
        ``room`` (the reader's ``max_bytes`` left: past it, ``feed`` refuses with the usual
        error). ``[]``: the next section is fed."""
        run: list[Direct] = []
        payload = 0
        for info in infos:
            size = info.raw_bytes if run else length
            if size != info.raw_bytes or (run and payload + size > budget) or 4 + size + 8 > room:
                break
            d = self.direct(info, size, shape)
            if d is None:
                break
            run.append(d)
            payload += size
            room -= 4 + size + 8
        return run


class Parser(Protocol):
    """What a :class:`Landing` asks of its reader (:class:`kdn.artifact.reader.ArtifactReader`)."""

    @property
    def complete(self) -> bool: ...

    def sections_left(self) -> int:
        """Sections not yet verified (0 before the header is)."""
        ...

    def need(self, b: memoryview) -> int:
        """Bytes the next part needs in all, as far as ``b`` (its first bytes) tells."""
        ...

    def feed(self, data: bytes | memoryview) -> list[Section]: ...

    def direct_run(self, length: int, budget: int) -> list[Direct]:
        """Where the next sections' payloads are received in place, if they are: the next one of
        ``length`` bytes, then those after it of their raw size, up to ``budget`` bytes."""
        ...

    def accept_landed(self, d: Direct, length: bytes, check: bytes) -> Section:
        """Verify a payload received in place; its section once its checksum matched."""
        ...


class Landing:
    """The buffers one reader's ``landing()`` hands out and ``landed()`` takes back.

    It refers to its reader weakly: the reader holds it, and a cycle between them would keep the
    reader's destination (a request's whole prefix KV, in a reused mapping) alive until the next
    garbage collection, so that the next request could not reuse it and mapped a fresh one."""

    __slots__ = ("_reader", "_scratch", "_scr_n", "_land_to", "_run")

    def __init__(self, reader: Parser) -> None:
        self._reader = weakref.proxy(reader)
        self._scratch = bytearray(64 << 10)  # everything but raw payloads received in place
        self._scr_n = 0  # bytes of the part being received that are in _scratch
        self._land_to = 0  # where the last landing in _scratch ends
        self._run: list[Direct] = []  # raw payloads being received into kv, in order

    def views(self) -> list[memoryview]:
        r = self._reader
        if r.complete:
            return []
        run = self._run
        if run:
            # each payload's runs, then its check and the next section's length (after the last
            # section of the artifact: its check and the trailer): one receive call for the run
            scratch = memoryview(self._scratch)
            views: list[memoryview] = []
            for j, d in enumerate(run):
                views += d.views
                views.append(scratch[12 * j + 4 : 12 * j + 16])
            if r.sections_left() == len(run):
                views[-1] = scratch[12 * len(run) - 8 : 12 * len(run) + TRAILER_BYTES]
            return views
        need = r.need(memoryview(self._scratch)[: self._scr_n])
        if need > len(self._scratch):
            grown = bytearray(need)
            grown[: self._scr_n] = self._scratch[: self._scr_n]
            self._scratch = grown
        self._land_to = need
        return [memoryview(self._scratch)[self._scr_n : need]]

    def landed(self) -> list[Section]:
        r = self._reader
        done: list[Section] = []
        run = self._run
        if run:
            self._run = []
            scratch = self._scratch
            # scratch holds, per section of the run, the length that arrived and the check:
            # the first length is the one direct_run() placed by; a later one must be the raw
            # size it was received as (the check covers it too)
            for j, d in enumerate(run):
                length = bytes(scratch[12 * j : 12 * j + 4])
                if j and U32.unpack(length)[0] != d.length:
                    raise ArtifactCorrupt(
                        f"layer {d.info.layer} {d.info.kind.upper()} section declares "
                        f"{U32.unpack(length)[0]} bytes; a raw section of this shape is {d.length}"
                    )
                done.append(r.accept_landed(d, length, bytes(scratch[12 * j + 4 : 12 * j + 12])))
            end = 12 * len(run)
            self._scr_n = 0
            if not r.sections_left():
                return done + r.feed(memoryview(scratch)[end : end + TRAILER_BYTES])
            scratch[0:4] = scratch[end : end + 4]  # the next section's length came along
            self._land_to = 4
        self._scr_n = self._land_to
        part = memoryview(self._scratch)[: self._scr_n]
        if self._scr_n == 4 and r.sections_left():
            run = r.direct_run(U32.unpack_from(part, 0)[0], RUN_BYTES)
            if run:
                self._run = run
                return done
        if r.need(part) > self._scr_n:
            return done  # a length arrived: the rest of this part comes next
        self._scr_n = 0
        return done + r.feed(part)
