"""/metrics (node-wide figures, all tenants together) can require a bearer token."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from kdn.edge.config import EdgeConfig
from kdn.edge.metrics import EdgeMetrics


def _get(port: int, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_metrics_require_the_token_when_one_is_set() -> None:
    assert EdgeConfig().metrics_host == "127.0.0.1"  # loopback unless the operator says otherwise
    m = EdgeMetrics("m0")
    m.misses.inc()
    port = m.serve(EdgeConfig(metrics_port=0, metrics_token="scrape-secret"))
    try:
        for token in (None, "wrong", "scrape-secre"):
            assert _get(port, token)[0] == 401
        status, body = _get(port, "scrape-secret")
        assert status == 200 and "kdn_edge_misses_total 1.0" in body
    finally:
        m.close()
    open_metrics = EdgeMetrics("m1")
    port = open_metrics.serve(EdgeConfig(metrics_port=0))
    try:
        assert _get(port)[0] == 200  # no token configured: loopback scrapes as before
    finally:
        open_metrics.close()


@pytest.mark.parametrize("host", ["127.0.0.1"])
def test_config_takes_a_metrics_token(host: str) -> None:
    cfg = EdgeConfig.build({"metrics_host": host, "metrics_token": "t", "metrics_port": 0})
    assert cfg.metrics_token == "t"


def test_idle_connections_take_no_thread_and_go_and_scrapes_keep_working() -> None:
    """400 connections that never send a request (or only part of one): no thread each, at most
    ``max_connections`` kept (the oldest go), every one closed within ``timeout_s``; a scrape
    with the token is answered all along, one without it is refused."""
    import socket
    import threading
    import time

    m = EdgeMetrics("m2")
    port = m.serve(EdgeConfig(metrics_port=0, metrics_token="scrape-secret", metrics_max_connections=32,
                                metrics_timeout_s=1.0))
    idle: list[socket.socket] = []
    try:
        threads0 = threading.active_count()
        for i in range(400):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # half a request, never finished
            idle.append(s)
        time.sleep(0.3)
        assert threading.active_count() <= threads0 + 1, threading.active_count() - threads0
        assert _get(port, "scrape-secret")[0] == 200
        assert _get(port)[0] == 401
        assert m._http is not None and m._http.connections <= 32
        time.sleep(1.5)  # past timeout_s: the edge closed every idle one
        assert m._http.connections == 0
        for s in idle[-32:]:
            s.settimeout(2)
            assert s.recv(1) == b""
    finally:
        for s in idle:
            s.close()
        m.close()
