"""Prometheus metrics of one edge node: one registry per node, never the process-global one.

Counters the node bumps itself (hits/misses per tier, bytes in/out, upstream fetches by target
and outcome, coalesced requests, prefetches, refused requests) and a latency histogram per RPC
and source; store-side figures (evictions, bytes per tier, ...) are read from
``TieredStore.stats()`` at scrape time by a collector, so they are never stale or double-counted.
:meth:`EdgeMetrics.serve` exposes ``/metrics`` over HTTP on a port (0 = ephemeral).

The HTTP side (:class:`MetricsHttp`) is one thread running one event loop, whatever the number of
connections: requests are parsed by h11 (bounded to 16 KiB of head), a request must arrive whole
within ``timeout_s`` of the connection, at most ``max_connections`` are open (a new one past it
closes the oldest: a scraper sends its request at once, an idle connection is the first to go),
and every answer closes its connection. So idle or half-sent connections hold one file
descriptor each, for at most ``timeout_s``, and no thread: at most ``max_connections`` of them
(an evicted connection's socket is closed before the next one is accepted).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import socket
import threading
from typing import TYPE_CHECKING, Callable, Mapping

import h11

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kdn.edge.accept import Accepted, listen
from kdn.errors import InvalidInput

if TYPE_CHECKING:
    from kdn.edge.config import EdgeConfig

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_METRIC_NAME = re.compile(r"[^a-zA-Z0-9_]")


class _StatsCollector(Collector):
    """Exposes a ``stats()`` mapping as gauges ``kdn_edge_store_<name>``."""

    def __init__(self, stats: Callable[[], Mapping[str, float]], node_id: str) -> None:
        self._stats = stats
        self._node = node_id

    def collect(self):  # type: ignore[override]
        try:
            stats = dict(self._stats())
        except Exception:  # a scrape must never take the node down
            return
        for name, value in sorted(stats.items()):
            g = GaugeMetricFamily(f"kdn_edge_store_{_METRIC_NAME.sub('_', name)}", f"store stat {name}", labels=["node"])
            g.add_metric([self._node], float(value))
            yield g


class EdgeMetrics:
    """All metrics of one node, in their own registry."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.hits = Counter("kdn_edge_hits", "fetches served from a local tier", ["tier"], registry=r)
        self.misses = Counter("kdn_edge_misses", "fetches not in any local tier", registry=r)
        self.bytes_out = Counter("kdn_edge_bytes_out", "artifact bytes sent to clients", ["path"], registry=r)
        self.bytes_in = Counter("kdn_edge_bytes_in", "artifact bytes received (upstream or Put)", ["source"], registry=r)
        self.upstream = Counter(
            "kdn_edge_upstream_fetches", "fetches sent upstream", ["target", "outcome"], registry=r
        )
        self.coalesced = Counter("kdn_edge_coalesced_requests", "misses that joined an in-flight fetch", registry=r)
        self.prefetch = Counter("kdn_edge_prefetch", "background prefetches", ["outcome"], registry=r)
        self.refused = Counter("kdn_edge_refused", "requests refused", ["rpc", "reason"], registry=r)
        self.corrupt = Counter("kdn_edge_corrupt_upstream", "artifacts from upstream that failed verification", registry=r)
        self.tokenization_mismatch = Counter(
            "kdn_edge_tokenization_mismatch",
            "requests none of whose chunks are stored, but whose first chunk is, with the BOS token toggled: "
            "documents were ingested under another tokenization than the requests use", registry=r)
        self.latency = Histogram(
            "kdn_edge_rpc_seconds", "RPC latency", ["rpc", "source"], buckets=_LATENCY_BUCKETS, registry=r
        )
        # edges behind NAT (kdn.edge.rtc): WebRTC setup, direct vs relayed, bytes per path
        self.rtc_setup = Histogram(
            "kdn_edge_rtc_setup_seconds", "WebRTC connection setup (offer to open data channel)", ["path", "role"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.rtc_connections = Counter(
            "kdn_edge_rtc_connections", "WebRTC connections up, by path (direct/relayed) and role (dial/answer)",
            ["path", "role"], registry=r,
        )
        self.rtc_offers = Counter(
            "kdn_edge_rtc_offers", "WebRTC offers to this edge, answered or dropped (past its bounds)", ["outcome"],
            registry=r,
        )
        self.peer_bytes = Counter(
            "kdn_edge_peer_bytes", "artifact bytes exchanged with peer edges, by direction and path (grpc/direct/relayed)",
            ["direction", "path"], registry=r,
        )
        self._http: MetricsHttp | None = None
        self.port: int | None = None

    def attach_store(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self.registry.register(_StatsCollector(stats, self.node_id))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, config: "EdgeConfig") -> int:
        """Serve ``/metrics`` over HTTP as ``config`` says; returns the bound port.

        It listens on ``metrics_host``:``metrics_port`` (0 = ephemeral; None = off, refused here).
        The figures are the node's, all tenants together (see ``EdgeNode.stats``), so the endpoint
        binds to loopback by default (``EdgeConfig.metrics_host``); with ``metrics_token`` every
        scrape must send ``Authorization: Bearer <token>`` (else 401), for a scraper on another
        host. Bounds (``metrics_max_connections``, ``metrics_timeout_s``): see :class:`MetricsHttp`."""
        c = config
        if c.metrics_port is None:
            raise InvalidInput("metrics_port is None: /metrics is off")
        self._http = MetricsHttp(self.exposition, token=c.metrics_token, max_connections=c.metrics_max_connections,
                                 timeout_s=c.metrics_timeout_s, name=f"metrics-{self.node_id}")
        self.port = self._http.start(c.metrics_host, c.metrics_port)
        return self.port

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def counters(self) -> dict[str, float]:
        """Flat view for the Stats RPC: ``name{label=value}`` -> value."""
        out: dict[str, float] = {}
        for metric in self.registry.collect():
            if metric.name.startswith("kdn_edge_store_"):
                continue
            for s in metric.samples:
                if s.name.endswith(("_created", "_bucket")):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
        return out


class MetricsHttp:
    """``GET`` -> ``body()`` as Prometheus text, on one thread's event loop (see the module docstring)."""

    MAX_HEAD = 16 << 10

    def __init__(self, body: Callable[[], bytes], *, token: str | None, max_connections: int, timeout_s: float,
                 name: str = "metrics") -> None:
        self._body = body
        self._expected = f"Bearer {token}".encode() if token else None
        self.timeout_s = timeout_s
        self._name = name
        self._open = Accepted(max_connections, what=f"{name}: /metrics")  # one task per connection, oldest first
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> int:
        """Bind and serve from a thread of its own; returns the port (OSError when it cannot bind)."""
        sock = self._sock = listen(host, port)
        loop = self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
        self._thread.start()

        async def begin() -> None:
            self._accept = asyncio.get_running_loop().create_task(self._open.forever(sock, self._serve))

        asyncio.run_coroutine_threadsafe(begin(), loop).result(10)
        return int(sock.getsockname()[1])

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def shut() -> None:
            tasks = [t for t in (self._accept, *self._open.tasks.values()) if t is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shut(), loop).result(5)
        except Exception as exc:  # noqa: BLE001 - stopping: report, go on
            log.debug("%s: closing /metrics: %s", self._name, exc)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if not loop.is_running():
            loop.close()

    @property
    def connections(self) -> int:
        return len(self._open)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            http = h11.Connection(h11.SERVER, max_incomplete_event_size=self.MAX_HEAD)
            async with asyncio.timeout(self.timeout_s):
                request = await self._request(http, loop, conn)
                if request is not None:
                    await loop.sock_sendall(conn, self._answer(http, request))
        except (TimeoutError, OSError, h11.ProtocolError, asyncio.CancelledError):
            pass  # slow, gone, not HTTP, or evicted: nothing more to say
        finally:
            self._open.done(conn)
            conn.close()

    @staticmethod
    async def _request(http: h11.Connection, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> h11.Request | None:
        """The request, or None when the client closed first (or sent something else)."""
        while True:
            event = http.next_event()
            if isinstance(event, h11.Request):
                return event
            if event is not h11.NEED_DATA:
                return None  # ConnectionClosed: the client hung up first
            http.receive_data(await loop.sock_recv(conn, 4096))  # b"" at the end: then ConnectionClosed

    def _answer(self, http: h11.Connection, request: h11.Request) -> bytes:
        headers = dict(request.headers)
        body = b""
        extra: list[tuple[str, str]] = []
        if self._expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
            status, extra = 401, [("WWW-Authenticate", "Bearer")]
        elif request.method != b"GET":
            status, extra = 405, [("Allow", "GET")]
        else:
            from prometheus_client import CONTENT_TYPE_LATEST

            status, body = 200, self._body()
            extra = [("Content-Type", CONTENT_TYPE_LATEST)]
        out = http.send(h11.Response(status_code=status, headers=[
            *extra, ("Content-Length", str(len(body))), ("Connection", "close")]))
        if body:
            out += http.send(h11.Data(data=body))
        return out + http.send(h11.EndOfMessage())
