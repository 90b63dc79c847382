"""The router's pure parts: the TTFT estimate, the policies, the rate fits, request parsing."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from kdn.errors import ConfigError, InvalidInput
from kdn.keys import Namespace
from kdn.prompts import ByteTokenizer, chat_tokens
from kdn.route.config import RouteConfig, parse_host
from kdn.route.hosts import EngineRecord
from kdn.route.openai import parse_body, request_namespace
from kdn.route.policy import Candidate, make_policy
from kdn.route.rates import LinkRates, PrefillFit, link_samples
from kdn.route.score import Estimate, HostCost, Holdings, RequestShape, estimate
from tests.route_fakes import ChatByteTokenizer

SHAPE = RequestShape(tokens=1000, chunk_tokens=256, piece_tokens=32, kv_bytes_per_token=1000)
RATES = {"memory": 1e9, "disk": 1e8, "peer": 1e8, "origin": 1e6}


def cost(queued: float = 0.0, r: float = 1e-3, links: dict[str, float] | None = None) -> HostCost:
    return HostCost(prefill_s_per_token=r, link_bytes_per_s=links or RATES, queued_tokens=queued)


def test_nothing_held_is_a_full_prefill_behind_the_queue() -> None:
    e = estimate(SHAPE, Holdings(), cost(queued=500))
    assert e.loaded_tokens == 0 and e.prefill_tokens == 1000
    assert e.ttft_s == pytest.approx(0.5 + 1.0)


def test_held_chunks_and_pieces_are_loaded_and_priced_by_their_tier() -> None:
    e = estimate(SHAPE, Holdings(("memory", "memory", "peer"), ("peer", "peer")), cost())
    assert e.loaded_tokens == 3 * 256 + 2 * 32
    assert e.fetch_bytes == {"memory": 512_000, "peer": 320_000}
    assert e.fetch_s == pytest.approx(512_000 / 1e9 + 320_000 / 1e8)
    assert e.prefill_tokens == 1000 - 832 and e.local_tokens == 512


def test_a_slow_origin_loses_to_recompute_but_what_comes_before_it_is_still_used() -> None:
    e = estimate(SHAPE, Holdings(("memory", "origin", "origin")), cost())
    assert e.loaded_tokens == 256 and "origin" not in e.fetch_bytes  # 256 kB at 1 MB/s > 256 ms of prefill
    fast = estimate(SHAPE, Holdings(("memory", "origin", "origin")), cost(links={**RATES, "origin": 1e9}))
    assert fast.loaded_tokens == 768


def test_the_engine_cache_is_free_and_unknown_tiers_are_recompute() -> None:
    e = estimate(SHAPE, Holdings(("engine", "engine")), cost())
    assert e.fetch_s == 0 and e.loaded_tokens == 512 and e.fetch_bytes == {}
    odd = estimate(SHAPE, Holdings(("memory", "tape", "memory")), cost())
    assert odd.loaded_tokens == 256


def test_the_last_prompt_token_is_always_computed() -> None:
    shape = RequestShape(tokens=512, chunk_tokens=256, piece_tokens=32, kv_bytes_per_token=1000)
    e = estimate(shape, Holdings(("memory", "memory")), cost())
    assert e.loaded_tokens == 511 and e.prefill_tokens == 1


def test_the_estimate_never_drops_when_a_cost_rises() -> None:
    rng = random.Random(7)
    tiers = ["engine", "memory", "disk", "peer", "origin"]
    for _ in range(300):
        held = Holdings(tuple(rng.choice(tiers) for _ in range(rng.randint(0, 4))), tuple(rng.choice(tiers) for _ in range(rng.randint(0, 3))))
        links = {t: 10 ** rng.uniform(5, 10) for t in tiers}
        base = cost(queued=rng.uniform(0, 2000), r=10 ** rng.uniform(-4, -2), links=links)
        e = estimate(SHAPE, held, base).ttft_s
        tier = rng.choice(tiers)
        slower = {**links, tier: links[tier] / 3}
        assert estimate(SHAPE, held, cost(base.queued_tokens, base.prefill_s_per_token, slower)).ttft_s >= e - 1e-12
        assert estimate(SHAPE, held, cost(base.queued_tokens + 100, base.prefill_s_per_token, links)).ttft_s >= e
        assert estimate(SHAPE, held, cost(base.queued_tokens, base.prefill_s_per_token * 2, links)).ttft_s >= e
        assert estimate(SHAPE, held, base).ttft_s <= estimate(SHAPE, Holdings(), base).ttft_s + 1e-12


def cand(name: str, ttft: float, local: int = 0, in_flight: int = 0) -> Candidate:
    return Candidate(name, in_flight, Holdings(), Estimate(ttft, 0, 0, ttft, 0, 0, {}, local))


def test_cost_picks_the_least_ttft_and_spreads_ties() -> None:
    p = make_policy("cost", tie_s=0.01, tie_fraction=0.0)
    assert p.choose([cand("a", 1.0), cand("b", 0.5), cand("c", 0.9)]) == 1
    picks = [p.choose([cand("a", 1.0), cand("b", 1.005), cand("c", 3.0)]) for _ in range(6)]
    assert sorted(set(picks)) == [0, 1] and picks.count(0) == 3
    assert p.choose([cand("a", 1.0, in_flight=2), cand("b", 1.001, in_flight=0)]) == 1


def test_prefix_overlap_picks_the_longest_local_run_whatever_it_costs() -> None:
    p = make_policy("prefix_overlap", tie_s=0.0, tie_fraction=0.0)
    assert p.choose([cand("a", 0.1, local=0), cand("b", 99.0, local=512)]) == 1
    assert p.choose([cand("a", 0.1, local=256, in_flight=3), cand("b", 0.1, local=256, in_flight=1)]) == 1


def test_unknown_policy() -> None:
    with pytest.raises(InvalidInput, match="round_robin"):
        make_policy("fastest")
    with pytest.raises(ConfigError, match="policy"):
        RouteConfig.build({"hosts": [{"url": "http://a:1"}], "policy": "fastest"})


def test_prefill_fit_recovers_rate_and_overhead_and_follows_a_change() -> None:
    fit = PrefillFit(prior_s_per_token=1.0)
    assert fit.s_per_token == 1.0 and fit.overhead_s == 0.0
    rng = random.Random(3)
    for _ in range(40):
        x = rng.uniform(10, 2000)
        fit.observe(x, 0.05 + 2e-3 * x + rng.gauss(0, 0.002))
    assert fit.s_per_token == pytest.approx(2e-3, rel=0.05)
    assert fit.overhead_s == pytest.approx(0.05, abs=0.02)
    for _ in range(40):  # the host slows down threefold
        x = rng.uniform(10, 2000)
        fit.observe(x, 0.05 + 6e-3 * x)
    assert fit.s_per_token == pytest.approx(6e-3, rel=0.05)


def test_prefill_fit_separates_per_request_overhead_from_queued_tokens() -> None:
    fit = PrefillFit(prior_s_per_token=1.0)
    rng = random.Random(5)
    for _ in range(60):
        m = rng.randint(1, 6)
        x = m * rng.uniform(5, 300)
        fit.observe(x, 0.08 * m + 3e-3 * x, m)
    assert fit.s_per_token == pytest.approx(3e-3, rel=0.01) and fit.overhead_s == pytest.approx(0.08, rel=0.02)


def test_prefill_fit_learns_the_engines_cost_of_loading_kv() -> None:
    """Requests that loaded KV took longer than their prefill and link time say: the fit finds the
    per-byte load cost beside the rate and overhead, and none where nothing was loaded."""
    fit = PrefillFit(prior_s_per_token=1.0)
    rng = random.Random(7)
    for _ in range(30):  # calibration-like: no loads
        x = rng.uniform(10, 2000)
        fit.observe(x, 0.05 + 2e-3 * x)
    assert fit.load_s_per_byte == 0.0
    for _ in range(60):
        m = rng.randint(1, 4)
        x, z = m * rng.uniform(5, 300), m * rng.choice([0.0, 0.0, 20e6, 40e6])
        fit.observe(x, 0.05 * m + 2e-3 * x + 10e-9 * z + rng.gauss(0, 0.003), m, z)
    assert fit.load_s_per_byte == pytest.approx(10e-9, rel=0.05)  # 10 ms per MB
    assert fit.s_per_token == pytest.approx(2e-3, rel=0.05) and fit.overhead_s == pytest.approx(0.05, rel=0.2)
    assert fit.as_dict()["load_s_per_mb"] == pytest.approx(0.010, rel=0.05)


def test_prefill_fit_never_prices_taking_in_a_tokens_kv_above_computing_it() -> None:
    """Delay that came with the loads (here: the machine was busy in proportion to the KV loaded,
    210 ms per MB) is not the engine's cost of taking bytes in: unbounded, the fit takes it as
    that, above the prefill of the same KV, and every edge hit on the host would be priced as
    worse than a recompute. Bounded by the KV's size per token, the fit drops the load term."""
    bpt = 46_080  # smollm2-135m fp32
    rng = random.Random(11)
    obs = []
    for _ in range(60):
        m = rng.randint(1, 3)
        x, z = m * rng.uniform(50, 1200), m * rng.choice([0.0, 0.0, 47e6])
        obs.append((x, 0.15 * m + 2.4e-3 * x + 2.1e-7 * z + rng.gauss(0, 0.02), m, z))
    free, bounded = PrefillFit(prior_s_per_token=1.0), PrefillFit(prior_s_per_token=1.0, bytes_per_token=bpt)
    for o in obs:
        free.observe(*o)
        bounded.observe(*o)
    assert free.load_s_per_byte * bpt > free.s_per_token  # what the bound is for
    assert bounded.load_s_per_byte * bpt <= bounded.s_per_token
    assert bounded.s_per_token > 0 and bounded.overhead_s >= 0
    # a real cost of taking KV in (10 ms per MB, a fifth of the prefill per token) is still learnt
    fit = PrefillFit(prior_s_per_token=1.0, bytes_per_token=bpt)
    for _ in range(60):
        m = rng.randint(1, 4)
        x, z = m * rng.uniform(5, 300), m * rng.choice([0.0, 0.0, 20e6, 40e6])
        fit.observe(x, 0.05 * m + 2.4e-3 * x + 10e-9 * z + rng.gauss(0, 0.003), m, z)
    assert fit.load_s_per_byte == pytest.approx(10e-9, rel=0.05)


