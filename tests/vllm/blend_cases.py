"""The store's blend in an unmodified vLLM: every case in ONE engine process (a start costs minutes).

    python -m tests.vllm.blend_cases OUT.json

An origin (in this process, the trained model, fp32) holds three documents as segments; a ``kdn
edge`` process holds the exact prefix chain of one prompt. vLLM runs with the KDN connector
pointed at both. Cases, each after a reset of vLLM's prefix cache:

- ``blend``: the documents in an order never seen, opted in (``kdn_blend``, a blend salt): the
  connector loads the origin's blend variant; its greedy tokens must equal the transformers
  blend's (:mod:`kdn.blend`, same layout and policy, computed here);
- ``blend_again``: the same request: the variant is served from the origin's memory;
- ``plain``: the same prompt without the opt-in: exact KV from the edge, vLLM's own answer;
- ``no_salt``, ``unknown_documents``, ``no_verdict``: opted in, but without a blend salt, with
  documents the store lacks, with the model's verdict removed: exact KV or a prefill, vLLM's own
  answer, and the connector's warning.

References come from the same engine with KDN off for the request (``kv_transfer_params: {"kdn":
false}``). The layout puts the documents' end on a chunk boundary, so vLLM loads the whole blended
region and computes only the question, as the transformers blend does.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.vllm import engine_output

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CHUNK = 64
BLOCK = 32
DOC_TOKENS = 128
MAX_TOKENS = 8
RATIO = 0.15


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    tmp = Path(tempfile.mkdtemp(prefix="kdn-vllm-blend-"))
    from kdn.pretrained import model_dir

    model = model_dir("smollm2-135m")  # the machine's converted model (under the user's KDN cache)
    os.environ["KDN_CACHE"] = str(tmp / "cache")  # from here on: the verdict this origin reads, nothing of the user's
    from tests.vllm.faults import EdgeProc

    edge = EdgeProc(tmp)
    try:  # the connector's lines ("blend variant ...", "... serving exact KV") land in errlog
        with engine_output("kdn-vllm-blend-engine-", tail=20000) as errlog:
            results = run(tmp, model, edge, errlog)
    finally:
        edge.stop()
    out.write_text(json.dumps(results))
    return 0


def run(tmp: Path, model: Path, edge: Any, errlog: Path) -> dict[str, Any]:
    import numpy as np
    import torch

    from kdn.artifact import encode_artifact
    from kdn.blend import Deviation, blend, place, prefill_segment
    from kdn.blend.verdict import Verdict, verdict_path, write_verdict
    from kdn.client import ClientConfig, KdnClient
    from kdn.integrations.vllm import engine_fingerprint
    from kdn.keys import DEFAULT_NAMESPACE, ROOT_KEY, chunk_keys
    from kdn.kv import forward, output_cache
    from kdn.lab.blend_tasks import chat_parts, document_pool
    from kdn.lab.reference import corpus_split
    from kdn.origin.config import OriginConfig
    from kdn.origin.segments import store_segment
    from kdn.origin.server import OriginServer
    from kdn.prefill import greedy_tail, prefill_chunks
    from kdn.segments import Segment
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    fp = engine_fingerprint(model, torch.float32, CHUNK)
    origin = OriginServer(OriginConfig(store_dir=str(tmp / "origin"), models=[str(model)], dtype="float32",
                                       chunk_size=CHUNK, codecs=["raw"], listen="127.0.0.1:0", fsync=False))
    origin.start()
    try:
        lm = origin.model()
        res: dict[str, Any] = {"fingerprint_equal": bytes(lm.fingerprint) == bytes(fp), "cases": {}}
        write_verdict(Verdict(bytes(lm.fingerprint).hex(), True, RATIO, 1, reason="vLLM test fixture"))
        cs = corpus_split()
        pool = document_pool(lm.tokenizer, cs.heldout[:12], cs.root, doc_tokens=DOC_TOKENS, per_file=1)
        docs = [list(d.tokens) for d in pool[:5]]
        for i, d in enumerate(docs[:3]):  # documents 3 and 4 are never stored
            store_segment(lm, origin.store, origin.segment_catalog, d, namespace=DEFAULT_NAMESPACE, doc_id=f"doc-{i}")
        chat, ask = chat_parts(lm.tokenizer)
        prefix = (chat + lm.tokenizer.encode("Read the files and answer.\n" * 20))[:CHUNK]
        order = [docs[2], docs[0], docs[1]]
        cue = docs[0][40:50]
        question = ask + cue
        prompt = prefix + sum(order, []) + question
        covered = CHUNK + 3 * DOC_TOKENS  # the documents end on a chunk boundary
        res["covered"] = covered

        # the transformers blend of the same layout and policy: the answer vLLM must give
        with torch.inference_mode():
            segs = [Segment(bytes(32), tuple(d), prefill_segment(lm.model, d)) for d in order]
            layout = place(lm.model, segs, prefix_tokens=prefix, prefix_kv=prefill_segment(lm.model, prefix))
            cache, _ = blend(lm.model, layout, Deviation(RATIO, 1))
            o = forward(lm.model, input_ids=torch.tensor([question]), cache=cache, use_cache=True, logits_to_keep=1)
            first = int(o.logits[0, -1].argmax())
            res["transformers_blend"] = greedy_tail(lm.model, output_cache(o), first, max_new_tokens=MAX_TOKENS, eos_ids=set())

        # the exact chain of the prompt's blended region, on the edge (what a plain request reuses)
        chunks = prefill_chunks(lm, np.asarray(prompt[:covered]))
        keys = chunk_keys(prompt[:covered], fingerprint=fp, namespace=DEFAULT_NAMESPACE, chunk_size=CHUNK)
        with KdnClient(ClientConfig(edge=edge.address, shm="off")) as c:
            for i, kv in enumerate(chunks):
                c.put(fp, keys[i], encode_artifact(kv, key=keys[i], parent_key=keys[i - 1] if i else ROOT_KEY,
                                                   fingerprint=fp, chunk_index=i))

        t0 = time.time()
        llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=2048, block_size=BLOCK,
                  enable_prefix_caching=True, max_num_seqs=4, seed=0,
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="KdnConnector", kv_connector_module_path="kdn.integrations.vllm",
                      kv_role="kv_both", kv_load_failure_policy="recompute",
                      kv_connector_extra_config={"edge": edge.address, "blend_origin": origin.address,
                                                 "chunk_size": CHUNK, "shm": "off", "bulk": False,
                                                 "write_back": False}))
        res["engine_start_s"] = time.time() - t0
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

        def gen(tokens: list[int], *, salt: str | None = None, params: dict | None = None) -> dict[str, Any]:
            p: dict[str, Any] = {"prompt_token_ids": list(tokens)}
            if salt:
                p["cache_salt"] = salt
            s = sp.clone()
            if params is not None:
                s.extra_args = {"kv_transfer_params": params}
            llm.reset_prefix_cache()
            before = errlog.stat().st_size
            t = time.perf_counter()
            o = llm.generate([p], s, use_tqdm=False)[0]
            secs = time.perf_counter() - t
            with open(errlog, "rb") as fh:
                fh.seek(before)
                log = fh.read().decode(errors="replace")
            return {"tokens": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0), "seconds": secs,
                    "variant_loaded": "blend variant" in log, "refused": [ln for ln in log.splitlines()  # every blend not honoured
                                                                          if "KDN:" in ln and "serving exact KV" in ln]}

        def case(name: str, tokens: list[int], **kw: Any) -> None:
            got = gen(tokens, **kw)
            got["reference"] = gen(tokens, params={"kdn": False})["tokens"]
            got["origin"] = {k: v for k, v in origin.stats().counters.items() if k.startswith("blend")}
            res["cases"][name] = got
            print(f"case {name}: cached {got['cached']} tokens {got['tokens']} ref {got['reference']}", flush=True)

        opt_in = {"kdn_blend": True}
        case("blend", prompt, salt="kdn-blend-1", params=opt_in)
        case("blend_again", prompt, salt="kdn-blend-1", params=opt_in)
        case("plain", prompt)
        case("no_salt", prompt, params=opt_in)
        unknown = prefix + docs[4] + docs[3] + question
        case("unknown_documents", unknown, salt="kdn-blend-2", params=opt_in)
        verdict_path(lm.fingerprint).unlink()
        case("no_verdict", prefix + docs[1] + docs[2] + docs[0] + question, salt="kdn-blend-3", params=opt_in)
        return res
    finally:
        origin.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
