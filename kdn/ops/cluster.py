"""`kdn up` / `kdn down`: a Ray cluster whose nodes carry KDN's roles.

``kdn up`` starts a Ray head (or joins ``--address``) and, on this machine, ``--origin-nodes``
Ray nodes with the custom resource ``kdn_origin`` and ``--edge-nodes`` nodes with ``kdn_edge``.
Each node is one ``ray start --block`` process in a session of its own, so ``kdn down`` can stop
exactly the processes ``kdn up`` started (every process in those sessions) and nothing else.
Then it places the roles as detached actors by those resources (:mod:`kdn.ops.roles`), waits until
every gRPC endpoint is registered (:mod:`kdn.ops.registry`), and prints the endpoints.

If anything fails half-way, everything started so far is stopped again before the error is shown.

Nothing of an earlier run is trusted: every ``kdn up`` that starts a head writes fresh logs
(``logs/*.log`` are truncated), a fresh Ray auth token and a fresh Ray temp dir, and takes the
head's address only from this run's log and only once its GCS answers on the port this run gave
it. ``cluster.json`` records the machine's boot id and each session leader's start time, so pids
from before a reboot, or pids the kernel has since given to other processes, are never taken for
ours (neither by ``kdn up``'s "already running" check nor by ``kdn down``). Every wait is bounded
by ``wait_s`` (``--wait-s``, default 120 s) and ends in one line naming what did not answer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import Field

from kdn.blobstore import write_json_atomic
from kdn.config import RoleConfig
from kdn.console import report_error
from kdn.errors import ConfigError, KdnError, Unavailable
from kdn.pretrained import DEFAULT_MODEL
from kdn.procs import pid_alive, session_members, stop_sessions
from kdn.ops.registry import RAY_NAMESPACE, RESOURCE_EDGE, RESOURCE_HEAD, RESOURCE_ORIGIN
from kdn.wire.channel import free_port
from kdn.wire.shm import DEFAULT_SHM_DIR, SEGMENT_NAME


def default_state_dir() -> Path:
    return Path(os.environ.get("KDN_CACHE", Path.home() / ".cache" / "kdn")) / "cluster"


class ClusterConfig(RoleConfig):
    """What `kdn up` starts. Every field can come from ``--config FILE`` and be overridden by flags."""

    address: str | None = Field(None, description="join this Ray cluster (host:port) instead of starting a head")
    head_port: int = Field(0, ge=0, le=65535, description="GCS port of the head we start; 0 = pick a free one")
    origin_nodes: int = Field(1, ge=0, le=16, description="local Ray nodes with the kdn_origin resource")
    edge_nodes: int = Field(3, ge=1, le=32, description="local Ray nodes with the kdn_edge resource (one edge each)")
    cpus_per_node: float = Field(1.0, gt=0, description="CPUs each local Ray node advertises")
    model: str = Field(DEFAULT_MODEL, description="model spec the origin serves")
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
    boot_id: str = ""  # the boot these pids belong to
    session_starts: list[int | None] = field(default_factory=list)  # each leader's start time (clock ticks after boot)
    actor_ids: dict[str, str] = field(default_factory=dict)  # node id -> Ray actor id of the role we placed
    auth_env: dict[str, str] = field(default_factory=dict)  # RAY_AUTH_MODE / _TOKEN_PATH a joined cluster took

    def add_session(self, pid: int) -> None:
        self.session_pids.append(pid)
        self.session_starts.append(_start_time(pid))

    def save(self) -> None:
        write_json_atomic(Path(self.state_dir) / "cluster.json", asdict(self), indent=2)

    @classmethod
    def load(cls, state_dir: Path) -> "ClusterState | None":
        path = Path(state_dir) / "cluster.json"
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    def our_sessions(self) -> list[int]:
        """The recorded session ids that can still be ours: none after a reboot, and none whose
        leader pid now belongs to a process that started at another time (a reused pid)."""
        if self.boot_id and self.boot_id != _boot_id():
            return []
        out = []
        for i, pid in enumerate(self.session_pids):
            recorded = self.session_starts[i] if i < len(self.session_starts) else None
            now = _start_time(pid)
            if recorded is not None and now is not None and now != recorded:
                continue
            out.append(pid)
        return out


# -- process management -------------------------------------------------------------------------


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the fields after ')' start at field 3


def _processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmd:
            out.append(int(entry))
    return out


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
    """Token authentication for the clusters we start, handed to every node and driver through the
    environment, independent of ~/.ray. The token file is written by :func:`_new_ray_auth_token`."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(state_dir) / "ray_auth_token")}