def test_prefill_fit_keeps_every_part_non_negative() -> None:
    fit = PrefillFit(prior_s_per_token=1.0)
    rng = random.Random(9)
    for _ in range(40):  # loads that made requests *faster* than their tokens say: no negative load
        x, z = rng.uniform(100, 2000), rng.choice([0.0, 30e6])
        fit.observe(x, 2e-3 * x - (0.02 if z else 0.0) + 0.03, 1, z)
    assert fit.load_s_per_byte == 0.0 and fit.s_per_token > 0 and fit.overhead_s >= 0


def test_the_engines_load_cost_prices_every_loaded_byte_and_the_queues() -> None:
    held = Holdings(("memory", "memory", "peer"))
    free = estimate(SHAPE, held, cost())
    dear = estimate(SHAPE, held, HostCost(1e-3, RATES, load_s_per_byte=1e-7))
    assert dear.link_s == pytest.approx(free.fetch_s) == pytest.approx(free.link_s)
    assert dear.fetch_s == pytest.approx(free.fetch_s + 768_000 * 1e-7)
    # at 1 us a byte loading costs more than recomputing: the estimate recomputes instead
    e = estimate(SHAPE, held, HostCost(1e-3, RATES, load_s_per_byte=1e-6))
    assert e.loaded_tokens == 0 and e.ttft_s == pytest.approx(1.0)
    engine = estimate(SHAPE, Holdings(("engine", "engine", "engine")), HostCost(1e-3, RATES, load_s_per_byte=1e-6))
    assert engine.loaded_tokens == 768 and engine.fetch_s == 0.0 and engine.load_bytes == 0
    q = estimate(SHAPE, Holdings(), HostCost(1e-3, RATES, queued_load_bytes=2e6, queued_requests=1, load_s_per_byte=1e-7))
    assert q.queue_s == pytest.approx(0.2)


