"""``kdn model``: the models KDN knows, where they live, and whether a model's tokens match the engine's.

    kdn model list                                  # built-in models (trained and random-init), lab models
    kdn model info smollm2-135m --dtype bfloat16    # shape, KV bytes per token, fingerprint, directory
    kdn model path smollm2-135m                     # the directory to give an engine (vllm serve DIR)
    kdn model check-tokens smollm2-135m             # KDN's document tokens vs the engine's request tokens
    kdn model train-reference [...]                 # the lab's small models (kdn.lab.reference)

``check-tokens`` tokenizes a document and a question the way KDN stores documents
(:mod:`kdn.prompts`) and the way the engine tokenizes requests — vLLM's own tokenizer and chat
rendering when vLLM is importable here, else the model's Hugging Face tokenizer called as an
OpenAI-style server calls it (completions with special tokens; chat templates rendered, then
tokenized without) — and reports, per layout, whether every full chunk of the stored document is
a prefix of the request. Exit code 1 when one is not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from kdn.console import plain, report_error
from kdn.errors import KdnError

SAMPLE_QUESTION = "What does this text say about repairs?"
QUESTION_AFTER = "\n\n"  # between a document and the question in one prompt or message


def _list() -> list[dict[str, Any]]:
    from kdn.config import cache_root
    from kdn.errors import ModelInstallError
    from kdn.models import BUILTIN_SPECS
    from kdn.pretrained import PRETRAINED, gguf_path, installed_dir

    rows: list[dict[str, Any]] = []
    for name, s in PRETRAINED.items():
        try:
            gguf_path(name)
            package = "installed"
        except ModelInstallError:
            package = "missing"
        d = installed_dir(name)
        rows.append({"name": name, "kind": "trained", "package": f"{s.package} ({package})",
                     "directory": str(d) if d else None, "description": s.description})
    for name, b in BUILTIN_SPECS.items():
        rows.append({"name": name, "kind": "random-init", "package": None, "directory": None,
                     "description": b.description})
    for sub, what in (("reference-model", "the lab's stdlib LM (kdn model train-reference)"),
                      ("retrieval-model", "the lab's retrieval LM (kdn model train-reference --task retrieval)")):
        d = cache_root() / sub
        if (d / "config.json").is_file():
            rows.append({"name": str(d), "kind": "lab", "package": None, "directory": str(d), "description": what})
    return rows


def _info(spec: str, dtype: str, chunk_size: int | None) -> dict[str, Any]:
    from kdn.keys import DEFAULT_CHUNK_SIZE
    from kdn.lab.layout import META_FILE
    from kdn.models import describe, load_model

    from kdn.blend.verdict import verdict_summary
    from kdn.steer.methods import calibration_summary

    lm = load_model(spec, dtype=dtype, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE)
    info = describe(lm)
    info["blend"] = verdict_summary(lm.fingerprint)  # whether documents anywhere in a prompt are blended, at what ratio
    info["steering"] = calibration_summary(info["fingerprint"])  # which variants it can store, their measured effect
    meta = Path(spec) / META_FILE
    if meta.is_file():
        info["reference"] = json.loads(meta.read_text()).get("result", {})
    return info


def _engine_tokens(directory: Path, document: str, question: str, layout: str) -> tuple[list[int], str]:
    """The request's tokens as the engine computes them, and which engine code computed them."""
    messages = ([{"role": "system", "content": document}, {"role": "user", "content": question}] if layout == "system"
                else [{"role": "user", "content": document + QUESTION_AFTER + question}])
    try:
        from vllm.tokenizers import get_tokenizer  # type: ignore[import-not-found]

        tok = get_tokenizer(str(directory))
        who = "vLLM's tokenizer"
    except ImportError:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        who = "transformers' tokenizer, as an OpenAI-style server calls it"
    if layout == "text":
        return list(tok(document + QUESTION_AFTER + question).input_ids), who  # completions: special tokens added
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(rendered, add_special_tokens=False).input_ids), who  # chat: the template writes them


