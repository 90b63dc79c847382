"""The router's core: for one request, ask every usable host's edge what it holds, price each host
(:func:`kdn.route.score.estimate`) and let the policy pick; keep hosts' health and rates fresh.

:meth:`Router.plan` is the scorer as a library call (no forwarding): the request's tokens give its
chunk keys once (:func:`kdn.keys.chunk_keys`); each host's edge gets one Lookup of them, then one of
the tail pieces after the chunks it holds (:func:`kdn.keys.piece_keys`), all hosts at once, each
under ``lookup_timeout_s`` (a late or failed edge counts as holding nothing, and the host stays
usable: its engine can still compute). The engine record (:class:`kdn.route.hosts.EngineRecord`)
adds what the router itself sent the host moments ago.

Background tasks, one per host: the health check (``/health``, then ``/v1/models`` to know it is
vLLM), the calibration probes when a host comes up, and the edge's counters every
``rates_interval_s`` (link rates). They stop with :meth:`Router.stop`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import httpx

from kdn.errors import KdnError, Unavailable
from kdn.keys import PIECE_TOKENS, ROOT_KEY, ChunkKey, ModelFingerprint, Namespace, chunk_keys, piece_keys
from kdn.prompts import Tokenizer
from kdn.route.config import HostSpec, RouteConfig
from kdn.route.edges import EdgeView, GrpcEdgeView
from kdn.route.hosts import EngineRecord, Host, InFlight
from kdn.route.openai import ParsedRequest
from kdn.route.policy import Candidate, make_policy
from kdn.route.rates import LinkRates, PrefillFit, link_samples
from kdn.route.score import Estimate, HostCost, Holdings, RequestShape, estimate

__all__ = ["Router", "Plan", "Chain"]

log = logging.getLogger("kdn.route")


class Chain:
    """One request's chain: its chunk keys, and tail-piece keys after any number of them."""

    def __init__(self, tokens: Sequence[int], fingerprint: ModelFingerprint, namespace: Namespace, chunk_size: int) -> None:
        self.tokens = list(tokens)
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.chunk_size = chunk_size
        limit = max(0, len(self.tokens) - 1)  # the chunks an engine asks for: up to its last prompt token
        keys = chunk_keys(self.tokens, fingerprint=fingerprint, namespace=namespace, chunk_size=chunk_size)
        self.keys: list[ChunkKey] = keys[: -(-limit // chunk_size)] if limit else []
        self._pieces: dict[int, list[ChunkKey]] = {}

    def pieces_after(self, n: int) -> list[ChunkKey]:
        """Keys of the tail pieces after the first ``n`` chunks, within the engine's limit."""
        got = self._pieces.get(n)
        if got is None:
            C = self.chunk_size
            limit = max(0, len(self.tokens) - 1)
            base = n * C
            got = [] if base >= limit else piece_keys(
                self.tokens[base:limit], after=self.keys[n - 1] if n else ROOT_KEY, fingerprint=self.fingerprint,
                namespace=self.namespace, chunk_size=C)
            self._pieces[n] = got
        return got


@dataclass(frozen=True, slots=True)
class Plan:
    """The policy's choice for one request and every candidate it weighed."""

    host: Host
    candidates: tuple[Candidate, ...]
    chosen: int
    shape: RequestShape
    chain: Chain | None
    cost: HostCost  # the chosen host's load and rates when it was chosen
    inflight: InFlight | None = None  # the reservation on ``host`` (None: only explained, not sent)

    @property
    def estimate(self) -> Estimate:
        return self.candidates[self.chosen].estimate

    def describe(self) -> dict[str, Any]:
        return {"host": self.host.name, "tokens": self.shape.tokens,
                "candidates": [{"host": c.name, "in_flight": c.in_flight, "chunks": list(c.holdings.chunks),
                                "pieces": list(c.holdings.pieces), "edge_error": c.holdings.error,
                                **c.estimate.as_dict()} for c in self.candidates]}


class Router:
    """Hosts, their state and the policy. ``clients``/``edges`` make a host's HTTP client and edge
    view (tests pass in-process ones); defaults: an ``httpx.AsyncClient`` and a gRPC view."""

    def __init__(
        self,
        config: RouteConfig,
        *,
        tokenizer: Tokenizer,
        fingerprint: ModelFingerprint,
        kv_bytes_per_token: int,
        clients: Callable[[HostSpec], httpx.AsyncClient] | None = None,
        edges: Callable[[HostSpec], EdgeView | None] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.kv_bytes_per_token = kv_bytes_per_token
        self.policy = make_policy(config.policy, tie_s=config.tie_s, tie_fraction=config.tie_fraction)
        self._make_client = clients or self._default_client
        self._make_edge = edges or self._default_edge
        self.hosts: list[Host] = []
        self.clients: dict[str, httpx.AsyncClient] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.counters: dict[str, float] = {
            "requests": 0, "forwarded": 0, "retried": 0, "bad_request": 0, "too_large": 0, "unauthorized": 0,
            "no_host": 0, "upstream_errors": 0, "lookups": 0}

    def _default_client(self, spec: HostSpec) -> httpx.AsyncClient:
        c = self.config
        timeout = httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        return httpx.AsyncClient(base_url=spec.url, timeout=timeout, limits=limits, trust_env=False)

    def _default_edge(self, spec: HostSpec) -> EdgeView | None:
        if not spec.edge:
            return None
        return GrpcEdgeView(spec.edge, token=self.config.edge_token, tls=self.config.edge_tls())

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, *, background: bool = True) -> None:
        c = self.config
        for spec in c.hosts:
            fit = PrefillFit(c.prior_s_per_token, bytes_per_token=self.kv_bytes_per_token)
            host = Host(spec, self._make_edge(spec), fit,
                        LinkRates(c.prior_link_bytes_per_s), EngineRecord(c.engine_record_tokens, c.engine_record_s))
            self.hosts.append(host)
            self.clients[host.name] = self._make_client(spec)
        if background:
            for host in self.hosts:
                self._tasks.append(asyncio.create_task(self._health_loop(host), name=f"health-{host.name}"))
                if host.edge is not None:
                    self._tasks.append(asyncio.create_task(self._rates_loop(host), name=f"rates-{host.name}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for client in self.clients.values():
            await client.aclose()
        for host in self.hosts:
            if host.edge is not None:
                await host.edge.close()

    # -- health, calibration, rates ------------------------------------------------------------

    async def check(self, host: Host) -> None:
        """One health check of ``host`` (what the loop runs every ``health_interval_s``)."""
        c = self.config
        client = self.clients[host.name]
        try:
            async with asyncio.timeout(c.health_timeout_s):
                r = await client.get("/health", headers=self.host_headers())
                if r.status_code != 200:
                    raise Unavailable(f"/health answered {r.status_code}")
                if host.status != "up":
                    r = await client.get("/v1/models", headers=self.host_headers())
                    model_id = _vllm_model(r)
        except TimeoutError:
            host.counters["health_failures"] += 1
            host.failed_check(f"no answer within {c.health_timeout_s:g}s", c.fail_after)
            return
        except (httpx.HTTPError, Unavailable) as exc:
            host.counters["health_failures"] += 1
            host.failed_check(f"{type(exc).__name__}: {exc}", c.fail_after)
            return
        except _NotVllm as exc:
            host.status, host.error = "not_vllm", str(exc)
            return
        if host.status != "up":
            host.model_id = model_id
            log.info("host %s is up (model %s)", host.name, model_id)
            host.status = "up"
            if not host.calibrated and c.calibrate_tokens:
                self._tasks.append(asyncio.create_task(self.calibrate(host), name=f"calibrate-{host.name}"))
        host.passed_check()

    async def _health_loop(self, host: Host) -> None:
        while True:
            await self.check(host)
            await asyncio.sleep(self.config.health_interval_s)

    async def calibrate(self, host: Host) -> None:
        """Probe ``host`` with prompts of ``calibrate_tokens`` fresh tokens (one warm-up first,
        not counted): each gives one prefill observation. KDN is off for them and their cache salt
        is fresh, so nothing is reused and nothing is stored."""
        host.calibrated = True
        for i, n in enumerate([2, *self.config.calibrate_tokens]):
            prompt = _fresh_prompt(self.tokenizer, n)
            body = {"model": host.model_id, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0,
                    "cache_salt": os.urandom(8).hex(), "kv_transfer_params": {"kdn": False}}
            try:
                ttft = await self._first_byte(host, body)
            except (httpx.HTTPError, TimeoutError, Unavailable) as exc:
                log.info("calibration of %s stopped: %s", host.name, exc)
                return
            if i:
                host.fit.observe(float(len(prompt)), ttft)

    async def _first_byte(self, host: Host, body: dict[str, Any]) -> float:
        client = self.clients[host.name]
        t0 = time.monotonic()
        async with asyncio.timeout(self.config.request_timeout_s):
            async with client.stream("POST", "/v1/completions", json=body, headers=self.host_headers()) as r:
                if r.status_code != 200:
                    raise Unavailable(f"probe answered {r.status_code}")
                ttft = None
                async for _ in r.aiter_raw():
                    if ttft is None:
                        ttft = time.monotonic() - t0
        return ttft if ttft is not None else time.monotonic() - t0

    async def read_rates(self, host: Host) -> None:
        """One reading of ``host``'s edge counters; the interval since the last feeds its link rates."""
        assert host.edge is not None
        try:
            cur = await host.edge.counters(timeout=self.config.health_timeout_s)
        except KdnError as exc:
            log.debug("edge %s counters unavailable: %s", host.spec.edge, exc)
            return
        if host.edge_counters is not None:
            host.links.observe(link_samples(host.edge_counters, cur))
        host.edge_counters = cur

    async def _rates_loop(self, host: Host) -> None:
        while True:
            await self.read_rates(host)
            await asyncio.sleep(self.config.rates_interval_s)

    def host_headers(self) -> dict[str, str]:
        key = self.config.host_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    # -- scoring -------------------------------------------------------------------------------

    def usable(self) -> list[Host]:
        return [h for h in self.hosts if h.usable]

    def cost_of(self, host: Host, now: float | None = None) -> HostCost:
        q = host.queued(now)
        return HostCost(host.fit.s_per_token, host.links.rates(), q.tokens, q.link_s, q.requests, host.fit.overhead_s,
                        load_s_per_byte=host.fit.load_s_per_byte, queued_load_bytes=q.load_bytes)

    async def holdings(self, host: Host, chain: Chain, token: str | None) -> Holdings:
        """What ``host`` holds of ``chain``: the engine record's leading run, then its edge's answer."""
        now = time.monotonic()
        keys = chain.keys
        engine = host.record.leading(keys, now)
        tiers: list[str] = []
        error = ""
        if host.edge is not None and keys:
            self.counters["lookups"] += 1
            tiers, error = await self._locate(host.edge, host, chain.namespace, keys, token)
        m = max(engine, len(tiers))
        chunks = ["engine"] * engine + tiers[engine:]
        pkeys = chain.pieces_after(m)
        e_pieces = host.record.leading(pkeys, now)
        p_tiers: list[str] = []
        if host.edge is not None and pkeys and not error and len(tiers) == m:
            p_tiers, error = await self._locate(host.edge, host, chain.namespace, pkeys, token)
        pieces = ["engine"] * e_pieces + p_tiers[e_pieces:]
        return Holdings(tuple(chunks), tuple(pieces), error)

    async def _locate(self, edge: EdgeView, host: Host, namespace: Namespace, keys: Sequence[ChunkKey],
                      token: str | None) -> tuple[list[str], str]:
        """``edge``'s tiers of the leading run of ``keys`` and "", or none and the error (counted at ``host``)."""
        timeout = self.config.lookup_timeout_s
        try:
            async with asyncio.timeout(timeout + 0.25):
                return await edge.locate(self.fingerprint, namespace, keys, token=token, timeout=timeout), ""
        except (KdnError, TimeoutError) as exc:
            host.counters["lookup_errors"] += 1
            return [], f"{type(exc).__name__}: {exc}"

    async def plan(self, req: ParsedRequest, *, token: str | None = None, exclude: Sequence[str] = (),
                   reserve: bool = True) -> Plan:
        """Choose the host for ``req`` (``token``: the caller's, used for the Lookups unless the
        router has its own edge token). Raises ``Unavailable`` when no host is up.

        ``reserve``: count the request at the chosen host at once (:attr:`Plan.inflight`; the
        caller ends it with ``plan.host.end``), between the prices and the pick with no await, so
        requests planned at the same moment each see the others' choices."""
        hosts = [h for h in self.usable() if h.name not in exclude]
        if not hosts:
            raise Unavailable("no inference host is up" if not exclude else "no other inference host is up")
        chain = None
        if req.tokens and req.namespace is not None:
            chain = Chain(req.tokens, self.fingerprint, req.namespace, self.config.chunk_size)
        shape = RequestShape(len(req.tokens or ()), self.config.chunk_size, PIECE_TOKENS, self.kv_bytes_per_token)
        lookup_token = self.config.edge_token or token
        if chain is not None and self.policy.needs_lookup:
            held = list(await asyncio.gather(*(self.holdings(h, chain, lookup_token) for h in hosts)))
        else:
            held = [Holdings() for _ in hosts]
        now = time.monotonic()
        costs = [self.cost_of(h, now) for h in hosts]
        cands = tuple(Candidate(h.name, len(h.active), hd, estimate(shape, hd, cost))
                      for h, hd, cost in zip(hosts, held, costs))
        i = self.policy.choose(cands)
        est = cands[i].estimate
        inflight = (hosts[i].begin(est.prefill_tokens, est.link_s, est.ttft_s, req.stream, est.load_bytes)
                    if reserve else None)
        return Plan(hosts[i], cands, i, shape, chain, costs[i], inflight)

    def remember(self, plan: Plan) -> None:
        """The chosen host will hold the request's chain in its engine: record its keys, and the
        tail pieces after its last two chunks (where a later request carrying the same document
        or conversation diverges)."""
        chain = plan.chain
        if chain is None:
            return
        now = time.monotonic()
        rec = plan.host.record
        rec.add(chain.keys, chain.chunk_size, now)
        n = len(chain.keys)
        for cut in {max(0, n - 1), n}:
            rec.add(chain.pieces_after(cut), PIECE_TOKENS, now)

    def observe_first_byte(self, plan: Plan, seconds: float) -> None:
        """A streamed answer's first byte came ``seconds`` after the request was sent."""
        plan.host.counters["first_bytes"] += 1
        ahead, est = plan.cost, plan.estimate
        x = ahead.queued_tokens + est.prefill_tokens
        y = seconds - est.link_s - ahead.queued_fetch_s  # the link time is the edges' measure; the rest is fitted
        plan.host.fit.observe(x, max(0.0, y), ahead.queued_requests + 1, ahead.queued_load_bytes + est.load_bytes)
        plan.host.predictions.observe(est.ttft_s, seconds, est.queue_s, est.fetch_s, est.prefill_s)

    def describe(self) -> dict[str, Any]:
        return {"policy": self.policy.name, "hosts": [h.describe() for h in self.hosts], "counters": dict(self.counters)}


class _NotVllm(Exception):
    pass


def _vllm_model(r: httpx.Response) -> str:
    """The first model id of a vLLM ``/v1/models`` answer; ``_NotVllm`` for anything else."""
    try:
        data = r.json()
        models = data["data"]
        assert isinstance(models, list) and models
        if not all(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in models):
            raise _NotVllm("its /v1/models does not list vLLM models (owned_by != 'vllm')")
        return str(models[0]["id"])
    except _NotVllm:
        raise
    except Exception as exc:
        raise _NotVllm(f"its /v1/models answered {r.status_code} without a model list: not a vLLM server") from exc


def _fresh_prompt(tok: Tokenizer, n: int) -> list[int]:
    """``n`` token ids nobody has sent before (from random text: real tokens of the vocabulary)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" ".join(os.urandom(4).hex() for _ in range(max(4, n // 4))))
    return ids[:n]
