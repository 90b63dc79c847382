"""The store blends, over real gRPC on loopback: a client (the vLLM connector's StoreBlend) asks an
origin to blend a prompt whose documents it holds as segments, fetches the variant's chunks and
verifies them like any artifact; tenants are kept apart; refusals arrive as answers, not errors."""

from __future__ import annotations

import asyncio

import pytest

from kdn.artifact import ArtifactReader
from kdn.blend.verdict import Verdict, write_verdict
from kdn.errors import NotFound, Unauthorized
from kdn.integrations.store_blend import StoreBlend
from kdn.keys import Namespace
from kdn.origin.config import OriginConfig
from kdn.origin.segments import ingest_segments, segment_tokens
from kdn.origin.server import OriginServer

pytestmark = pytest.mark.integration

CHUNK = 32
DOCS = [f"Note {i}: " + " ".join(f"item{i}-{j}" for j in range(12)) + ".\n" for i in range(3)]
ACME = Namespace("acme")


@pytest.fixture()
def origin(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    cfg = OriginConfig(store_dir=str(tmp_path / "store"), models=["tiny"], chunk_size=CHUNK, codecs=["raw"],
                       listen="127.0.0.1:0", fsync=False, tokens={"tok-a": ["acme"], "tok-b": ["beta"]})
    srv = OriginServer(cfg)
    srv.start()
    yield srv
    srv.stop()


def _fetch_all(sb, fp, ns, keys):
    async def go():
        out = []
        for k in keys:
            reader = ArtifactReader(expect_fingerprint=fp, expect_key=k, require_lossless=True)
            async for piece, via in sb.fetch(fp, ns, k):
                assert via == "origin"
                reader.feed(piece)
            out.append(reader.finish())
        return out
    return go()


def test_a_client_gets_the_variant_over_grpc_and_other_tenants_do_not(origin) -> None:
    lm = origin.model()
    write_verdict(Verdict(bytes(lm.fingerprint).hex(), True, 0.3, 1, reason="test"))
    ingest_segments(lm, origin.store, [(f"d{i}", t) for i, t in enumerate(DOCS)], namespace=ACME,
                    catalog=origin.segment_catalog)
    toks = [segment_tokens(lm, t) for t in DOCS]
    prompt = lm.tokenizer.encode("Read these.\n") + toks[2] + toks[0] + toks[1] + lm.tokenizer.encode("Which item?")

    async def run():
        sb = StoreBlend(origin.address, token="tok-a")
        other = StoreBlend(origin.address, token="tok-b")
        try:
            ans = await sb.blend(lm.fingerprint, ACME, prompt)
            assert not ans.refused and ans.documents == 3 and ans.keys
            arts = await _fetch_all(sb, lm.fingerprint, ACME, ans.keys)
            assert all(h.token_count == CHUNK for h in arts) and len(arts) * CHUNK == ans.covered
            with pytest.raises(Unauthorized):  # tok-b may not speak for acme
                await other.blend(lm.fingerprint, ACME, prompt)
            with pytest.raises(NotFound):  # beta holds no such key, and cannot tell acme's exists
                await _fetch_all(other, lm.fingerprint, Namespace("beta"), ans.keys[:1])
            beta = await other.blend(lm.fingerprint, Namespace("beta"), prompt)
            assert beta.refused == "no_segments" and not beta.keys  # acme's segments are not beta's
        finally:
            await sb.close()
            await other.close()

    asyncio.run(run())
    assert origin.stats().counters["blend_fetches"] >= 1


def test_a_refusal_is_an_answer_with_a_code(origin) -> None:
    lm = origin.model()  # no verdict written: the gate refuses

    async def run():
        sb = StoreBlend(origin.address, token="tok-a")
        try:
            return await sb.blend(lm.fingerprint, ACME, list(range(5, 200)))
        finally:
            await sb.close()

    ans = asyncio.run(run())
    assert ans.refused == "no_verdict" and "kdn eval-blend" in ans.reason and not ans.keys
    assert origin.stats().counters["blend_refused_no_verdict"] == 1