def check_tokens(spec: str, document: str, question: str, layouts: Sequence[str], chunk_size: int) -> dict[str, Any]:
    from kdn.errors import InvalidInput
    from kdn.models import load_model
    from kdn.prompts import document_tokens

    lm = load_model(spec, chunk_size=chunk_size)
    directory = lm.directory
    if directory is None:
        raise InvalidInput(f"{spec} is a random-init spec with KDN's own byte tokenizer: no engine tokenizes for it")
    rows = []
    for layout in layouts:
        try:
            stored = document_tokens(lm.tokenizer, document, layout)
        except InvalidInput as exc:
            rows.append({"layout": layout, "ok": None, "why": str(exc)})
            continue
        engine, who = _engine_tokens(directory, document, question, layout)
        full = (len(stored) - 1) // chunk_size  # whole chunks, the document's last token left out
        same = 0
        while same < len(stored) and same < len(engine) and stored[same] == engine[same]:
            same += 1
        ok = same >= full * chunk_size
        rows.append({"layout": layout, "ok": ok, "engine": who, "stored_tokens": len(stored),
                     "request_tokens": len(engine), "common_prefix": same, "full_chunks": full,
                     "first_difference": None if same >= min(len(stored), len(engine)) else same,
                     "stored_head": stored[:4], "engine_head": engine[:4]})
    return {"spec": spec, "directory": str(directory), "chunk_size": chunk_size, "layouts": rows,
            "ok": all(r["ok"] is not False for r in rows)}


def _print_check(out: dict[str, Any]) -> None:
    print(f"{out['spec']} ({out['directory']}), chunks of {out['chunk_size']} tokens")
    for r in out["layouts"]:
        if r["ok"] is None:
            print(f"  {r['layout']:>6}: not available ({r['why']})")
            continue
        verdict = "ok" if r["ok"] else "MISMATCH"
        print(f"  {r['layout']:>6}: {verdict}: the stored document's {r['stored_tokens']} tokens ({r['full_chunks']} full "
              f"chunks) and the request's {r['request_tokens']} share their first {r['common_prefix']} ({r['engine']})")
        if not r["ok"]:
            print(f"          first tokens stored {r['stored_head']} vs the engine's {r['engine_head']}: requests "
                  "would never reuse these chunks")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kdn model", description=plain(__doc__.split("\n\n")[0]))
    sub = parser.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="built-in models (trained and random-init) and the lab's trained ones")
    ls.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    inf = sub.add_parser("info", help="shape, KV bytes per token, fingerprint and directory of a model")
    inf.add_argument("spec", nargs="?", default=None, help="built-in name or model dir (default: the lab's reference model)")
    inf.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (part of the fingerprint)")
    inf.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default 256)")
    inf.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    path = sub.add_parser("path", help="the model directory an engine loads (converts a trained built-in once)")
    path.add_argument("spec", help="built-in trained model name or model dir")
    path.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    chk = sub.add_parser("check-tokens", help="does KDN store documents under the tokens the engine gives requests?")
    chk.add_argument("spec", help="built-in trained model name or model dir")
    chk.add_argument("--document", type=Path, default=None, help="a document (default: a bundled sample)")
    chk.add_argument("--question", default=SAMPLE_QUESTION, help="the question after it")
    chk.add_argument("--layout", action="append", choices=["text", "system", "user"], default=None,
                     help="layouts to check (repeatable; default all)")
    chk.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default 256)")
    chk.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    sub.add_parser("train-reference", add_help=False, help="train one of the lab's small models (kdn.lab.reference)")
    if argv[:1] == ["train-reference"]:
        from kdn.lab.reference import main as train_main

        return train_main(argv)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "list":
            rows = _list()
            if args.json:
                print(json.dumps({"models": rows}, indent=2))
            else:
                for r in rows:
                    where = r["directory"] or (r["package"] or "")
                    print(f"{r['name']:<16} {r['kind']:<11} {r['description']}" + (f"\n{'':<28} {where}" if where else ""))
            return 0
        if args.cmd == "info":
            from kdn.lab.reference import default_reference_dir

            info = _info(args.spec or str(default_reference_dir()), args.dtype, args.chunk_size)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                for k, v in info.items():
                    print(f"{k:>20}: {v}")
            return 0
        if args.cmd == "path":
            from kdn.models import is_model_dir, resolve_spec
            from kdn.errors import UnknownModel

            d = resolve_spec(args.spec)
            if not is_model_dir(d):
                raise UnknownModel(f"{args.spec!r} has no model directory: it is a random-init spec or not a model "
                                   "(random-init specs: python -m kdn.integrations.model_dir SPEC DIR)")
            print(json.dumps({"spec": args.spec, "directory": d}) if args.json else d)
            return 0
        from kdn.ops.demo import SAMPLES_DIR

        doc_path = args.document or SAMPLES_DIR / "lease_policy.txt"
        try:
            document = doc_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KdnError(f"cannot read --document {doc_path}: {exc}") from exc
        out = check_tokens(args.spec, document, args.question, args.layout or ["text", "system", "user"],
                           args.chunk_size)
    except KdnError as exc:
        report_error(f"model {args.cmd}", exc, as_json=args.json)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_check(out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
