"""The trust boundary: :class:`ArtifactReader` verifies a container (:mod:`kdn.artifact.format`)
as its bytes arrive and hands out sections only once they are verified.

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
- no pickle anywhere; no thread is made here (large raw runs are split only onto a ``pool`` the
  caller owns).
"""

from __future__ import annotations

import functools
import traceback
from concurrent.futures import Executor
from typing import Callable

import numpy as np
import torch
import xxhash

from kdn.artifact.digest import copy_verified
from kdn.artifact.format import (
    DEFAULT_MAX_BYTES, MAX_HEADER, PREFIX, TRAILER_BYTES, TRAILER_MAGIC, U32, U64, ArtifactHeader, Section,
    header_shape, section_infos,
)
from kdn.artifact.landing import Destination, Direct, Landing
from kdn.artifact.trust import Expect, header_part
from kdn.codecs import Codec, SectionInfo
from kdn.errors import ArtifactCorrupt, MessageTooLarge
from kdn.keys import ChunkKey, ModelFingerprint


@functools.lru_cache(maxsize=64)
def _framed(size: int) -> np.dtype:
    """One framed raw section of ``size`` payload bytes as a numpy record: its length field,
    payload and check, read where they lie."""
    return np.dtype({"names": ["length", "payload", "check"], "formats": ["<u4", ("u1", (size,)), "<u8"],
                     "offsets": [0, 4, 4 + size], "itemsize": 4 + size + 8})


@functools.lru_cache(maxsize=64)
def _length_seed(size: int) -> "xxhash.xxh3_64":
    """The hash state after a raw section's length field (every check starts with it); callers
    copy it, never update it."""
    return xxhash.xxh3_64(U32.pack(size))


