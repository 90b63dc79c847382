"""``kdn query``: one request through the local edge, with its time-to-first-token breakdown.

    kdn query --edge 127.0.0.1:50071 --model small-125m --prompt-file manual.txt --prompt "Summary:"

Prints where the time to the first token went (chunk keys, lookup, fetch — of which decode —,
cache assembly, remainder prefill, first token), how many prompt tokens were reused vs computed,
and the generated text. If the cache failed (edge down, timeout, corrupt artifact, another
model's artifact) the answer is still computed locally and the one warning says what happened.
``--compare`` also runs a full recompute and reports whether the outputs match.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from kdn.console import report_error
from kdn.errors import KdnError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdn query", description=__doc__.split("\n\n")[0])
    p.add_argument("--edge", help="host:port of the local edge (omit: recompute only)")
    p.add_argument("--fallback-edge", action="append", dest="fallback_edges", metavar="ADDR",
                   help="another edge to use while the ones before it are unavailable (repeatable)")
    p.add_argument("--model", default="tiny", help="built-in spec or local HF model directory (default: tiny)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default 256)")
    p.add_argument("--prompt", help="prompt text (after --prompt-file's text when both are given)")
    p.add_argument("--prompt-file", type=Path, help="file whose text starts the prompt (e.g. a document)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--tenant", default=None, help="namespace tenant (default: default)")
    p.add_argument("--salt", default=None, help="namespace salt")
    p.add_argument("--token", default=None, help="bearer token for the edge")
    p.add_argument("--shm", choices=["auto", "on", "off"], default=None, help="shared-memory path (auto: loopback)")
    p.add_argument("--no-write-back", action="store_true", help="do not store newly computed chunks on the edge")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each fetch, seconds")
    p.add_argument("--config", type=Path, help="ClientConfig file (YAML/JSON); flags override it")
    p.add_argument("--compare", action="store_true", help="also run a full recompute and compare outputs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _prompt(args: argparse.Namespace) -> str:
    parts = []
    if args.prompt_file is not None:
        try:
            parts.append(args.prompt_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise KdnError(f"cannot read --prompt-file {args.prompt_file}: {exc}") from exc
    if args.prompt is not None:
        parts.append(args.prompt)
    if not parts:
        raise KdnError("give --prompt TEXT or --prompt-file FILE")
    return "".join(parts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kdn.client import ClientConfig, KdnClient
    from kdn.integrations.transformers import generate
    from kdn.keys import DEFAULT_CHUNK_SIZE
    from kdn.models import load_model

    prompt = _prompt(args)
    overrides = dict(edge=args.edge, fallback_edges=args.fallback_edges, tenant=args.tenant, salt=args.salt, token=args.token, shm=args.shm,
                     fetch_timeout_s=args.timeout, write_back=False if args.no_write_back else None)
    cfg = ClientConfig.from_file(args.config, **overrides) if args.config else ClientConfig.build(**overrides)
    lm = load_model(args.model, dtype=args.dtype, chunk_size=args.chunk_size or DEFAULT_CHUNK_SIZE)
    with KdnClient(cfg) as client:
        result = generate(lm, prompt, client=client, max_new_tokens=args.max_new_tokens)
        client.flush(cfg.put_timeout_s)
        written = int(client.counters["written_back"])
    out: dict[str, Any] = {
        "edge": cfg.edge,
        "model": args.model,
        "dtype": args.dtype,
        "fingerprint": bytes(lm.fingerprint).hex(),
        "tenant": cfg.tenant,
        "prompt_tokens": result.prompt_tokens,
        "reused_tokens": result.reused_tokens,
        "computed_tokens": result.computed_tokens,
        "fetched_bytes": result.fetched_bytes,
        "via": result.via,
        "written_back_chunks": written,
        "timings": result.timings.as_dict(),
        "ttft_s": result.timings.ttft_s,
        "tokens": result.tokens,
        "text": result.text,
        "warnings": list(result.warnings),
    }
    if args.compare:
        base = generate(lm, prompt, max_new_tokens=args.max_new_tokens)
        out["recompute"] = {"ttft_s": base.timings.ttft_s, "tokens": base.tokens}
        out["outputs_match"] = base.tokens == result.tokens
        out["speedup"] = base.timings.ttft_s / max(result.timings.ttft_s, 1e-9)
    return out


def render(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = out["timings"]
    table = Table(title=f"kdn query — {out['model']} via {out['edge'] or '(no edge)'}", show_header=True)
    table.add_column("step")
    table.add_column("ms", justify="right")
    for label, key in (("chunk keys", "keys_s"), ("lookup", "lookup_s"), ("fetch (wall)", "fetch_s"),
                       ("  of which verify+decode", "decode_s"), ("cache assembly", "build_s"),
                       ("remainder prefill", "prefill_s"), ("first token", "first_token_s")):
        table.add_row(label, f"{t[key] * 1e3:.1f}")
    table.add_row("[bold]time to first token[/bold]", f"[bold]{t['ttft_s'] * 1e3:.1f}[/bold]")
    console.print(table)
    via = f" via {out['via']}" if out["via"] else ""
    console.print(
        f"prompt {out['prompt_tokens']} tokens: reused {out['reused_tokens']}{via} "
        f"({out['fetched_bytes'] / 1e6:.1f} MB), computed {out['computed_tokens']}; "
        f"wrote back {out['written_back_chunks']} chunk(s)"
    )
    if "recompute" in out:
        console.print(
            f"full recompute: TTFT {out['recompute']['ttft_s'] * 1e3:.1f} ms "
            f"({out['speedup']:.1f}x); outputs match: {out['outputs_match']}"
        )
    for w in out["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}", markup=True, highlight=False)
    console.print("generated:", out["text"] if out["text"] is not None else out["tokens"], markup=False)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    # the client's one warning goes to the JSON / the rendered output, not twice to stderr
    logging.getLogger("kdn.client").addHandler(logging.NullHandler())
    logging.getLogger("kdn.client").propagate = False
    try:
        out = run(args)
    except KdnError as exc:
        report_error("query", exc, as_json=args.json)
        return 2
    finally:
        logging.getLogger("kdn.client").propagate = True
    if args.json:
        print(json.dumps(out))
    else:
        render(out)
    return 0
