"""The operator commands reach a TLS + token edge, and `kdn stats` reads an origin (issue 17 items 7, 9).

A real `kdn edge` process serves TLS with bearer tokens on loopback; `kdn stats`, `kdn edge pin`
and `kdn query` reach it with `--tls-ca` and `--token` (the flags every client command shares),
and fail in one line without them. An in-process origin answers `kdn stats` as an origin.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kdn.edge.cli import main as edge_main
from kdn.edge.cli import main_stats
from kdn.ops.query import main as query_main
from kdn.origin.config import OriginConfig
from kdn.origin.server import OriginServer
from tests.children import reap

pytestmark = pytest.mark.integration

TOKEN = "s3cret"


def _certs(tmp: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=kdn-test-ca", "-days", "2")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=server")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "san.ext")


@pytest.fixture(scope="module")
def tls_edge(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls-edge")
    _certs(d)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdn.edge.cli", "--listen", "127.0.0.1:0", "--node-id", "tls-edge",
         "--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"), "--token-grant", f"{TOKEN}=*",
         "--no-shm"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        ready = json.loads(proc.stdout.readline())
        yield ready["address"], d / "ca.pem"
    finally:
        proc.terminate()
        reap(proc)
        proc.stdout.close()


def test_stats_and_hints_reach_a_tls_edge_with_a_token(tls_edge, capsys) -> None:
    address, ca = tls_edge
    assert main_stats(["--edge", address, "--tls-ca", str(ca), "--token", TOKEN]) == 0
    assert capsys.readouterr().out.startswith("edge tls-edge ")
    key = "ab" * 32
    assert edge_main(["pin", "--edge", address, "--tls-ca", str(ca), "--token", TOKEN, key]) == 0
    assert capsys.readouterr().out.strip() == "command=pin affected=0"
    # without the CA the handshake fails; without the token the edge refuses: one line each
    assert main_stats(["--edge", address, "--token", TOKEN, "--deadline", "3"]) == 1
    assert main_stats(["--edge", address, "--tls-ca", str(ca), "--deadline", "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("kdn stats:") for line in err), err


def test_query_reaches_a_tls_edge_with_flags(tls_edge, capsys) -> None:
    address, ca = tls_edge
    argv = ["--edge", address, "--model", "tiny", "--prompt", "hello " * 60, "--max-new-tokens", "2", "--json",
            "--no-write-back"]
    assert query_main([*argv, "--tls-ca", str(ca), "--token", TOKEN]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["warnings"] == [], out["warnings"]  # the edge answered (nothing cached yet: a miss, no warning)
    assert query_main(argv) == 0  # without TLS the edge is unreachable: still answered, with a warning
    assert json.loads(capsys.readouterr().out)["warnings"]


def test_stats_of_an_origin(tmp_path, tiny_model, capsys) -> None:
    cfg = OriginConfig(store_dir=str(tmp_path), models=["tiny"], codecs=["raw"], listen="127.0.0.1:0", fsync=False)
    srv = OriginServer(cfg, preloaded=(tiny_model,))
    srv.start()
    try:
        for flag in ("--origin", "--edge"):  # asked as an edge, an origin answers as itself
            assert main_stats([flag, srv.address]) == 0
            out = capsys.readouterr().out
            assert out.startswith(f"origin {cfg.node_id} ({srv.address})  models: tiny"), out
            rows = [line.split() for line in out.splitlines()[1:]]
            assert rows and all(len(r) == 2 for r in rows)
            assert len({line.index(r[1]) + len(r[1]) for line, r in zip(out.splitlines()[1:], rows)}) == 1  # aligned
    finally:
        srv.stop()


def test_stats_rows_are_one_name_per_metric() -> None:
    from kdn.edge.cli import stats_text
    from kdn.wire.convert import NodeStats

    stats = NodeStats("e", {"coalesced": 3.0, "kdn_edge_coalesced_requests_total": 3.0, "store_hits": 12345.0,
                            "kdn_edge_hits_total{tier=memory}": 7.0, "uptime_s": 1.5}, {"address": "a:1"})
    lines = stats_text(stats, "a:1").splitlines()
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["coalesced_requests", "hits{tier=memory}", "store_hits", "uptime_s"]
    assert len({len(line) for line in lines[1:]}) == 1 and "12,345" in lines[3]
