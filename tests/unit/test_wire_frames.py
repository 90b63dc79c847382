"""kdn.wire.frames produces and reads exactly protobuf's FetchChunk bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kdn.wire.frames import decode_chunk, encode_chunk
from kdn.errors import ArtifactCorrupt
from kdn.proto import kdn_pb2 as pb


@given(data=st.binary(max_size=3000), total=st.integers(0, 2**64 - 1), source=st.text(max_size=20),
       shm=st.text(max_size=40))
def test_roundtrip_against_generated_class(data: bytes, total: int, source: str, shm: str) -> None:
    mine = encode_chunk(memoryview(data), total_size=total, source=source, shm_name=shm)
    theirs = pb.FetchChunk(data=data, total_size=total, source=source, shm_name=shm).SerializeToString()
    assert mine == theirs
    got = decode_chunk(theirs)
    assert (bytes(got.data), got.total_size, got.source, got.shm_name) == (data, total, source, shm)


def test_unknown_fields_are_skipped_and_garbage_refused() -> None:
    msg = pb.FetchChunk(data=b"abc", total_size=3).SerializeToString()
    extra = bytes([0x28, 0x07]) + bytes([0x31]) + b"\x00" * 8 + bytes([0x3D]) + b"\x00" * 4  # fields 5 (varint), 6 (i64), 7 (i32)
    got = decode_chunk(extra + msg)
    assert bytes(got.data) == b"abc" and got.total_size == 3
    for bad in (b"\x0a\x05ab", b"\x0a", b"\x10\xff", b"\x0f"):
        with pytest.raises(ArtifactCorrupt):
            decode_chunk(bad)


def test_whole_artifact_frames_equal_the_messages_protobuf_would_send() -> None:
    from kdn.wire.channel import split_pieces
    from kdn.wire.frames import encode_frames

    data = bytes(range(256)) * 41  # 10496 bytes: two full pieces and a short one
    theirs = [pb.FetchChunk(data=bytes(p)).SerializeToString() for p in split_pieces(data, 4096)]
    theirs[0] = pb.FetchChunk(data=data[:4096], total_size=len(data), source="origin").SerializeToString()
    assert list(encode_frames(data, piece=4096, source="origin")) == theirs