def _bad_check(info: SectionInfo) -> ArtifactCorrupt:
    return ArtifactCorrupt(f"layer {info.layer} {info.kind.upper()} section checksum mismatch")


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
        pool: Executor | None = None,
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
        and keep no reference to the tensor (the fed buffer is reused after ``feed`` returns).

        ``pool``: an executor the caller owns; whole raw layers fed at once into ``kv`` from
        ``kdn.artifact.digest.SPLIT_RUN_BYTES`` on are copied and verified half on it. Without
        one, every byte is hashed on the calling thread. The KV and the errors are the same."""
        self._expect = Expect(expect_fingerprint, expect_key, require_lossless, expect_steer, max_bytes)
        self._decode = decode
        self._assemble = (assemble or out is not None) and decode
        self._dest = Destination(out)  # (L, 2, H, T, D) when assembling; out's geometry is checked
        self._sink = sink if not self._assemble and decode else None
        self._pool = pool
        self._buf = bytearray()  # bytes that arrived but belong to an unfinished part
        self._view: memoryview = memoryview(b"")  # what the current feed() parses
        self._pos = 0  # bytes of _view consumed
        self._total = 0
        self._tree = xxhash.xxh3_128()
        self.header: ArtifactHeader | None = None
        self._codec: Codec | None = None
        self._infos: tuple[SectionInfo, ...] = ()
        self._bounds: list[int] = []
        self._next = 0
        self._done = False
        self._landing: Landing | None = None

    @property
    def kv(self) -> torch.Tensor | None:
        """The ``(L, 2, H, T, D)`` KV sections are decoded into (``out``, or allocated when assembling)."""
        return self._dest.kv

    @property
    def complete(self) -> bool:
        return self._done

    @property
    def received(self) -> int:
        """Bytes of the container given to this reader so far (fed or landed)."""
        return self._total

    # -- receiving in place (kdn.artifact.landing) ---------------------------------------------

    def landing(self) -> list[memoryview]:
        """Writable views the next bytes of the container should be received into, in order
        (fill every one, then call :meth:`landed`); ``[]`` once the artifact is complete."""
        if self._landing is None:
            self._landing = Landing(self)
        return self._landing.views()

    def landed(self) -> list[Section]:
        """The views of the last :meth:`landing` are filled: parse (verify) what they completed."""
        assert self._landing is not None, "landed() before landing()"
        return self._landing.landed()

    def sections_left(self) -> int:
        return len(self._infos) - self._next

    def direct_run(self, length: int, budget: int) -> list[Direct]:
        """The next sections received in place, if they are (:meth:`Destination.run`)."""
        assert self._codec is not None and self.header is not None
        if not (self._assemble and self._codec.stores_raw):
            return []
        return self._dest.run(self._infos[self._next :], length, budget, self._expect.max_bytes - self._total,
                              header_shape(self.header))

    def accept_landed(self, d: Direct, length: bytes, check: bytes) -> Section:
        h = xxhash.xxh3_64(length)  # the check covers the length field and the payload, as it landed
        for run in d.views:
            h.update(run)
        if h.intdigest() != U64.unpack(check)[0]:
            raise _bad_check(d.info)
        self._tree.update(check)
        self._total += 4 + d.length + 8
        self._next += 1
        return Section(d.info.layer, d.info.kind, whole=self.kv)

    def need(self, b: memoryview) -> int:
        """Bytes the next part needs in all, as far as ``b`` (its first bytes) tells. A length
        that is out of bounds asks for no more: the parser then refuses it."""
        if self.header is None:
            if len(b) < PREFIX.size:
                return PREFIX.size
            hlen = PREFIX.unpack_from(b, 0)[3]
            return PREFIX.size + hlen + 8 if hlen <= MAX_HEADER else PREFIX.size
        if self._next < len(self._infos):
            if len(b) < 4:
                return 4
            (length,) = U32.unpack_from(b, 0)
            return 4 + length + 8 if length <= self._bounds[self._next] else 4
        return TRAILER_BYTES

    # -- receiving by copy ---------------------------------------------------------------------

    def feed(self, data: bytes | memoryview) -> list[Section]:
        if self._done:
            if data:
                raise ArtifactCorrupt("bytes after the artifact trailer")
            return []
        self._total += len(data)
        if self._total > self._expect.max_bytes:
            raise MessageTooLarge(f"artifact exceeds {self._expect.max_bytes} bytes")
        src = memoryview(data).cast("B")
        out: list[Section] = []
        try:
            # A part (header, section, trailer) that began in an earlier piece: copy into the
            # buffer only the bytes that part still needs, parse it, and go on in place.
            while self._buf:
                need = self.need(memoryview(self._buf))
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

    def finish(self) -> ArtifactHeader:
        if not self._done:
            raise ArtifactCorrupt(f"artifact truncated after {self._total} bytes")
        assert self.header is not None
        return self.header

    # -- parsing steps: each returns None when more bytes are needed ---------------------------

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

    def _avail(self) -> int:
        return len(self._view) - self._pos

    def _take(self, n: int) -> memoryview:
        view = self._view[self._pos : self._pos + n]
        self._pos += n
        return view

    def _parse_header(self) -> bool:
        part = header_part(self._view[self._pos :])
        if part is None:
            return False
        n, header, check = part
        self._pos += n
        self._tree.update(check)
        self._codec = self._expect.codec_for(header, self._dest.kv)
        self._infos = section_infos(header)
        self._bounds = [self._codec.max_payload(info) for info in self._infos]  # what each may declare
        self.header = header
        return True

    def _parse_raw_run(self) -> list[Section]:
        """Raw KV into a destination, for every whole layer that lies in ``_view``, copied into
        ``kv`` and hashed where it landed (:func:`kdn.artifact.digest.copy_verified`: one read of
        the source, as a plain copy makes; and what is verified is what the caller gets, even if
        the source changed meanwhile). Same checks and errors as section by section (the first
        bad section in order is the error); nothing is handed out before every checksum matched,
        and a refused run leaves bytes in ``kv`` that the caller never uses. ``[]`` when the run
        does not apply (the slow path then parses the next section, and says what is wrong)."""
        assert self._codec is not None and self.header is not None
        if not (self._assemble and self._codec.stores_raw):
            return []
        info = self._infos[self._next]
        size = info.raw_bytes
        stride = 4 + size + 8
        layers = min((len(self._infos) - self._next) // 2, self._avail() // (2 * stride))
        if layers < 1 or size % info.dtype.itemsize:
            return []
        rows = 2 * layers
        framed = np.frombuffer(self._view, dtype=_framed(size), count=rows, offset=self._pos)
        if framed["length"].tolist().count(size) != rows:
            return []  # a length that is not the raw size: the slow path refuses it
        checks = framed["check"].tolist()
        whole = self._dest.array(header_shape(self.header), info.dtype)
        dst = whole[info.layer : info.layer + layers]  # (layers, 2, H, T, D), same-width ints
        src = framed["payload"].view(dst.dtype).reshape(dst.shape)
        bad = copy_verified(dst, src, _length_seed(size), checks, 2 * stride, self._pool)
        if bad is not None:
            raise _bad_check(self._infos[self._next + bad])
        self._tree.update(framed["check"].tobytes())  # the checks, in order
        self._pos += rows * stride
        self._next += rows
        kv = self.kv
        return [Section(i.layer, i.kind, whole=kv) for i in self._infos[self._next - rows : self._next]]

    def _parse_section(self) -> Section | bool | None:
        info = self._infos[self._next]
        avail = self._avail()
        if avail < 4:
            return None
        (length,) = U32.unpack_from(self._view, self._pos)
        assert self._codec is not None and self.header is not None
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
        if xxhash.xxh3_64_intdigest(framed) != U64.unpack(check)[0]:
            raise _bad_check(info)
        self._tree.update(check)
        self._next += 1
        if not self._decode:
            return True
        if self._sink is not None:
            lent = self._codec.borrow_array(framed[4:], info)
            self._sink(Section(info.layer, info.kind, array=lent, dtype=info.dtype) if lent is not None
                       else Section(info.layer, info.kind, self._codec.borrow(framed[4:], info)))
            return True  # the section (and its view of the fed bytes) is gone once the sink returns
        if not self._assemble:
            return Section(info.layer, info.kind, self._codec.decode(framed[4:], info))
        return self._dest.decode(self._codec, framed[4:], info, header_shape(self.header))

    def _parse_trailer(self) -> None:
        if self._avail() < TRAILER_BYTES:
            return
        tail = bytes(self._take(TRAILER_BYTES))
        if tail[:4] != TRAILER_MAGIC or tail[4:] != self._tree.digest():
            raise ArtifactCorrupt("artifact digest mismatch")
        if self._avail() > 0:
            raise ArtifactCorrupt("bytes after the artifact trailer")
        self._done = True
