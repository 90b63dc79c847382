"""A lab of two sites behind NAT and a public segment, in network namespaces.

Layout (``ip netns``, so it needs root; every name carries the lab's prefix)::

    siteA 192.168.1.2 ── lan0 natA pub0 203.0.113.1 ─┐
                                                     br0 (pub) 203.0.113.10: origin + coturn (STUN/TURN)
    siteB 192.168.2.2 ── lan0 natB pub0 203.0.113.2 ─┘

Each NAT masquerades its site behind its public address and lets in only replies (conntrack
ESTABLISHED/RELATED); unsolicited packets to the NAT itself are dropped, as a home router does. ``symmetric=True`` adds ``--random-fully``: every new destination gets a
fresh random public port, so the address STUN saw is useless to the other site and ICE must
relay through TURN; otherwise Linux keeps the source port (a port-restricted cone NAT) and a
direct path is found. ``block_direct=True`` keeps the NATs port-preserving but drops UDP from
one site to the other's NAT (a firewall that allows only the public services): TURN again.
``rate_mbit`` shapes natA's LAN side (every byte into site A passes it,
direct, relayed, or plain TCP from the public segment) with ``tbf``.

:meth:`NatLab.spawn` starts a process in a namespace and remembers it; :meth:`NatLab.close`
ends exactly those processes (by pid) and deletes exactly the namespaces it made.
Only the standard library and ``ip``/``iptables``/``tc``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

__all__ = ["NatLab", "available", "PUBLIC_IP", "SITE_IP", "TURN_USER", "TURN_PORT"]

PUBLIC_IP = "203.0.113.10"
SITE_IP = {"A": "192.168.1.2", "B": "192.168.2.2"}
NAT_IP = {"A": "203.0.113.1", "B": "203.0.113.2"}
TURN_PORT = 3478
TURN_USER = "kdn"


def available(*, turn: bool = True) -> str | None:
    """None if the lab can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    tools = ["ip", "iptables", "tc"] + (["turnserver"] if turn else [])
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} not found" + (" (apt-get install coturn)" if tool == "turnserver" else "")
    name = f"kdnprobe{os.getpid()}"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            return f"ip netns add not permitted: {r.stderr.strip()[:200]}"
        r = subprocess.run(["ip", "netns", "exec", name, "iptables", "-t", "nat", "-L"], capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            return f"iptables nat table not usable in a namespace: {r.stderr.strip()[:200]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns failed: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return None


class NatLab:
    """Build with :meth:`build`, run things with :meth:`spawn`/:meth:`run`, always :meth:`close`."""

    def __init__(
        self, *, symmetric: bool = False, block_direct: bool = False, rate_mbit: float | None = None, prefix: str | None = None,
    ) -> None:
        self.prefix = prefix or f"k{os.getpid() % 100000}"
        self.symmetric = symmetric
        self.block_direct = block_direct
        self.rate_mbit = rate_mbit
        self.made: list[str] = []
        self.procs: list[subprocess.Popen[str]] = []

    def ns(self, role: str) -> str:
        """The namespace of ``role``: pub, natA, natB, siteA, siteB."""
        return f"{self.prefix}-{role}"

    def _ip(self, *args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def sh(self, role: str, *cmd: str) -> str:
        r = subprocess.run(["ip", "netns", "exec", self.ns(role), *cmd], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"{role}: {' '.join(cmd)}: {r.stderr.strip()}")
        return r.stdout

    def build(self) -> "NatLab":
        for role in ("pub", "natA", "natB", "siteA", "siteB"):
            self._ip("netns", "add", self.ns(role))
            self.made.append(self.ns(role))
            self._ip("-n", self.ns(role), "link", "set", "lo", "up")
        pub = self.ns("pub")
        self._ip("-n", pub, "link", "add", "br0", "type", "bridge")
        self._ip("-n", pub, "addr", "add", f"{PUBLIC_IP}/24", "dev", "br0")
        self._ip("-n", pub, "link", "set", "br0", "up")
        for site, i in (("A", 1), ("B", 2)):
            nat, lan = self.ns(f"nat{site}"), self.ns(f"site{site}")
            self._ip("-n", nat, "link", "add", "pub0", "type", "veth", "peer", "name", f"n{site}", "netns", pub)
            self._ip("-n", pub, "link", "set", f"n{site}", "master", "br0")
            self._ip("-n", pub, "link", "set", f"n{site}", "up")
            self._ip("-n", nat, "addr", "add", f"{NAT_IP[site]}/24", "dev", "pub0")
            self._ip("-n", nat, "link", "set", "pub0", "up")
            self._ip("-n", nat, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", lan)
            self._ip("-n", nat, "addr", "add", f"192.168.{i}.1/24", "dev", "lan0")
            self._ip("-n", nat, "link", "set", "lan0", "up")
            self._ip("-n", lan, "addr", "add", f"{SITE_IP[site]}/24", "dev", "eth0")
            self._ip("-n", lan, "link", "set", "eth0", "up")
            self._ip("-n", lan, "route", "add", "default", "via", f"192.168.{i}.1")
            self.sh(f"nat{site}", "sysctl", "-qw", "net.ipv4.ip_forward=1")
            masq = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "pub0", "-j", "MASQUERADE"]
            self.sh(f"nat{site}", *(masq + (["--random-fully"] if self.symmetric else [])))
            self.sh(f"nat{site}", "iptables", "-A", "FORWARD", "-i", "pub0", "-o", "lan0", "-m", "conntrack",
                    "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            self.sh(f"nat{site}", "iptables", "-A", "FORWARD", "-i", "pub0", "-o", "lan0", "-j", "DROP")
            # unsolicited packets to the NAT's own address are dropped before conntrack confirms them:
            # a confirmed entry for the other site's first hole-punching packet would make this NAT
            # remap its site's own reply flow to a fresh port (a clash), and no punch would succeed
            self.sh(f"nat{site}", "iptables", "-A", "INPUT", "-i", "pub0", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")
            if self.block_direct:  # a firewall that lets UDP out only to the public services, not to the other site
                other = NAT_IP["B" if site == "A" else "A"]
                self.sh(f"nat{site}", "iptables", "-A", "FORWARD", "-o", "pub0", "-p", "udp", "-d", other, "-j", "DROP")
        if self.rate_mbit:
            self.sh("natA", "tc", "qdisc", "add", "dev", "lan0", "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                    "burst", "32kb", "limit", "4000000")
        return self

    def spawn(
        self, role: str, argv: list[str], *, log: Path | None = None, env: dict[str, str] | None = None, stdout: bool = True,
    ) -> subprocess.Popen[str]:
        """Start ``argv`` in ``role``'s namespace; stdout is a pipe (read it, or pass ``stdout=False``),
        stderr goes to ``log``."""
        err = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(role), *argv],
                             stdout=subprocess.PIPE if stdout else subprocess.DEVNULL, stderr=err,
                             text=True, env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(p)
        return p

    def start_turn(self, secret: str, workdir: Path) -> subprocess.Popen[str]:
        """coturn on the public segment: STUN and TURN (long-term credentials) on :data:`TURN_PORT`."""
        argv = [
            "turnserver", "-n", "--listening-ip", PUBLIC_IP, "--relay-ip", PUBLIC_IP, "--listening-port", str(TURN_PORT),
            "--min-port", "49152", "--max-port", "49352", "--lt-cred-mech", "--user", f"{TURN_USER}:{secret}",
            "--realm", "kdn.test", "--no-tls", "--no-dtls", "--no-cli", "--log-file", str(workdir / "turnserver.log"),
            "--simple-log", "--pidfile", str(workdir / "turnserver.pid"), "--userdb", str(workdir / "turndb"),
            "--allow-loopback-peers", *(["-V"] if os.environ.get("KDN_TURN_VERBOSE") else []),
        ]
        p = self.spawn("pub", argv, log=workdir / "turnserver.err", stdout=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # ready when it listens on its UDP port
            out = subprocess.run(["ip", "netns", "exec", self.ns("pub"), "ss", "-Hlun", f"sport = :{TURN_PORT}"],
                                 capture_output=True, text=True, timeout=10).stdout
            if out.strip():
                return p
            if p.poll() is not None:
                raise RuntimeError(f"turnserver exited with {p.returncode}: {(workdir / 'turnserver.err').read_text()[-500:]}")
            time.sleep(0.1)
        raise RuntimeError("turnserver did not listen within 10 s")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 15)  # its own session: the process and what it started
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        self.made.clear()

    def __enter__(self) -> "NatLab":
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()
