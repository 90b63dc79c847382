"""The vLLM connector's blend requests (kdn/integrations/vllm_blend.py) without vLLM: the scheduler
answers "not yet" while the store blends, adopts the variant's keys once they arrive (whole
chunks, before the last prompt token, no write-back), and serves anything else exactly, counted.

The connector is a stand-in that lends BlendRequests what the real one does (a BlendHost); the
store is a fake whose answer the test releases. The real engine runs the same code in tests/vllm/test_vllm_blend.py.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kdn.integrations.store_blend import BlendAnswer
from kdn.integrations.vllm_blend import BlendHost, BlendRequests
from kdn.keys import ChunkKey, Namespace

C = 64


@dataclass
class State:  # the fields of the connector's ReqState that blending sets
    ns: Namespace
    keys: list
    n_prompt: int
    on_edge: int
    saved: int = 0
    first_saved: int = 0
    tokens: Any = None
    pieces_saved: bool = False
    blend: bool = False
    end: int = 0


class Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class FakeStore:
    def __init__(self, answer: BlendAnswer) -> None:
        self.answer = answer
        self.release = threading.Event()
        self.asked: list[tuple[Namespace, list[int], list]] = []

    async def blend(self, fp, ns, tokens, docs):
        self.asked.append((ns, tokens, docs))
        while not self.release.is_set():
            await asyncio.sleep(0.005)
        return self.answer


@dataclass
class Conn:
    config: Any
    loop: Loop
    reqs: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    fingerprint: bytes = bytes(32)
    block_size: int = 32

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def host(self) -> BlendHost:
        return BlendHost(self.config, self.fingerprint, self.block_size, states=self.reqs,  # type: ignore[arg-type]
                         count=self.count, submit=self.loop.submit, new_state=State, namespace_of=_namespace)


def _namespace(salt, params, default):
    params = params or {}
    return Namespace(params["kdn_tenant"]) if params.get("kdn_tenant") else default


@pytest.fixture()
def setup():
    loop = Loop()
    cfg = SimpleNamespace(blend=False, blend_origin="127.0.0.1:1", blend_poll_s=0.01, blend_timeout_s=5.0,
                          namespace=Namespace("default"), tokens={}, token=None, fetch_timeout_s=1.0,
                          chunk_size=C, tls=lambda: None)
    conn = Conn(cfg, loop)
    blends = BlendRequests(conn.host())
    yield conn, blends
    loop.close()


def _request(rid="r1", n=300, salt="kdn-blend-x", params=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)), cache_salt=salt,
                           kv_transfer_params={"kdn_blend": True, "kdn_tenant": "acme"} if params is None else params)


def test_the_scheduler_waits_for_the_store_then_loads_the_variants_whole_chunks(setup) -> None:
    conn, blends = setup
    keys = tuple(ChunkKey(bytes([i]) * 32) for i in range(4))
    store = FakeStore(BlendAnswer(keys, 4 * C, "ab" * 32, documents=3))
    blends._client = lambda tenant: store  # type: ignore[method-assign]
    req = _request(n=4 * C + 10)
    assert blends.pending(req) and blends.pending(req)  # vLLM is told "not yet", twice
    assert len(store.asked) == 1 and store.asked[0][0] == Namespace("acme")  # asked once, in the params' tenant
    store.release.set()
    for _ in range(200):
        if not blends.pending(req):
            break
    st = conn.reqs["r1"]
    assert st.blend and st.keys == list(keys) and st.end == 4 * C  # whole chunks, before the last prompt token
    assert st.saved == st.first_saved == len(keys) and st.pieces_saved  # nothing is ever written back
    assert conn.counters["blend_variants"] == 1 and not blends.pending(req)
    blends.finished("r1")


def test_the_last_prompt_token_is_left_to_vllm(setup) -> None:
    conn, blends = setup
    keys = tuple(ChunkKey(bytes([i]) * 32) for i in range(4))
    store = FakeStore(BlendAnswer(keys, 4 * C))
    store.release.set()
    blends._client = lambda tenant: store  # type: ignore[method-assign]
    req = _request(n=4 * C)  # the variant covers every prompt token: the last chunk is vLLM's to compute
    while blends.pending(req):
        pass
    assert conn.reqs["r1"].end == 3 * C


@pytest.mark.parametrize("case", ["refused", "no_salt", "plain_salt", "no_origin", "error", "timeout"])
def test_anything_else_is_served_exactly_and_counted(setup, case) -> None:
    conn, blends = setup
    store = FakeStore(BlendAnswer((), 0, refused="no_segments", reason="none stored"))
    if case != "timeout":
        store.release.set()
    if case == "error":
        async def broken(*a):
            raise ConnectionError("origin down")
        store.blend = broken  # type: ignore[method-assign]
    if case == "no_origin":
        conn.config.blend_origin = None
    if case == "timeout":
        conn.config.blend_timeout_s = 0.05
    blends._client = lambda tenant: store  # type: ignore[method-assign]
    req = _request(salt={"no_salt": None, "plain_salt": "acme"}.get(case, "kdn-blend-x"))
    for _ in range(500):
        if not blends.pending(req):
            break
    assert "r1" not in conn.reqs and not blends.pending(req)  # the plain path runs next
    want = {"refused": "blend_refused_no_segments", "no_salt": "blend_no_salt", "plain_salt": "blend_no_salt",
            "no_origin": "blend_no_origin", "error": "blend_errors", "timeout": "blend_timeouts"}[case]
    assert conn.counters[want] == 1
    st = State(Namespace("acme"), [ChunkKey(bytes(32))] * 3, 300, 0)
    blends.never_save(req, st)  # asked for a blend: never writes back, whatever it was served
    assert st.saved == 3 and st.pieces_saved
    store.release.set()


def test_requests_that_do_not_opt_in_are_left_alone_but_a_blend_salt_never_saves(setup) -> None:
    conn, blends = setup
    plain = _request(params={}, salt=None)
    assert not blends.pending(plain) and not conn.counters
    st = State(Namespace("default"), [ChunkKey(bytes(32))] * 3, 300, 0)
    blends.never_save(plain, st)
    assert st.saved == 0
    salted = _request(params={}, salt="kdn-blend-x")  # blended blocks may sit under this salt in vLLM's cache
    blends.never_save(salted, st)
    assert st.saved == 3
    assert not blends.pending(_request(params={"kdn_blend": True, "kdn": False}))  # opted out of KDN
