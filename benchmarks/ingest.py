"""Origin ingest throughput vs plain model prefill, and on-demand compute latency.

    .venv/bin/python benchmarks/ingest.py            # small-125m, 4 documents x 2048 tokens
    .venv/bin/python benchmarks/ingest.py --quick    # tiny, for a smoke run
    .venv/bin/python benchmarks/ingest.py --ray      # also through one Ray origin worker

Baseline, measured in the same run on the same model and documents: ``prefill_chunks`` alone (the
forward pass that any KV producer must pay). Ingest is the whole pipeline: read file, tokenise,
chunk keys, store lookup, prefill, encode per codec, atomic fsynced writes, manifest rows.
Timing is paired: per document, plain prefill then each ingest variant of that same document,
back to back; the ratio reported is the median of the per-document ratios (load from other
processes hits both sides alike), tokens/s are totals. Goal: ingest >= 0.8x plain prefill.

Compute on demand: one ``Compute`` RPC over loopback for a chain nobody stored (cold: prefill +
encode + store) and for the same chain again (warm: keys only), vs plain prefill of that chain.
Records the run as ``ingest`` (``benchmarks/_results.py``); the plot goes to
benchmarks/results/ingest.png.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _results import Record, plot_dir  # noqa: E402

METHOD = """Baseline, measured in the same run on the same model and documents (Python standard-library
source): `prefill_chunks` alone, the forward pass any KV producer must pay. Ingest is the whole
pipeline: read file, tokenise, chunk keys, store lookup, prefill, encode per codec, atomic fsynced
writes, manifest rows. Timing is paired: per document, plain prefill then each ingest variant of
that same document, back to back; the ratio is the median of the per-document ratios, tokens/s are
totals. Compute on demand: one `Compute` RPC over loopback for a chain nobody stored (cold) and for
the same chain again (already stored), against a plain prefill of that chain."""


def corpus(n_docs: int, tokens: int) -> list[str]:
    """Real text: Python's own standard-library sources, cut to ``tokens`` bytes (byte tokenizer)."""
    src = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    for f in sorted(src.glob("*.py")):
        t = f.read_text(encoding="utf-8", errors="ignore")
        t = t.encode("ascii", errors="ignore").decode()
        if len(t) >= tokens:
            texts.append(t[:tokens])
        if len(texts) == n_docs:
            break
    return texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, fewer rounds")
    ap.add_argument("--model", help="model spec (default small-125m; tiny with --quick)")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per document")
    ap.add_argument("--codecs", default="raw,zstd:3")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--compute-tokens", type=int, default=1024)
    ap.add_argument("--ray", action="store_true", help="also ingest through one Ray origin worker")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: fair on a shared box)")
    ap.add_argument("--no-append", action="store_true", help="print only; record nothing")
    args = ap.parse_args(argv)
    model = args.model or ("tiny" if args.quick else "small-125m")
    rounds = args.rounds or (2 if args.quick else 3)
    codecs = [c for c in args.codecs.split(",") if c]
    rec = None if args.no_append else Record(__file__, "ingest", "Origin ingest vs plain prefill, compute on demand", argv)

    import torch

    torch.set_num_threads(args.threads)
    from kdn.models import load_model
    from kdn.prefill import document_tokens, prefill_chunks
    from kdn.origin.config import OriginConfig
    from kdn.origin.ingest import LocalExecutor, ingest
    from kdn.origin.worker import PrefillWorker

    lm = load_model(model)
    texts = corpus(args.docs, args.tokens)
    work = Path(tempfile.mkdtemp(prefix="kdn-bench-ingest-"))
    docs = work / "docs"
    docs.mkdir()
    for i, t in enumerate(texts):
        (docs / f"doc-{i}.py").write_text(t)
    tok_lists = [document_tokens(lm, t) for t in texts]
    covered = sum((len(t) // lm.chunk_size) * lm.chunk_size for t in tok_lists)
    print(f"model {model}, {len(texts)} documents, {covered} tokens in full chunks, codecs {codecs}, {rounds} rounds, "
          f"{args.threads} torch threads, load average {os.getloadavg()[0]:.1f}")

    prefill_chunks(lm, tok_lists[0])  # warm-up
    # Paired, interleaved timing: for each document, plain prefill then each ingest variant of
    # that same document, back to back, so load from other processes hits both sides alike.
    plain_s: list[float] = []
    ing_s: dict[str, list[float]] = {c: [] for c in codecs}
    pair: dict[str, list[float]] = {c: [] for c in codecs}  # per-document ratio ingest/plain tokens/s
    sizes: dict[str, int] = {c: 0 for c in codecs}
    for r in range(rounds):
        for i, t in enumerate(tok_lists):
            n_tok = (len(t) // lm.chunk_size) * lm.chunk_size
            t0 = time.perf_counter()
            prefill_chunks(lm, t)
            base = time.perf_counter() - t0
            plain_s.append(base)
            for c in codecs:
                store = work / f"store-{c.replace(':', '-')}-{r}-{i}"
                cfg = OriginConfig(store_dir=str(store), models=[model], codecs=[c], workers=0)
                ex = LocalExecutor(PrefillWorker(cfg, lm=lm))
                s = ingest([docs / f"doc-{i}.py"], cfg, executor=ex)
                ex.close()
                assert s.failed == 0 and s.prefilled_tokens == n_tok, s.render()
                ing_s[c].append(s.seconds)
                pair[c].append(base / s.seconds)
                sizes[c] = s.bytes_written * len(tok_lists)
                shutil.rmtree(store, ignore_errors=True)
        print(f"  round {r + 1}: plain {covered / sum(plain_s[-len(tok_lists):]):.0f} tok/s; "
              + ", ".join(f"ingest[{c}] {covered / sum(ing_s[c][-len(tok_lists):]):.0f} tok/s" for c in codecs))
    plain_m = covered * rounds / sum(plain_s)
    rows = [("plain prefill (baseline)", plain_m, 1.0, "")]
    for c in codecs:
        m = covered * rounds / sum(ing_s[c])
        rows.append((f"ingest, in-process, {c}", m, statistics.median(pair[c]),
                     f"{sizes[c] / covered:.0f} B/token stored; paired ratios {min(pair[c]):.2f}-{max(pair[c]):.2f}"))

    if args.ray:
        import ray

        from kdn.origin.ingest import RayExecutor
        from kdn.origin.worker import spawn_workers

        tmp = tempfile.mkdtemp(prefix="kdnray")
        ray.init(num_cpus=args.threads, resources={"kdn_origin": 1}, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
        try:
            c = codecs[0]
            vals = []
            for r in range(rounds):
                store = work / f"store-ray-{r}"
                cfg = OriginConfig(store_dir=str(store), models=[model], codecs=[c], workers=1, worker_threads=args.threads,
                                   chunk_size=lm.chunk_size)
                ex = RayExecutor(spawn_workers(cfg, model), max_attempts=cfg.max_attempts, max_restarts=cfg.max_restarts)
                ex.info()  # wait until the actor holds its model: startup is not ingest time
                s = ingest([docs], cfg, executor=ex)
                ex.close()
                vals.append(s.prefilled_tokens / s.seconds)
                shutil.rmtree(store, ignore_errors=True)
            m = statistics.median(vals)
            rows.append((f"ingest, 1 Ray worker, {c}", m, m / plain_m, "actor startup excluded; not paired (noisier)"))
        finally:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)

    # -- compute on demand ---------------------------------------------------------------------
    from kdn.proto import kdn_pb2 as pb
    from kdn.proto import kdn_pb2_grpc as pbg
    from kdn.wire.channel import sync_channel
    from kdn.origin.server import OriginServer

    n_ct = (args.compute_tokens // lm.chunk_size) * lm.chunk_size
    chain = (tok_lists[0] * (n_ct // max(1, len(tok_lists[0])) + 1))[:n_ct]
    srv = OriginServer(OriginConfig(store_dir=str(work / "compute"), models=[model], codecs=[codecs[0]], listen="127.0.0.1:0"),
                       preloaded=(lm,))
    srv.start()
    ch = sync_channel(srv.address)
    stub = pbg.OriginServiceStub(ch)
    cold, warm, base = [], [], []
    for r in range(rounds + 1):
        ns = pb.Namespace(tenant=f"bench{r}")  # a new namespace: nothing stored yet
        t0 = time.perf_counter()
        prefill_chunks(lm, chain)
        base.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        resp = stub.Compute(pb.ComputeRequest(fingerprint=bytes(lm.fingerprint), namespace=ns, tokens=chain), timeout=600)
        cold.append(time.perf_counter() - t0)
        assert resp.computed == n_ct // lm.chunk_size
        t0 = time.perf_counter()
        resp = stub.Compute(pb.ComputeRequest(fingerprint=bytes(lm.fingerprint), namespace=ns, tokens=chain), timeout=600)
        warm.append(time.perf_counter() - t0)
        assert resp.computed == 0
    ch.close()
    srv.stop()
    cold_m, warm_m, base_m = (statistics.median(x[1:]) for x in (cold, warm, base))  # first round = warm-up

    goal = min(v for _, v, ratio, _ in rows[1:] for v in [ratio])
    print()
    print(f"{'what':42} {'tokens/s':>10} {'vs plain':>9}")
    for name, v, ratio, note in rows:
        print(f"{name:42} {v:10.0f} {ratio:8.2f}x  {note}")
    print(f"compute on demand, {n_ct}-token chain ({n_ct // lm.chunk_size} chunks, {codecs[0]}): cold {cold_m * 1e3:.0f} ms "
          f"({cold_m / base_m:.2f}x plain prefill {base_m * 1e3:.0f} ms), already stored {warm_m * 1e3:.1f} ms")
    print(f"goal ingest >= 0.8x plain prefill: {'MET' if goal >= 0.8 else 'NOT MET'} (worst {goal:.2f}x)")

    png = plot_dir(rec is not None) / "ingest.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color=["#888"] * (len(rows) - 1) + ["#357"])
        ax.set_xlabel("prefilled tokens/s")
        ax.set_title(f"Origin ingest vs plain prefill, {model}")
        fig.tight_layout()
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=100)
    except Exception as exc:  # plotting is a nicety
        print(f"(no plot: {exc})")

    if rec is not None:
        rec.set_rounds(rounds)
        rec.goal(f"ingest vs plain prefill tokens/s, {model} (worst of {', '.join(codecs)})", "≥ 0.8x", median=goal,
                 at_least=0.8, rounds=rounds)
        rec.markdown([
            f"Model {model}, {len(texts)} documents (stdlib source), {covered} tokens in full chunks, chunk {lm.chunk_size}, "
            f"{rounds} rounds, paired per document (ratio = median of per-document ratios), {args.threads} torch threads.",
            "",
            "| what | tokens/s | vs plain prefill | note |",
            "|---|---|---|---|",
            *[f"| {n} | {v:.0f} | {ratio:.2f}x | {note} |" for n, v, ratio, note in rows],
            "",
            f"Compute on demand (one gRPC `Compute`, loopback), {n_ct}-token chain, {codecs[0]}: cold {cold_m * 1e3:.0f} ms "
            f"= {cold_m / base_m:.2f}x a plain prefill of the chain ({base_m * 1e3:.0f} ms); already stored: {warm_m * 1e3:.1f} ms.",
        ])
        if png.is_file():
            rec.plot(png)
        rec.save()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
