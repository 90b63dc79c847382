"""kdn.wire.convert and kdn.wire.tls: the rules every hop shares, stated once."""

from __future__ import annotations

import asyncio

import pytest

from kdn.errors import InvalidInput, MessageTooLarge, Unauthorized
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.wire.convert import FetchSpec, parse_keys, parse_namespace, put_messages, receive_put
from kdn.wire.tls import TlsFiles

KEY = ChunkKey(bytes(range(32)))
FP = ModelFingerprint(bytes(32))


def test_empty_tenant_is_invalid_everywhere() -> None:
    assert parse_namespace(pb.Namespace(tenant="acme", salt="s")) == Namespace("acme", "s")
    for bad in ("", "bad/tenant"):
        with pytest.raises(InvalidInput):
            parse_namespace(pb.Namespace(tenant=bad))


def test_key_lists_are_bounded_before_they_are_parsed() -> None:
    assert parse_keys([bytes(KEY)] * 3, limit=3) == [KEY] * 3
    with pytest.raises(MessageTooLarge):
        parse_keys([b"short"] * 4, limit=3)
    with pytest.raises(InvalidInput):
        parse_keys([b"short"], limit=3)


def test_fetch_spec_round_trips() -> None:
    spec = FetchSpec(KEY, FP, Namespace("acme"), codec="raw", require_lossless=True)
    req = spec.to_proto([KEY], shm=True)
    assert req.shm and list(req.next_keys) == [bytes(KEY)]
    assert FetchSpec.from_proto(req, parse_namespace(req.namespace)) == spec
    assert spec.local().local_only


def test_put_stream_round_trips_and_checks_the_token_before_buffering() -> None:
    data = bytes(range(256)) * 40

    async def stream(msgs):
        for m in msgs:
            yield m

    async def main() -> None:
        msgs = list(put_messages(data, key=KEY, fingerprint=FP, namespace=Namespace("acme"), piece=1000))
        seen: list[str] = []
        header, got = await receive_put(stream(msgs), limit=1 << 20, authorize=lambda ns: seen.append(ns.tenant))
        assert got == data and header.key == KEY and seen == ["acme"]

        def refuse(ns: Namespace) -> None:
            raise Unauthorized("no")

        with pytest.raises(Unauthorized):
            await receive_put(stream(msgs), limit=1 << 20, authorize=refuse)
        with pytest.raises(MessageTooLarge):
            await receive_put(stream(msgs), limit=100, authorize=lambda ns: None)
        with pytest.raises(InvalidInput):
            await receive_put(stream(msgs[1:]), limit=1 << 20, authorize=lambda ns: None)

    asyncio.run(main())


def test_tls_rules() -> None:
    assert TlsFiles.for_server(None, None, None) is None
    assert TlsFiles.for_server("c.pem", "k.pem", "ca.pem") == TlsFiles(cert="c.pem", key="k.pem", ca="ca.pem")
    assert TlsFiles.for_client(None, None, None) is None
    assert TlsFiles.for_client(None, None, "ca.pem") is not None
    for args in (("c.pem", None, None), (None, "k.pem", None)):
        with pytest.raises(ValueError, match="go together"):
            TlsFiles.for_client(*args)
    with pytest.raises(ValueError, match="mTLS"):
        TlsFiles.for_server(None, None, "ca.pem")
