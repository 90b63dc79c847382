"""``kdn route``: run the KV-aware router in front of inference hosts.

::

    kdn route --host http://127.0.0.1:8001=127.0.0.1:7071 --host http://127.0.0.1:8002=127.0.0.1:7072 \\
              --model smollm2-135m --listen 127.0.0.1:8100 [--policy cost|prefix_overlap|round_robin]

Each ``--host`` is a ``vllm serve`` base URL and, after ``=``, the address of the edge beside it.
``--config FILE`` loads a RouteConfig (YAML/JSON; ``tokens``, rates priors, timeouts ...); flags
override it. On readiness it prints one JSON line (``{"event": "ready", "address": ..., "port":
...}``) and serves until SIGTERM/SIGINT, then prints ``{"event": "stopped"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
from typing import Any

from pydantic import ValidationError

from kdn.console import report_error
from kdn.errors import ConfigError, KdnError
from kdn.route.config import RouteConfig, parse_host

__all__ = ["main", "build_config"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdn route", description="KV-aware router: an OpenAI-compatible front that sends "
                                "each request to the host where its KV is cheapest to have")
    p.add_argument("--host", action="append", default=None, metavar="URL[=EDGE]",
                   help="an inference host's base URL, and the host:port of its edge (repeat per host)")
    p.add_argument("--config", help="RouteConfig file (YAML/JSON); flags override it")
    p.add_argument("--listen", help="host:port to serve on (port 0: any free port)")
    p.add_argument("--model", help="the hosts' model: a built-in name or the directory vLLM loads")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the engines' dtype")
    p.add_argument("--chunk-size", type=int, help="the connectors' chunk size")
    p.add_argument("--policy", help="cost (default), prefix_overlap or round_robin")
    p.add_argument("--tenant", help="namespace of requests that name none")
    p.add_argument("--edge-token", help="bearer token for the edges ('*' grants: link rates from Stats)")
    p.add_argument("--max-body-bytes", type=int, help="largest request body accepted")
    p.add_argument("--no-calibrate", action="store_true", help="send no calibration probes when a host comes up")
    p.add_argument("--verbose", action="store_true", help="log at INFO on stderr")
    p.add_argument("--json", action="store_true", help="accepted for uniformity: the ready/stopped events are JSON lines")
    return p


def build_config(args: argparse.Namespace) -> RouteConfig:
    flags: dict[str, Any] = {"listen": args.listen, "model": args.model, "dtype": args.dtype, "chunk_size": args.chunk_size,
                             "policy": args.policy, "tenant": args.tenant, "edge_token": args.edge_token,
                             "max_body_bytes": args.max_body_bytes}
    if args.host:
        try:
            flags["hosts"] = [parse_host(h).model_dump() for h in args.host]
        except ValidationError as exc:  # one line: the reasons, without pydantic's report around them
            raise ConfigError(f"--host: {'; '.join(e['msg'] for e in exc.errors())}") from None
    if args.no_calibrate:
        flags["calibrate_tokens"] = []
    flags = {k: v for k, v in flags.items() if v is not None}
    if args.config:
        return RouteConfig.from_file(args.config, **flags)
    return RouteConfig.build(flags)


def _bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--listen must be HOST:PORT, got {listen!r}")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def _serve(config: RouteConfig) -> int:
    import uvicorn

    from kdn.route.app import build_app
    from kdn.route.model import load_route_model
    from kdn.route.router import Router

    model = load_route_model(config.model, dtype=config.dtype, chunk_size=config.chunk_size)
    sock = _bind(config.listen)
    router = Router(config, tokenizer=model.tokenizer, fingerprint=model.fingerprint,
                    kv_bytes_per_token=model.kv_bytes_per_token)
    await router.start()
    server = uvicorn.Server(uvicorn.Config(build_app(router), log_level="warning", access_log=False,
                                           timeout_keep_alive=30, lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # ours below
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    host, port = sock.getsockname()[:2]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    print(json.dumps({"event": "ready", "address": address, "port": port, "policy": config.policy,
                      "hosts": [h.name for h in config.hosts], "fingerprint": bytes(model.fingerprint).hex()}), flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        await router.stop()
    print(json.dumps({"event": "stopped"}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def fail(exc: BaseException, text: str, code: int) -> int:
        if args.json:
            report_error("route", exc, as_json=True, event="failed")
        else:
            print(f"kdn route: {text}", file=sys.stderr)
        return code

    if not args.host and not args.config:
        return fail(ConfigError("give at least one --host URL[=EDGE] (or --config)"),
                    "give at least one --host URL[=EDGE] (or --config)", 2)
    try:
        config = build_config(args)
    except KdnError as exc:
        return fail(exc, str(exc), 2)
    try:
        return asyncio.run(_serve(config))
    except KdnError as exc:
        return fail(exc, str(exc), 2)
    except OSError as exc:
        return fail(exc, str(exc), 1)
