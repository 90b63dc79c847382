"""A prefix fetched under the prefill (kdn.layered): each layer runs once its KV is in place, the
tokens are recompute's, and a chunk that breaks mid-pass leaves its verified predecessors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kdn.client import ClientConfig, KdnClient
from kdn.integrations.transformers import generate
from kdn.layered import LayerGate, LoadBroken, pays
from kdn.models import load_model
from kdn.testing import MemoryEdgeTransport

CHUNK = 32
DOC = ("KDN keeps the KV cache of long contexts close to the GPUs that read them again. " * 4)[: 4 * CHUNK]
PROMPT = DOC + " Question: what does KDN keep?"


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny", chunk_size=CHUNK)


def _publish(lm, edge: MemoryEdgeTransport) -> list[bytes]:
    """DOC's four chunks on ``edge`` (written back by a first request); their keys in order."""
    with KdnClient(ClientConfig(edge="mem", write_back=True), transport=edge) as client:
        r = generate(lm, DOC, client=client, max_new_tokens=1)
        client.flush(10)
        assert r.written_back and client.counters["written_back"] == 4
        return [bytes(k) for k in client.keys_for(lm.tokenizer.encode_prompt(DOC), lm.fingerprint, CHUNK)][:4]


# -- the gate ------------------------------------------------------------------------------------


def test_a_layer_opens_only_when_every_item_has_it_and_the_last_only_when_whole():
    gate = LayerGate(items=2, layers=3, deadline_s=5)
    gate.advance(0, 1)
    opened = threading.Event()

    def forward() -> None:
        gate.wait(0)
        opened.set()

    t = threading.Thread(target=forward)
    t.start()
    assert not opened.wait(0.2)  # item 1 has no layer yet
    gate.advance(1, 3)  # all its sections, but not yet verified whole: the last layer stays shut
    assert opened.wait(5)
    t.join()
    gate.advance(0, 3)
    assert gate.ready == [2, 2, 0]
    gate.done(0)
    gate.done(1)
    gate.wait(2)
    assert gate.settle() == 2


def test_a_failed_item_breaks_every_waiter_and_settles_to_its_predecessors():
    gate = LayerGate(items=3, layers=2, deadline_s=5)
    gate.done(0)
    gate.advance(1, 1)
    broke: list[BaseException] = []

    def forward() -> None:
        try:
            gate.wait(1)
        except LoadBroken as exc:
            broke.append(exc)

    t = threading.Thread(target=forward)
    t.start()
    time.sleep(0.05)
    gate.fail(1, ValueError("bad checksum"))
    t.join(5)
    assert broke and not t.is_alive()
    gate.done(2)  # a later item that finished counts for nothing
    assert gate.settle() == 1 and isinstance(gate.error, ValueError)


def test_a_gate_past_its_deadline_breaks_the_wait():
    gate = LayerGate(items=1, layers=1, deadline_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(LoadBroken):
        gate.wait(0)
    assert time.monotonic() - t0 < 2 and gate.settle() == 0


# -- through generate ----------------------------------------------------------------------------


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "same-host"])
def test_layered_hit_gives_recompute_tokens_and_runs_every_layer_behind_the_gate(lm, whole, monkeypatch):
    import kdn.integrations.transformers as host

    edge = MemoryEdgeTransport()
    _publish(lm, edge)
    edge.whole = whole
    waited: list[int] = []
    real = host.prefill_in_place

    def spy(*a, ready=None, **kw):
        assert ready is not None  # the hit is layered
        return real(*a, ready=lambda l: (waited.append(l), ready(l))[1], **kw)

    monkeypatch.setattr(host, "prefill_in_place", spy)
    base = generate(lm, PROMPT, max_new_tokens=6)
    with KdnClient(ClientConfig(edge="mem", write_back=False, layered=True), transport=edge) as client:
        got = generate(lm, PROMPT, client=client, max_new_tokens=6)
        assert got.tokens == base.tokens and got.reused_tokens == 4 * CHUNK and not got.warnings
        assert waited == list(range(lm.model.config.num_hidden_layers))
        assert client.counters["reused_chunks"] == 4 and client.counters["fetch_errors"] == 0
        assert got.fetched_bytes > 0 and got.via == ("shm" if whole else "memory")


