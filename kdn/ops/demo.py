"""``kdn demo``: a whole KDN on this machine, and what it buys (a few minutes on an idle 2-core CPU, longer on a busy one).

The model is the trained built-in ``smollm2-135m`` (SmolLM2-135M-Instruct, float32) unless
``--model`` names another.

1. loads the model on this host (converting it once per machine, :mod:`kdn.pretrained`) and
   starts a local Ray cluster whose node carries both roles (``kdn_origin``, ``kdn_edge``);
2. ingests the bundled sample documents (``kdn/ops/samples``) with the origin's Ray prefill workers
   into an origin store — as the system message of a chat when the model has a chat template
   (:mod:`kdn.prompts`), else as the start of a plain prompt — and serves that store with an
   origin server (a Ray actor);
3. runs an edge (:class:`kdn.edge.server.EdgeServer` in a Ray actor placed by ``kdn_edge``) whose
   upstream is the origin;
4. for each document asks its question (``samples/questions.json``) in a request that carries the
   document first: once by full recompute, once through the edge while it is still cold (it pulls
   the chunks from the origin), once more now that the edge holds them — and checks that the three
   answers are the same tokens, and that the answer states the fact the document gives;
5. prints a table of time to first token, recompute vs KDN, the answers, and shuts everything down.

``--json`` prints one JSON object (``queries``: ``question``, ``text``, ``correct``,
``ttft_recompute_s``, ``ttft_kdn_s`` (edge hit), ``ttft_kdn_cold_s``, ``reused_tokens``,
``outputs_match`` ...); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kdn.console import plain, report_error
from kdn.errors import KdnError
from kdn.pretrained import DEFAULT_MODEL
from kdn.procs import start_local_ray

SAMPLES_DIR = Path(__file__).resolve().parent / "samples"
QUESTIONS_FILE = "questions.json"  # {document: {"question": ..., "expect": [words the answer must contain]}}
DEFAULT_QUESTION = "Summarise the text above in one sentence."


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    expect: tuple[str, ...] = ()  # case-insensitive: the answer is correct when it contains every one

    def judge(self, answer: str) -> bool | None:
        """None when there is nothing to check against."""
        if not self.expect:
            return None
        low = answer.lower()
        return all(w.lower() in low for w in self.expect)


def load_questions(samples: Path) -> dict[str, Question]:
    path = samples / QUESTIONS_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return {name: Question(str(q["question"]), tuple(str(w) for w in q.get("expect", ())))
                for name, q in raw.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KdnError(f"{path} is not a questions file ({{document: {{question, expect}}}}): {exc}") from exc


def request_for(layout: str, document: str, question: str) -> tuple[list[dict[str, str]] | None, str]:
    """A request carrying ``document`` first, as ``layout`` stores it: chat messages, or a text prompt."""
    if layout == "system":
        return [{"role": "system", "content": document}, {"role": "user", "content": question}], ""
    return None, f"{document}\n\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True, slots=True)
class QueryRow:
    document: str
    question: str
    correct: bool | None  # the answer states the document's fact (None: no expected answer given)
    prompt_tokens: int
    reused_tokens: int
    ttft_recompute_s: float
    ttft_kdn_cold_s: float
    ttft_kdn_s: float
    speedup: float
    outputs_match: bool
    via: str
    text: str
    warnings: list[str]
    kdn_timings: dict[str, float]  # breakdown of the edge-hit request (kdn.integrations.transformers.Timings)
    kdn_cold_timings: dict[str, float]


class _Progress:
    """One line per step on stderr (rich when it is a terminal)."""

    def __init__(self, enabled: bool) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def step(self, msg: str) -> None:
        if self.enabled:
            self.console.print(f"[dim]{time.perf_counter() - self.t0:6.1f}s[/dim] {msg}", highlight=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdn demo", description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model spec (default {DEFAULT_MODEL}, trained; small-125m: random weights, for timing)")
    p.add_argument("--samples", type=Path, default=SAMPLES_DIR,
                   help=f"directory of *.txt documents (and their questions in {QUESTIONS_FILE})")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens each answer generates at most (default 24)")
    p.add_argument("--keep", type=Path, default=None, help="keep stores and logs in this directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace, progress: _Progress) -> dict[str, Any]:
    import ray

    from kdn.client import ClientConfig, KdnClient
    from kdn.integrations.transformers import generate
    from kdn.errors import InvalidInput
    from kdn.models import load_model
    from kdn.origin.config import OriginConfig
    from kdn.origin.ingest import ingest
    from kdn.origin.ray_origin import start_origin_actor
    from kdn.prompts import check_chat_template

    docs = sorted(p for p in args.samples.glob("*.txt") if p.is_file())
    if not docs:
        raise KdnError(f"no *.txt sample documents in {args.samples}")
    questions = load_questions(args.samples)
    t_start = time.perf_counter()
    load_start = _load_1min()
    progress.step(f"loading {args.model} on this host")
    lm = load_model(args.model)
    try:
        check_chat_template(lm.tokenizer, args.model)
        layout = "system"
    except InvalidInput:  # a random-init spec: no chat template, the document starts a plain prompt
        layout = "text"
    with ExitStack() as stack:
        work = args.keep or Path(tempfile.mkdtemp(prefix="kdn-demo-"))
        work.mkdir(parents=True, exist_ok=True)
        if args.keep is None:
            stack.callback(shutil.rmtree, work, ignore_errors=True)
        from kdn.ops.registry import RESOURCE_EDGE, RESOURCE_ORIGIN

        progress.step(f"starting a local Ray cluster (roles kdn_origin, kdn_edge; work dir {work})")
        cpus = max(2, os.cpu_count() or 2)
        start_local_ray(
            num_cpus=cpus,
            resources={RESOURCE_ORIGIN: 2, RESOURCE_EDGE: 1},
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            _temp_dir=str(work / "ray"),
        )
        stack.callback(ray.shutdown)

        ocfg = OriginConfig(store_dir=str(work / "origin"), models=[args.model], codecs=["raw"], workers=1, worker_threads=cpus,
                            listen="127.0.0.1:0", fsync=False, verify_on_start="size")
        where = "as the system message of a chat" if layout == "system" else "as the start of a prompt"
        progress.step(f"ingesting {len(docs)} sample documents with {args.model} on a Ray prefill worker ({where})")
        # progress on stderr: a bar on a terminal, else a line per document
        summary = ingest(docs, ocfg, progress=("bar" if sys.stderr.isatty() and not args.json else "lines")
                         if progress.enabled else "off", layout=layout)
        if summary.failed:
            raise KdnError(f"ingest failed for {summary.failed} document(s): {summary.to_json()}")
        progress.step(f"ingested {summary.tokens} tokens into {summary.chunks} chunks; starting origin + edge actors")

        origin_actor, origin_address = start_origin_actor(ocfg, max_restarts=0)
        stack.callback(lambda: _quietly(lambda: ray.get(origin_actor.stop.remote(), timeout=30)))
        from kdn.edge.ray_edge import EdgeActor

        edge_cls = ray.remote(EdgeActor)
        edge_actor = edge_cls.options(resources={RESOURCE_EDGE: 1}, num_cpus=0, max_restarts=0).remote(
            {"node_id": "demo-edge", "listen": "127.0.0.1:0", "origin": origin_address, "memory_bytes": 2 << 30})
        edge_address = ray.get(edge_actor.address.remote(), timeout=120)
        stack.callback(lambda: _quietly(lambda: ray.get(edge_actor.stop.remote(), timeout=30)))
        progress.step(f"origin at {origin_address}, edge at {edge_address}")

        if bytes(lm.fingerprint).hex() != summary.fingerprint and summary.fingerprint:
            raise KdnError("the inference host and the origin disagree on the model fingerprint")
        client = stack.enter_context(KdnClient(ClientConfig(edge=edge_address)))
        warm_messages, warm_prompt = request_for(layout, "A short text.", "What is it?")
        generate(lm, warm_prompt or None, messages=warm_messages, max_new_tokens=2)  # first-call costs, untimed

        rows: list[QueryRow] = []
        for doc in docs:
            text = doc.read_text(encoding="utf-8")
            q = questions.get(doc.name, Question(DEFAULT_QUESTION))
            messages, prompt = request_for(layout, text, q.text)
            ask = dict(prompt=prompt or None, messages=messages, max_new_tokens=args.max_new_tokens)
            progress.step(f"{doc.name}: {q.text!r} by full recompute")
            base = generate(lm, **ask)
            progress.step(f"{doc.name}: through the edge (cold: it pulls from the origin), then again (edge hit)")
            cold = generate(lm, client=client, **ask)
            client.flush(30)
            hot = generate(lm, client=client, **ask)
            rows.append(QueryRow(
                document=doc.name,
                question=q.text,
                correct=q.judge(base.text or ""),
                prompt_tokens=base.prompt_tokens,
                reused_tokens=hot.reused_tokens,
                ttft_recompute_s=base.timings.ttft_s,
                ttft_kdn_cold_s=cold.timings.ttft_s,
                ttft_kdn_s=hot.timings.ttft_s,
                speedup=base.timings.ttft_s / max(hot.timings.ttft_s, 1e-9),
                outputs_match=base.tokens == cold.tokens == hot.tokens,
                via=hot.via,
                text=hot.text or "",
                warnings=[*cold.warnings, *hot.warnings],
                kdn_timings=hot.timings.as_dict(),
                kdn_cold_timings=cold.timings.as_dict(),
            ))
        load_end = _load_1min()
        progress.step("shutting down edge, origin and Ray")
    return {
        "model": args.model,
        "dtype": lm.dtype,
        "layout": layout,
        "untrained": lm.untrained,  # random-init specs: the timings are real, the answers noise
        "fingerprint": bytes(lm.fingerprint).hex(),
        "origin": origin_address,
        "edge": edge_address,
        "edge_placement": "Ray actor with resources {kdn_edge: 1}",
        "ingest": {"documents": len(docs), "tokens": summary.tokens, "chunks": summary.chunks,
                   "seconds": summary.seconds},
        "queries": [asdict(r) for r in rows],
        "all_outputs_match": all(r.outputs_match for r in rows),
        "seconds": time.perf_counter() - t_start,
        # the timings share the machine with everything else on it: the figures depend on it
        "load_average": {"start_1min": load_start, "end_1min": load_end, "cpus": os.cpu_count() or 1},
    }


def _load_1min() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:  # shutting down: an actor that is already gone is fine
        pass


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else f"{s:.1f} s"


def load_caption(load: dict[str, Any]) -> str:
    """The load beside the table: speedups are ratios of two timings on a shared machine, and a
    busy CPU stretches recompute and reuse by different factors."""
    if load.get("start_1min") is None:
        where = f"{load['cpus']} CPUs (load average unavailable here)"
    else:
        where = f"load average {load['start_1min']:.1f} → {load['end_1min']:.1f} (1 min) on {load['cpus']} CPUs"
    return f"{where}; speedups depend on the load: rerun on an idle machine to compare figures"


def untrained_note(model: str, sample: str) -> str:
    """Said wherever a built-in model's answer could be taken for the product's: its weights are
    random, so its text is noise by construction, and only "same" says whether reuse is right."""
    seen = f" (e.g. {sample[:24]!r})" if sample else ""
    return (f"note: {model} has random, untrained weights: it has the shape and cost of a real model, so the "
            f"timings are real, but its answers{seen} are noise, not meant to be read. Reuse is shown correct by "
            "'same': the edge's answer has exactly the tokens of a full recompute. The trained model is the "
            "default: `kdn demo` without --model.")


def render(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from rich import box

    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough for the table's nine columns
        console.width = 100
    table = Table(title=f"KDN demo — time to first token, {out['model']} ({out['dtype']}) on CPU", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True, caption=load_caption(out["load_average"]),
                  caption_justify="left")
    for col, just in (("document", "left"), ("tokens", "right"), ("reused", "right"),
                      ("recompute", "right"), ("KDN cold", "right"), ("KDN hit", "right"),
                      ("speedup", "right"), ("same", "center"), ("correct", "center")):
        table.add_column(col, justify=just, min_width=len(col))  # type: ignore[arg-type]
    for q in out["queries"]:
        table.add_row(
            q["document"].removesuffix(".txt"), str(q["prompt_tokens"]), str(q["reused_tokens"]),
            _secs(q["ttft_recompute_s"]), _secs(q["ttft_kdn_cold_s"]), _secs(q["ttft_kdn_s"]), f"{q['speedup']:.1f}x",
            "[green]yes[/green]" if q["outputs_match"] else "[red]NO[/red]",
            "–" if q["correct"] is None or out.get("untrained") else "[green]yes[/green]" if q["correct"] else "[red]no[/red]",
        )
    console.print(table)
    console.print(
        "recompute: full prefill; KDN cold: through the edge while it still pulls from the origin; "
        "KDN hit: the edge holds the chunks; speedup = recompute / KDN hit; same: identical greedy output; "
        "correct: the answer states the fact the document gives.",
        style="dim", highlight=False,
    )
    if not out.get("untrained"):
        for q in out["queries"]:
            console.print(f"[bold]{q['document'].removesuffix('.txt')}[/bold]: {q['question']}", highlight=False)
            console.print(f"  → {q['text'].strip()}", highlight=False, markup=False)
    if out.get("untrained"):
        console.print(untrained_note(out["model"], out["queries"][0]["text"] if out["queries"] else ""),
                      style="yellow", highlight=False, markup=False)
    for q in out["queries"]:
        for w in q["warnings"]:
            console.print(f"[yellow]warning ({q['document']}):[/yellow] {w}", highlight=False)
    console.print(
        f"ingested {out['ingest']['tokens']} tokens ({out['ingest']['chunks']} chunks) on Ray; edge "
        f"{out['edge']} ({out['edge_placement']}), origin {out['origin']}; finished in {out['seconds']:.0f} s."
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    progress = _Progress(enabled=True)
    progress.step(f"kdn demo: {len(list(args.samples.glob('*.txt')))} documents with {args.model}; a few minutes on an "
                  "idle 2-core CPU, longer on a busy one; importing Ray and torch")
    try:
        out = run(args, progress)
    except KdnError as exc:
        report_error("demo", exc, as_json=args.json)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        render(out)
    return 0 if out["all_outputs_match"] else 1
