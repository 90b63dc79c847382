"""What a placement policy may use, and nothing more: :class:`Context`.

A policy (:mod:`kdn.simulator.delivery`) never sees the run that drives it. It gets a
:class:`Context` holding the run's inputs (the scenario's policy parameters, the topology, the
request stream), the clock and scheduler (the event loop), the immutable :class:`CostModel`, and
four small pieces of state, each with the only operations that change it:

* :class:`Network` — the egress links (FIFO or fair sharing) and the pooled TCP connections
  between sites; a transfer is predicted or committed, and a committed one is counted in the tally;
* :class:`Origin` — which chunks the origins hold; GPUs publish what they computed;
* :class:`GpuPool` — when each GPU replica of each edge is next free;
* the :class:`~kdn.simulator.tally.Tally`, fed only by :meth:`Context.finish` with a request's
  frozen :class:`~kdn.simulator.tally.Plan` and by :class:`Network` with committed transfers.

Caches are the policy's own (:meth:`Context.make_caches` builds them from the scenario).
A prediction and the commit that follows it agree, because nothing else is committed in between
(:mod:`kdn.simulator.links`). On a fair link a transfer committed later can still slow one already
there; a request's reported figures (TTFT, fetch time) follow its flows to the end: they are put
right once its flows have left their links (:meth:`Context.settle`). With ``gpu_replicas_per_edge``
the GPU replica is booked at the predicted time; a request whose data comes later starts later,
and the replica's booking is not moved (the next request's queueing is slightly under-counted).
"""

from __future__ import annotations

from collections import deque

from kdn.edge.eviction import make_policy
from kdn.simulator.cache import BoundedCache
from kdn.simulator.core import EventLoop
from kdn.simulator.cost import CostModel
from kdn.simulator.links import FairLinks, Flow, make_links
from kdn.simulator.scenario import NetworkSpec, PolicyParams, Scenario
from kdn.simulator.tcp import Connections, TcpModel
from kdn.simulator.tally import GB, Plan, Tally
from kdn.simulator.topology import Topology
from kdn.simulator.workload import TAIL_BASE, Requests

__all__ = ["Context", "GpuPool", "Network", "Origin"]


class Network:
    """Every site's egress link and the connections between sites. ``fetch_ready`` predicts
    (``commit=False``) or takes the link; each committed fetch's :class:`~kdn.simulator.links.Flow`
    and the seconds from its last byte leaving to its data at the GPUs go into :attr:`taken`, for
    the request being served to collect (:meth:`Context.finish`)."""

    __slots__ = ("cost", "links", "conns", "_tally", "_bw", "loop", "taken", "_advance", "_fair")

    def __init__(self, cost: CostModel, topo: Topology, tally: Tally, spec: NetworkSpec | None = None, loop: EventLoop | None = None) -> None:
        spec = spec if spec is not None else NetworkSpec()
        tcp = TcpModel(iw_segments=spec.initial_window_segments, streams=spec.streams, congestion_control=spec.congestion_control)
        self.cost = cost
        self.links = make_links(spec.link_sharing, topo.uplink_Bps, tcp)
        self.conns = Connections(tcp, spec.connections)
        self._bw = self.links.bw
        self._tally = tally
        self.loop = loop if loop is not None else EventLoop()
        self.taken: list[tuple[Flow, float]] = []
        self._advance = self.links.advance
        self._fair = isinstance(self.links, FairLinks)

    def fetch_ready(self, src: int, e: int, nblocks: int, now: float, commit: bool) -> float:
        """When ``nblocks`` chunks from site ``src`` are decoded at edge ``e``'s GPUs, as predicted
        now: request latency, (a handshake on a new connection,) the link's share and the
        connection's window rounds on ``src``'s link, propagation, decode."""
        lat, nbytes, decode_s = self.cost.transfer(e, src, nblocks)
        rtt = 2.0 * lat
        links = self.links
        self._advance(src, self.loop.now)
        if commit:
            cold, cwnd, conn = self.conns.take(src, e, now + lat, rtt, now)
            sent = links.commit(src, now + lat, nbytes, rtt, cwnd, cold)
            flow = links.last
            assert flow is not None
            self.conns.hold(conn, nbytes, rtt, flow.rate, cwnd, flow)
            if self._fair:
                self.taken.append((flow, lat + decode_s))
            self._tally.moved(nbytes, self.cost.is_wan[e][src], now)
        else:
            cold, cwnd = self.conns.state(src, e, now + lat, rtt, now)
            sent = links.finish(src, now + lat, nbytes, rtt, cwnd, cold)
        return sent + lat + decode_s

    def send(self, e: int, dst: int, nblocks: int, now: float) -> None:
        """Edge ``e`` uploads ``nblocks`` chunks to site ``dst`` (publish / fill): its bytes take
        their share of ``e``'s link from ``now``. No one waits on an upload, so its own window is
        not modelled (nor its connection): only the capacity it takes from the fetches beside it."""
        if nblocks <= 0 or dst == e:
            return
        _, nbytes, _ = self.cost.transfer(e, dst, nblocks)
        self._advance(e, self.loop.now)
        self.links.commit(e, now, nbytes, predict=False)
        self._tally.moved(nbytes, self.cost.is_wan[e][dst], now)

    def settle(self) -> None:
        """Run every link until its last flow has left (every Flow's finish is then known)."""
        self.links.settle()


