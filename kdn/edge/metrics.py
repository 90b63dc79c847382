"""Prometheus metrics of one edge node: one registry per node, never the process-global one.

Counters the node bumps itself (hits/misses per tier, bytes in/out, upstream fetches by target
and outcome, coalesced requests, prefetches, refused requests) and a latency histogram per RPC
and source; store-side figures (evictions, bytes per tier, ...) are read from
``TieredStore.stats()`` at scrape time by a collector, so they are never stale or double-counted.
:meth:`EdgeMetrics.serve` exposes ``/metrics`` over HTTP on a port (0 = ephemeral).
"""

from __future__ import annotations

import hmac
import re
from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

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
        self.peer_bytes = Counter(
            "kdn_edge_peer_bytes", "artifact bytes exchanged with peer edges, by direction and path (grpc/direct/relayed)",
            ["direction", "path"], registry=r,
        )
        self._http = None
        self._thread = None
        self.port: int | None = None

    def attach_store(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self.registry.register(_StatsCollector(stats, self.node_id))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None) -> int:
        """Serve ``/metrics`` over HTTP; returns the bound port.

        The figures are the node's, all tenants together (see ``EdgeNode.stats``), so the endpoint
        binds to loopback by default (``EdgeConfig.metrics_host``); with ``token`` every scrape
        must send ``Authorization: Bearer <token>`` (else 401), for a scraper on another host."""
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from prometheus_client import CONTENT_TYPE_LATEST

        metrics = self
        expected = f"Bearer {token}".encode() if token else None

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if expected is not None:
                    got = (self.headers.get("Authorization") or "").encode()
                    if not hmac.compare_digest(got, expected):
                        self.send_response(401)
                        self.send_header("WWW-Authenticate", "Bearer")
                        self.end_headers()
                        return
                body = metrics.exposition()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self._http = Server((host, port), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, name=f"metrics-{self.node_id}", daemon=True)
        self._thread.start()
        self.port = int(self._http.server_address[1])
        return self.port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

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