def test_queued_requests_cost_their_fetches_and_overheads() -> None:
    idle = estimate(SHAPE, Holdings(), HostCost(1e-3, RATES, overhead_s=0.05))
    busy = estimate(SHAPE, Holdings(), HostCost(1e-3, RATES, queued_tokens=100, queued_fetch_s=0.2, queued_requests=3,
                                                overhead_s=0.05))
    assert idle.queue_s == pytest.approx(0.05)
    assert busy.queue_s == pytest.approx(0.1 + 0.2 + 4 * 0.05)


def test_prefill_fit_with_one_size_is_a_line_through_the_origin() -> None:
    fit = PrefillFit(prior_s_per_token=1.0)
    fit.observe(100, 0.3)
    fit.observe(100, 0.3)
    assert fit.s_per_token == pytest.approx(3e-3) and fit.overhead_s == 0.0
    fit.observe(0, 5.0)  # no tokens: says nothing
    fit.observe(10, float("nan"))
    assert fit.n == 2


def test_link_rates_from_edge_counter_deltas() -> None:
    prev = {"kdn_edge_bytes_in_total{source=peer}": 1e6, "kdn_edge_rpc_seconds_sum{rpc=Fetch,source=peer}": 1.0,
            "kdn_edge_bytes_out_total{path=grpc}": 5e6, "kdn_edge_hits_total{tier=memory}": 10,
            "kdn_edge_rpc_seconds_sum{rpc=Fetch,source=memory}": 0.1}
    cur = {"kdn_edge_bytes_in_total{source=peer}": 11e6, "kdn_edge_rpc_seconds_sum{rpc=Fetch,source=peer}": 2.0,
           "kdn_edge_bytes_out_total{path=grpc}": 25e6, "kdn_edge_bytes_out_total{path=shm}": 10e6,
           "kdn_edge_hits_total{tier=memory}": 30, "kdn_edge_rpc_seconds_sum{rpc=Fetch,source=memory}": 0.12}
    s = link_samples(prev, cur)
    assert s["peer"] == (10e6, pytest.approx(1.0))
    assert s["memory"] == (pytest.approx(20e6), pytest.approx(0.02))  # 30 MB sent, 10 MB of them from the peer
    assert s["origin"] == (0.0, 0.0) and s["disk"] == (0.0, 0.0)
    links = LinkRates({"peer": 1.0, "origin": 7.0})
    links.observe(s)
    assert links.rates()["peer"] == pytest.approx(10e6) and links.rates()["origin"] == 7.0
    assert links.rates()["memory"] == pytest.approx(1e9)
    links.observe({"peer": (30e6, 1.0)})
    assert links.rates()["peer"] == pytest.approx(20e6)  # moving average
    links.observe({"peer": (1000.0, 1.0)})  # too little moved to tell
    assert links.rates()["peer"] == pytest.approx(20e6)


