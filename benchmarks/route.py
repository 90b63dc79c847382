"""KV-aware routing: round-robin vs prefix-overlap vs KDN's cost score, in front of real vLLM hosts.

    .venv/bin/python benchmarks/route.py [--rounds 2] [--workloads prefix chat] [--prefix-len 1024] ...

Two ``vllm serve`` engines of the trained model (``smollm2-135m``, fp32) with ``KdnConnector``, each
beside its own ``kdn edge``; the two edges are peers of one overlay (replicas 2), so a document one
host computed and wrote back can be fetched by the other from its peer. One ``kdn route`` per
policy in front of both hosts. Per round, every workload runs once against each router, the
policies' order rotating from round to round; each run has fresh random documents (its own seed),
so no run reuses another's KV. Workloads, from outside the router:

- ``prefix``: ``vllm bench serve --dataset-name prefix_repetition`` (streamed completions;
  ``num_prefixes`` documents of ``prefix_len`` random tokens, each followed by ``suffix_len`` new
  ones), Poisson arrivals at ``--rate``;
- ``hot``: the same generator with one document every request shares, at ``--hot-rate`` (more
  requests than one host serves in time): the document's holder saturates unless the router
  moves requests to the other host, which fetches the document's KV from its peer edge;
- ``chat``: ``--conversations`` concurrent multi-turn chats (streamed chat completions; a
  ``--chat-doc-tokens`` system document, then ``--turns`` user turns, each answered with
  ``--chat-output`` tokens that become part of the next turn's history).

TTFT is measured by the workload generator (first streamed token); throughput is completed
requests per second of the run. Ratios (cost vs prefix-overlap, cost vs round-robin, of the mean
TTFT) are taken per round, reported as medians with the range. Engines are pinned to one core each
(``VLLM_CPU_OMP_THREADS_BIND``) on this 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VLLM_BIN = ROOT / ".venv-vllm" / "bin"
KDN = Path(sys.executable).with_name("kdn")
POLICIES = ("round_robin", "prefix_overlap", "cost")
WORKLOADS = ("prefix", "hot", "chat")
CHUNK = 256

METHOD = """Two `vllm serve` engines of the trained model (smollm2-135m, fp32, one CPU core each) with
KdnConnector, each beside its own `kdn edge`; the edges are peers (replicas 2), so KV one host wrote
back can be fetched by the other. One `kdn route` per policy (round_robin, prefix_overlap: the
longest run held on the host; cost: expected TTFT from queue, measured prefill rate, and fetch at
measured link rates or recompute) in front of both. Per round each workload runs once per router,
the policies' order rotating; every run draws fresh documents. Workloads come from outside the
router: `vllm bench serve --dataset-name prefix_repetition` (Poisson arrivals, streamed
completions; "hot": one document shared by every request, faster than one host serves) and a
multi-turn chat driver (concurrent conversations, each turn's answer part of the
next turn's history, streamed). TTFT is the client's (first token); ratios of mean TTFT are taken
per round; medians over rounds with the range."""


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready_line(proc: subprocess.Popen[str], what: str, timeout: float = 120.0) -> dict[str, Any]:
    assert proc.stdout is not None
    t0 = time.monotonic()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} exited with {proc.wait(10)} before it was ready ({time.monotonic() - t0:.0f} s)")
    return json.loads(line)


def _stop(proc: subprocess.Popen[Any], group: bool = False) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM) if group else proc.terminate()
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
        proc.wait(10)


class Fleet:
    """Edges, engines and one router per policy; everything stopped by :meth:`close`."""

    def __init__(self, args: argparse.Namespace, tmp: Path, model: Path) -> None:
        self.tmp, self.model, self.args = tmp, model, args
        self.procs: list[tuple[subprocess.Popen[Any], bool]] = []
        self.edges: list[str] = []
        self.hosts: list[str] = []
        self.routers: dict[str, str] = {}
        self.start_s: dict[str, float] = {}
        self.learnt: list[dict[str, Any]] = []  # the cost router's fitted rates per host, read at the end

    def spawn(self, cmd: list[str], *, group: bool = False, log: Path | None = None, env: dict[str, str] | None = None,
              ) -> subprocess.Popen[Any]:
        out: Any = subprocess.PIPE if log is None else log.open("w")
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL, text=True,
                             cwd=self.tmp, env=env or os.environ.copy(), start_new_session=group)
        self.procs.append((p, group))
        return p

    def start(self) -> None:
        a = self.args
        peers = self.tmp / "peers.json"
        peers.write_text("{}")
        for i in range(2):
            p = self.spawn([str(KDN), "edge", "--listen", "127.0.0.1:0", "--node-id", f"e{i}", "--peers-file", str(peers),
                            "--refresh-s", "0.5", "--replicas", "2", "--memory-bytes", a.edge_memory])
            self.edges.append(_ready_line(p, f"edge {i}")["address"])
        peers.write_text(json.dumps({f"e{i}": addr for i, addr in enumerate(self.edges)}))
        serves = []
        t0 = time.monotonic()
        for i, edge in enumerate(self.edges):
            port = _free_port()
            ktc = {"kv_connector": "KdnConnector", "kv_connector_module_path": "kdn.integrations.vllm",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"edge": edge, "chunk_size": CHUNK}}
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": a.kv_space, "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
            cmd = [str(VLLM_BIN / "vllm"), "serve", str(self.model), "--dtype", "float32", "--max-model-len",
                   str(a.max_model_len), "--enforce-eager", "--port", str(port), "--host", "127.0.0.1",
                   "--kv-transfer-config", json.dumps(ktc), "--disable-log-stats"]
            serves.append((self.spawn(cmd, group=True, log=self.tmp / f"serve{i}.log", env=env), f"http://127.0.0.1:{port}"))
        for i, (p, url) in enumerate(serves):
            deadline = time.monotonic() + 1200
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"vllm serve {i} exited: " + (self.tmp / f"serve{i}.log").read_text()[-4000:])
                try:
                    urllib.request.urlopen(url + "/health", timeout=5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"vllm serve {i} did not answer /health in 1200 s") from None
                    time.sleep(3)
            self.hosts.append(url)
        self.start_s["engines"] = time.monotonic() - t0
        hosts = [f"{u}={e}" for u, e in zip(self.hosts, self.edges)]
        for policy in a.policies:
            cmd = [str(KDN), "route", "--listen", "127.0.0.1:0", "--model", str(self.model), "--dtype", "float32",
                   "--chunk-size", str(CHUNK), "--policy", policy, "--json"]
            for h in hosts:
                cmd += ["--host", h]
            p = self.spawn(cmd, log=None)
            self.routers[policy] = "http://" + _ready_line(p, f"router {policy}")["address"]
        t1 = time.monotonic()
        for policy, url in self.routers.items():  # up, and calibrated (its probes answered)
            while True:
                st = _get(url + "/route/stats")
                if all(h["status"] == "up" and h["prefill"]["observations"] >= 2 for h in st["hosts"]):
                    break
                if time.monotonic() - t1 > 600:
                    raise RuntimeError(f"router {policy} not calibrated in 600 s: {st}")
                time.sleep(1)
        self.start_s["calibration"] = time.monotonic() - t1

    def close(self) -> None:
        for p, group in reversed(self.procs):
            _stop(p, group)


def run_prefix(fleet: Fleet, policy: str, seed: int, out: Path, *, hot: bool = False) -> dict[str, Any]:
    """``vllm bench serve`` through ``policy``'s router: the ``prefix`` workload, or with ``hot``
    one shared document at ``--hot-rate``."""
    a = fleet.args
    num_prefixes, rate, prompts = (1, a.hot_rate, a.hot_prompts) if hot else (a.num_prefixes, a.rate, a.prompts)
    name = f"{'hot' if hot else 'prefix'}-{policy}-{seed}.json"
    cmd = [str(VLLM_BIN / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", fleet.routers[policy],
           "--endpoint", "/v1/completions", "--model", str(fleet.model), "--tokenizer", str(fleet.model),
           "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(a.prefix_len),
           "--prefix-repetition-suffix-len", str(a.suffix_len), "--prefix-repetition-num-prefixes", str(num_prefixes),
           "--prefix-repetition-output-len", str(a.output_len), "--num-prompts", str(prompts), "--request-rate",
           str(rate), "--seed", str(seed), "--num-warmups", "0", "--disable-tqdm", "--save-result", "--result-dir",
           str(out), "--result-filename", name, "--percentile-metrics", "ttft", "--metric-percentiles", "50,99"]
    log = out / (name + ".log")
    with log.open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=fleet.tmp, timeout=1800).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve failed ({rc}): {log.read_text()[-3000:]}")
    res = json.loads((out / name).read_text())
    return {"mean_ttft_s": res["mean_ttft_ms"] / 1e3, "median_ttft_s": res["median_ttft_ms"] / 1e3,
            "p99_ttft_s": res["p99_ttft_ms"] / 1e3, "req_per_s": res["request_throughput"],
            "completed": res["completed"], "failed": res.get("failed", prompts - res["completed"]),
            "wall_s": res["duration"]}


def _chat_docs(n: int, tokens: int, seed: int, tok: Any) -> list[str]:
    rng = random.Random(seed)
    words = [w for w in tok.decode(list(range(1000, 9000))).split() if w.isalpha()] or ["lease", "rent", "bins"]
    docs = []
    for _ in range(n):
        text = ""
        while len(tok.encode(text)) < tokens:
            text += " ".join(rng.choice(words) for _ in range(64)) + ". "
        docs.append(text)
    return docs


async def _chat_runs(url: str, model: str, docs: list[str], turns: int, output: int, seed: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    ttfts: list[float] = []
    failed = 0

    async def one(client: Any, doc: str) -> None:
        nonlocal failed
        msgs = [{"role": "system", "content": doc}]
        await asyncio.sleep(rng.uniform(0, 1.0))
        for t in range(turns):
            msgs.append({"role": "user", "content": f"Question {t}: {rng.randrange(10**6)} — summarise part {t}."})
            body = {"model": model, "messages": msgs, "max_tokens": output, "min_tokens": output, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            t0 = time.monotonic()
            first = None
            answer = []
            try:
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        failed += 1
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
                        if delta and first is None:
                            first = time.monotonic() - t0
                        answer.append(delta)
            except Exception:  # noqa: BLE001 - a failed request is counted, the conversation ends
                failed += 1
                return
            if first is not None:
                ttfts.append(first)
            msgs.append({"role": "assistant", "content": "".join(answer)})
            await asyncio.sleep(rng.uniform(0.2, 0.8))  # the user reads and types

    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        await asyncio.gather(*(one(client, d) for d in docs))
    wall = time.monotonic() - t0
    ttfts.sort()
    return {"mean_ttft_s": statistics.fmean(ttfts) if ttfts else float("nan"),
            "median_ttft_s": statistics.median(ttfts) if ttfts else float("nan"),
            "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan"),
            "req_per_s": len(ttfts) / wall, "completed": len(ttfts), "failed": failed, "wall_s": wall}


def run_chat(fleet: Fleet, policy: str, seed: int, tok: Any) -> dict[str, Any]:
    a = fleet.args
    docs = _chat_docs(a.conversations, a.chat_doc_tokens, seed, tok)
    return asyncio.run(_chat_runs(fleet.routers[policy], str(fleet.model), docs, a.turns, a.chat_output, seed))


def routed(fleet: Fleet, policy: str) -> list[float]:
    return [h["counters"]["routed"] for h in _get(fleet.routers[policy] + "/route/stats")["hosts"]]


def edge_peer_fetches(fleet: Fleet) -> float:
    from kdn.edge.admin import EdgeClient

    total = 0.0
    for addr in fleet.edges:
        with EdgeClient(addr) as c:
            total += c.stats().counters.get("kdn_edge_upstream_fetches_total{outcome=ok,target=peer}", 0.0)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--num-prefixes", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=18)
    ap.add_argument("--rate", type=float, default=1.0, help="prefix workload: requests per second (Poisson)")
    ap.add_argument("--hot-rate", type=float, default=4.0, help="hot workload: requests per second (Poisson)")
    ap.add_argument("--hot-prompts", type=int, default=80)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--chat-doc-tokens", type=int, default=768)
    ap.add_argument("--chat-output", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-space", default="1", help="VLLM_CPU_KVCACHE_SPACE (GiB) per engine")
    ap.add_argument("--edge-memory", default="2GiB")
    ap.add_argument("--no-append", action="store_true", help="print only; record nothing")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from kdn.pretrained import model_dir

    load_start = os.getloadavg()[0]
    model = model_dir("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(model)
    tmp = Path(tempfile.mkdtemp(prefix="kdn-route-bench-"))
    out = tmp / "results"
    out.mkdir()
    fleet = Fleet(args, tmp, model)
    runs: list[dict[str, Any]] = []
    try:
        fleet.start()
        print(f"[route] fleet up: engines {fleet.start_s['engines']:.0f} s, calibration "
              f"{fleet.start_s['calibration']:.0f} s", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            order = args.policies[r % len(args.policies):] + args.policies[: r % len(args.policies)]
            for wi, w in enumerate(args.workloads):
                for pi, policy in enumerate(order):
                    seed = 1000 * (r + 1) + 100 * wi + 10 * POLICIES.index(policy)
                    before, peers0 = routed(fleet, policy), edge_peer_fetches(fleet)
                    load0 = os.getloadavg()[0]
                    res = (run_chat(fleet, policy, seed, tok) if w == "chat"
                           else run_prefix(fleet, policy, seed, out, hot=w == "hot"))
                    after = routed(fleet, policy)
                    res.update(round=r, workload=w, policy=policy, seed=seed, load=[load0, os.getloadavg()[0]],
                               per_host=[b - a for a, b in zip(before, after)],
                               peer_fetches=edge_peer_fetches(fleet) - peers0)
                    runs.append(res)
                    print(f"[route] round {r} {w:6s} {policy:14s} mean TTFT {res['mean_ttft_s']:.2f} s, median "
                          f"{res['median_ttft_s']:.2f}, p99 {res['p99_ttft_s']:.2f}, {res['req_per_s']:.2f} req/s, "
                          f"hosts {res['per_host']}, peer fetches {res['peer_fetches']:.0f}, failed {res['failed']}",
                          file=sys.stderr, flush=True)
        if "cost" in fleet.routers:  # what the cost score had learnt of each host by the end
            fleet.learnt = [{"prefill": h["prefill"], "links": h["links"]["bytes_per_s"],
                             "predictions": h.get("predictions", {})}
                            for h in _get(fleet.routers["cost"] + "/route/stats")["hosts"]]
            print(f"[route] the cost router fitted: {json.dumps([h['prefill'] for h in fleet.learnt])}; "
                  f"its predictions vs first bytes: {json.dumps([h['predictions'] for h in fleet.learnt])}",
                  file=sys.stderr, flush=True)
    finally:
        fleet.close()
        (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
        keep = tmp / "runs.json"
        keep.write_text(json.dumps(runs, indent=1))
        print(f"[route] raw runs in {keep}", file=sys.stderr)
    load_end = os.getloadavg()[0]
    summary = summarize(runs, args)
    print(json.dumps(summary, indent=1))
    if not args.no_append:
        record(summary, runs, args, fleet, load_start, load_end, argv)
    shutil.rmtree(tmp / "results", ignore_errors=True)
    return 0


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w in args.workloads:
        per: dict[str, dict[str, float]] = {}
        for p in args.policies:
            rs = [x for x in runs if x["workload"] == w and x["policy"] == p]
            if not rs:
                continue
            per[p] = {k: statistics.median(x[k] for x in rs) for k in ("mean_ttft_s", "median_ttft_s", "p99_ttft_s", "req_per_s")}
            per[p]["failed"] = sum(x["failed"] for x in rs)
            per[p]["per_host"] = [sum(x["per_host"][i] for x in rs) for i in range(2)]
            per[p]["peer_fetches"] = sum(x["peer_fetches"] for x in rs)
        ratios: dict[str, list[float]] = {}
        for base in ("prefix_overlap", "round_robin"):
            vals = []
            for r in range(args.rounds):
                c = [x for x in runs if x["workload"] == w and x["policy"] == "cost" and x["round"] == r]
                b = [x for x in runs if x["workload"] == w and x["policy"] == base and x["round"] == r]
                if c and b and b[0]["mean_ttft_s"] > 0:
                    vals.append(c[0]["mean_ttft_s"] / b[0]["mean_ttft_s"])
            ratios[base] = vals
        out[w] = {"policies": per, "cost_over": ratios}
    return out


def record(summary: dict[str, Any], runs: list[dict[str, Any]], args: argparse.Namespace, fleet: Fleet,
           load_start: float, load_end: float, argv: list[str] | None) -> None:
    from _results import Record  # benchmarks/ is on sys.path when this runs as a script

    # the default workloads keep the "route" section; a run of some of them only gets its own
    rid = "route" if sorted(args.workloads) == sorted(WORKLOADS) else "route-" + "-".join(args.workloads)
    title = "" if rid == "route" else f" ({', '.join(args.workloads)})"
    rec = Record(__file__, rid, f"KV-aware routing: round-robin, prefix-overlap, cost score{title}", argv)
    rec.doc["load"]["start"] = round(load_start, 2)
    rec.set_rounds(args.rounds)
    names = {"prefix": (f"prefix_repetition: {args.num_prefixes} documents x {args.prefix_len} tokens + "
                        f"{args.suffix_len} new, {args.output_len} out, {args.prompts} requests at {args.rate:g}/s"),
             "hot": (f"hot document: 1 document x {args.prefix_len} tokens shared by every request + "
                     f"{args.suffix_len} new, {args.output_len} out, {args.hot_prompts} requests at {args.hot_rate:g}/s"),
             "chat": (f"multi-turn chat: {args.conversations} conversations x {args.turns} turns, "
                      f"{args.chat_doc_tokens}-token system document, {args.chat_output} tokens per answer")}
    for w, s in summary.items():
        for base, goal, bound in (("prefix_overlap", "≤ 0.8x", 0.8), ("round_robin", "≤ 0.5x", 0.5)):
            vals = s["cost_over"][base]
            if vals:
                rec.goal(f"{w}: mean TTFT, cost vs {base.replace('_', '-')}", goal, vals, at_most=bound, rounds=len(vals))
    for w, s in summary.items():
        rows = []
        for p, v in s["policies"].items():
            rows.append([p, f"{v['mean_ttft_s']:.2f}", f"{v['median_ttft_s']:.2f}", f"{v['p99_ttft_s']:.2f}",
                         f"{v['req_per_s']:.2f}", f"{v['per_host'][0]:.0f} / {v['per_host'][1]:.0f}",
                         f"{v['peer_fetches']:.0f}", f"{v['failed']:.0f}"])
        rec.table(["policy", "mean TTFT s", "median TTFT s", "p99 TTFT s", "req/s", "requests host 0 / 1",
                   "peer fetches", "failed"], rows, title=names[w] + " (medians of the rounds)")
    loads = [x["load"][0] for x in runs] + [x["load"][1] for x in runs]
    rec.note(f"Engines started in {fleet.start_s.get('engines', 0):.0f} s; routers calibrated in "
             f"{fleet.start_s.get('calibration', 0):.0f} s; 1-minute load during the runs {min(loads):.1f}–{max(loads):.1f}.")
    learnt = fleet.learnt
    if learnt:
        rec.note("What the cost router had fitted by the end, per host: " + "; ".join(
            f"host {i}: {h['prefill']['s_per_token'] * 1e3:.2f} ms/token, overhead {h['prefill']['overhead_s'] * 1e3:.0f} ms, "
            f"load {h['prefill'].get('load_s_per_mb', 0.0) * 1e3:.1f} ms/MB, links (MB/s) "
            + ", ".join(f"{t} {r / 1e6:.0f}" for t, r in sorted(h["links"].items()))
            for i, h in enumerate(learnt)) + ".")
        rec.note("Its predicted TTFT against the streamed first byte, per host (last 256 requests): " + "; ".join(
            f"host {i}: n {p['n']}, predicted {p['mean_predicted_s']:.2f} s (queue {p['mean_queue_s']:.2f}, fetch "
            f"{p['mean_fetch_s']:.2f}, prefill {p['mean_prefill_s']:.2f}), observed {p['mean_observed_s']:.2f} s, median "
            f"error {p['median_error_s']:+.2f} s, median |error| {p['median_abs_error_s']:.2f} s"
            for i, p in ((i, h.get("predictions", {})) for i, h in enumerate(learnt)) if p.get("n")) + ".")
    rec.doc["data"] = {"runs": runs, "learnt": learnt}
    rec.save(load_end=round(load_end, 2))


if __name__ == "__main__":
    sys.exit(main())