def _new_ray_auth_token(state_dir: Path) -> None:
    """A fresh secret for each head we start (mode 0600 from the start, replaced atomically)."""
    token = Path(state_dir) / "ray_auth_token"
    tmp = token.with_name(token.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
        fh.write(secrets.token_hex(32))
    os.replace(tmp, token)


AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


def _start_node(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """One `ray start --block` in a new session (its children stay in that session). Its log is
    this run's alone: an earlier run's lines would name an earlier run's (dead) cluster."""
    fh = open(log, "wb")
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
    if existing is not None and session_members(set(existing.our_sessions())):
        raise ConfigError(f"a cluster started by `kdn up` is already running (state in {state_dir}); "
                          f"run `kdn down{_state_dir_flag(state_dir)}` first")
    temp_dir = ray_temp_dir(state_dir)
    if config.address is None and (stray := _processes_mentioning(str(temp_dir))):
        raise ConfigError(f"Ray processes of an earlier `kdn up` with this state dir still run without a "
                          f"record in {state_dir / 'cluster.json'} (pids {' '.join(map(str, stray))}); stop them first")
    if config.address is None and config.head_port and _port_in_use(config.head_port):
        raise ConfigError(f"head port {config.head_port} is already in use")
    if config.address is not None and not _answers(config.address):
        raise Unavailable(f"no Ray cluster answers at {config.address}")
    if config.address is None and config.origin_nodes < 1:
        raise ConfigError("a new cluster needs at least one origin node (--origin-nodes >= 1)")

    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    state = ClusterState(address=config.address or "", state_dir=str(state_dir), started_unix=time.time(),
                         boot_id=_boot_id())
    procs: list[subprocess.Popen] = []
    if config.address is None:
        _new_ray_auth_token(state_dir)
        auth = ray_auth_env(state_dir)
        os.environ.pop("RAY_AUTH_TOKEN", None)  # a token exported for another cluster would win over ours
        shutil.rmtree(temp_dir, ignore_errors=True)  # no process uses it (checked above)
    else:
        auth = {}
        state.auth_env = {k: os.environ[k] for k in AUTH_VARS if os.environ.get(k)}
    os.environ.update(auth)  # this driver, and the actors it creates, speak the same token
    try:
        common = [f"--num-cpus={config.cpus_per_node:g}"]
        if config.address is None and config.bind_host in ("127.0.0.1", "localhost"):
            # every node on this host: Ray's own traffic stays on loopback too (by default it
            # advertises the host's primary address)
            common.append("--node-ip-address=127.0.0.1")
        if config.address is None:
            port = config.head_port or free_port()
            progress(f"starting Ray head on port {port}")
            procs.append(_start_node(
                ["--head", f"--port={port}", "--include-dashboard=false",
                 f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dir}",
                 f"--resources={json.dumps({RESOURCE_HEAD: 1})}", *common],
                logs / "head.log", auth,
            ))
            state.started_head = True
            state.add_session(procs[-1].pid)
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
                state.add_session(procs[-1].pid)
                state.save()
                want[resource] += 1
                _wait_for_resources(want, config.wait_s)
            from kdn.ops.roles import deploy_roles

            state.origins, state.edges = deploy_roles(config, progress=progress)
            state.actor_ids = _actor_ids([m["node_id"] for m in state.origins + state.edges])
        finally:
            ray.shutdown()
        state.save()
        return state
    except BaseException:
        progress("start-up failed; stopping what was started")
        stop_sessions([p.pid for p in procs])
        (state_dir / "cluster.json").unlink(missing_ok=True)
        if state.started_head:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise


HEAD_MARKER = "ray start --address='"


def _head_address(log_text: str, port: int) -> str | None:
    """The address the head's log names for joining, if it is on ``port`` (the last such line)."""
    found = None
    for chunk in log_text.split(HEAD_MARKER)[1:]:
        address = chunk.split("'", 1)[0]
        if address.rpartition(":")[2] == str(port):
            found = address
    return found


def _wait_for_head(proc: subprocess.Popen, log: Path, port: int, timeout_s: float) -> str:
    """The GCS address of the head we started, once it answers there; at most ``timeout_s``.

    The address comes from this run's log (truncated when the head started) and must be on the
    port this run gave the head, and its GCS must accept connections before Ray is asked to
    connect: a Ray driver pointed at a dead GCS retries for minutes."""
    deadline = time.monotonic() + timeout_s
    address = None
    while True:
        if proc.poll() is not None:
            last = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] if log.exists() else []
            raise Unavailable(f"the Ray head exited with code {proc.returncode} before its GCS answered on port "
                              f"{port} (log: {log}{'; last line: ' + last[0].strip()[:200] if last else ''})")
        if address is None and log.exists():
            address = _head_address(log.read_text(errors="replace"), port)
        if address is not None and _answers(address, timeout_s=1.0):
            return address
        if time.monotonic() >= deadline:
            what = f"at {address}" if address else f"on port {port} (it never printed its address)"
            raise Unavailable(f"the Ray head's GCS did not answer {what} within {timeout_s:g}s (log: {log})")
        time.sleep(0.3)