def test_engine_record_is_bounded_and_ages() -> None:
    rec = EngineRecord(max_tokens=3 * 256, max_age_s=10)
    keys = [bytes([i]) * 32 for i in range(5)]
    rec.add(keys[:3], 256, now=0.0)
    assert rec.leading(keys, now=1.0) == 3
    rec.add(keys[3:4], 256, now=1.0)  # the oldest goes
    assert rec.leading(keys, now=2.0) == 0 and rec.leading(keys[1:], now=2.0) == 3
    assert rec.leading(keys[1:], now=10.5) == 0  # key 1, 2 too old
    assert EngineRecord(0, 10).leading(keys, 0.0) == 0


def test_parse_completion_bodies_as_the_engine_tokenizes_them() -> None:
    tok = ByteTokenizer()
    ns = Namespace("default")
    p = parse_body(b'{"prompt": "hello", "stream": true}', "completions", tok, ns)
    assert p.tokens == tok.encode_prompt("hello") and p.stream and p.namespace == ns
    assert parse_body(b'{"prompt": [5, 6, 7]}', "completions", tok, ns).tokens == [5, 6, 7]
    assert parse_body(b'{"prompt": ["ab", "cd"]}', "completions", tok, ns).tokens == tok.encode_prompt("ab")
    assert parse_body(b'{"prompt": [[1, 2], [3]]}', "completions", tok, ns).tokens == [1, 2]
    for bad in (b'{"prompt": []}', b'{"prompt": [1, "a"]}', b'{"prompt": [-1]}', b'{"prompt": "x", "model": 3}',
                b'\xff\xfe', b'"just a string"'):
        with pytest.raises(InvalidInput):
            parse_body(bad, "completions", tok, ns)


def test_parse_chat_bodies_with_the_template() -> None:
    tok = ChatByteTokenizer()
    ns = Namespace("default")
    msgs = [{"role": "system", "content": "doc"}, {"role": "user", "content": "q"}]
    p = parse_body(b'{"messages": ' + str(msgs).replace("'", '"').encode() + b'}', "chat", tok, ns)
    assert p.tokens == chat_tokens(tok, msgs)
    parts = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}'
    assert parse_body(parts, "chat", tok, ns).tokens == chat_tokens(tok, [{"role": "user", "content": "a\nb"}])
    image = b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}'
    assert parse_body(image, "chat", tok, ns).tokens is None  # routed by load alone
    assert parse_body(b'{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}', "chat", tok, ns).tokens is None
    no_template = parse_body(b'{"messages": [{"role": "user", "content": "x"}]}', "chat", ByteTokenizer(), ns)
    assert no_template.tokens is None


