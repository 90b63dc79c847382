"""``kdn origin`` (serve) and ``kdn ingest`` (documents -> artifacts).

Exit codes: 0 success; 1 some documents failed (``kdn ingest``; the summary says which and why);
2 nothing could run (unknown model spec, bad config or flags, port in use).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from kdn.console import report_error
from kdn.errors import InvalidInput, KdnError, Unavailable

if TYPE_CHECKING:
    from kdn.origin.config import OriginConfig

__all__ = ["main_ingest", "main_origin"]

# Both commands print their first line before importing torch, transformers and Ray (several
# seconds on a small machine, tens of seconds on a busy one): a user sees at once what is going on.


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="OriginConfig file (YAML or JSON); flags override it")
    p.add_argument("--store", dest="store_dir", help="origin store directory")
    p.add_argument("--codec", dest="codecs", action="append", help="codec to store (repeatable), e.g. zstd:3")
    p.add_argument("--workers", type=int, help="Ray origin workers; 0 = in-process, no Ray")
    p.add_argument("--ray-address", help="existing Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    p.add_argument("--dtype", help="KV dtype: float32, float16, bfloat16")
    p.add_argument("--chunk-size", type=int, help="tokens per chunk")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _config(args: argparse.Namespace, **extra: Any) -> "OriginConfig":
    from kdn.origin.config import OriginConfig

    flags = dict(
        store_dir=args.store_dir,
        codecs=args.codecs,
        workers=args.workers,
        ray_address=args.ray_address,
        dtype=args.dtype,
        chunk_size=args.chunk_size,
        **extra,
    )
    if args.config:
        return OriginConfig.from_file(args.config, **flags)
    return OriginConfig.build(**flags)


def _fatal(args: argparse.Namespace, exc: BaseException) -> int:
    report_error(args.command, exc, as_json=getattr(args, "json", False))
    return 2


def main_ingest(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="kdn ingest",
        description="Turn documents into KV artifacts in the origin store. Where it prefills: with RAY_ADDRESS "
                    "exported (after `kdn up`), on Ray workers on the cluster's kdn_origin nodes; else in this "
                    "process. --workers N and --local override; the first lines say which it uses.")
    p.set_defaults(command="ingest")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories (recursive)")
    p.add_argument("--model", help="model spec: built-in name or local model directory")
    p.add_argument("--namespace", help="TENANT or TENANT:SALT")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (default: a bar on a terminal, else one line per stage and document)")
    p.add_argument("--local", action="store_true",
                   help="prefill in this process even when RAY_ADDRESS names a cluster (default: its kdn_origin nodes)")
    p.add_argument("--layout", default="text", choices=["text", "system", "user"],
                   help="where each document sits in the requests that reuse it: text (a completion prompt starts "
                        "with it; default), system (the system message of a chat), user (the start of the first user "
                        "message). Requests must carry the document the same way, first, with the question after it")
    p.add_argument("--emphasize", metavar="METHOD",
                   help="also store a steered variant of each document: key-edit (marked tokens get more attention; "
                        "needs marks and the model's calibration from `kdn eval-steer`) or re-read (the model reads "
                        "the document, or its marked lines, twice). Clients get it only by naming its variant id")
    p.add_argument("--segments", action="store_true",
                   help="also store each document as a segment: its KV computed on its own, reusable anywhere in a prompt "
                        "and in any order; the origin then blends prompts made of stored documents (docs/blend.md)")
    p.add_argument("--emphasize-regex", metavar="RX", default=None, help="mark the lines that match RX")
    p.add_argument("--emphasize-spans", metavar="S:E,...", default=None, help="mark token spans [S, E)")
    p.add_argument("--emphasize-strength", metavar="NATS", type=float, default=None,
                   help="key-edit: attention logit added to marked tokens, (0, 8] (default: the calibrated one)")
    _common(p)
    args = p.parse_args(argv)
    from kdn.console import StageLines

    # a bar on a terminal; anywhere else (a pipe, a log, CI) plain lines, so it is never silent
    mode = "off" if args.no_progress else "bar" if sys.stderr.isatty() else "lines"
    stages = StageLines(sys.stderr if mode != "off" else None, prog="ingest")
    stages.line("starting: importing torch and the model code")
    from kdn.origin.ingest import check_model_spec, discover, ingest, make_executor
    from kdn.origin.ingest.where import Placement, decide, origin_nodes

    started_ray = False
    emphasize = ""
    try:
        marks_given = args.emphasize_regex is not None or args.emphasize_spans is not None
        if args.emphasize or marks_given or args.emphasize_strength is not None:
            from kdn.steer import Emphasis

            if not args.emphasize:
                raise InvalidInput("--emphasize-regex/-spans/-strength need --emphasize METHOD")
            if args.emphasize_regex == "":  # an empty mark (an unset variable?) must not mean "the whole document"
                raise InvalidInput("--emphasize-regex is empty")
            emphasize = Emphasis(args.emphasize, args.emphasize_regex or "",
                                 Emphasis.parse_spans(args.emphasize_spans) if args.emphasize_spans is not None else (),
                                 args.emphasize_strength).to_json()
        config = _config(args, models=[args.model] if args.model is not None else None, namespace=args.namespace)
        check_model_spec(config.models[0])
        # before any worker (which opens, so creates, the store): no document, nothing is made
        found = discover(args.paths)
        if not found.sources:
            raise InvalidInput(found.nothing_to_ingest())
        stages.line(f"found {len(found.sources)} document(s) under {', '.join(args.paths)}; store {config.store_path}")
        given = config.model_fields_set  # flags and config file; not the defaults
        place = decide(workers=config.workers if "workers" in given else None, local=args.local,
                       ray_address=config.ray_address, env=os.environ)
        nodes: list[str] = []
        if place.mode != "local":
            from kdn.origin.ray_origin import ensure_ray

            stages.line(f"connecting to Ray ({place.address or 'a new local cluster'}; {place.reason})")
            try:
                started_ray = ensure_ray(address=place.address, origin_slots=place.workers or 1, num_cpus=None)
            except Exception as exc:  # Ray's own errors (ConnectionError, auth, timeouts): one line
                raise Unavailable(f"cannot join the Ray cluster at {place.address}: {type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}; "
                                  "--local to ingest in this process") from exc
            if place.mode == "cluster":
                nodes = origin_nodes()
                if not nodes and place.workers is None:
                    import ray

                    stages.line(f"the cluster at {place.address} has no kdn_origin node: prefilling in this process")
                    ray.shutdown()
                    started_ray = False
                    place = Placement("local", 0, None, f"no kdn_origin node at {place.address}")
                elif not nodes:
                    raise Unavailable(f"the cluster at {place.address} has no kdn_origin node for --workers "
                                      f"{place.workers}; --local to ingest in this process")
                elif place.workers is None:
                    place = Placement("cluster", len(nodes), place.address, place.reason)
        config = config.model_copy(update={"workers": place.workers or 0})
        where = place.describe()
        if place.mode == "local":
            stages.line(f"prefilling {where}: loading {config.models[0]}")
        else:
            stages.line(f"prefilling {where}: starting the workers, each loading {config.models[0]}")
        t_load = time.perf_counter()
        executor = make_executor(config, on_nodes=nodes)
        if place.mode == "local":
            stages.line(f"model loaded in {time.perf_counter() - t_load:.1f}s")
    except KdnError as exc:
        return _fatal(args, exc)
    try:
        summary = ingest(args.paths, config, executor=executor, progress=mode, found=found, emphasize=emphasize,
                         layout=args.layout, segments=args.segments)
        summary.where = where
    except KdnError as exc:
        return _fatal(args, exc)
    finally:
        executor.close()
        if started_ray:
            import ray

            ray.shutdown()
    if args.json:
        print(json.dumps(summary.to_json()))
    else:
        print(summary.render())
    return summary.exit_code


def main_origin(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kdn origin", description="Run an origin: gRPC serving + compute on demand.")
    p.set_defaults(command="origin")
    p.add_argument("--model", dest="models", action="append", help="model spec to serve (repeatable)")
    p.add_argument("--listen", help="address to bind, e.g. 127.0.0.1:50061 (port 0 = any free port)")
    p.add_argument("--node-id", help="name reported in Stats and Lookup")
    p.add_argument("--token", action="append", metavar="TOKEN=TENANT[,TENANT]", help="grant a bearer token (repeatable)")
    _common(p)
    args = p.parse_args(argv)
    from kdn.console import StageLines

    stages = StageLines(sys.stderr, prog="origin")  # stdout holds only the ready line
    stages.line("starting: importing torch, transformers and gRPC")
    started_ray = False
    server = None
    try:
        tokens = None
        if args.token:
            tokens = {}
            for item in args.token:
                tok, sep, tenants = item.partition("=")
                if not sep or not tok or not tenants:
                    raise KdnError(f"--token wants TOKEN=TENANT[,TENANT], got {item!r}")
                tokens[tok] = tenants.split(",")
        config = _config(args, models=args.models, listen=args.listen, node_id=args.node_id, tokens=tokens)
        from kdn.origin.ingest import check_model_spec
        from kdn.origin.server import OriginServer

        for spec in config.models:
            check_model_spec(spec)
        compute = None
        if config.workers:
            from kdn.origin.compute import RayCompute
            from kdn.origin.ray_origin import ensure_ray

            stages.line(f"connecting to Ray ({config.ray_address or 'RAY_ADDRESS, else a new local cluster'})")
            started_ray = ensure_ray(address=config.ray_address, origin_slots=config.workers)
            stages.line(f"starting {config.workers} Ray prefill worker(s) with {', '.join(config.models)}")
            compute = RayCompute(config)
        else:
            stages.line(f"opening store {config.store_path} (check: {config.verify_on_start}) and loading "
                        f"{', '.join(config.models)} in this process")
        server = OriginServer(config, compute=compute)
        stages.line(f"binding {config.listen}")
        address = server.start()
    except KdnError as exc:
        if server is not None:
            server.stop()
        return _fatal(args, exc)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    models = {bytes(fp).hex(): info["spec"] for fp, info in server.compute.models().items()}
    if args.json:
        print(json.dumps({"event": "ready", "address": address, "port": server.port, "node_id": config.node_id,
                          "models": models, "store_dir": str(config.store_path), "workers": config.workers}), flush=True)
    else:
        check = server.store.check
        print(f"origin {config.node_id} serving on {address}; models: "
              + ", ".join(f"{s} ({fp[:16]}…)" for fp, s in models.items())
              + f"; store {config.store_path}"
              + (f" ({check.artifacts} artifacts, {check.dropped_missing + check.dropped_corrupt} dropped on check"
                 + (f", {check.unknown_codec} in codecs this version does not know, kept but not served" if check.unknown_codec else "")
                 + ")" if check else ""),
              flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        if started_ray:
            import ray

            ray.shutdown()
    return 0
