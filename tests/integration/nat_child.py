"""Processes the NAT test (test_rtc_nat.py) and benchmarks/webrtc.py start inside the lab's namespaces.

    python -m tests.integration.nat_child origin STORE LISTEN TOKEN        prints {"event": "ready", "address": ...}
    python -m tests.integration.nat_child generate EDGE TOKEN TENANT PROMPT_SEED
    python -m tests.integration.nat_child metrics PORT

``generate``: greedy generation with the tiny model through the edge (reuse + write back) and
without it (recompute); prints one JSON line with the reused token count and whether outputs match.
"""

from __future__ import annotations

import json
import signal
import sys
import urllib.request

CHUNK = 64
CLUSTER_KEY = "nat-lab-cluster-key-1"  # the origin's and every edge's (signalling takes edge tokens only)


def _doc(seed: str) -> str:
    return "".join(f"Clause {i} of {seed}: the tenant keeps the premises in good repair and pays rent. " for i in range(10))


def origin(store: str, listen: str, token: str) -> None:
    from kdn.origin.config import OriginConfig
    from kdn.origin.server import OriginServer

    cfg = OriginConfig(store_dir=store, models=["tiny"], listen=listen, codecs=["raw"], chunk_size=CHUNK,
                       verify_on_start="none", fsync=False, tokens={token: ["*"]}, cluster_key=CLUSTER_KEY)
    srv = OriginServer(cfg)
    srv.start()
    print(json.dumps({"event": "ready", "address": srv.address}), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    srv.stop()


def generate(edge: str, token: str, tenant: str, seed: str) -> None:
    from kdn.client import ClientConfig, KdnClient
    from kdn.integrations.transformers import generate as gen
    from kdn.models import load_model

    lm = load_model("tiny", chunk_size=CHUNK)
    prompt = _doc(seed) + " Question: who keeps the premises in repair? Answer:"
    cfg = ClientConfig(edge=edge, token=token, tenant=tenant, lookup_timeout_s=30.0, fetch_timeout_s=30.0, shm="off")
    with KdnClient(cfg) as client:
        got = gen(lm, prompt, client=client, max_new_tokens=8)
    base = gen(lm, prompt, max_new_tokens=8)
    print(json.dumps({"reused_tokens": got.reused_tokens, "equal": got.tokens == base.tokens,
                      "warnings": list(got.warnings), "full": min(got.prompt_tokens // CHUNK * CHUNK, got.prompt_tokens - 1)}), flush=True)


def metrics(port: str) -> None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    print(json.dumps({"metrics": [ln for ln in text.splitlines() if ln.startswith("kdn_edge_") and not ln.startswith("kdn_edge_rpc_seconds_bucket")]}))


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"origin": origin, "generate": generate, "metrics": metrics}[cmd](*args)
