"""kdn.wire.bulk's pieces without sockets: the buffer pool, the frames, the status round trip."""

from __future__ import annotations

import pytest

from kdn import errors as e
from kdn.wire import bulk as wb
from kdn.wire.errors import error_from_status, status_for, status_value


def test_buffer_pool_reuses_by_size_class_and_bounds_what_it_keeps() -> None:
    pool = wb.BufferPool(max_idle_bytes=3 << 20, min_size=64 << 10)
    a = pool.take(1_000_000)
    assert len(a) == 1 << 20  # rounded up to its power-of-two class
    pool.give(a)
    b = pool.take(600_000)  # same class: the same buffer comes back, not a new one
    assert b is a and pool.reused == 1 and pool.allocated == 1
    c, d = pool.take(1 << 20), pool.take(1 << 20)
    for buf in (b, c, d):
        pool.give(buf)
    assert pool.idle_bytes == 3 << 20
    pool.give(bytearray(1 << 20))  # over the idle bound: dropped
    pool.give(bytearray(1000))  # not a pool size: dropped
    assert pool.idle_bytes == 3 << 20


@pytest.mark.parametrize("exc", [e.NotFound("k"), e.Unauthorized("t"), e.ArtifactCorrupt("x"), e.MessageTooLarge("m"),
                                 e.LossyRefused("l"), e.InvalidInput("i"), e.Unavailable("u")])
def test_a_refusal_carried_as_a_number_becomes_the_same_exception(exc: e.KdnError) -> None:
    code, message = status_for(exc)
    back = error_from_status(status_value(code), message, peer="edge-a")
    assert type(back) is type(exc) and str(exc) in str(back) and "edge-a" in str(back)


def test_frames() -> None:
    raw = wb.answer(5, "why" * 3000, 7)
    status, zero, tlen, size = wb.ANSWER.unpack_from(raw)
    assert (status, zero, size) == (5, 0, 7) and tlen == wb.MAX_TEXT == len(raw) - wb.ANSWER.size
    ticket = bytes(range(32))
    assert wb.parse_hello(wb.HELLO.pack(wb.MAGIC, wb.VERSION, ticket)) == ticket
    with pytest.raises(e.InvalidInput, match="magic"):
        wb.parse_hello(wb.HELLO.pack(b"HTTP", wb.VERSION, ticket))
    with pytest.raises(e.InvalidInput, match="version 2"):
        wb.parse_hello(wb.HELLO.pack(wb.MAGIC, 2, ticket))


def test_an_answer_naming_a_segment_carries_the_flag() -> None:
    raw = wb.answer(0, "kdn-edge-1-0123456789abcdef", 1 << 25, flags=wb.SHM_ANSWER)
    status, flags, tlen, size = wb.ANSWER.unpack_from(raw)
    assert (status, flags, size) == (0, wb.SHM_ANSWER, 1 << 25)
    assert raw[wb.ANSWER.size:].decode() == "kdn-edge-1-0123456789abcdef" and tlen == 27
    assert wb.ANSWER.unpack_from(wb.answer(0, "memory", 5))[1] == 0  # a Fetch's answer has no flags