class Origin:
    """The origins, replicas of one store: a chunk published at one is at all. With
    ``preloaded``, every non-tail chunk of the workload is there from the start."""

    __slots__ = ("preloaded", "published", "nearest", "publishing", "net")

    def __init__(self, reqs: Requests, topo: Topology, net: Network, *, publishing: bool) -> None:
        self.preloaded = reqs.origin_preloaded
        self.published: set[int] = set()
        self.nearest: list[int] = topo.nearest_origin.tolist()  # each edge's origin site
        self.publishing = publishing
        self.net = net

    def has(self, key: int) -> bool:
        return (self.preloaded and key < TAIL_BASE) or key in self.published

    def leading_run(self, keys: list[int], start: int) -> int:
        """How many chunks from ``keys[start]`` on the origin holds, leading run."""
        k = 0
        pre = self.preloaded
        pub = self.published
        for key in keys[start:] if start else keys:
            if (pre and key < TAIL_BASE) or key in pub:
                k += 1
            else:
                break
        return k

    def publish(self, e: int, keys: list[int], now: float) -> None:
        """GPUs of edge ``e`` computed ``keys``: upload the ones the origin lacks."""
        if not self.publishing or not keys:
            return
        pub = self.published
        pre = self.preloaded
        new = [k for k in keys if not ((pre and k < TAIL_BASE) or k in pub)]
        if new:
            pub.update(new)
            self.net.send(e, self.nearest[e], len(new), now)


class GpuPool:
    """When each GPU replica of each edge is next free; ``replicas=None``: unlimited, no queueing."""

    __slots__ = ("free",)

    def __init__(self, n_edges: int, replicas: int | None) -> None:
        self.free: list[list[float]] | None = None if replicas is None else [[0.0] * replicas for _ in range(n_edges)]

    def next_free(self, e: int) -> float:
        """When the earliest-free replica of edge ``e`` is free (-inf: unlimited pool)."""
        return float("-inf") if self.free is None else min(self.free[e])

    def run(self, e: int, ready: float, busy_s: float) -> float:
        """Run ``busy_s`` seconds of work whose data is there at ``ready`` on edge ``e``'s
        earliest-free replica (FIFO); returns when it starts."""
        if self.free is None:
            return ready
        free = self.free[e]
        k = free.index(min(free))
        start = free[k] if free[k] > ready else ready
        free[k] = start + busy_s
        return start


