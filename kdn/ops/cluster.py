"""`kdn up` / `kdn down`: a Ray cluster whose nodes carry KDN's roles.

``kdn up`` starts a Ray head (or joins ``--address``) and, on this machine, ``--origin-nodes``
Ray nodes with the custom resource ``kdn_origin`` and ``--edge-nodes`` nodes with ``kdn_edge``.
Each node is one ``ray start --block`` process in a session of its own, so ``kdn down`` can stop
exactly the processes ``kdn up`` started (every process in those sessions) and nothing else.
Then it places the roles as detached actors by those resources (:mod:`kdn.ops.roles`), waits until
every gRPC endpoint is registered (:mod:`kdn.ops.registry`), and prints the endpoints.

If anything fails half-way, everything started so far is stopped again before the error is shown.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import Field

from kdn.config import RoleConfig
from kdn.errors import ConfigError, KdnError, Unavailable
from kdn.procs import session_members, stop_sessions
from kdn.ops.registry import RAY_NAMESPACE, RESOURCE_EDGE, RESOURCE_HEAD, RESOURCE_ORIGIN
from kdn.wire.channel import free_port


def default_state_dir() -> Path:
    return Path(os.environ.get("KDN_CACHE", Path.home() / ".cache" / "kdn")) / "cluster"


class ClusterConfig(RoleConfig):
    """What `kdn up` starts. Every field can come from ``--config FILE`` and be overridden by flags."""

    address: str | None = Field(None, description="join this Ray cluster (host:port) instead of starting a head")
    head_port: int = Field(0, ge=0, le=65535, description="GCS port of the head we start; 0 = pick a free one")
    origin_nodes: int = Field(1, ge=0, le=16, description="local Ray nodes with the kdn_origin resource")
    edge_nodes: int = Field(3, ge=1, le=32, description="local Ray nodes with the kdn_edge resource (one edge each)")
    cpus_per_node: float = Field(1.0, gt=0, description="CPUs each local Ray node advertises")
    model: str = Field("tiny", description="model spec the origin serves")
    codec: str = Field("zstd", description="codec the origin stores")
    state_dir: Path = Field(default_factory=default_state_dir, description="pids, logs, stores")
    edge_memory_bytes: int = Field(256 << 20, gt=0)
    edge_disk_bytes: int = Field(2 << 30, gt=0)
    replicas: int = Field(2, ge=1)
    bind_host: str = Field("127.0.0.1", description="host the origin and edge gRPC servers bind; a node's IP for multi-host clusters")
    wait_s: float = Field(120.0, gt=0, description="how long to wait for nodes and endpoints")


@dataclass(slots=True)
class ClusterState:
    """What `kdn down` needs: the session leaders we started, and what they serve."""

    address: str
    state_dir: str
    session_pids: list[int] = field(default_factory=list)
    started_head: bool = False
    origins: list[dict] = field(default_factory=list)
    edges: list[dict] = field(default_factory=list)
    started_unix: float = 0.0

    def save(self) -> None:
        path = Path(self.state_dir) / "cluster.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, state_dir: Path) -> "ClusterState | None":
        path = Path(state_dir) / "cluster.json"
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))


# -- process management -------------------------------------------------------------------------


def ray_temp_dir(state_dir: Path) -> Path:
    """Ray's session files for this cluster. Kept short: Ray's socket paths must fit in 107 bytes."""
    digest = hashlib.blake2b(str(Path(state_dir).resolve()).encode(), digest_size=4).hexdigest()
    return Path(tempfile.gettempdir()) / f"kdn-ray-{digest}"


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def _answers(address: str, timeout_s: float = 3.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def ray_auth_env(state_dir: Path) -> dict[str, str]:
    """Token authentication for the clusters we start: a fresh secret per state dir (mode 0600),
    handed to every node and driver through the environment, independent of ~/.ray."""
    token = Path(state_dir) / "ray_auth_token"
    if not token.exists():
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


def _start_node(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """One `ray start --block` in a new session (its children stay in that session)."""
    fh = open(log, "ab")
    return subprocess.Popen(
        [_ray_bin(), "start", "--block", "--disable-usage-stats", *args],
        stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, **env},
    )


def _wait_for_resources(want: dict[str, float], timeout_s: float) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    have: dict = {}
    while time.monotonic() < deadline:
        have = ray.cluster_resources()
        if all(have.get(k, 0) >= v for k, v in want.items()):
            return
        time.sleep(0.5)
    missing = {k: v for k, v in want.items() if have.get(k, 0) < v}
    raise Unavailable(f"Ray nodes did not come up within {timeout_s:.0f}s; missing resources {missing}")


# -- up / down ----------------------------------------------------------------------------------


def up(config: ClusterConfig, *, progress=print) -> ClusterState:
    """Start (or join) the cluster and place the roles. Cleans up after itself on failure."""
    state_dir = Path(config.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    existing = ClusterState.load(state_dir)
    if existing is not None and session_members(set(existing.session_pids)):
        raise ConfigError(f"a cluster started by `kdn up` is already running (state in {state_dir}); run `kdn down` first")
    if config.address is None and config.head_port and _port_in_use(config.head_port):
        raise ConfigError(f"head port {config.head_port} is already in use")
    if config.address is not None and not _answers(config.address):
        raise Unavailable(f"no Ray cluster answers at {config.address}")
    if config.address is None and config.origin_nodes < 1:
        raise ConfigError("a new cluster needs at least one origin node (--origin-nodes >= 1)")

    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    state = ClusterState(address=config.address or "", state_dir=str(state_dir), started_unix=time.time())
    procs: list[subprocess.Popen] = []
    auth = ray_auth_env(state_dir) if config.address is None else {}
    os.environ.update(auth)  # this driver, and the actors it creates, speak the same token
    try:
        common = [f"--num-cpus={config.cpus_per_node:g}"]
        if config.address is None:
            port = config.head_port or free_port()
            progress(f"starting Ray head on port {port}")
            procs.append(_start_node(
                ["--head", f"--port={port}", "--include-dashboard=false",
                 f"--ray-client-server-port={free_port()}", f"--temp-dir={ray_temp_dir(state_dir)}",
                 f"--resources={json.dumps({RESOURCE_HEAD: 1})}", *common],
                logs / "head.log", auth,
            ))
            state.started_head = True
            state.session_pids = [p.pid for p in procs]
            state.save()
            state.address = _wait_for_head(procs[0], logs / "head.log", port, config.wait_s)
        import ray

        ray.init(address=state.address, namespace=RAY_NAMESPACE, logging_level="ERROR", log_to_driver=False)
        try:
            # Nodes on one machine join one at a time: raylets that register concurrently from the
            # same IP can miss each other's node info and time out.
            have = ray.cluster_resources()
            want = {r: float(have.get(r, 0.0)) for r in (RESOURCE_ORIGIN, RESOURCE_EDGE)}
            roles = [(RESOURCE_ORIGIN, f"origin-{i}") for i in range(config.origin_nodes)]
            roles += [(RESOURCE_EDGE, f"edge-{i}") for i in range(config.edge_nodes)]
            for resource, name in roles:
                progress(f"starting Ray node {name}")
                procs.append(_start_node(
                    [f"--address={state.address}", f"--resources={json.dumps({resource: 1})}", *common],
                    logs / f"{name}.log", auth))
                state.session_pids = [p.pid for p in procs]
                state.save()
                want[resource] += 1
                _wait_for_resources(want, config.wait_s)
            from kdn.ops.roles import deploy_roles

            state.origins, state.edges = deploy_roles(config, progress=progress)
        finally:
            ray.shutdown()
        state.save()
        return state
    except BaseException:
        progress("start-up failed; stopping what was started")
        stop_sessions([p.pid for p in procs])
        (state_dir / "cluster.json").unlink(missing_ok=True)
        raise


def _wait_for_head(proc: subprocess.Popen, log: Path, port: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise Unavailable(f"Ray head exited with code {proc.returncode}:\n{tail}")
        text = log.read_text(errors="replace") if log.exists() else ""
        marker = "ray start --address='"
        if marker in text:
            return text.split(marker, 1)[1].split("'", 1)[0]
        time.sleep(0.3)
    raise Unavailable(f"Ray head did not start within {timeout_s:.0f}s (log: {log})")


def down(state_dir: Path) -> dict:
    """Stop every process `kdn up` started (by session), and nothing else."""
    state = ClusterState.load(state_dir)
    if state is None:
        return {"stopped": [], "message": f"no cluster state in {state_dir}; nothing to stop"}
    if not state.started_head:
        _remove_roles(state)
    stopped = stop_sessions(state.session_pids)
    (Path(state_dir) / "cluster.json").unlink(missing_ok=True)
    if state.started_head:
        shutil.rmtree(ray_temp_dir(Path(state_dir)), ignore_errors=True)
    return {"stopped": stopped, "message": f"stopped {len(stopped)} processes"}


def _remove_roles(state: ClusterState) -> None:
    """When we joined someone else's cluster, kill only our actors there."""
    try:
        import ray

        from kdn.ops.roles import kill_roles

        ray.init(address=state.address, namespace=RAY_NAMESPACE, logging_level="ERROR", log_to_driver=False)
        try:
            kill_roles([m["node_id"] for m in state.origins + state.edges])
        finally:
            ray.shutdown()
    except Exception as exc:  # the cluster may be gone already; stopping our nodes still proceeds
        print(f"kdn down: could not remove roles from {state.address}: {exc}", file=sys.stderr)


