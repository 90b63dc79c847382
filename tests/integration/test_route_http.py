"""``kdn route`` over real HTTP on loopback: two ``kdn edge`` processes that are peers, two fake
vLLM hosts (``python -m tests.route_fakes``: the OpenAI surface over a real KDN client, a prefill
that costs time) and one that is not vLLM, the router as its own process.

One setup serves every check (each process costs seconds to start on a 2-core machine): the
document's requests go to the host whose edge holds it and spill to the other under a burst,
which fetches from the peer edge (its Stats say so); streaming passes through; bad input gets
JSON errors while the router keeps serving; a killed host is taken out within the bounded time
and its requests go elsewhere; a restarted router routes as before (it keeps no state it cannot
rebuild).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.children import ready_line

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
C = 64
_POLICY = ("The lease runs for twelve months from the first of March. Rent is due on the fifth of each month and is "
           "paid by standing order. Bins are emptied on Mondays and Thursdays; the recycling goes out on alternate "
           "Fridays. The garden is shared with the ground-floor flat and must be kept tidy. Pets need the landlord's "
           "written consent. Notice is two months for either side, given in writing. ")
DOC = "".join(f"Section {i}. {_POLICY}" for i in range(5))  # ~500 tokens: ~2 s of fake prefill


class Proc:
    """A child process whose first stdout line is a JSON ready event."""

    def __init__(self, args: list[str], timeout: float = 90.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            self.ready: dict[str, Any] = ready_line(self.proc, str(args[:4]), timeout)
        except TimeoutError as exc:
            err = self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else ""
            raise RuntimeError(f"{exc}: {err}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def kdn(*args: str) -> list[str]:
    return [sys.executable, "-m", "kdn.ops.cli", *args]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    from kdn.pretrained import model_dir

    model = str(model_dir("smollm2-135m"))
    tmp = tmp_path_factory.mktemp("route")
    peers = tmp / "peers.json"
    peers.write_text("{}")
    procs: list[Proc] = []
    try:
        edges = []
        for nid in ("a", "b"):
            p = Proc(kdn("edge", "--listen", "127.0.0.1:0", "--node-id", nid, "--peers-file", str(peers), "--refresh-s",
                         "0.2", "--replicas", "2", "--memory-bytes", "256MiB"))
            procs.append(p)
            edges.append(p.ready["address"])
        peers.write_text(json.dumps({"a": edges[0], "b": edges[1]}))
        hosts = []
        for edge in edges:
            p = Proc([sys.executable, "-m", "tests.route_fakes", "--edge", edge, "--model", model, "--chunk-size", str(C),
                      "--s-per-token", "0.004"])
            procs.append(p)
            hosts.append(p)
        other = Proc([sys.executable, "-m", "tests.route_fakes", "--model", model, "--owned-by", "someone-else"])
        procs.append(other)
        config = tmp / "route.yaml"
        # lookups get a generous deadline: a late edge counts as holding nothing, and a loaded CI
        # machine must not turn the routing checks below into timeout checks
        config.write_text(json.dumps({"health_interval_s": 0.3, "fail_after": 2, "health_timeout_s": 1.0,
                                      "rates_interval_s": 0.5, "lookup_timeout_s": 3.0,
                                      "calibrate_tokens": [16, 200], "max_body_bytes": 65536,
                                      "prior_link_bytes_per_s": {"memory": 1e9, "disk": 1e8, "peer": 5e7, "origin": 1e6}}))
        time.sleep(0.5)  # the edges re-read the peers file
        router_args = kdn("route", "--listen", "127.0.0.1:0", "--model", model, "--chunk-size", str(C), "--config",
                          str(config), "--host", f"{hosts[0].ready['url']}={edges[0]}",
                          "--host", f"{hosts[1].ready['url']}={edges[1]}", "--host", other.ready["url"], "--json")
        router = Proc(router_args)
        procs.append(router)
        yield {"router": router, "router_args": router_args, "hosts": hosts, "edges": edges, "other": other,
               "model": model, "procs": procs}
    finally:
        for p in reversed(procs):
            p.stop()


def url(cluster: dict[str, Any]) -> str:
    return f"http://{cluster['router'].ready['address']}"


def stats(cluster: dict[str, Any]) -> dict[str, Any]:
    return httpx.get(url(cluster) + "/route/stats", timeout=5).json()


def wait_for(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def edge_counters(address: str) -> dict[str, float]:
    from kdn.edge.admin import EdgeClient

    client = EdgeClient(address)
    try:
        return client.stats().counters
    finally:
        client.close()


def complete(cluster: dict[str, Any], prompt: str, **body: Any) -> httpx.Response:
    return httpx.post(url(cluster) + "/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 4,
                                                              **body}, timeout=60)


def why(plan: dict[str, Any], cluster: dict[str, Any]) -> str:
    """What a routing assertion needs to be read: the plan's candidates and each host's state."""
    lines = [f"explain chose {plan['host']}"]
    for c in plan["candidates"]:
        lines.append(f"  {c['host']}: ttft {c['ttft_s']:.3f}s queue {c['queue_s']:.3f} fetch {c['fetch_s']:.3f} "
                     f"prefill {c['prefill_s']:.3f} chunks {c['chunks']} edge_error {c['edge_error']!r}")
    for h in stats(cluster)["hosts"]:
        lines.append(f"  {h['name']} {h['status']} {h['error']!r} prefill {h['prefill']} links {h['links']} "
                     f"counters {h['counters']}")
    return "\n".join(lines)


def test_routing_over_http(cluster: dict[str, Any]) -> None:
    hosts, edges = cluster["hosts"], cluster["edges"]
    names = [h.ready["url"].removeprefix("http://") for h in hosts]
    wait_for(lambda: [h["status"] for h in stats(cluster)["hosts"]] == ["up", "up", "not_vllm"], 30, "hosts up")
    s = stats(cluster)
    assert "vLLM" in s["hosts"][2]["error"]
    wait_for(lambda: all(h["prefill"]["observations"] >= 2 for h in stats(cluster)["hosts"][:2]), 30, "calibrated")
    # the document, computed once by host 0 itself: its edge holds it
    r = httpx.post(hosts[0].ready["url"] + "/v1/completions", json={"prompt": DOC, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200
    probe = {"prompt": DOC + " When are the bins emptied?"}
    wait_for(lambda: httpx.post(url(cluster) + "/route/explain/completions", json=probe, timeout=10).json()
             ["candidates"][0]["local_tokens"] > 0, 10, "host 0's edge holds the document")
    for q in range(3):
        prompt = DOC + f" Question {q}: when are the bins emptied?"
        plan = httpx.post(url(cluster) + "/route/explain/completions", json={"prompt": prompt}, timeout=10).json()
        r = complete(cluster, prompt)
        assert r.status_code == 200 and r.headers["x-kdn-route-host"] == names[0], why(plan, cluster)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(url(cluster) + "/v1/completions", json={
                "model": "fake-model", "prompt": DOC + f" Burst question {q}?", "max_tokens": 4}) for q in range(8)))

    before = edge_counters(edges[1])
    plan = httpx.post(url(cluster) + "/route/explain/completions", json={"prompt": DOC + " Burst?"}, timeout=10).json()
    assert [c["chunks"][:1] for c in plan["candidates"]] == [["engine"], ["peer"]]
    where = [r.headers["x-kdn-route-host"] for r in asyncio.run(burst())]
    assert names[1] in where and names[0] in where, (where, why(plan, cluster))
    after = edge_counters(edges[1])
    peer_ok = "kdn_edge_upstream_fetches_total{outcome=ok,target=peer}"
    assert after.get(peer_ok, 0) - before.get(peer_ok, 0) >= 4
    assert after.get("kdn_edge_bytes_in_total{source=peer}", 0) > before.get("kdn_edge_bytes_in_total{source=peer}", 0)
    counters = httpx.get(hosts[1].ready["url"] + "/fake/counters", timeout=5).json()
    assert counters["reused_chunks"] >= 4 and counters["computed_tokens"] < counters["requests"] * C
    # the edges' counters measured link rates (no longer the priors)
    wait_for(lambda: "peer" in stats(cluster)["hosts"][1]["links"]["measured"], 10, "peer link measured")

    # streaming passes through, chunk by chunk
    with httpx.stream("POST", url(cluster) + "/v1/completions", json={"prompt": "stream it", "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = b"".join(r.iter_raw()).decode()
    assert text.rstrip().endswith("data: [DONE]")

    # bad input: JSON errors, no host reached, the router keeps serving
    n_before = [httpx.get(h.ready["url"] + "/fake/counters", timeout=5).json()["requests"] for h in hosts]
    for body, status in ((b"{nope", 400), (b'{"prompt": 5}', 400), (b'{"prompt": "' + b"y" * 70000 + b'"}', 413)):
        r = httpx.post(url(cluster) + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=10)
        assert r.status_code == status and r.json()["error"]["code"] == status
    assert httpx.get(url(cluster) + "/v2/nothing", timeout=5).status_code == 404
    n_after = [httpx.get(h.ready["url"] + "/fake/counters", timeout=5).json()["requests"] for h in hosts]
    assert n_after == n_before
    assert complete(cluster, "still serving").status_code == 200

    # a host killed: out within health_interval x fail_after + timeouts; nothing is lost meanwhile
    hosts[1].kill()
    t0 = time.monotonic()
    results = [complete(cluster, f"while host 1 dies {q}") for q in range(6)]
    assert all(r.status_code == 200 and r.headers["x-kdn-route-host"] == names[0] for r in results)
    wait_for(lambda: stats(cluster)["hosts"][1]["status"] == "down", 5, "host 1 taken out")
    assert time.monotonic() - t0 < 0.3 * 2 + 1.0 * 2 + 1.0

    # the router restarted: it learns its hosts again and routes the document where it is held
    router = cluster["router"]
    router.stop()
    assert router.proc.returncode == 0
    cluster["router"] = restarted = Proc(cluster["router_args"])
    cluster["procs"].append(restarted)
    wait_for(lambda: stats(cluster)["hosts"][0]["status"] == "up", 20, "host 0 up after the restart")
    r = complete(cluster, DOC + " After the restart: when is rent due?")
    assert r.status_code == 200 and r.headers["x-kdn-route-host"] == names[0]
    plan = httpx.post(url(cluster) + "/route/explain/completions", json=probe, timeout=10).json()
    assert plan["candidates"][0]["chunks"][:4] == ["memory"] * 4 or plan["candidates"][0]["chunks"][:4] == ["engine"] * 4