def test_request_namespace_follows_the_connector() -> None:
    d = Namespace("default")
    assert request_namespace({}, d) == d
    assert request_namespace({"cache_salt": "acme"}, d) == Namespace("acme")
    assert request_namespace({"cache_salt": "acme:s1"}, d) == Namespace("acme", "s1")
    assert request_namespace({"cache_salt": "not a tenant!"}, d).tenant.startswith("salt-")
    assert request_namespace({"kv_transfer_params": {"kdn_tenant": "t", "kdn_salt": "s"}, "cache_salt": "x"}, d) == Namespace("t", "s")
    assert request_namespace({"kv_transfer_params": {"kdn": False}}, d) is None
    with pytest.raises(InvalidInput):
        request_namespace({"kv_transfer_params": [1]}, d)


def test_host_specs() -> None:
    h = parse_host("http://127.0.0.1:8001=127.0.0.1:7071")
    assert (h.url, h.edge, h.name) == ("http://127.0.0.1:8001", "127.0.0.1:7071", "127.0.0.1:8001")
    assert parse_host("https://gpu-3:8000/").edge is None
    with pytest.raises(ValueError, match="http"):
        parse_host("gpu-3:8000")
    with pytest.raises(ConfigError, match="differ"):
        RouteConfig.build({"hosts": [{"url": "http://a:1"}, {"url": "http://a:1"}]})
    with pytest.raises(ConfigError, match="hosts"):
        RouteConfig.build({"hosts": []})


def test_edge_counters_of_a_real_edge_give_peer_and_memory_rates() -> None:
    from kdn.transport import GrpcEdgeTransport
    from kdn.testing import InMemoryOverlay, InProcessEdge, make_chain
    from kdn.route.edges import GrpcEdgeView
    from kdn.wire.convert import FetchSpec

    async def go() -> None:
        chain = make_chain(3, shape=(2, 2, 256, 16))
        async with InMemoryOverlay(2, replicas=2) as overlay:
            for k, b in zip(chain.keys, chain.blobs):
                await overlay.nodes["e0"].put(b, namespace=chain.namespace, fingerprint=chain.fingerprint, key=k)
            edge = InProcessEdge(node=overlay.nodes["e1"])
            view = GrpcEdgeView("inproc:e1", channel=edge.channel())
            assert await view.locate(chain.fingerprint, chain.namespace, chain.keys, token=None, timeout=1) == ["peer"] * 3
            before = await view.counters(timeout=1)
            t = GrpcEdgeTransport("inproc:e1", channel=edge.channel(), bulk=False)
            for _ in range(2):  # first from the peer, then from its own memory
                for k in chain.keys:
                    async for _piece in t.fetch(FetchSpec(k, chain.fingerprint, chain.namespace), timeout=2):
                        pass
            after = await view.counters(timeout=1)
            s = link_samples(before, after)
            size = sum(len(b) for b in chain.blobs)
            assert s["peer"][0] == size and s["peer"][1] > 0
            assert s["memory"][0] == pytest.approx(size) and s["memory"][1] > 0
            assert await view.locate(chain.fingerprint, chain.namespace, chain.keys, token=None, timeout=1) == ["memory"] * 3
            await t.close()
            await view.close()

    asyncio.run(go())


def test_the_command_refuses_bad_flags_with_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    from kdn.ops.cli import main

    assert main(["route"]) == 2
    assert "--host" in capsys.readouterr().err
    assert main(["route", "--host", "gpu-3:8000"]) == 2
    assert "http" in capsys.readouterr().err
    assert main(["route", "--host", "http://a:1", "--policy", "fastest", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == "ConfigError" and "fastest" in out["message"]
    assert main(["route", "--host", "http://a:1", "--model", "/nonexistent/model", "--listen", "127.0.0.1:0"]) == 2
    assert "model" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "says"), [
    (["--host", "gpu-3:8000"], "http"),
    (["--host", "http://127.0.0.1:abc"], "http://127.0.0.1:abc"),  # a port that is no number
    (["--host", "http://127.0.0.1:70000"], "http://127.0.0.1:70000"),
    (["--host", "http://[::1:8000"], "http://[::1:8000"),
    (["--host", "http://a:1", "--listen", "127.0.0.1:99999"], "listen"),
    (["--host", "http://a:1", "--listen", ":8100"], "listen"),
])
def test_bad_host_urls_and_listen_addresses_are_one_line_before_anything_starts(
        flags: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kdn.ops.cli import main

    assert main(["route", "--model", "/nonexistent/model", *flags]) == 2  # refused before the model is looked at
    err = capsys.readouterr().err
    assert says in err and "model" not in err and len(err.strip().splitlines()) == 1, err
    assert main(["route", "--model", "/nonexistent/model", "--json", *flags]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == "ConfigError" and says in out["message"] and "\n" not in out["message"]
