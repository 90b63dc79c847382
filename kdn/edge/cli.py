"""``kdn edge`` (run an edge, or send hints to a running one) and ``kdn stats --edge ADDR``.

Run standalone::

    kdn edge --listen 127.0.0.1:0 --node-id a --peers b=127.0.0.1:50062,c=127.0.0.1:50063 \\
             --origin 127.0.0.1:50051 --memory-bytes 1G --disk-dir /tmp/edge-a --disk-bytes 10G --policy prefix

On readiness it prints one JSON line to stdout (``{"event": "ready", "address": ..., "port": ...}``)
and serves until SIGTERM/SIGINT. ``--config FILE`` loads an EdgeConfig (YAML/JSON); flags override it.

Operator hints (the operator's interface to the cache)::

    kdn edge pin      --edge ADDR --tenant acme KEYHEX...        (or --document DOC --fingerprint HEX)
    kdn edge unpin    --edge ADDR --tenant acme KEYHEX...
    kdn edge ttl      --edge ADDR --tenant acme --seconds 3600 KEYHEX...
    kdn edge priority --edge ADDR --tenant acme --priority 5 KEYHEX...
    kdn edge schedule --edge ADDR --tenant acme --cron "0 8 * * *" --document DOC --fingerprint HEX
    kdn edge cancel   --edge ADDR --tenant acme --schedule-id ID
    kdn edge prefetch --edge ADDR --tenant acme --fingerprint HEX (KEYHEX... | --document DOC)
    kdn edge emphasize --edge ADDR --fingerprint HEX --document DOC --method key-edit|re-read
                       [--regex RX | --spans S:E,...] [--strength NATS]
        (the origin computes a steered variant of the document and the edge fetches it; prints its
        variant id, which a client names to reuse it: kdn.steer)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from kdn.console import report_error
from kdn.errors import ConfigError, KdnError

if TYPE_CHECKING:  # imported lazily below: `kdn --help` stays light
    from kdn.edge.config import EdgeConfig

HINT_COMMANDS = ("pin", "unpin", "ttl", "priority", "schedule", "cancel", "prefetch", "emphasize")
_SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``1073741824``, ``512M``, ``10G`` (binary units)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in _SUFFIX:
            return int(float(t[:-1]) * _SUFFIX[t[-1]])
        return int(t)
    except (ValueError, OverflowError):  # "x", "nanG", "infG"
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512M, 10G)") from None


def parse_peers(text: str) -> dict[str, str]:
    """``id=host:port,id2=host:port``."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        node, sep, addr = item.partition("=")
        if not sep or not node or not addr:
            raise argparse.ArgumentTypeError(f"peer must be id=host:port, got {item!r}")
        out[node] = addr
    return out


def parse_tokens(items: Sequence[str]) -> dict[str, list[str]]:
    """``TOKEN=tenant1,tenant2`` (repeatable)."""
    out: dict[str, list[str]] = {}
    for item in items:
        tok, sep, tenants = item.partition("=")
        if not sep or not tok or not tenants:
            raise ConfigError(f"--token-grant must be TOKEN=tenant[,tenant...], got {item!r}")
        out[tok] = [t for t in tenants.split(",") if t]
    return out