def _actor_ids(node_ids: list[str]) -> dict[str, str]:
    """The Ray actor id behind each role we placed: `kdn down` kills a role only if it is still that actor."""
    import ray

    from kdn.ops.roles import ROLE_PREFIX

    out = {}
    for node_id in node_ids:
        try:
            out[node_id] = ray.get_actor(f"{ROLE_PREFIX}{node_id}", namespace=RAY_NAMESPACE)._actor_id.hex()
        except ValueError:
            continue
    return out


def down(state_dir: Path, *, shm_dir: str = DEFAULT_SHM_DIR) -> dict:
    """Stop every process `kdn up` started (by session), and nothing else; then remove the
    shared-memory segments those processes left (an edge's segments are named after its pid)."""
    state = ClusterState.load(state_dir)
    if state is None:
        return {"stopped": [], "message": f"no cluster state in {state_dir}; nothing to stop"}
    problem = None
    if not state.started_head:
        problem = _remove_roles(state)
    stopped = stop_sessions(state.our_sessions())
    # the edges' own pids too: on a joined cluster their actors were killed above, before the
    # sessions were listed, so they are not among ``stopped``
    edge_pids = [int(e["pid"]) for e in state.edges if isinstance(e.get("pid"), int)]
    segments, freed = remove_segments_of(stopped + edge_pids, shm_dir)
    (Path(state_dir) / "cluster.json").unlink(missing_ok=True)
    if state.started_head:
        shutil.rmtree(ray_temp_dir(Path(state_dir)), ignore_errors=True)
    out = {"stopped": stopped, "shm_segments_removed": segments, "shm_bytes_freed": freed,
           "message": f"stopped {len(stopped)} processes"
                      + (f"; removed {segments} shared-memory segments ({freed / 2**20:.1f} MiB)" if segments else "")}
    if problem:
        out["warning"] = problem
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie's segments are as orphaned as a reaped one's)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return pid_alive(pid)  # no /proc: the signal check


def remove_segments_of(pids: list[int], directory: str = DEFAULT_SHM_DIR) -> tuple[int, int]:
    """Unlink the shared-memory segments (``kdn-<node>-<pid>-<hex>``, kdn.wire.shm) of these
    stopped processes; a live pid's are left alone. Returns (segments, bytes) removed.

    A killed edge cannot unlink its own segments, and the sweep of a new pool only runs when one
    opens on this host: without this, `kdn down` would leave them in RAM (/dev/shm is tmpfs)."""
    gone = {p for p in pids if not _running(p)}
    count = size = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0, 0
    for entry in entries:
        m = SEGMENT_NAME.match(entry.name)
        if not m or int(m.group(1)) not in gone:
            continue
        try:
            n = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
        except OSError:
            continue
        count += 1
        size += n
    return count, size


REMOVE_TIMEOUT_S = 30.0
_AUTH_FAILURES = ("InvalidAuthToken", "AuthenticationError", "UNAUTHENTICATED", "Unauthenticated")

# Runs in a child process: Ray reads its auth settings when it is imported, and a driver that
# cannot get in retries for a long time, printing as it goes; the parent bounds and summarises it.
_REMOVE_SCRIPT = """
import json, sys, ray
from kdn.ops.registry import RAY_NAMESPACE
from kdn.ops.roles import ROLE_PREFIX, kill_roles
want = json.loads(sys.argv[1])
ray.init(address=want["address"], namespace=RAY_NAMESPACE, logging_level="ERROR", log_to_driver=False)
ours, foreign = [], []
for node_id, actor_id in want["roles"].items():
    try:
        live = ray.get_actor(ROLE_PREFIX + node_id, namespace=RAY_NAMESPACE)._actor_id.hex()
    except ValueError:
        continue
    (ours if actor_id in (None, live) else foreign).append(node_id)
print(json.dumps({"killed": kill_roles(ours), "foreign": foreign}), flush=True)
ray.shutdown()
"""


