"""TTFT on the trained model (smollm2-135m): full recompute vs an edge hit, in transformers and in vLLM.

    .venv/bin/python benchmarks/real_model.py                       # 2k/4k/8k, fp32 + bf16, both engines, 7 rounds
    .venv/bin/python benchmarks/real_model.py --engines transformers --dtypes float32 --sizes 2048 --rounds 2

A request is a chat: a document (held-out Python standard-library source, cut to about N tokens) as
the system message and a short question as the user's, rendered with the model's chat template —
how KDN users lay out prompts for reuse (:mod:`kdn.prompts`). The document's chunks are held by a
local edge (a separate ``kdn edge`` process on loopback) as the origin stores them — the chunks and
the tail after the last one, in pieces, so a hit is a whole-document hit; the host reaches the edge
by its default path (shared memory on the same host).

- transformers (this interpreter): per round, a full recompute, an edge hit through
  :func:`kdn.integrations.transformers.generate`, and the floor (the document's KV already in this
  process: what an engine's own prefix cache gives; the question prefilled over it as a hit does,
  :func:`kdn.blend.prefill_in_place`). TTFT is measured inside ``generate`` (request
  tokens in hand to the first token); 8 tokens are generated and compared with recompute's.
- vLLM (``--vllm-python``, default ``.venv-vllm/bin/python``, skipped if absent): one engine per
  dtype with the KDN connector; per round a recompute (prefix cache reset, the request opted out of
  KDN), a KDN hit (prefix cache reset, KV from the edge, written back by vLLM itself at warm-up) and
  the floor (the same request again with KDN off: its KV is in vLLM's own prefix cache, loaded by
  the hit). TTFT is the wall time of ``LLM.generate`` with ``max_tokens=1``; the first tokens of
  all three are compared. The engine runs with 32-token KV blocks (``--vllm-block-size``): the
  edge holds a document's tail in 32-token pieces and a hit loads it to its last piece, while
  vLLM's prefix cache keeps whole blocks only, so at vLLM's CPU default of 128 the floor would
  prefill up to 96 more tokens than the hit and stop being a floor.

Records ``real_model`` (``benchmarks/_results.py``) and ``benchmarks/results/real_model.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METHOD = """A chat request: a document of about N tokens (held-out Python standard-library source) as the
system message, a short question as the user message, rendered with SmolLM2's chat template. The
document's chunks sit in a separate `kdn edge` process on loopback, reached by the host's default
path (shared memory). transformers: per round a full recompute, an edge hit through
`kdn.integrations.transformers.generate` and the in-process floor (the document's KV already in
memory, the question prefilled over it as a hit does: into the KV's room, `kdn.blend.prefill_in_place`,
from the record of 2026-12-07 15:28 UTC; before, a forward over a `DynamicCache`); TTFT from the request's tokens to the first token, 8 tokens generated and compared with
recompute's (the time per token after the first is reported too). vLLM 0.32 (CPU): one engine per dtype with the KDN connector; per round a recompute
(prefix cache reset, KDN off for the request), a KDN hit (prefix cache reset, KV from the edge,
written back by vLLM at warm-up) and the floor (the same request again, KDN off, its KV in vLLM's
own prefix cache); TTFT is `LLM.generate`'s wall time with `max_tokens=1`. vLLM runs with 32-token
KV blocks, the edge's piece size, so that its prefix cache (the floor) holds exactly the tokens a hit
loads; at its CPU default of 128 the floor prefills up to 96 tokens more than the hit. Ratios are per
round (measured back to back), medians with min–max."""

SKIPPED: list[str] = []  # engines that could not run on this machine, and why (the report says so)
QUESTION = "Which function in this file is defined first, and what does it do?"
CHUNK = 256
MODEL = "smollm2-135m"


def documents(sizes: list[int]) -> dict[int, str]:
    """Held-out stdlib source cut to about ``n`` tokens of the model, per size (the same text for
    every engine and dtype)."""
    from kdn.lab.reference import heldout_texts
    from kdn.models import load_model

    tok = load_model(MODEL).tokenizer
    text = "\n\n".join(heldout_texts())
    ids = tok.encode(text)
    out = {}
    for n in sizes:
        out[n] = tok.decode(ids[: n - 48])  # room for the template's head and the question
    return out


def messages(doc: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": doc}, {"role": "user", "content": QUESTION}]


def start_edge(tmp: Path) -> tuple[subprocess.Popen, str]:
    kdn = str(Path(sys.executable).with_name("kdn"))
    proc = subprocess.Popen([kdn, "edge", "--listen", "127.0.0.1:0", "--node-id", "real-bench", "--memory-bytes", "6GiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["address"]


# -- transformers ------------------------------------------------------------------------------


def run_transformers(docs: dict[int, str], dtype: str, rounds: int, edge: str) -> list[dict[str, Any]]:
    import torch

    from kdn.artifact import encode_artifact
    from kdn.client import ClientConfig, KdnClient
    from kdn.integrations.transformers import generate
    from kdn.keys import ROOT_KEY, piece_keys
    from kdn.blend import prefill_in_place, predicts_in_pass
    from kdn.kv import cache_from_layers, forward
    from kdn.models import load_model
    from kdn.prefill import prefill_document
    from kdn.prompts import chat_tokens, document_tokens
    from kdn.layered import pays

    rows = []
    lm = load_model(MODEL, dtype=dtype)
    auto = pays(lm.model)  # what a default client does on this machine: the headline hit
    with KdnClient(ClientConfig(edge=edge, tenant=f"bench-{dtype}", write_back=False, layered=auto)) as client, \
            KdnClient(ClientConfig(edge=edge, tenant=f"bench-{dtype}", write_back=False, layered=not auto)) as other:
        generate(lm, messages=[{"role": "user", "content": "warm up"}], max_new_tokens=2)
        for n, doc in docs.items():
            tokens = chat_tokens(lm.tokenizer, messages(doc))
            stored = document_tokens(lm.tokenizer, doc, "system")
            # what the origin stores for the document: its chunks, then its tail in pieces
            chunks, tail = prefill_document(lm, stored)  # each (L, 2, H, C or PIECE_TOKENS, D)
            keys = client.keys_for(stored, lm.fingerprint, CHUNK)
            pkeys = piece_keys(stored[len(keys) * CHUNK:], after=keys[-1], fingerprint=lm.fingerprint,
                               namespace=client.config.namespace, chunk_size=CHUNK)
            chain = [*keys, *pkeys]
            for i, (key, c) in enumerate(zip(chain, [*chunks, *tail])):
                data = encode_artifact(c, key=key, parent_key=chain[i - 1] if i else ROOT_KEY, fingerprint=lm.fingerprint,
                                       codec="raw", chunk_index=min(i, len(keys)))
                assert client.put(lm.fingerprint, key, data)
            kv = torch.cat([*chunks, *tail], dim=3)  # (L, 2, H, n_chunks*C + n_pieces*P, D)
            n_kv = kv.shape[3]
            del chunks, tail
            # the floor's KV in memory with room for the question, as a hit's fetch lands it
            room = torch.empty((*kv.shape[:3], len(tokens), kv.shape[4]), dtype=kv.dtype)
            room[:, :, :, :n_kv] = kv
            in_place = predicts_in_pass(lm.model)
            t: dict[str, list[float]] = {"recompute": [], "hit": [], "floor": [], "hit_other": []}
            same = 0
            for r in range(rounds):
                base = generate(lm, tokens, max_new_tokens=8)
                # the hit as a default client makes it, and the other way (ClientConfig.layered), in turn
                got = {}
                for c, name in ((client, "hit"), (other, "hit_other"))[:: 1 if r % 2 else -1]:
                    got[name] = res = generate(lm, tokens, client=c, max_new_tokens=8)
                    assert res.reused_tokens == n_kv and not res.warnings, (res.reused_tokens, n_kv, res.warnings)
                    t[name].append(res.timings.ttft_s)
                hit = got["hit"]
                same += hit.tokens == base.tokens and got["hit_other"].tokens == base.tokens
                with torch.inference_mode():
                    # the question prefilled over the document's KV the way a hit does it
                    t0 = time.perf_counter()
                    if in_place:
                        _, logits = prefill_in_place(lm.model, room, n_kv, tokens)
                    else:
                        cache = cache_from_layers([(kv[l, 0].unsqueeze(0), kv[l, 1].unsqueeze(0))
                                                   for l in range(kv.shape[0])], lm.config)
                        logits = forward(lm.model, input_ids=torch.tensor([tokens[n_kv:]]), cache=cache,
                                         use_cache=True, logits_to_keep=1).logits[0, -1]
                    int(torch.argmax(logits))
                    t["floor"].append(time.perf_counter() - t0)
                t["recompute"].append(base.timings.ttft_s)
                for name, res in (("decode_recompute", base), ("decode_hit", hit)):  # per token after the first
                    if len(res.tokens) > 1:
                        t.setdefault(name, []).append((res.timings.total_s - res.timings.ttft_s) / (len(res.tokens) - 1))
            lay, whole = (t["hit"], t.pop("hit_other")) if auto else (t.pop("hit_other"), t["hit"])
            rows.append(_row("transformers", dtype, n, len(tokens), n_kv, t, same, rounds))
            rows[-1].update(layered=auto, threads=torch.get_num_threads(),
                            vs_whole=[a / b for a, b in zip(lay, whole)])
            print(_line(rows[-1]), flush=True)
    return rows


def _row(engine: str, dtype: str, n: int, prompt: int, reused: int, t: dict[str, list[float]], same: int,
         rounds: int) -> dict[str, Any]:
    speed = [a / b for a, b in zip(t["recompute"], t["hit"])]
    row: dict[str, Any] = {"engine": engine, "dtype": dtype, "size": n, "prompt_tokens": prompt, "reused_tokens": reused,
                           "same_tokens": same, "rounds": rounds, "speedup": speed,
                           **{f"{k}_s": statistics.median(v) for k, v in t.items()}, "load": round(os.getloadavg()[0], 2)}
    if t.get("floor"):
        row["vs_floor"] = [a / b for a, b in zip(t["hit"], t["floor"])]
    return row


def _line(r: dict[str, Any]) -> str:
    sp = r["speedup"]
    floor = f", hit {statistics.median(r['vs_floor']):.2f}x floor" if "vs_floor" in r else ""
    floor += (f", layered {statistics.median(r['vs_whole']):.2f}x fetched-whole ({r['threads']} torch threads, "
              f"hit {'layered' if r['layered'] else 'fetched whole'})") if "vs_whole" in r else ""
    return (f"{r['engine']:>12} {r['dtype']:>8} {r['prompt_tokens']:>5} tokens: recompute {r['recompute_s']:.2f} s, "
            f"hit {r['hit_s']:.3f} s ({r['reused_tokens']} reused): {statistics.median(sp):.1f}x "
            f"[{min(sp):.1f}–{max(sp):.1f}]{floor}; same tokens {r['same_tokens']}/{r['rounds']}; load {r['load']}"
            + (f"; decode {r['decode_hit_s'] * 1e3:.0f} / {r['decode_recompute_s'] * 1e3:.0f} ms a token (hit / recompute)"
               if "decode_hit_s" in r else ""))


# -- vLLM (child, in the vLLM environment) -------------------------------------------------------


def run_vllm_child(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KdnConnector", kv_connector_module_path="kdn.integrations.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"edge": args.edge, "chunk_size": CHUNK})
    llm = LLM(model=args.dir, dtype=args.dtype, enforce_eager=True, max_model_len=8192, max_num_batched_tokens=8192,
              enable_prefix_caching=True, max_num_seqs=1, seed=0, kv_transfer_config=ktc, block_size=args.block_size)
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = {int(k): v for k, v in json.loads(Path(args.prompts).read_text()).items()}

    def gen(tokens: list[int], kdn: bool, reset: bool = True) -> tuple[float, int, int]:
        if reset:
            llm.reset_prefix_cache()
        s = sp.clone()
        s.extra_args = {"kv_transfer_params": {"kdn_tenant": f"vllm-{args.dtype}"} if kdn else {"kdn": False}}
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], s, use_tqdm=False)[0]
        return time.perf_counter() - t0, int(out.outputs[0].token_ids[0]), int(out.num_cached_tokens or 0)

    result = {}
    for n, tokens in prompts.items():  # warm up, and let vLLM write the document's chunks back
        gen(tokens, True)
        gen(tokens, False)
    time.sleep(2.0)
    for n, tokens in prompts.items():
        t: dict[str, list[float]] = {"recompute": [], "hit": [], "floor": []}
        same = 0
        cached, floor_cached = [], []
        for _ in range(args.rounds):
            s_base, first_base, _ = gen(tokens, False)
            s_hit, first_hit, c = gen(tokens, True)
            # the floor: the same request again, KDN off, its KV already in vLLM's own prefix cache
            # (the blocks the hit just loaded): what an engine-local hit costs
            s_floor, first_floor, fc = gen(tokens, False, reset=False)
            t["recompute"].append(s_base)
            t["hit"].append(s_hit)
            t["floor"].append(s_floor)
            same += first_hit == first_base == first_floor
            cached.append(c)
            floor_cached.append(fc)
        result[n] = {"t": t, "same": same, "prompt": len(tokens), "cached": statistics.median(cached),
                     "floor_cached": statistics.median(floor_cached)}
    return result


def run_vllm(docs: dict[int, str], dtype: str, rounds: int, edge: str, python: str, tmp: Path,
             block_size: int) -> list[dict[str, Any]]:
    from kdn.models import load_model
    from kdn.pretrained import model_dir
    from kdn.prompts import chat_tokens

    tok = load_model(MODEL).tokenizer
    pfile = tmp / f"prompts-{dtype}.json"
    pfile.write_text(json.dumps({n: chat_tokens(tok, messages(d)) for n, d in docs.items()}))
    out = tmp / f"vllm-{dtype}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    t0 = time.perf_counter()
    proc = subprocess.run([python, __file__, "--child", "--edge", edge, "--dir", str(model_dir(MODEL)), "--prompts",
                           str(pfile), "--dtype", dtype, "--rounds", str(rounds), "--result", str(out),
                           "--block-size", str(block_size)], timeout=5400,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        # e.g. the connector refuses bfloat16 where vLLM picks its AMX kernel (docs/vllm.md, Limits):
        # that engine's rows are missing, the others stand
        sys.stderr.write(proc.stdout[-20000:])
        why = next((line.split("ValueError: ", 1)[1] for line in reversed(proc.stdout.splitlines())
                    if "ValueError: " in line), f"exit status {proc.returncode}")
        print(f"[real_model] vLLM {dtype} did not run: {why}", file=sys.stderr)
        SKIPPED.append(f"vLLM {dtype} did not run here: {why}")
        return []
    print(f"[real_model] vLLM {dtype}: {time.perf_counter() - t0:.0f} s with the engine start", file=sys.stderr)
    rows = []
    for n, r in json.loads(out.read_text()).items():
        rows.append(_row("vLLM", dtype, int(n), r["prompt"], int(r["cached"]), r["t"], r["same"], rounds))
        rows[-1]["floor_cached"] = int(r.get("floor_cached", 0))
        print(_line(rows[-1]), flush=True)
    return rows


# -- report ------------------------------------------------------------------------------------


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    groups = sorted({(r["engine"], r["dtype"]) for r in rows})
    for engine, dtype in groups:
        rs = sorted((r for r in rows if (r["engine"], r["dtype"]) == (engine, dtype)), key=lambda r: r["prompt_tokens"])
        ax.plot([r["prompt_tokens"] for r in rs], [statistics.median(r["speedup"]) for r in rs], marker="o",
                label=f"{engine} {dtype}")
    ax.axhline(25, ls=":", c="grey")  # the goals at ~4k and ~8k tokens
    ax.axhline(40, ls=":", c="grey")
    ax.set_xlabel("prompt tokens (document + question)")
    ax.set_ylabel("TTFT speedup, edge hit vs recompute")
    ax.set_title(f"{MODEL} on CPU: median of per-round ratios")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def floor_bound(rows: list[dict[str, Any]]) -> str:
    """What the floor allows: a hit can be no faster than the floor, so recompute / floor (medians)
    is the largest speedup any load path could show on this machine."""
    parts = [f"{r['engine']} ~{r['size'] // 1024}k {r['recompute_s'] / r['floor_s']:.1f}x"
             for r in rows if r["dtype"] == "float32" and r.get("floor_s")]
    return ("The floor bounds the speedup: recompute / floor (medians), the most a hit could show here, fp32: "
            + ", ".join(parts) + ".")


def record(rows: list[dict[str, Any]], argv: list[str] | None, load_start: float, png: Path) -> None:
    from _results import Record

    rec = Record(__file__, "real_model", f"TTFT on the trained model ({MODEL}), transformers and vLLM", argv)
    rec.doc["load"]["start"] = load_start
    rounds = max(r["rounds"] for r in rows)
    rec.set_rounds(rounds)
    for r in rows:
        if r["dtype"] != "float32":
            continue
        for n, want in ((4096, 25), (8192, 40)):
            if r["size"] == n:
                rec.goal(f"{r['engine']}: edge hit vs recompute, ~{n // 1024}k tokens, fp32", f"≥ {want}x",
                         r["speedup"], at_least=want, digits=1)
        if r["size"] >= 4096 and "vs_floor" in r:
            rec.goal(f"{r['engine']}: edge hit vs the floor (KV already in memory), ~{r['size'] // 1024}k, fp32",
                     "≤ 1.3x", r["vs_floor"], at_most=1.3)
        rec.goal(f"{r['engine']}: same greedy tokens as recompute in every round, ~{r['size'] // 1024}k, fp32",
                 f"{r['rounds']}/{r['rounds']}", median=r["same_tokens"] / r["rounds"], at_least=1.0)
    rec.table(["engine", "dtype", "prompt tokens", "reused (hit / floor)", "recompute", "edge hit", "speedup [range]",
               "hit vs floor", "same tokens", "load"],
              [[r["engine"], r["dtype"], r["prompt_tokens"], f"{r['reused_tokens']} / {r.get('floor_cached', r['reused_tokens'])}",
                f"{r['recompute_s']:.2f} s",
                f"{r['hit_s'] * 1e3:.0f} ms",
                f"{statistics.median(r['speedup']):.1f}x [{min(r['speedup']):.1f}–{max(r['speedup']):.1f}]",
                f"{statistics.median(r['vs_floor']):.2f}x" if "vs_floor" in r else "–",
                f"{r['same_tokens']}/{r['rounds']}", r["load"]] for r in rows],
              title="Per engine, dtype and context")
    rec.note(floor_bound(rows))
    lay = [r for r in rows if "vs_whole" in r]
    if lay:
        rec.note("transformers: a hit whose fetch runs under the prefill, layer l computed once layer l of every "
                 "chunk is in place (`kdn.layered`), vs one fetched whole first, per-round ratios, median [min–max]: "
                 + ", ".join(f"{r['dtype']} ~{r['size'] // 1024}k {statistics.median(r['vs_whole']):.2f}x "
                             f"[{min(r['vs_whole']):.2f}–{max(r['vs_whole']):.2f}]" for r in lay)
                 + f", with {lay[0]['threads']} torch thread(s) on {len(os.sched_getaffinity(0))} cores. A default "
                 "client layers the fetch only where that pays (`kdn.layered.pays`: a core "
                 f"torch leaves free); the edge-hit figures above are its choice here: "
                 f"{'layered' if lay[0]['layered'] else 'fetched whole'}.")
    decode = [f"~{r['size'] // 1024}k {r['decode_hit_s'] * 1e3:.0f} / {r['decode_recompute_s'] * 1e3:.0f} ms"
              for r in rows if r["engine"] == "transformers" and r["dtype"] == "float32" and "decode_hit_s" in r]
    if decode:
        rec.note("transformers, fp32: each token decoded after the first, after a hit (the cache decodes into the "
                 "fetched KV's room, `kdn.kv.cache_in_room`) / after a recompute (transformers' own cache, which "
                 "copies every layer's KV per token), medians: " + ", ".join(decode) + ".")
    for why in SKIPPED:
        rec.note(why)
    rec.plot(png)
    rec.data(rows)
    rec.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2048,4096,8192", help="approximate prompt tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--engines", default="transformers,vllm")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--vllm-block-size", type=int, default=32,
                    help="vLLM's KV block size (32, the edge's piece size, lets the floor hold what a hit loads)")
    ap.add_argument("--torch-threads", type=int, help="torch's threads in this process (default: torch's own)")
    ap.add_argument("--no-append", action="store_true", help="print only; record nothing")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--edge", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--block-size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        Path(args.result).write_text(json.dumps(run_vllm_child(args)))
        return 0
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    load_start = round(os.getloadavg()[0], 2)
    sizes = [int(s) for s in args.sizes.split(",")]
    engines = args.engines.split(",")
    if "vllm" in engines and not Path(args.vllm_python).is_file():
        print(f"[real_model] no vLLM environment at {args.vllm_python} (deploy/install-vllm.sh): transformers only",
              file=sys.stderr)
        engines = [e for e in engines if e != "vllm"]
    docs = documents(sizes)
    tmp = Path(tempfile.mkdtemp(prefix="kdn-real-model-"))
    edge_proc, edge = start_edge(tmp)
    rows: list[dict[str, Any]] = []
    try:
        for dtype in args.dtypes.split(","):
            if "transformers" in engines:
                rows += run_transformers(docs, dtype, args.rounds, edge)
            if "vllm" in engines:
                rows += run_vllm(docs, dtype, args.rounds, edge, args.vllm_python, tmp, args.vllm_block_size)
    finally:
        edge_proc.terminate()
        edge_proc.wait(20)
    from _results import plot_dir  # benchmarks/ is on sys.path when this runs as a script

    png = plot(rows, plot_dir(not args.no_append) / "real_model.png")
    if args.no_append:
        print(f"not recorded; plot written to {png}")
    else:
        record(rows, argv, load_start, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