class _HeldBack(MemoryEdgeTransport):
    """Holds the last piece of ``key`` until ``release`` is set (from the forward's thread)."""

    def __init__(self, key: bytes, release: threading.Event) -> None:
        super().__init__(piece=4096)
        self.key, self.release = key, release

    async def fetch(self, spec, *, timeout, next_keys=()):
        pieces = [p async for p in super().fetch(spec, timeout=timeout, next_keys=next_keys)]
        for n, (piece, via) in enumerate(pieces):
            if bytes(spec.key) == self.key and n == len(pieces) - 1:
                await asyncio.to_thread(self.release.wait, 10)
            yield piece, via


def test_the_first_layer_runs_before_the_last_chunk_has_arrived(lm, monkeypatch):
    """Pipelined, not fetched-then-run: the last chunk's final bytes are sent only once the
    forward has reached layer 1, so a host that waited for the whole prefix would time out."""
    import kdn.integrations.transformers as host

    release = threading.Event()
    edge = _HeldBack(b"", release)
    keys = _publish(lm, edge)
    edge.key = keys[-1]
    real = host.prefill_in_place

    def spy(*a, ready=None, **kw):
        def gated(l: int) -> None:
            if l == 1:
                release.set()
            ready(l)
        return real(*a, ready=gated, **kw)

    monkeypatch.setattr(host, "prefill_in_place", spy)
    base = generate(lm, PROMPT, max_new_tokens=6)
    with KdnClient(ClientConfig(edge="mem", write_back=False, fetch_timeout_s=3, layered=True), transport=edge) as client:
        got = generate(lm, PROMPT, client=client, max_new_tokens=6)
    assert release.is_set() and got.tokens == base.tokens
    assert got.reused_tokens == 4 * CHUNK and not got.warnings


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "same-host"])
@pytest.mark.parametrize("bad", [0, 2])
def test_a_chunk_corrupt_under_the_pass_leaves_its_predecessors_and_the_right_tokens(lm, whole, bad):
    edge = MemoryEdgeTransport()
    keys = _publish(lm, edge)
    edge.whole = whole
    edge.corrupt.add(keys[bad])
    base = generate(lm, PROMPT, max_new_tokens=6)
    with KdnClient(ClientConfig(edge="mem", write_back=False, layered=True), transport=edge) as client:
        got = generate(lm, PROMPT, client=client, max_new_tokens=6)
        assert got.tokens == base.tokens
        assert got.reused_tokens == bad * CHUNK and got.computed_tokens == len(PROMPT) - bad * CHUNK
        assert len(got.warnings) == 1 and f"chunk {bad} of 4" in got.warnings[0]
        assert client.counters["fetch_errors"] == 1 and client.counters["reused_chunks"] == bad


class _Stalls(MemoryEdgeTransport):
    """Never answers the Fetch of ``key`` (a stuck edge): the deadline ends it."""

    key = b""

    async def fetch(self, spec, *, timeout, next_keys=()):
        if bytes(spec.key) == self.key:
            await asyncio.sleep(3600)
        async for p in super().fetch(spec, timeout=timeout, next_keys=next_keys):
            yield p


def test_a_chunk_that_never_arrives_ends_at_the_deadline_with_the_right_tokens(lm):
    edge = _Stalls()
    keys = _publish(lm, edge)
    edge.key = keys[3]
    base = generate(lm, PROMPT, max_new_tokens=6)
    with KdnClient(ClientConfig(edge="mem", write_back=False, fetch_timeout_s=0.5, layered=True), transport=edge) as client:
        t0 = time.monotonic()
        got = generate(lm, PROMPT, client=client, max_new_tokens=6)
        assert time.monotonic() - t0 < 10
        assert got.tokens == base.tokens and got.reused_tokens == 3 * CHUNK
        assert got.warnings and "chunk 3 of 4" in got.warnings[0]


def test_layered_is_chosen_only_where_a_core_is_left_for_the_reader(lm, monkeypatch):
    import os

    import torch

    import kdn.integrations.transformers as host

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert not pays(lm.model)  # the forward takes every core: the reader would only contend
    monkeypatch.setattr(torch, "get_num_threads", lambda: max(1, cores - 1))
    assert pays(lm.model) == (cores > 1)
    layered: list[bool] = []
    real = host.prefill_in_place
    monkeypatch.setattr(host, "prefill_in_place",
                        lambda *a, ready=None, **kw: layered.append(ready is not None) or real(*a, ready=ready, **kw))
    edge = MemoryEdgeTransport()
    _publish(lm, edge)
    for setting in (None, False, True):
        with KdnClient(ClientConfig(edge="mem", write_back=False, layered=setting), transport=edge) as client:
            generate(lm, PROMPT, client=client, max_new_tokens=2)
    assert layered == [cores > 1, False, True]