class Context:
    """Everything a placement policy uses (see the module docstring)."""

    __slots__ = (
        "params", "topo", "reqs", "loop", "cost", "net", "origin", "gpus", "_tally", "decision",
        "edge_of", "tokens_of", "key_off", "keys", "_cache_spec", "_capacity", "_late", "_since_flush",
    )

    def __init__(self, sc: Scenario, topo: Topology, reqs: Requests, cost: CostModel, loop: EventLoop, tally: Tally) -> None:
        self.params: PolicyParams = sc.params
        self.topo = topo
        self.reqs = reqs
        self.loop = loop
        self.cost = cost
        self._tally = tally
        self.net = Network(cost, topo, tally, sc.network, loop)
        self.origin = Origin(reqs, topo, self.net, publishing=sc.params.publish_to_origin)
        self.gpus = GpuPool(topo.n_edges, sc.gpu_replicas_per_edge)
        self.decision = sc.params.decision
        # per-request inputs as Python lists (cheap indexing in the hot loop)
        self.edge_of: list[int] = reqs.edge.tolist()
        self.tokens_of: list[int] = reqs.input_tokens.tolist()
        self.key_off: list[int] = reqs.key_off.tolist()
        self.keys = reqs.keys
        self._cache_spec = sc.cache
        self._capacity = int(sc.cache.edge_cache_gb * GB)
        # requests whose figures wait for their flows to leave a fair link, in arrival order:
        # (tally index, plan, edge-part flows, origin flow or None, serve_s, gpu free at commit, booked start)
        self._late: deque[tuple] = deque()
        self._since_flush = 0

    @property
    def capacity(self) -> int:
        """Bytes each edge cache holds."""
        return self._capacity

    def make_caches(self, *, whole_chains: bool = True) -> list[BoundedCache]:
        """One byte-budget cache per edge, driven by the scenario's ``kdn.edge.eviction`` policy.
        ``whole_chains=False``: an edge holds scattered chunks of each chain (consistent hashing),
        so the prefix-aware policy must not treat a chunk whose parent lives elsewhere as dead."""
        name = self._cache_spec.eviction
        return [BoundedCache(self._capacity, make_policy(name, whole_chains=whole_chains)) for _ in range(self.topo.n_edges)]

    def request(self, i: int) -> tuple[float, int, int, list[int]]:
        """Request ``i``, arriving now: ``(now, edge, input tokens, chunk keys in chain order)``.
        Starts the request: the transfers it commits from here on are its own."""
        self.net.taken.clear()
        return self.loop.now, self.edge_of[i], self.tokens_of[i], self.chain(i)

    def chain(self, i: int) -> list[int]:
        """Request ``i``'s chunk keys, in chain order."""
        off = self.key_off
        return self.keys[off[i] : off[i + 1]].tolist()

    def choose(self, now: float, e: int, n_in: int, keys: list[int], h: int, edge_ready: float) -> tuple[bool, int, bool]:
        """Apply the fetch-or-recompute rule to a request at edge ``e`` whose ``h`` leading
        chunks edges hold (at the GPUs at ``edge_ready``), followed by the origin's leading run.
        Returns ``(use_edges, origin_offered, take_origin)``; nothing is committed. For layer
        pipelining the edges' part flows in from the request on (a peer's round trip included:
        a slight overestimate of its span), the origin's from one round trip after it."""
        k2 = self.origin.leading_run(keys, h) if h < len(keys) else 0
        ready: list[float] = []
        sizes: list[int] = []
        spans: list[float] = []
        if h:
            ready.append(edge_ready)
            sizes.append(h)
            spans.append(edge_ready - now)
        if k2:
            src = self.origin.nearest[e]
            t2 = self.net.fetch_ready(src, e, k2, now, False)
            ready.append(t2)
            sizes.append(k2)
            spans.append(self._origin_span(e, src, now, t2))
        m = self.cost.best_prefix(self.decision, now, self.gpus.next_free(e), n_in, ready, sizes, spans)
        return m >= 1 and h > 0, k2, k2 > 0 and m == len(sizes)

    def finish(self, plan: Plan) -> None:
        """Commit the origin part of ``plan``, run its prefill on the edge's GPUs, count it.

        Its figures are counted as predicted now; on a fair link, flows that join later can still
        slow its transfers, so a request with flows on one is kept (:attr:`_late`) and its TTFT
        and fetch time are put right once they have left (:meth:`settle`)."""
        e = plan.edge
        ready = plan.edge_ready
        span = ready - plan.arrival
        taken = self.net.taken
        edge_flows = tuple(taken) if taken else ()
        taken.clear()
        origin_flow = None
        if plan.origin:
            src = self.origin.nearest[e]
            t2 = self.net.fetch_ready(src, e, plan.origin, plan.arrival, True)
            if taken:
                origin_flow = (taken[0][0], t2)
                taken.clear()
            if t2 > ready:
                ready, span = t2, self._origin_span(e, src, plan.arrival, t2)
        cost = self.cost
        serve_s = cost.serve_s(plan.local + plan.peer + plan.origin, plan.tokens)
        gpus = self.gpus
        gpu_free = gpus.next_free(e)
        fetch_s = ready - plan.arrival
        if cost.pipelined:  # prefill starts before the last layer is in (never before a GPU is free)
            ready -= cost.overlap(span, serve_s - cost.first_token_s, ready, gpu_free)
        start = ready if gpus.free is None else gpus.run(e, ready, serve_s)
        k = self._tally.add(plan, start, serve_s, cost.serve_s(0, plan.tokens), fetch_s)
        if k >= 0 and (edge_flows or origin_flow is not None):
            self._late.append((k, plan, edge_flows, origin_flow, serve_s, gpu_free, start if gpus.free is not None else None))
        self._since_flush += 1
        if self._since_flush >= 8192:
            self._flush(self.loop.now)

    def _flush(self, now: float, final: bool = False) -> None:
        """Put right the figures of the late requests whose flows have all left (all of them
        when ``final``), oldest first."""
        self._since_flush = 0
        late = self._late
        if not late:
            return
        if not final:
            advance = self.net.links.advance
            for site in range(len(self.net.links.bw)):
                advance(site, now)
        cost = self.cost
        fix = self._tally.fix
        while late:
            k, plan, edge_flows, origin_flow, serve_s, gpu_free, booked = late[0]
            if not final and (any(f.finish is None for f, _ in edge_flows) or (origin_flow is not None and origin_flow[0].finish is None)):
                break
            late.popleft()
            arrival = plan.arrival
            edge_ready = plan.edge_ready
            for f, to_gpus in edge_flows:
                if f.finish is not None and f.finish + to_gpus > edge_ready:
                    edge_ready = f.finish + to_gpus
            ready, span = edge_ready, edge_ready - arrival
            if origin_flow is not None:
                f, t2 = origin_flow
                t2 += f.delay
                if t2 > ready:
                    ready, span = t2, self._origin_span(plan.edge, self.origin.nearest[plan.edge], arrival, t2)
            fetch_s = ready - arrival
            if cost.pipelined:
                ready -= cost.overlap(span, serve_s - cost.first_token_s, ready, gpu_free)
            start = booked if booked is not None and booked > ready else ready
            fix(k, start - arrival + serve_s, fetch_s)

    def settle(self) -> None:
        """The run is over: let every link run out and put every late request's figures right."""
        self.net.settle()
        self._flush(self.loop.now, final=True)

    def _origin_span(self, e: int, src: int, now: float, ready: float) -> float:
        """How long an origin fetch's data flows in: from its first bytes (a round trip after the
        request, at the earliest) to ``ready``."""
        first = now + 2.0 * self.cost.lat[e][src]
        return ready - first if ready > first else 0.0
