"""Every vLLM connector case in ONE engine process (an engine start costs minutes on this CPU).

    python -m tests.vllm.cases OUT.json [--model tiny] [--chunk 64] [--block 32]

Runs a real vLLM engine (``LLM``) with the KDN connector against a real ``kdn edge`` process,
reached through a fault proxy (:mod:`tests.vllm.faults`, ``shm: off`` so every byte crosses it).
For each case it records what a test must compare — the greedy tokens with the connector, the
reference greedy tokens of the same prompt, and how many prompt tokens the engine reported as
cached — and writes them to OUT.json; ``tests/vllm/test_vllm_connector.py`` asserts on them.

Reference tokens come from the same engine with the prefix cache reset and the request opted out
of KDN (``kv_transfer_params: {"kdn": false}``): a full recompute by vLLM's own kernels, the
connector neither loading nor saving. Every request with the connector also runs after a prefix
cache reset, so whatever it reuses came from the edge.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.vllm import engine_output

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_TOKENS = 16


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="tiny")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--device", default="", help="vLLM device (empty: the platform's)")
    args = p.parse_args(argv)

    import torch

    # bfloat16: on a CPU with AMX vLLM runs it on its "amx" kernel, whose block layout the
    # connector learns at start, so every case below runs through that layout there
    args.dtype = "bfloat16"
    dtype = getattr(torch, args.dtype)

    from kdn.integrations.model_dir import save_builtin
    from kdn.integrations.vllm import engine_fingerprint
    from tests.vllm.faults import EdgeProc, FaultProxy

    C = args.chunk
    tmp = Path(tempfile.mkdtemp(prefix="kdn-vllm-cases-"))
    model_dir = save_builtin(args.model, tmp / "model", dtype=args.dtype)
    fp = engine_fingerprint(model_dir, dtype, C)
    results: dict[str, Any] = {"chunk": C, "block": args.block, "model": args.model, "dtype": args.dtype, "cases": {}}

    edge = EdgeProc(tmp)
    proxy = FaultProxy(edge)
    try:
        return run_cases(args, results, model_dir, fp, edge, proxy)
    finally:  # never leave the edge behind, whatever failed
        proxy.close()
        edge.stop()


def run_cases(args: Any, results: dict[str, Any], model_dir: Path, fp: Any, edge: Any, proxy: Any) -> int:
    # the connector's lines ("KDN load of chunk ... failed" among them) land in this file, so each
    # case can tell whether its loads failed
    with engine_output("kdn-vllm-engine-") as errlog:
        return _run_cases(args, results, model_dir, fp, edge, proxy, errlog)


def _run_cases(args: Any, results: dict[str, Any], model_dir: Path, fp: Any, edge: Any, proxy: Any, errlog: Path) -> int:
    import numpy as np
    import torch

    from kdn.artifact import encode_artifact
    from kdn.client import ClientConfig, KdnClient
    from kdn.keys import ROOT_KEY, Namespace, chunk_keys
    from kdn.kv import KVShape
    from kdn.models import load_model
    from kdn.prefill import prefill_chunks
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    C = args.chunk
    t0 = time.time()
    kw: dict[str, Any] = {"device": args.device} if args.device else {}
    llm = LLM(
        model=str(model_dir), dtype=args.dtype, enforce_eager=True, max_model_len=2048, block_size=args.block,
        enable_prefix_caching=True, max_num_seqs=4, seed=0, **kw,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KdnConnector", kv_connector_module_path="kdn.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"edge": proxy.address, "chunk_size": C, "shm": "off", "edge_backoff_s": 0.5,
                                       # every byte through the fault proxy (the bulk path would go
                                       # around it; its faults: tests/integration/test_bulk.py)
                                       "bulk": False},
        ),
    )
    results["engine_start_s"] = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    rng = random.Random(1234)
    vocab = 259 if args.model.startswith("tiny") or args.model == "small-125m" else 1000

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def run(tokens: list[int], *, salt: str | None = None, params: dict | None = None) -> tuple[list[int], int, int]:
        """(greedy tokens, cached prompt tokens, chunk loads that failed) of one request."""
        prompt: dict[str, Any] = {"prompt_token_ids": list(tokens)}
        if salt:
            prompt["cache_salt"] = salt
        s = sp.clone()
        if params is not None:
            s.extra_args = {"kv_transfer_params": params}
        llm.reset_prefix_cache()
        before = errlog.stat().st_size
        out = llm.generate([prompt], s, use_tqdm=False)[0]
        with open(errlog, "rb") as fh:
            fh.seek(before)
            failures = fh.read().count(b"KDN load of chunk")
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0), failures

    def reference(tokens: list[int]) -> list[int]:
        return run(tokens, params={"kdn": False})[0]

    def edge_client(ns: Namespace) -> KdnClient:
        return KdnClient(ClientConfig(edge=edge.address, tenant=ns.tenant, salt=ns.salt, shm="off"))

    def wait_stored(tokens: list[int], ns: Namespace, n: int, timeout: float = 30.0) -> int:
        keys = chunk_keys(np.asarray(tokens), fingerprint=fp, namespace=ns, chunk_size=C)[:n]
        with edge_client(ns) as c:
            deadline = time.time() + timeout
            while True:
                have = c.lookup(fp, keys)
                if have >= n or time.time() > deadline:
                    return have
                time.sleep(0.1)

    def record(name: str, tokens: list[int], got: tuple[list[int], int, int], expect_cached: int, **extra: Any) -> None:
        results["cases"][name] = {"tokens": got[0], "reference": reference(tokens), "cached": got[1],
                                  "load_failures": got[2], "expect_cached": expect_cached, "prompt_len": len(tokens),
                                  **extra}
        print(f"case {name}: cached {got[1]} (expect {expect_cached}) same={got[0] == results['cases'][name]['reference']}",
              flush=True)

    # 1. KV saved by vLLM itself: a writer request stores doc's 5 chunks, readers reuse them
    ns_a = Namespace("tenant-a")
    doc = rand(5 * C)
    writer = doc + rand(10)
    got = run(writer, params={"kdn_tenant": ns_a.tenant})
    results["cases"]["writer"] = {"tokens": got[0], "reference": reference(writer), "cached": got[1],
                                  "expect_cached": 0, "prompt_len": len(writer)}
    results["stored_after_writer"] = wait_stored(writer, ns_a, 5)
    by_a = {"kdn_tenant": ns_a.tenant}
    p = rand(3 * C + 7)
    record("share_0", p, run(p, params=by_a), 0)
    p = doc[: C // 2 + 3] + rand(2 * C)
    record("share_part_of_chunk", p, run(p, params=by_a), 0)
    p = doc[: 4 * C]
    record("exactly_4_chunks", p, run(p, params=by_a), 3 * C)  # the last chunk holds the last token: recomputed
    p = doc[: 4 * C] + rand(1)
    record("4_chunks_plus_1", p, run(p, params=by_a), 4 * C)
    p = doc + rand(C // 2 + 9)
    record("5_chunks_plus_tail", p, run(p, params=by_a), 5 * C)

    # 2. the same, with the namespace carried by cache_salt, and a second tenant that must not reuse it
    salted = rand(4 * C) + rand(5)
    got = run(salted, salt="tenant-s1")
    results["stored_salted"] = wait_stored(salted, Namespace("tenant-s1"), 4)
    record("salt_same_tenant", salted, run(salted, salt="tenant-s1"), 4 * C)
    record("salt_other_tenant", salted, run(salted, salt="tenant-s2"), 0)
    p = doc + rand(9)
    record("params_other_tenant", p, run(p, params={"kdn_tenant": "tenant-b"}), 0)

    # 3. KV made by the origin's code path: HF transformers prefill (kdn.prefill) in bf16 from the
    # same directory, encoded as artifacts and Put; vLLM reuses them (same keys, same fingerprint)
    lm = load_model(str(model_dir), dtype=args.dtype, chunk_size=C)
    results["origin_fingerprint_equal"] = bytes(lm.fingerprint) == bytes(fp)
    ns_o = Namespace("tenant-origin")
    odoc = rand(6 * C)
    chunks = prefill_chunks(lm, np.asarray(odoc))  # 6 x (L, 2, H, C, D)
    okeys = chunk_keys(np.asarray(odoc), fingerprint=lm.fingerprint, namespace=ns_o, chunk_size=C)
    with edge_client(ns_o) as c:
        for i, kv in enumerate(chunks):
            c.put(lm.fingerprint, okeys[i], encode_artifact(kv, key=okeys[i], parent_key=okeys[i - 1] if i else ROOT_KEY,
                                                            fingerprint=lm.fingerprint, chunk_index=i))
    agree = []
    for q in range(4):
        p = odoc + rand(C // 2 + 5 * q + 1)
        got = run(p, params={"kdn_tenant": ns_o.tenant})
        ref = reference(p)
        # first position where the greedy continuations differ (the common length when they don't)
        n_same = next((i for i, (a, b) in enumerate(zip(got[0], ref)) if a != b), min(len(got[0]), len(ref)))
        agree.append({"cached": got[1], "load_failures": got[2], "first_divergence": n_same, "equal": got[0] == ref,
                      "token_agreement": sum(a == b for a, b in zip(got[0], ref)) / max(1, len(ref))})
    results["origin_agreement"] = agree
    # the KV itself: vLLM's own (written back under another tenant) vs the origin's, chunk by chunk
    ns_v = Namespace("tenant-vllm-kv")
    run(odoc + rand(3), params={"kdn_tenant": ns_v.tenant})
    results["stored_vllm_copy"] = wait_stored(odoc, ns_v, 6)
    vkeys = chunk_keys(np.asarray(odoc), fingerprint=fp, namespace=ns_v, chunk_size=C)
    diffs = []
    with edge_client(ns_v) as c:
        shape = KVShape.from_config(lm.config, getattr(torch, args.dtype))
        r = c.reuse(odoc, fingerprint=fp, kv_shape=shape, chunk_size=C)
        if r.kv is not None:
            hf = torch.cat(chunks, dim=3)[:, :, :, : r.tokens].float()  # (L, 2, H, N, D)
            vl = r.kv.float()
            err = (vl - hf).abs()
            diffs = {"tokens": r.tokens, "max_abs": float(err.max()), "mean_abs": float(err.mean()),
                     "rel_l2": float((vl - hf).norm() / hf.norm()), "max_abs_ref": float(hf.abs().max()),
                     "per_layer_rel_l2": [float((vl[l] - hf[l]).norm() / hf[l].norm()) for l in range(hf.shape[0])]}
    results["origin_vs_vllm_kv"] = diffs

    # 4. faults in the middle of a 16-chunk load: a flipped byte, then the edge killed
    ns_f = Namespace("tenant-faults")
    fdoc = rand(16 * C)
    run(fdoc + rand(3), params={"kdn_tenant": ns_f.tenant})
    results["stored_faults"] = wait_stored(fdoc, ns_f, 16)
    chunk_bytes = len(encode_artifact(chunks[0], key=okeys[0], parent_key=ROOT_KEY, fingerprint=fp))
    results["chunk_bytes"] = chunk_bytes
    p = fdoc + rand(11)
    proxy.flip_at(int(chunk_bytes * 5.5))
    got = run(p, params={"kdn_tenant": ns_f.tenant})
    record("corrupt_mid_load", p, got, -1, fault_fired=proxy.fired.is_set())
    p = fdoc + rand(13)
    proxy.kill_after(int(chunk_bytes * 7.5))
    got = run(p, params={"kdn_tenant": ns_f.tenant})
    record("edge_killed_mid_load", p, got, -1, fault_fired=proxy.fired.is_set())
    p = fdoc + rand(17)
    record("edge_down", p, run(p, params={"kdn_tenant": ns_f.tenant}), 0)

    Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
