"""``kdn query``: one request through the local edge, with its time-to-first-token breakdown.

    kdn query --edge 127.0.0.1:50071 --model small-125m --prompt-file manual.txt --prompt "Summary:"

Prints where the time to the first token went (chunk keys, lookup, fetch — of which decode —,
cache assembly, remainder prefill, first token), how many prompt tokens were reused vs computed,
and the generated text. If the cache failed (edge down, timeout, corrupt artifact, another
model's artifact) the answer is still computed locally and the one warning says what happened.
``--compare`` also runs a full recompute and reports whether the outputs match (the model is
warmed up first, so neither timing pays for the first call).

``--layout system`` (or ``user``) sends a chat: ``--prompt-file``'s document as the system message
(or the start of the first user message) and ``--prompt`` as the question, rendered with the
model's chat template exactly as an engine's chat endpoint renders it — so a document ingested with
``kdn ingest --layout system`` is reused. ``--layout text`` (the default) is a completion prompt:
the file's text, then the prompt's.

``--documents a.md b.md c.md`` reuses each document wherever it sits in the prompt
(``[--prompt-file][documents…][--prompt]``): each is fetched as a segment (or computed here and
stored as one), re-placed and blended at the ratio the model's verdict names (``kdn eval-blend``);
``--blend-ratio R`` forces a ratio for experiments. Without a passing verdict the documents are
reused as an exact prefix only, and the warning says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from kdn.console import StageLines, plain, report_error
from kdn.edge.cli import add_connection_flags
from kdn.errors import InvalidInput, KdnError
from kdn.pretrained import DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdn query", description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("--edge", help="host:port of the local edge (omit: recompute only)")
    p.add_argument("--fallback-edge", action="append", dest="fallback_edges", metavar="ADDR",
                   help="another edge to use while the ones before it are unavailable (repeatable)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"built-in name or local HF model directory (default: {DEFAULT_MODEL}, trained)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default 256)")
    p.add_argument("--prompt", help="prompt text (after --prompt-file's text when both are given)")
    p.add_argument("--prompt-file", type=Path, help="file whose text starts the prompt (e.g. a document)")
    p.add_argument("--layout", choices=["text", "system", "user"], default="text",
                   help="text: one completion prompt (file, then prompt); system: a chat with the file as the system "
                        "message and the prompt as the user's question; user: a chat whose user message is file + prompt "
                        "(use the layout the document was ingested with)")
    p.add_argument("--documents", nargs="+", type=Path, metavar="FILE",
                   help="documents reused anywhere in the prompt (segments, blended): placed after --prompt-file, before --prompt")
    p.add_argument("--blend-ratio", type=float, default=None,
                   help="with --documents: recompute this share of document tokens regardless of the verdict")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--tenant", default=None, help="namespace tenant (default: default)")
    p.add_argument("--salt", default=None, help="namespace salt")
    add_connection_flags(p)  # --token, --tls-ca, --tls-cert, --tls-key: as kdn stats and kdn edge pin
    p.add_argument("--shm", choices=["auto", "on", "off"], default=None, help="shared-memory path (auto: loopback)")
    p.add_argument("--no-write-back", action="store_true", help="do not store newly computed chunks on the edge")
    p.add_argument("--steer", default=None, metavar="VARIANT",
                   help="reuse this steered variant (id printed by `kdn ingest --emphasize`) instead of plain KV")
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


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KdnError(f"cannot read {what} {path}: {exc}") from exc


def _window_prompt(lm: Any, prompt: str, max_new_tokens: int, model: str) -> list[int]:
    """The prompt's tokens, refused with a clear error when the prompt and the answer do not fit
    the model window. An error, not a silent cut: cutting a prompt changes the question asked
    (and which end to keep is the user's choice), and a model run past its positions answers
    garbage. Bounded: the tokenizer sees about the window's worth of text, not the whole prompt."""
    from kdn.prefill import window_tokens

    window = lm.max_positions
    if window <= 0:
        return window_tokens(lm, prompt, 0).tokens
    if max_new_tokens >= window:
        raise InvalidInput(f"--max-new-tokens {max_new_tokens} does not fit the window of {model} ({window} positions)")
    room = window - max_new_tokens
    wt = window_tokens(lm, prompt, room)
    if not wt.complete or len(wt.tokens) > room:
        raise InvalidInput(
            f"prompt too long: more than {room} tokens ({len(prompt.encode('utf-8', 'replace'))} bytes of text), but "
            f"{model} has {window} positions and --max-new-tokens {max_new_tokens} needs {max_new_tokens} of them; "
            "shorten the prompt or ask for fewer new tokens"
        )
    return wt.tokens


def _chat_prompt(lm: Any, args: argparse.Namespace, max_new_tokens: int) -> list[int]:
    """The tokens of ``--layout system|user``'s chat, refused when they and the answer do not fit."""
    from kdn.prompts import request_tokens

    document = _read(args.prompt_file, "--prompt-file") if args.prompt_file is not None else ""
    if not args.prompt:
        raise KdnError(f"--layout {args.layout} needs the question as --prompt TEXT")
    tokens = request_tokens(lm.tokenizer, document, args.prompt, args.layout)
    if lm.max_positions and len(tokens) + max_new_tokens > lm.max_positions:
        raise InvalidInput(f"prompt too long: {len(tokens)} tokens and --max-new-tokens {max_new_tokens} do not fit the "
                           f"{lm.max_positions} positions of {args.model}; shorten the document or ask for fewer tokens")
    return tokens


def run(args: argparse.Namespace, stages: StageLines | None = None) -> dict[str, Any]:
    stages = stages or StageLines(None, prog="query")
    from kdn.client import ClientConfig, KdnClient
    from kdn.integrations.transformers import generate
    from kdn.keys import DEFAULT_CHUNK_SIZE
    from kdn.models import load_model

    if args.layout != "text" and args.documents:
        raise InvalidInput("--documents blends segments into a text prompt; use --layout text with it")
    if args.steer and args.documents:
        raise InvalidInput("--steer applies to stored prefix chains; --documents blends plain segments (steered "
                           "segments are not built)")
    documents = [_read(p, "--documents file") for p in args.documents] if args.documents else None
    if documents is not None:
        prefix = _read(args.prompt_file, "--prompt-file") if args.prompt_file is not None else ""
        if not args.prompt:
            raise KdnError("with --documents give the question as --prompt TEXT")
        prompt = args.prompt
    else:
        prompt = _prompt(args)
    overrides = dict(edge=args.edge, fallback_edges=args.fallback_edges, tenant=args.tenant, salt=args.salt, token=args.token, shm=args.shm,
                     tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                     fetch_timeout_s=args.timeout, write_back=False if args.no_write_back else None,
                     steer=args.steer)
    cfg = ClientConfig.from_file(args.config, **overrides) if args.config else ClientConfig.build(**overrides)
    stages.line(f"loading {args.model} in this process")
    lm = load_model(args.model, dtype=args.dtype, chunk_size=args.chunk_size or DEFAULT_CHUNK_SIZE)
    whole = prompt if documents is None else prefix + "".join(documents) + prompt
    if args.layout == "text":
        tokens = _window_prompt(lm, whole, args.max_new_tokens, args.model)
    else:
        tokens = _chat_prompt(lm, args, args.max_new_tokens)
    doing = (f"{len(tokens)} prompt tokens, " + (f"reusing what edge {cfg.edge} holds" if cfg.edge else "no edge: full prefill")
             + f", then {args.max_new_tokens} new tokens")
    generate(lm, tokens[:8], max_new_tokens=2)  # first-call costs (kernels, allocator) stay out of every timing
    with stages.ongoing(doing), KdnClient(cfg) as client:
        if documents is not None:
            from kdn.blend import Deviation
            from kdn.integrations.blend import BlendOptions

            opts = BlendOptions(policy=Deviation(args.blend_ratio) if args.blend_ratio is not None else None)
            result = generate(lm, prompt, documents=documents, prefix=prefix, client=client,
                              max_new_tokens=args.max_new_tokens, blend=opts)
        else:
            result = generate(lm, tokens, client=client, max_new_tokens=args.max_new_tokens)
        client.flush(cfg.put_timeout_s)
        written = int(client.counters["written_back"])
    out: dict[str, Any] = {
        "edge": cfg.edge,
        "model": args.model,
        "layout": args.layout,
        "untrained": lm.untrained,  # random-init specs: the timings are real, the text is noise
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
    if result.blend is not None:
        out["blend"] = {"policy": result.blend.policy, "document_tokens": result.blend.candidates,
                        "recomputed_tokens": result.blend.selected, "compute_share": result.blend.layer_token_fraction,
                        "blend_ms": result.timings.blend_s * 1e3}
    if args.compare:
        with stages.ongoing(f"--compare: full recompute of {len(tokens)} prompt tokens without the cache"):
            base = generate(lm, tokens if documents is None else whole, max_new_tokens=args.max_new_tokens)
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
    if "blend" in out:
        b = out["blend"]
        console.print(f"documents blended ({b['policy']}): {b['recomputed_tokens']} of {b['document_tokens']} document "
                      f"tokens recomputed, compute share {b['compute_share']:.1%}, {b['blend_ms']:.1f} ms")
    if "recompute" in out:
        console.print(
            f"full recompute: TTFT {out['recompute']['ttft_s'] * 1e3:.1f} ms "
            f"({out['speedup']:.1f}x); outputs match: {out['outputs_match']}"
        )
    for w in out["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}", markup=True, highlight=False)
    console.print("generated:", out["text"] if out["text"] is not None else out["tokens"], markup=False)
    if out.get("untrained"):
        console.print(f"note: {out['model']} has random, untrained weights (for timing): the generated text is noise, "
                      "not meant to be read. Whether reuse is right shows in --compare: the same tokens as a full "
                      "recompute. The trained model is the default (--model smollm2-135m).",
                      style="yellow", markup=False, highlight=False)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    stages = StageLines(sys.stderr, prog="query")  # progress on stderr; stdout is the result
    stages.line("starting: importing torch and the model code")
    # the client's one warning goes to the JSON / the rendered output, not twice to stderr
    logging.getLogger("kdn.client").addHandler(logging.NullHandler())
    logging.getLogger("kdn.client").propagate = False
    try:
        out = run(args, stages)
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