def _remove_roles(state: ClusterState, timeout_s: float = REMOVE_TIMEOUT_S) -> str | None:
    """When we joined someone else's cluster, kill only our actors there: the roles whose Ray
    actor is still the one we placed. Returns one line saying what went wrong, or None."""
    roles = {m["node_id"]: state.actor_ids.get(m["node_id"]) for m in state.origins + state.edges}
    if not roles:
        return None
    where = f"the Ray cluster at {state.address}"
    if not _answers(state.address):
        return f"{where} does not answer; no roles removed there"
    env = {**os.environ, "RAY_ADDRESS": state.address}
    env.update({k: v for k, v in state.auth_env.items() if not os.environ.get(k)})
    child = subprocess.Popen(
        [sys.executable, "-c", _REMOVE_SCRIPT, json.dumps({"address": state.address, "roles": roles})],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    lines: list[str] = []
    auth_failed = threading.Event()

    def read_stderr() -> None:
        for line in child.stderr:
            lines.append(line)
            if any(m in line for m in _AUTH_FAILURES):
                auth_failed.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while child.poll() is None and not auth_failed.is_set() and time.monotonic() < deadline:
        time.sleep(0.1)
    if child.poll() is None:
        child.kill()
    out = child.communicate()[0] if not auth_failed.is_set() else ""
    reader.join(1)
    if auth_failed.is_set():
        how = (f"with the token in {env['RAY_AUTH_TOKEN_PATH']}" if env.get("RAY_AUTH_TOKEN_PATH")
               else "without an auth token (export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=... as for `kdn up --address`)")
        return f"{where} refused this driver {how}; roles {', '.join(roles)} not removed there"
    if child.returncode != 0 or not out.strip():
        if child.returncode == -9:
            return f"{where} did not let a driver in within {timeout_s:g}s; roles {', '.join(roles)} not removed there"
        last = next((ln.strip() for ln in reversed(lines) if ln.strip()), f"exit code {child.returncode}")
        return f"could not remove roles {', '.join(roles)} from {where}: {last[:300]}"
    result = json.loads(out.strip().splitlines()[-1])
    if result["foreign"]:
        return (f"left {', '.join(result['foreign'])} on {where} alone: those names now belong to actors "
                f"another `kdn up` placed")
    return None


# -- CLI ----------------------------------------------------------------------------------------


def main_up(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kdn up", description=__doc__.split("\n\n")[0])
    def about(name: str) -> str:  # the help is the config field's own description (one place)
        f = ClusterConfig.model_fields[name]
        default = "" if f.default_factory is not None else f" (default {f.default})"
        return f"{f.description}{default}"

    p.add_argument("--address", help="join an existing Ray cluster instead of starting a head")
    p.add_argument("--head-port", type=int, help=about("head_port"))
    p.add_argument("--origin-nodes", type=int, help=about("origin_nodes"))
    p.add_argument("--edge-nodes", type=int, help=about("edge_nodes"))
    p.add_argument("--cpus-per-node", type=float, help=about("cpus_per_node"))
    p.add_argument("--model", help=about("model"))
    p.add_argument("--codec", help=about("codec"))
    p.add_argument("--state-dir", type=Path,
                   help="pids, logs, token, origin store and edge disks (default ~/.cache/kdn/cluster, or $KDN_CACHE/cluster)")
    p.add_argument("--bind-host", help="address the gRPC servers bind (default 127.0.0.1)")
    p.add_argument("--wait-s", type=float,
                   help="bound on each wait: the head's GCS, every node, every endpoint (default 120)")
    p.add_argument("--config", type=Path, help="YAML/JSON file with ClusterConfig fields")
    p.add_argument("--json", action="store_true", help="print one JSON object: address, endpoints, env (errors too)")
    a = p.parse_args(argv)
    overrides = {k: getattr(a, k) for k in ("address", "head_port", "origin_nodes", "edge_nodes",
                                             "cpus_per_node", "model", "codec", "state_dir", "bind_host", "wait_s")}
    log = (lambda msg: print(msg, file=sys.stderr)) if a.json else print
    try:
        cfg = ClusterConfig.from_file(a.config, **overrides) if a.config else ClusterConfig.build(**overrides)
        state = up(cfg, progress=log)
    except KdnError as exc:
        report_error("up", exc, as_json=a.json)
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
        print(f"stop it with: kdn down{_state_dir_flag(Path(state.state_dir))}")
    return 0


def _state_dir_flag(state_dir: Path) -> str:
    """`` --state-dir DIR`` unless DIR is the default one (for the commands we suggest)."""
    if Path(state_dir).resolve() == default_state_dir().resolve():
        return ""
    return f" --state-dir {shlex.quote(str(state_dir))}"


def main_down(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kdn down", description="stop exactly what `kdn up` started")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the --state-dir `kdn up` was given (default ~/.cache/kdn/cluster, or $KDN_CACHE/cluster)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    result = down(a.state_dir or default_state_dir())
    if result.get("warning"):
        print(f"kdn down: {result['warning']}", file=sys.stderr)
    print(json.dumps(result) if a.json else result["message"])
    return 0