def _run_parser() -> argparse.ArgumentParser:
    from kdn.edge.config import EdgeConfig

    def about(name: str) -> str:  # the help is the config field's own description (one place)
        f = EdgeConfig.model_fields[name]
        return f"{f.description} (default {f.default})"

    p = argparse.ArgumentParser(
        prog="kdn edge",
        description="Run an edge node (default), or send hints to a running one: "
        + ", ".join(HINT_COMMANDS) + " (kdn edge pin --help).",
    )
    p.add_argument("--config", help="EdgeConfig file (YAML or JSON); flags override it")
    p.add_argument("--node-id", help=about("node_id"))
    p.add_argument("--listen", help="host:port to serve on (port 0 = any free port)")
    p.add_argument("--peers", type=parse_peers, help="static overlay members: id=host:port,...")
    p.add_argument("--peers-file", help="peers file re-read periodically: JSON {id: host:port} or id=host:port lines")
    p.add_argument("--refresh-s", type=float, help="how often the peers file is re-read (seconds)")
    p.add_argument("--peer-backoff-s", type=float, help="a failed peer is retried after this long")
    p.add_argument("--origin", help="origin host:port")
    p.add_argument("--memory-bytes", type=parse_bytes, help=about("memory_bytes") + "; 512M, 8G ...")
    p.add_argument("--disk-dir", help=about("disk_dir"))
    p.add_argument("--disk-bytes", type=parse_bytes, help=about("disk_bytes") + "; 512M, 100G ...")
    p.add_argument("--policy", help="eviction policy: adaptive (default), prefix, lru, s3fifo, sieve")
    p.add_argument("--replicas", type=int, help=about("replicas"))
    p.add_argument("--prefetch-depth", type=int, help=about("prefetch_depth"))
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here (0 = ephemeral)")
    p.add_argument("--token-grant", action="append", default=[], metavar="TOKEN=TENANTS",
                   help="enable auth: this bearer token may use these tenants (repeatable; '*' = all)")
    p.add_argument("--upstream-token", help="token to present to peers and the origin")
    p.add_argument("--tls-cert", help="PEM certificate chain to serve TLS with (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="require client certificates signed by this CA (mTLS)")
    p.add_argument("--no-shm", action="store_true", help="disable the same-host shared-memory path")
    p.add_argument("--no-bulk", action="store_true", help="disable the bulk byte path (plain TCP beside gRPC; off with TLS)")
    p.add_argument("--bulk-port", type=int, help="port of the bulk byte path on the listen host (default: a free one)")
    p.add_argument("--rtc-signal", help="origin host:port serving WebRTC signalling: reach edges behind NAT "
                   "(STUN/TURN servers go in --config: a TURN credential stays out of the process list)")
    p.add_argument("--rtc-mode", choices=["auto", "always"], help=about("rtc_mode"))
    p.add_argument("--rtc-link-codec", help=about("rtc_link_codec"))
    p.add_argument("--json", action="store_true", help="accepted for uniformity: the ready/stopped events are always JSON lines")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level on stderr")
    return p


def build_config(args: argparse.Namespace) -> EdgeConfig:
    from kdn.edge.config import EdgeConfig

    overrides: dict[str, Any] = {
        "node_id": args.node_id, "listen": args.listen, "peers": args.peers, "peers_file": args.peers_file,
        "membership_refresh_s": args.refresh_s, "peer_backoff_s": args.peer_backoff_s, "origin": args.origin,
        "memory_bytes": args.memory_bytes, "disk_dir": args.disk_dir, "disk_bytes": args.disk_bytes,
        "policy": args.policy, "replicas": args.replicas, "prefetch_depth": args.prefetch_depth,
        "metrics_port": args.metrics_port, "upstream_token": args.upstream_token,
        "tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_ca": args.tls_ca,
        "tokens": parse_tokens(args.token_grant) or None,
        "shm": False if args.no_shm else None,
        "bulk": False if args.no_bulk else None, "bulk_port": args.bulk_port,
        "rtc_signal": args.rtc_signal, "rtc_mode": args.rtc_mode, "rtc_link_codec": args.rtc_link_codec,
    }
    if args.config:
        return EdgeConfig.from_file(args.config, **overrides)
    return EdgeConfig.build({}, **overrides)


async def _serve(config: EdgeConfig) -> int:
    from kdn.edge.server import EdgeServer

    server = EdgeServer(config)
    await server.start()
    # what exists now (imports: torch, grpc, ~190k objects) lives as long as the process: keep it
    # out of the cyclic collector, whose full passes over it stalled every request for ~75 ms
    gc.collect()
    gc.freeze()
    ready = {"event": "ready", "node_id": config.node_id, "address": server.address, "port": server.port,
             "metrics_port": server.metrics_port, "bulk_port": server.bulk.port if server.bulk else None}
    print(json.dumps(ready), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)
    print(json.dumps({"event": "stopped", "node_id": config.node_id}), flush=True)
    return 0


def _run(argv: list[str]) -> int:
    args = _run_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    def fail(exc: BaseException, text: str, code: int) -> int:
        if args.json:  # the ready/stopped events are JSON lines: so is a failure (kdn.console's shape)
            report_error("edge", exc, as_json=True, event="failed")
        else:
            print(f"kdn edge: {text}", file=sys.stderr)
        return code

    try:
        config = build_config(args)
    except KdnError as exc:
        return fail(exc, str(exc), 2)
    except (UnicodeDecodeError, OSError) as exc:  # a binary or unreadable --config file
        return fail(exc, f"cannot read config {args.config}: {type(exc).__name__}: {exc}", 2)
    try:
        return asyncio.run(_serve(config))
    except KdnError as exc:  # e.g. a TLS key that is not the certificate's
        return fail(exc, str(exc), 2)
    except OSError as exc:
        return fail(exc, f"cannot serve: {exc}", 1)


# -- hints ---------------------------------------------------------------------------------------


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """``--token`` and ``--tls-ca/--tls-cert/--tls-key``: how every client command (``kdn stats``,
    ``kdn edge pin ...``, ``kdn query``) reaches an edge that requires auth or TLS. The same names
    as ``ClientConfig``'s ``token``/``tls_*`` fields, checked by the same rules (kdn.wire.tls)."""
    p.add_argument("--token", help="bearer token the server granted (its --token-grant)")
    p.add_argument("--tls-ca", help="PEM CA that signed the server's certificate: connect with TLS")
    p.add_argument("--tls-cert", help="PEM client certificate, for a server that requires mTLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")


def client_tls(args: argparse.Namespace) -> Any:
    """The TLS files of :func:`add_connection_flags` (None: plaintext); ConfigError names a bad pair."""
    from kdn.wire.tls import TlsFiles

    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    try:
        return TlsFiles.for_client(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as exc:
        raise ConfigError("--tls-cert and --tls-key go together") from exc


def _ttl_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"seconds must be a finite number >= 0 (0 clears the TTL), got {text!r}")
    return value


def _int32(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not -(1 << 31) <= value < (1 << 31):
        raise argparse.ArgumentTypeError(f"priority must fit in 32 bits (-2147483648..2147483647), got {text}")
    return value


def _hint_parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"kdn edge {command}", description=f"send a {command} hint to a running edge")
    p.add_argument("--edge", required=True, help="edge host:port")
    p.add_argument("--tenant", default="default", help="namespace tenant (default: default)")
    p.add_argument("--salt", default="", help="namespace salt the tenant's keys were made with")
    add_connection_flags(p)
    if command != "cancel":  # cancel names a schedule, not what it prefetches
        p.add_argument("--fingerprint", default="", help="model fingerprint, 64 hex digits (needed with --document)")
        p.add_argument("--document", default="", help="a document instead of keys: the path it was ingested as "
                       "(relative to here, or absolute) or the id `kdn ingest` lists")
        p.add_argument("keys", nargs="*", help="chunk keys, 64 hex digits each")
    else:
        p.set_defaults(fingerprint="", document="", keys=[])
    if command == "ttl":
        p.add_argument("--seconds", type=_ttl_seconds, required=True, help="seconds from now; 0 clears the TTL")
    if command == "priority":
        p.add_argument("--priority", type=_int32, required=True, help="eviction priority: higher is kept longer")
    if command == "schedule":
        p.add_argument("--cron", required=True, help='"M H DOM MON DOW", e.g. "0 8 * * *" (UTC)')
    if command == "cancel":
        p.add_argument("--schedule-id", required=True, help="the id `kdn edge schedule` printed")
    if command == "emphasize":
        p.add_argument("--method", required=True, help="key-edit (marked tokens get more attention) or re-read")
        p.add_argument("--regex", default=None, help="mark the lines of the document that match RX")
        p.add_argument("--spans", default=None, help="mark token spans S:E,... of the document")
        p.add_argument("--strength", type=float, default=None, help="key-edit: nats, (0, 8] (default: calibrated)")
    p.add_argument("--deadline", type=float, default=10.0, help="seconds to wait for the answer (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    return p


def _hint(command: str, argv: list[str]) -> int:
    from kdn.edge.admin import EdgeClient, hint_request
    from kdn.keys import ModelFingerprint, Namespace, parse_fingerprint, parse_key
    from kdn.wire.convert import HintAction as A

    args = _hint_parser(command).parse_args(argv)
    # the name goes as typed: `kdn ingest` ids a document by its absolute path on the ingest host
    # (kdn.origin.ingest.doc_id_for), and the origin matches it exactly or by its tail
    # (docs/manual.md), which works from any directory or host; resolving it here would name a
    # path of this host. An ambiguous tail is refused with the candidates listed.
    try:
        keys = [parse_key(k) for k in args.keys]
        fp = parse_fingerprint(args.fingerprint) if args.fingerprint else ModelFingerprint(b"")
        ns = Namespace(args.tenant, args.salt)
        if command not in ("cancel",) and not keys and not args.document:
            raise ConfigError("give chunk keys or --document")
        emphasis = ""
        if command == "emphasize":
            from kdn.steer import Emphasis

            if keys or not args.document or not args.fingerprint:
                raise ConfigError("emphasize names a document (--document DOC --fingerprint HEX), not keys")
            if args.regex == "":  # an empty mark (an unset variable?) must not mean "the whole document"
                raise ConfigError("--regex is empty")
            emphasis = Emphasis(args.method, args.regex or "",
                                Emphasis.parse_spans(args.spans) if args.spans is not None else (),
                                args.strength).to_json()  # checked here: a bad one never reaches the origin
        with EdgeClient(args.edge, token=args.token, tls=client_tls(args), deadline_s=args.deadline) as client:
            if command == "prefetch":
                queued = client.prefetch(keys, fingerprint=fp, namespace=ns, document=args.document)
                result: dict[str, Any] = {"command": command, "queued": queued}
            else:
                action = {
                    "pin": A.PIN, "unpin": A.UNPIN, "ttl": A.SET_TTL, "priority": A.SET_PRIORITY,
                    "schedule": A.SCHEDULE_PREFETCH, "cancel": A.CANCEL_SCHEDULE, "emphasize": A.EMPHASIZE,
                }[command]
                resp = client.hint(hint_request(
                    action, fingerprint=fp, namespace=ns, keys=keys, document=args.document,
                    ttl_s=getattr(args, "seconds", 0.0), priority=getattr(args, "priority", 0),
                    cron=getattr(args, "cron", ""), schedule_id=getattr(args, "schedule_id", ""), emphasis=emphasis,
                ))
                result = {"command": command, "affected": resp.affected, "schedule_id": resp.schedule_id}
                if command == "emphasize":
                    result = {"command": command, "fetched": resp.affected, "steer_variant": resp.steer_variant}
    except KdnError as exc:
        report_error(f"edge {command}", exc, as_json=args.json, command=command)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print(" ".join(f"{k}={v}" for k, v in result.items() if v != ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in HINT_COMMANDS:
        return _hint(argv[0], argv[1:])
    return _run(argv)


# -- stats ---------------------------------------------------------------------------------------


def main_stats(argv: list[str] | None = None) -> int:
    """``kdn stats --edge ADDR`` (or ``--origin ADDR``) ``[--json]``: a node's counters.

    Asked with ``--edge``, a node that turns out to be an origin answers as one (it has no edge
    Stats, so its own). The plain output has one row per metric: Prometheus samples under their
    short names (``kdn_edge_misses_total`` -> ``misses``), an internal counter left out where a
    Prometheus sample counts the same thing, names and values in aligned columns. ``--json``
    prints the node's answer unchanged.
    """
    from kdn.edge.admin import EdgeClient

    p = argparse.ArgumentParser(prog="kdn stats", description="show an edge's or an origin's counters")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--edge", help="edge host:port (an origin there answers as an origin)")
    where.add_argument("--origin", help="origin host:port")
    add_connection_flags(p)
    p.add_argument("--deadline", type=float, default=10.0, help="seconds to wait for the answer")
    p.add_argument("--json", action="store_true", help="print the answer as one JSON object (errors too)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    address = args.edge or args.origin
    try:
        with EdgeClient(address, token=args.token, tls=client_tls(args), deadline_s=args.deadline) as client:
            stats = client.origin_stats() if args.origin else None
            if stats is None:
                try:
                    stats = client.stats()
                except KdnError as exc:
                    if not _unimplemented(exc):
                        raise
                    stats = client.origin_stats()  # not an edge: an origin answers its own Stats
    except KdnError as exc:
        report_error("stats", exc, as_json=args.json)
        return 1
    if args.json:
        print(json.dumps(stats.as_dict(), sort_keys=True))
        return 0
    print(stats_text(stats, address))
    return 0


def _unimplemented(exc: BaseException) -> bool:
    import grpc

    cause = exc.__cause__
    return isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.UNIMPLEMENTED


# Internal counters that a Prometheus sample also counts: shown once, under the sample's name.
_TWINS = {"coalesced": "coalesced_requests"}
_PREFIXES = ("kdn_edge_", "kdn_origin_")


def display_name(name: str) -> str:
    """``kdn_edge_hits_total{tier=memory}`` -> ``hits{tier=memory}``; internal names unchanged."""
    base, brace, labels = name.partition("{")
    for prefix in _PREFIXES:
        if base.startswith(prefix):
            base = base.removeprefix(prefix).removesuffix("_total")
            break
    return base + brace + labels


def stats_text(stats: Any, address: str) -> str:
    """The plain ``kdn stats`` table: a header line, then one aligned row per metric."""
    c = stats.counters
    role = stats.details.get("role") or ("origin" if "models" in stats.details else "edge")
    if role == "origin":
        models = ", ".join(f"{info.get('spec', '?')} ({fp[:16]}…)" for fp, info in stats.details.get("models", {}).items())
        head = (f"origin {stats.node_id} ({address})  models: {models or '-'}  "
                f"codecs: {', '.join(stats.details.get('codecs', [])) or '-'}  store: {stats.details.get('store_dir', '-')}")
        from kdn.steer import steering_line

        head += "".join(f"  steering ({fp[:16]}…): {steering_line(s)}" for fp, s in stats.details.get("steering", {}).items())
    else:
        origin = "n/a" if not c.get("origin_configured") else ("available" if c.get("origin_available") else "UNAVAILABLE")
        head = (f"edge {stats.node_id} ({stats.details.get('address', address)})  origin: {origin}  "
                f"peers: {int(c.get('peers', 0))} ({int(c.get('peers_down', 0))} down)")
    rows: dict[str, float] = {}
    for name, value in c.items():
        rows[display_name(name)] = value
    for internal, sample in _TWINS.items():
        if sample in rows:
            rows.pop(internal, None)
    if not rows:
        return head
    values = {n: (f"{v:,.0f}" if float(v).is_integer() else f"{v:,.3f}") for n, v in rows.items()}
    wn = max(map(len, values))
    wv = max(map(len, values.values()))
    return "\n".join([head, *(f"  {n:<{wn}}  {values[n]:>{wv}}" for n in sorted(values))])


if __name__ == "__main__":
    sys.exit(main())
