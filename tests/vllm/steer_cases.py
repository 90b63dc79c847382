"""A steered variant served through an edge into vLLM, beside the transformers path, in ONE engine process.

    python -m tests.vllm.steer_cases OUT.json [--haystacks 2] [--length 1024] [--calibration FILE]

Test haystacks of the steering task (:mod:`kdn.lab.steer_task`) are written as files and ingested
at an origin the way an operator does it — ``kdn ingest --layout system --emphasize key-edit
--emphasize-regex '^# NOTE:'`` — which stores the plain chain and the steered variant; a ``kdn
edge`` pulls both from that origin. Every question (five per haystack) then runs:

- transformers (:func:`kdn.integrations.transformers.generate`, fp32): full recompute, a plain
  hit, and a steered hit (a client naming the variant);
- vLLM (fp32, the KDN connector): alone (KDN off, its own salt), a plain hit, and a steered hit
  (``kdn_steer`` and a ``cache_salt`` naming the variant), each after a prefix-cache reset;

recording greedy tokens, reused/cached tokens and times. Bad input on the first question: a
steered request without the salt, and another tenant's request for the variant. ``--calibration``
is a key-edit calibration file to serve with (the benchmark passes the one ``kdn eval-steer``
chose); without it one is made here from a calibration haystack (the setting does not matter to
the equality this checks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_TOKENS = 6
RULE = "^# NOTE:"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--haystacks", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--calibration", type=Path, default=None)
    args = p.parse_args(argv)

    from kdn.pretrained import model_dir

    real = model_dir("smollm2-135m")
    tmp = Path(tempfile.mkdtemp(prefix="kdn-vllm-steer-"))
    cache = tmp / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(real.parent)  # the converted model, shared; calibrations stay here
    os.environ["KDN_CACHE"] = str(cache)
    try:
        return run(args, tmp, real)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _calibration(args: argparse.Namespace, lm: Any) -> None:
    from kdn.lab.steer_eval import Setting, answer_query_means, calibration_of
    from kdn.lab.steer_task import SourcePool, make_haystack
    from kdn.steer.methods import calibration_root, full_kv, write_calibration

    fp = bytes(lm.fingerprint).hex()
    if args.calibration is not None:
        calibration_root().mkdir(parents=True, exist_ok=True)
        shutil.copy(args.calibration, calibration_root() / f"{fp}.json")
        return
    hs = make_haystack(SourcePool(lm.tokenizer, "calibration"), length=args.length, n_docs=5, seed=0, index=0)
    means = answer_query_means(lm, full_kv(lm.model, hs.tokens), hs.questions) / len(hs.questions)
    write_calibration(calibration_of(Setting("key-edit", "late", "ramp", 2.0), lm, means.float(), 4096))


def run(args: argparse.Namespace, tmp: Path, model: Path) -> int:
    import torch

    from kdn.client import ClientConfig, KdnClient
    from kdn.integrations.transformers import generate
    from kdn.lab.steer_task import SourcePool, answer_opening, make_haystack, question_text
    from kdn.models import load_model
    from kdn.prompts import chat_tokens
    from tests.vllm.faults import EdgeProc, kdn_command

    torch.set_num_threads(2)
    lm = load_model("smollm2-135m")
    _calibration(args, lm)
    pool = SourcePool(lm.tokenizer, "test")
    docs = tmp / "docs"
    docs.mkdir()
    haystacks = [make_haystack(pool, length=args.length, n_docs=5, seed=0, index=i) for i in range(args.haystacks)]
    for i, hs in enumerate(haystacks):
        (docs / f"h{i}.txt").write_text(hs.text, encoding="utf-8")
    store = tmp / "store"
    t0 = time.perf_counter()
    ing = subprocess.run([kdn_command(), "ingest", str(docs), "--model", "smollm2-135m", "--layout", "system",
                          "--emphasize", "key-edit", "--emphasize-regex", RULE, "--store", str(store), "--codec", "raw",
                          "--workers", "0", "--json"], capture_output=True, text=True, timeout=1800, cwd=tmp)
    if ing.returncode != 0:
        raise RuntimeError(f"kdn ingest failed: {ing.stdout[-3000:]} {ing.stderr[-3000:]}")
    ingest_s = time.perf_counter() - t0
    by_doc = {Path(r["doc_id"].split("#")[0]).name: r for r in json.loads(ing.stdout)["results"]}
    variants = [by_doc[f"h{i}.txt"]["steer_variant"] for i in range(len(haystacks))]
    spec = by_doc["h0.txt"]["steer"]
    origin = subprocess.Popen([kdn_command(), "origin", "--store", str(store), "--model", "smollm2-135m",
                               "--listen", "127.0.0.1:0", "--json"], stdout=subprocess.PIPE, text=True, cwd=tmp)
    edge = None
    try:
        assert origin.stdout is not None
        edge = EdgeProc(tmp, "--origin", json.loads(origin.stdout.readline())["address"])
        prompts = []
        for i, hs in enumerate(haystacks):
            for q in hs.questions:
                msgs = [{"role": "system", "content": hs.text}, {"role": "user", "content": question_text(q.vault)}]
                tokens = chat_tokens(lm.tokenizer, msgs) + lm.tokenizer.encode(answer_opening(q.vault))
                prompts.append({"haystack": i, "depth": q.depth, "code": q.code, "variant": variants[i],
                                "tokens": tokens, "stored": len(hs.tokens)})
        tf = transformers_path(lm, prompts, edge.address, generate, KdnClient, ClientConfig)
        vl = vllm_path(str(model), prompts, edge.address)
    finally:
        if edge is not None:
            edge.stop()
        origin.terminate()
        origin.wait(30)
    out = {"haystacks": len(haystacks), "length": args.length, "spec": spec, "variants": variants,
           "ingest_s": ingest_s, "prompts": [{k: v for k, v in p.items() if k != "tokens"} | tf[j] | vl["prompts"][j]
                                             for j, p in enumerate(prompts)],
           "bad": vl["bad"], "chunk": 256}
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def transformers_path(lm: Any, prompts: list[dict[str, Any]], edge: str, generate: Any, client_cls: Any,
                      config_cls: Any) -> list[dict[str, Any]]:
    out = []
    # one client per variant, kept open like the plain one: the TTFTs compare hits, not channel setups
    steered_clients: dict[str, Any] = {}
    with client_cls(config_cls(edge=edge, write_back=False)) as plain, contextlib.ExitStack() as stack:
        for p in prompts:
            ref = generate(lm, p["tokens"], max_new_tokens=MAX_TOKENS)
            hit = generate(lm, p["tokens"], client=plain, max_new_tokens=MAX_TOKENS)
            if p["variant"] not in steered_clients:
                steered_clients[p["variant"]] = stack.enter_context(
                    client_cls(config_cls(edge=edge, write_back=False, steer=p["variant"])))
            steered = generate(lm, p["tokens"], client=steered_clients[p["variant"]], max_new_tokens=MAX_TOKENS)
            out.append({"hf_alone": ref.tokens, "hf_plain": hit.tokens, "hf_plain_reused": hit.reused_tokens,
                        "hf_steered": steered.tokens, "hf_steered_reused": steered.reused_tokens,
                        "hf_steered_warnings": list(steered.warnings), "hf_plain_ttft_s": hit.timings.ttft_s,
                        "hf_steered_ttft_s": steered.timings.ttft_s, "hf_text": lm.tokenizer.decode(steered.tokens)})
    return out


def vllm_path(model: str, prompts: list[dict[str, Any]], edge: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KdnConnector", kv_connector_module_path="kdn.integrations.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"edge": edge, "chunk_size": 256, "write_back": False})
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=4096, max_num_batched_tokens=4096,
              enable_prefix_caching=True, max_num_seqs=1, seed=0, kv_transfer_config=ktc)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def gen(tokens: list[int], params: dict[str, Any], salt: str | None) -> tuple[list[int], int, float]:
        llm.reset_prefix_cache()
        s = sp.clone()
        s.extra_args = {"kv_transfer_params": params}
        prompt: dict[str, Any] = {"prompt_token_ids": tokens}
        if salt is not None:
            prompt["cache_salt"] = salt
        t0 = time.perf_counter()
        o = llm.generate([prompt], s, use_tqdm=False)[0]
        return list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0), time.perf_counter() - t0

    gen(prompts[0]["tokens"], {"kdn": False}, "warm-up")
    rows = []
    for j, p in enumerate(prompts):
        v = p["variant"]
        alone, _, t_alone = gen(p["tokens"], {"kdn": False}, f"alone-{j}")
        plain, plain_cached, t_plain = gen(p["tokens"], {}, None)
        steered, steered_cached, t_steered = gen(p["tokens"], {"kdn_steer": v}, f"kdn-steer-{v}")
        rows.append({"vllm_alone": alone, "vllm_plain": plain, "vllm_plain_cached": plain_cached,
                     "vllm_steered": steered, "vllm_steered_cached": steered_cached, "vllm_alone_s": t_alone,
                     "vllm_plain_s": t_plain, "vllm_steered_s": t_steered})
    p = prompts[0]
    v = p["variant"]
    no_salt, no_salt_cached, _ = gen(p["tokens"], {"kdn_steer": v}, None)  # refused: no salt naming the variant
    other, other_cached, _ = gen(p["tokens"], {"kdn_steer": v, "kdn_tenant": "someone-else"}, f"kdn-steer-{v}")
    bad = {"no_salt": {"tokens": no_salt, "cached": no_salt_cached},
           "other_tenant": {"tokens": other, "cached": other_cached}}
    return {"prompts": rows, "bad": bad}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
