"""Hostile kvq codec metadata in a checksum-valid container: our own errors from every reader."""

from __future__ import annotations

import asyncio
import random

import pytest

from kdn.artifact import decode_artifact, iter_sections, verify_artifact
from kdn.testing import make_chain, reseal
from kdn.errors import KdnError

HOSTILE = [
    b'{"v":1,"k_bits":Infinity,"v_bits":4}',
    b'{"v":1,"k_bits":4,"v_bits":4,"early_frac":NaN}',
    b'{"v":1,"k_bits":4,"v_bits":4,"early_frac":1e999}',
    b'{"v":1,"k_bits":4,"v_bits":4,"table":[[1e999,4],[4,4]]}',
    b'{"v":1,"k_bits":4.5,"v_bits":4}',
    b'{"v":1,"k_bits":true,"v_bits":4}',
    b'{"v":1,"k_bits":4,"v_bits":4,"group":' + b"9" * 5000 + b"}",
    b'{"v":1,"k_bits":4,"v_bits":4,"table":[4,4]}',
    b'{"v":1,"k_bits":4,"v_bits":4,"table":{"a":1}}',
    b"[" * 20000 + b"]" * 20000,
    b'{"a":' * 5000 + b"1" + b"}" * 5000,
    b"[1,2]",
    b"\xff\xfe",
]


def _with_meta(meta: bytes) -> bytes:
    def edit(h) -> None:  # type: ignore[no-untyped-def]
        h.codec_meta = meta

    return reseal(make_chain(1, codec="kvq").blobs[0], header=edit)


def _readers(blob: bytes) -> list:  # type: ignore[type-arg]
    def streaming() -> None:
        list(iter_sections(blob[i : i + 7] for i in range(0, len(blob), 7)))

    return [lambda: verify_artifact(blob), lambda: decode_artifact(blob), streaming]


@pytest.mark.parametrize("meta", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_kvq_meta_is_a_project_error_everywhere(meta: bytes) -> None:
    blob = _with_meta(meta)
    for read in _readers(blob):
        with pytest.raises(KdnError):
            read()


def test_hostile_kvq_meta_through_put_is_a_clear_status_not_internal() -> None:
    import grpc

    from tests.unit.test_edge_put import _put, _servicer
    from kdn.testing import InMemoryOverlay, origin_with
    from kdn.keys import Namespace
    from kdn.wire.convert import put_messages

    chain = make_chain(1, codec="kvq")

    async def stream(blob: bytes):  # type: ignore[no-untyped-def]
        for m in put_messages(blob, key=chain.keys[0], fingerprint=chain.fingerprint, namespace=Namespace("default")):
            yield m

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin_with([])) as ov:
            servicer = _servicer(ov.nodes["e0"])
            for meta in HOSTILE:
                code, details = await _put(servicer, stream(_with_meta(meta)))
                assert code not in (None, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (meta[:40], code)
                assert "kvq" in details or "codec" in details
            assert (await _put(servicer, stream(chain.blobs[0])))[0] is None

    asyncio.run(main())


def test_seeded_fuzz_of_kvq_meta_reaches_only_project_errors() -> None:
    """Random edits of valid meta, resealed (checksums recomputed): every reader either accepts or
    raises a KdnError; never OverflowError, RecursionError, TypeError, ..."""
    rng = random.Random(19)
    base = bytearray(b'{"anchor_bits":8,"early_bonus":2,"early_frac":0.25,"group":16,"k_bits":6,"v":1,"v_bits":4}')
    tokens = [b"Infinity", b"-Infinity", b"NaN", b"1e999", b"[", b"]", b"{", b"}", b'"', b",", b":", b"true",
              b"null", b"4.5", b"-1", b"99999999999999999999", b"0"]
    for _ in range(150):
        meta = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(meta))
            op = rng.random()
            if op < 0.4:
                meta[at : at + rng.randint(0, 3)] = rng.choice(tokens)
            elif op < 0.7:
                meta[at] = rng.randrange(256)
            else:
                del meta[at : at + rng.randint(1, 5)]
        blob = _with_meta(bytes(meta))
        for read in _readers(blob):
            try:
                read()
            except KdnError:
                pass