# -- CLI ----------------------------------------------------------------------------------------


def main_up(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kdn up", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="join an existing Ray cluster instead of starting a head")
    p.add_argument("--head-port", type=int)
    p.add_argument("--origin-nodes", type=int)
    p.add_argument("--edge-nodes", type=int)
    p.add_argument("--cpus-per-node", type=float)
    p.add_argument("--model")
    p.add_argument("--codec")
    p.add_argument("--state-dir", type=Path)
    p.add_argument("--bind-host", help="address the gRPC servers bind (default 127.0.0.1)")
    p.add_argument("--config", type=Path, help="YAML/JSON file with ClusterConfig fields")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    overrides = {k: getattr(a, k) for k in ("address", "head_port", "origin_nodes", "edge_nodes",
                                             "cpus_per_node", "model", "codec", "state_dir", "bind_host")}
    log = (lambda msg: print(msg, file=sys.stderr)) if a.json else print
    try:
        cfg = ClusterConfig.from_file(a.config, **overrides) if a.config else ClusterConfig.build(**overrides)
        state = up(cfg, progress=log)
    except KdnError as exc:
        print(f"kdn up: {exc}", file=sys.stderr)
        return 1
    env = {"RAY_ADDRESS": state.address, **(ray_auth_env(Path(state.state_dir)) if state.started_head else {})}
    if a.json:
        print(json.dumps({**asdict(state), "env": env}))
    else:
        print(f"Ray cluster: {state.address}")
        print("drivers (kdn ingest --workers N, ray status) connect with:")
        print("  export " + " ".join(f"{k}={v}" for k, v in env.items()))
        for o in state.origins:
            print(f"origin {o['node_id']}: {o['address']}")
        for e in state.edges:
            print(f"edge   {e['node_id']}: {e['address']}  (metrics {e.get('metrics_address') or '-'})")
        print("stop it with: kdn down")
    return 0


def main_down(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kdn down", description="stop exactly what `kdn up` started")
    p.add_argument("--state-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    result = down(a.state_dir or default_state_dir())
    print(json.dumps(result) if a.json else result["message"])
    return 0
