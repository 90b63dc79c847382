"""Edges behind NAT exchange KV over WebRTC (issue 18), through real NATs in network namespaces.

The lab (:mod:`kdn.simulator.natlab`): two sites, each behind its own masquerading NAT, and a
public segment with the origin (which also serves WebRTC signalling) and coturn (STUN + TURN).
An edge in each site; neither can dial the other. They discover each other through the origin,
connect over a WebRTC data channel — directly where the NATs keep ports (cone-like), relayed
through TURN where both NATs are symmetric (``--random-fully``) — and an inference client at
site A reuses KV that only site B's edge holds, with output equal to recompute. Checks also that
the path is what the NATs allow (edge metrics), that the TURN credential appears in no log line,
and that with site B's edge gone site A still answers (origin, then recompute).
Namespaces and processes are removed by the test (:meth:`NatLab.close`).
In this lab relayed pairs complete only in relay-only ICE sessions, so an edge with a TURN server
starts a relay-only attempt beside the first when no path is up after ``rtc_relay_after_s``
(kdn.wire.rtc.RtcEndpoint._dial): that attempt is what carries the symmetric case.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdn.simulator import natlab
from tests.integration import nat_child

# ~80 s on the 2-core machine (six Python processes load torch): kept out of the default run
pytestmark = [pytest.mark.integration, pytest.mark.netns, pytest.mark.slow]


REPO = Path(__file__).resolve().parents[2]
TOKEN = "tok-" + secrets.token_hex(8)


def _why_not() -> str | None:
    try:
        import aiortc  # noqa: F401
    except ImportError:
        return "aiortc is not installed (pip install -e '.[webrtc]')"
    return natlab.available()


def _ready(proc: subprocess.Popen, what: str, log: Path, timeout: float = 60.0) -> dict:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == "ready":
                return msg
    raise AssertionError(f"{what} not ready: {log.read_text()[-2000:] if log.exists() else ''}")


def _child(lab: natlab.NatLab, role: str, *args: str, timeout: float = 120.0) -> dict:
    r = subprocess.run(["ip", "netns", "exec", lab.ns(role), sys.executable, "-m", "tests.integration.nat_child", *args],
                       capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _edge_config(tmp: Path, site: str, origin: str, turn_secret: str) -> Path:
    import yaml

    turn = f"{natlab.PUBLIC_IP}:{natlab.TURN_PORT}"
    cfg = {
        "node_id": f"edge-{site.lower()}", "listen": f"{natlab.SITE_IP[site]}:0", "origin": origin,
        "memory_bytes": 64 << 20, "disk_dir": str(tmp / f"edge-{site}"), "shm": False, "bulk": False,
        "metrics_port": 0, "tokens": {TOKEN: ["*"]}, "upstream_token": TOKEN, "cluster_key": nat_child.CLUSTER_KEY,
        "rtc_signal": origin, "rtc_announce_s": 1.0, "rtc_connect_timeout_s": 15.0, "membership_refresh_s": 0.5,
        "rtc_ice_servers": [
            {"urls": [f"stun:{turn}"]},
            {"urls": [f"turn:{turn}?transport=udp"], "username": natlab.TURN_USER, "credential": turn_secret},
        ],
    }
    path = tmp / f"edge-{site}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.timeout(240)
@pytest.mark.parametrize("symmetric,path", [
    (False, "direct"),
    (True, "relayed"),
], ids=["cone-direct", "symmetric-relayed"])
def test_edges_behind_nat_share_kv_over_webrtc(tmp_path: Path, symmetric: bool, path: str) -> None:
    why = _why_not()  # probed here, not at collection: it makes a namespace
    if why is not None:
        pytest.skip(f"NAT lab unavailable: {why}")
    turn_secret = "turn-" + secrets.token_hex(12)
    lab = natlab.NatLab(symmetric=symmetric)
    try:
        lab.build()
        lab.start_turn(turn_secret, tmp_path)
        olog = tmp_path / "origin.err"
        origin = lab.spawn("pub", [sys.executable, "-m", "tests.integration.nat_child", "origin", str(tmp_path / "origin"),
                                   f"{natlab.PUBLIC_IP}:0", TOKEN], log=olog)
        origin_addr = _ready(origin, "origin", olog)["address"]
        edges = {}
        for site in ("A", "B"):
            log = tmp_path / f"edge-{site}.err"
            p = lab.spawn(f"site{site}", [sys.executable, "-m", "kdn.edge.cli", "--config",
                                          str(_edge_config(tmp_path, site, origin_addr, turn_secret)), "-v"], log=log)
            edges[site] = (_ready(p, f"edge {site}", log), log)
        time.sleep(1.5)  # a couple of announcements: each edge knows the other

        wrote = _child(lab, "siteB", "generate", edges["B"][0]["address"], TOKEN, "t1", "lease-b")
        assert wrote["reused_tokens"] == 0 and wrote["equal"]  # computed at B, written back to B's edge only
        got = _child(lab, "siteA", "generate", edges["A"][0]["address"], TOKEN, "t1", "lease-b")
        assert got["equal"], got
        assert got["reused_tokens"] == got["full"] > 0, (got, edges["A"][1].read_text()[-3000:])

        m = _child(lab, "siteA", "metrics", str(edges["A"][0]["metrics_port"]))["metrics"]
        conn = [ln for ln in m if ln.startswith("kdn_edge_rtc_connections_total") and 'role="dial"' in ln]
        assert any(f'path="{path}"' in ln and not ln.endswith(" 0.0") for ln in conn), m
        assert not any(f'path="{other}"' in ln for ln in conn for other in {"direct", "relayed"} - {path}), m
        got_bytes = [ln for ln in m if ln.startswith("kdn_edge_peer_bytes_total") and 'direction="in"' in ln and f'path="{path}"' in ln]
        assert got_bytes and float(got_bytes[0].split()[-1]) > 0, m

        # site B's edge gone: site A's client still gets the recomputed answer (peer down -> origin -> recompute)
        lab.procs[-1].terminate()
        lab.procs[-1].wait(timeout=15)
        again = _child(lab, "siteA", "generate", edges["A"][0]["address"], TOKEN, "t1", "other-doc")
        assert again["equal"] and again["reused_tokens"] == 0

        logs = "".join(log.read_text() for _, log in edges.values()) + olog.read_text()
        assert "WebRTC dial edge-b up" in logs or "WebRTC dial" in logs
        assert turn_secret not in logs  # TURN credentials never logged
    finally:
        lab.close()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab.prefix + "-" not in left
