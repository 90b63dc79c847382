"""TTFT of a real vLLM engine: recompute vs its own prefix cache vs its own connector vs KDN.

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--model small-125m] [--contexts 1024 4096] [--rounds 5]

One model directory (a built-in spec saved with :mod:`kdn.integrations.model_dir`, ``--dtype``), one
``kdn edge`` process, and three engines, each in its own child process (engine start is minutes
on a CPU, and one process per engine keeps them from sharing threads):

- ``kdn-grpc``: the KDN connector, edge over gRPC (``shm: off``). Per round and context, with a
  prompt of ``context`` shared tokens + 16 new ones and ``max_tokens=1``:
  *recompute* (prefix cache reset, request opted out of KDN), *prefix-cache hit* (the same prompt
  again in the same engine: vLLM's floor), *KDN hit* (prefix cache reset, KV from the edge);
- ``kdn-shm``: the same connector, edge answers by shared memory: *KDN hit*;
- ``native``: vLLM's own connector beside it, hit after a prefix-cache reset. vLLM's
  ``OffloadingConnector`` (and ``SimpleCPUOffloadConnector``) need CUDA streams; on the CPU
  backend this uses ``ExampleConnector`` (per-layer safetensors files, here on /dev/shm) instead
  and says so. ``--native offloading`` forces the CPU-offloading connector (GPU hosts).

TTFT is the wall time of ``LLM.generate`` for one request with ``max_tokens=1``. Medians over the
rounds, with the range; the load average is reported. Records the run as ``vllm_ttft``
(``benchmarks/_results.py``) and saves ``benchmarks/results/vllm_ttft.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

METHOD = """One model directory (a built-in spec saved with `kdn.integrations.model_dir`), one `kdn edge`
process, and three vLLM engines, each in its own child process. TTFT is the wall time of
`LLM.generate` for one request of `context` shared tokens plus 16 new ones with `max_tokens=1`.
Per round and context: recompute (prefix cache reset, request opted out of KDN), prefix-cache hit
(the same prompt again in the same engine: vLLM's floor), KDN hit over gRPC and by shared memory
(prefix cache reset, KV from the edge), and vLLM's own connector hit after a prefix-cache reset
(`OffloadingConnector` on CUDA; on the CPU backend, which it cannot run on, `ExampleConnector`
with its files on /dev/shm). Medians over the rounds, with the range."""
QUESTION = 16
CHUNK = 256


def prompts(contexts: list[int], vocab: int) -> dict[int, list[int]]:
    """The same prompts in every engine: ``context`` document tokens + 16 question tokens."""
    rng = random.Random(20261130)
    doc = [rng.randrange(3, vocab) for _ in range(max(contexts))]
    q = [rng.randrange(3, vocab) for _ in range(QUESTION)]
    return {n: doc[:n] + q for n in contexts}


# -- child: one engine -----------------------------------------------------------------------


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra: dict[str, Any]
    if args.engine.startswith("kdn"):
        ktc = KVTransferConfig(
            kv_connector="KdnConnector", kv_connector_module_path="kdn.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"edge": args.edge, "chunk_size": CHUNK,
                                       "shm": "on" if args.engine == "kdn-shm" else "off"},
        )
        native = ""
    elif args.native == "offloading":
        ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                               kv_connector_extra_config={"cpu_bytes_to_use": 8 << 30})
        native = "OffloadingConnector (CPU offloading)"
    else:
        ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                               kv_connector_extra_config={"shared_storage_path": args.example_dir})
        native = f"ExampleConnector (safetensors on {args.example_dir})"
    kw: dict[str, Any] = {"device": args.device} if args.device else {}
    t0 = time.perf_counter()
    llm = LLM(model=args.dir, dtype=args.dtype, enforce_eager=True, max_model_len=8192, max_num_batched_tokens=8192,
              enable_prefix_caching=True, max_num_seqs=1, seed=0, kv_transfer_config=ktc, **kw)
    start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    kdn_on = {"kdn_tenant": "bench"}
    kdn_off = {"kdn": False}

    def gen(tokens: list[int], params: dict | None, reset: bool) -> tuple[float, int]:
        if reset:
            llm.reset_prefix_cache()
        s = sp.clone()
        if params is not None:
            s.extra_args = {"kv_transfer_params": params}
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], s, use_tqdm=False)[0]
        return time.perf_counter() - t, int(out.num_cached_tokens or 0)

    ps = {int(k): v for k, v in json.loads(Path(args.prompts).read_text()).items()}
    times: dict[str, dict[int, list[float]]] = {}
    cached: dict[str, dict[int, list[int]]] = {}

    def add(mode: str, n: int, r: tuple[float, int]) -> None:
        times.setdefault(mode, {}).setdefault(n, []).append(r[0])
        cached.setdefault(mode, {}).setdefault(n, []).append(r[1])

    for n, tokens in ps.items():  # warm up, and store: KDN writes back, the native connector saves
        gen(tokens, kdn_on if args.engine.startswith("kdn") else None, reset=True)
        gen(tokens, kdn_on if args.engine.startswith("kdn") else None, reset=True)
    if args.engine.startswith("kdn"):
        time.sleep(2.0)  # write-backs are asynchronous
    for _ in range(args.rounds):
        for n, tokens in ps.items():
            if args.engine == "kdn-grpc":
                add("recompute", n, gen(tokens, kdn_off, reset=True))
                add("prefix-cache hit (floor)", n, gen(tokens, kdn_off, reset=False))
                add("KDN hit, gRPC", n, gen(tokens, kdn_on, reset=True))
            elif args.engine == "kdn-shm":
                add("KDN hit, shm", n, gen(tokens, kdn_on, reset=True))
            else:
                add("native connector hit", n, gen(tokens, None, reset=True))
    return {"engine": args.engine, "start_s": start_s, "times": times, "cached": cached, "native": native}


# -- parent: edge, engines, report -------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-125m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="", help="vLLM device (default: the platform's)")
    ap.add_argument("--dtype", default="float32",
                    help="model and KV dtype; float32 by default because vLLM's CPU bf16 matmuls fall back to slow "
                         "kernels without AVX512-BF16 (use bfloat16 on a GPU)")
    ap.add_argument("--native", choices=["auto", "example", "offloading"], default="auto",
                    help="vLLM's own connector: auto = offloading on CUDA, example elsewhere")
    ap.add_argument("--no-append", action="store_true", help="print only; record nothing")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    # child mode
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--edge", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--example-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.engine:
        Path(args.result).write_text(json.dumps(run_engine(args)))
        return 0

    import torch

    from kdn.integrations.model_dir import save_builtin
    from kdn.models import BUILTIN_SPECS

    if args.native == "auto":
        args.native = "offloading" if torch.cuda.is_available() else "example"
    tmp = Path(tempfile.mkdtemp(prefix="kdn-vllm-ttft-"))
    model_dir = save_builtin(args.model, tmp / args.model, dtype=args.dtype)
    vocab = int(BUILTIN_SPECS[args.model].config["vocab_size"]) if args.model in BUILTIN_SPECS else 259
    pfile = tmp / "prompts.json"
    pfile.write_text(json.dumps(prompts(args.contexts, vocab)))
    example_dir = Path(tempfile.mkdtemp(prefix="kdn-vllm-example-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    kdn = str(Path(sys.executable).with_name("kdn"))  # the console script of this environment
    edge = subprocess.Popen([kdn, "edge", "--listen", "127.0.0.1:0", "--memory-bytes", "2GiB"],
                            stdout=subprocess.PIPE, text=True, cwd=tmp)
    assert edge.stdout is not None
    address = json.loads(edge.stdout.readline())["address"]
    results: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    try:
        for engine in ("kdn-grpc", "kdn-shm", "native"):
            out = tmp / f"{engine}.json"
            cmd = [sys.executable, __file__, "--engine", engine, "--edge", address, "--dir", str(model_dir),
                   "--prompts", str(pfile), "--example-dir", str(example_dir), "--result", str(out),
                   "--rounds", str(args.rounds), "--native", args.native, "--dtype", args.dtype]
            if args.device:
                cmd += ["--device", args.device]
            print(f"[vllm_ttft] engine {engine} ...", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, timeout=1800)
            results.append(json.loads(out.read_text()))
    finally:
        edge.terminate()
        edge.wait(20)
        shutil.rmtree(example_dir, ignore_errors=True)
    load = os.getloadavg()
    rows = summarize(results, args.contexts)
    native = next(r["native"] for r in results if r["engine"] == "native")
    print(json.dumps({"rows": rows, "load_avg": load, "native": native,
                      "engine_start_s": {r["engine"]: round(r["start_s"], 1) for r in results},
                      "wall_s": round(time.perf_counter() - t_all, 1)}, indent=1))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(rows, out_dir / "vllm_ttft.png", args.model)
    if not args.no_append:
        record(rows, args, png, load, native, results)
    return 0


def summarize(results: list[dict[str, Any]], contexts: list[int]) -> list[dict[str, Any]]:
    merged: dict[str, dict[int, list[float]]] = {}
    cached: dict[str, dict[int, list[int]]] = {}
    for r in results:
        for mode, by_n in r["times"].items():
            merged[mode] = {int(n): v for n, v in by_n.items()}
            cached[mode] = {int(n): v for n, v in r["cached"][mode].items()}
    rows = []
    for n in contexts:
        row: dict[str, Any] = {"context": n}
        for mode, by_n in merged.items():
            v = by_n[n]
            row[mode] = {"median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v), "max_ms": 1e3 * max(v),
                         "n": len(v), "cached_tokens": statistics.median(cached[mode][n])}
        rows.append(row)
    return rows


MODES = ["recompute", "prefix-cache hit (floor)", "native connector hit", "KDN hit, gRPC", "KDN hit, shm"]


def plot(rows: list[dict[str, Any]], path: Path, model: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(MODES)
    for j, mode in enumerate(MODES):
        xs = [i + (j - (len(MODES) - 1) / 2) * width for i in range(len(rows))]
        med = [r[mode]["median_ms"] for r in rows]
        lo = [r[mode]["median_ms"] - r[mode]["min_ms"] for r in rows]
        hi = [r[mode]["max_ms"] - r[mode]["median_ms"] for r in rows]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=mode)
    ax.set_xticks(range(len(rows)), [f"{r['context']} tokens" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, ms (median, bars: range)")
    ax.set_title(f"vLLM TTFT, {model}: recompute vs prefix cache vs connectors")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def record(rows: list[dict[str, Any]], args: argparse.Namespace, png: Path, load: tuple[float, float, float],
           native: str, results: list[dict[str, Any]]) -> None:
    from _results import Record  # benchmarks/ is on sys.path when this runs as a script

    starts = ", ".join(f"{r['engine']} {r['start_s']:.0f} s" for r in results)
    cmd = (f".venv-vllm/bin/python benchmarks/vllm_ttft.py --rounds {args.rounds} --contexts "
           f"{' '.join(map(str, args.contexts))} --dtype {args.dtype}")
    rec = Record(__file__, "vllm_ttft", "vLLM TTFT with the KDN connector", command=cmd)
    rec.doc["load"]["start"] = None  # the run's start is minutes of engine starts before this
    rec.set_rounds(args.rounds)
    lines = [
        f"Model `{args.model}` saved as a {args.dtype} directory, vllm 0.32.0, "
        f"chunk {CHUNK}, prompt = context + {QUESTION} new tokens, `max_tokens=1`; medians of {args.rounds} rounds "
        f"(range in brackets). Edge: a separate `kdn edge` process on loopback. vLLM's own connector: {native}. "
        f"Engine starts: {starts}.", "",
        "| context | " + " | ".join(MODES) + " | KDN gRPC vs recompute | KDN shm vs recompute | KDN best vs native |",
        "|---|" + "---|" * (len(MODES) + 3),
    ]
    for r in rows:
        cells = [f"{r[m]['median_ms']:.0f} ms [{r[m]['min_ms']:.0f}–{r[m]['max_ms']:.0f}]" for m in MODES]
        rc = r["recompute"]["median_ms"]
        g, s, nat = r["KDN hit, gRPC"]["median_ms"], r["KDN hit, shm"]["median_ms"], r["native connector hit"]["median_ms"]
        lines.append(f"| {r['context']} | " + " | ".join(cells) +
                     f" | {rc / g:.1f}x | {rc / s:.1f}x | {nat / min(g, s):.2f}x |")
    at = next((r for r in rows if r["context"] == 4096), rows[-1])
    rc = at["recompute"]["median_ms"]
    best = min(at["KDN hit, gRPC"]["median_ms"], at["KDN hit, shm"]["median_ms"])
    nat = at["native connector hit"]["median_ms"]
    for label, key in (("gRPC", "KDN hit, gRPC"), ("shm", "KDN hit, shm")):
        rec.goal(f"vLLM + KDN hit vs vLLM recompute, {at['context']} tokens, {label} (medians of the rounds)", "≥ 10x",
                 median=rc / at[key]["median_ms"], at_least=10, rounds=args.rounds, digits=1)
    rec.goal(f"vLLM + KDN hit vs vLLM's own connector hit ({native}), {at['context']} tokens", "≥ 1.0x",
             median=nat / best, at_least=1.0, rounds=args.rounds)
    lines += ["", f"Cached tokens reported by vLLM for the KDN hits: {at['KDN hit, gRPC']['cached_tokens']:.0f} of "
              f"{at['context'] + QUESTION} at {at['context']} (whole chunks; the rest is computed)."]
    rec.markdown(lines)
    rec.plot(png)
    rec.save(load_end=round(load[0], 2))


if __name__ == "__main__":
    sys.exit(main())
