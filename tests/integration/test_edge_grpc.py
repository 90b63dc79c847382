"""Three edges and one origin over real gRPC on loopback: coalescing, failover, restart, corruption,
bad input, auth, TLS, origin down.

Edges that get killed run as subprocesses (``python -m edge.cli``); each prints its bound port as a
JSON line on readiness. Membership goes through a peers file the test rewrites when an edge comes
back on a new port. Every wait is bounded; every process started here is stopped here.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from kdn.edge.admin import AsyncEdgeClient
from kdn.testing import Chain, make_chain
from kdn import errors as e
from kdn.keys import ModelFingerprint, Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.proto import kdn_pb2_grpc as pbg
from kdn.wire.tls import TlsFiles
from tests.children import ready_line

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


# -- processes ---------------------------------------------------------------------------------


class EdgeProc:
    """One ``python -m edge.cli`` process."""

    def __init__(self, node_id: str, root: Path, origin: str, peers_file: Path, *extra: str) -> None:
        self.node_id = node_id
        self.disk = root / node_id
        self.args = [
            sys.executable, "-m", "kdn.edge.cli", "--listen", "127.0.0.1:0", "--node-id", node_id,
            "--origin", origin, "--peers-file", str(peers_file), "--refresh-s", "0.2", "--peer-backoff-s", "30",
            "--disk-dir", str(self.disk), "--disk-bytes", "64M", "--replicas", "2", *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def spawn(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)

    def wait_ready(self, timeout: float = 60.0) -> str:
        assert self.proc is not None
        ready = ready_line(self.proc, f"edge {self.node_id}", timeout)
        assert ready["event"] == "ready"
        self.address = ready["address"]
        return self.address

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def write_peers(path: Path, edges: dict[str, EdgeProc]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({nid: p.address for nid, p in edges.items() if p.address}))
    tmp.replace(path)


async def wait_peers(address: str, n: int, timeout: float = 20.0) -> None:
    async with AsyncEdgeClient(address, deadline_s=2.0) as c:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = await c.stats()
            if st.counters["peers"] == n and st.counters["peers_down"] == 0:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{address} did not see {n} peers")


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kdn.origin.config import OriginConfig
    from kdn.origin.server import OriginServer

    root = tmp_path_factory.mktemp("origin")
    srv = OriginServer(OriginConfig(store_dir=str(root / "store"), models=["tiny"], listen="127.0.0.1:0", codecs=["raw"]))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(origin: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("edges")
    peers_file = root / "peers.json"
    edges = {
        "a": EdgeProc("a", root, origin.address, peers_file),
        "b": EdgeProc("b", root, origin.address, peers_file, "--memory-bytes", "2500"),
        "c": EdgeProc("c", root, origin.address, peers_file),
    }
    try:
        for p in edges.values():
            p.spawn()
        for p in edges.values():
            p.wait_ready()
        write_peers(peers_file, edges)
        for p in edges.values():
            asyncio.run(wait_peers(p.address, 2))
        yield {"edges": edges, "peers_file": peers_file, "root": root}
    finally:
        for p in edges.values():
            p.stop()


def fp_of(origin: Any) -> ModelFingerprint:
    return origin.default_fingerprint


def seed_origin(origin: Any, n: int, seed: int, tenant: str = "default") -> Chain:
    chain = make_chain(n, fingerprint=fp_of(origin), seed=seed, namespace=Namespace(tenant))
    for blob in chain.blobs:
        origin.store.put(blob, tenant=tenant)
    return chain


def origin_fetches(origin: Any) -> float:
    return origin.stats().counters.get("fetches", 0.0)


# -- tests -------------------------------------------------------------------------------------


def test_100_concurrent_fetches_of_a_missing_key_one_origin_fetch(origin: Any, cluster: dict[str, Any]) -> None:
    chain = seed_origin(origin, 1, seed=101)
    before = origin_fetches(origin)

    async def main() -> None:
        address = cluster["edges"]["a"].address
        clients = [AsyncEdgeClient(address) for _ in range(4)]
        results = await asyncio.gather(*[
            clients[i % 4].fetch(chain.keys[0], fingerprint=chain.fingerprint, namespace=chain.namespace)
            for i in range(100)
        ])
        assert len(results) == 100 and all(r == chain.blobs[0] for r in results)
        for c in clients:
            await c.close()

    asyncio.run(main())
    assert origin_fetches(origin) - before == 1


def test_every_edge_serves_and_lookup_says_where(origin: Any, cluster: dict[str, Any]) -> None:
    chain = seed_origin(origin, 4, seed=102)

    async def main() -> None:
        edges = cluster["edges"]
        for p in edges.values():
            async with AsyncEdgeClient(p.address) as c:
                for i in range(4):
                    data, source = await c.fetch_with_source(chain.keys[i], fingerprint=chain.fingerprint,
                                                             namespace=chain.namespace)
                    assert data == chain.blobs[i]
                    assert source in ("memory", "disk", "peer", "origin")
        async with AsyncEdgeClient(edges["a"].address) as c:
            resp = await c.lookup(chain.keys, fingerprint=chain.fingerprint, namespace=chain.namespace)
            assert resp.available == 4 and resp.node_id == "a"
            assert {loc.tier for loc in resp.locations} <= {"memory", "disk"}
            other = seed_origin(origin, 2, seed=103)
            resp = await c.lookup(other.keys, fingerprint=other.fingerprint, namespace=other.namespace)
            assert resp.available == 2 and [loc.tier for loc in resp.locations] == ["origin", "origin"]
            with await c.fetch_shm(chain.keys[0], fingerprint=chain.fingerprint, namespace=chain.namespace) as art:
                assert bytes(art.data) == chain.blobs[0]

    asyncio.run(main())
    from kdn.edge.admin import EdgeClient

    with EdgeClient(cluster["edges"]["a"].address) as blocking:  # the blocking twin reads the same frames
        assert blocking.fetch(chain.keys[1], fingerprint=chain.fingerprint, namespace=chain.namespace) == chain.blobs[1]


def test_bad_input_gets_a_clear_status_and_nothing_breaks(origin: Any, cluster: dict[str, Any]) -> None:
    chain = seed_origin(origin, 1, seed=104)
    address = cluster["edges"]["c"].address

    async def main() -> None:
        async with AsyncEdgeClient(address, max_message=64 << 20) as c:
            with pytest.raises(e.InvalidInput):
                await c.fetch(b"\x01" * 7, fingerprint=chain.fingerprint, namespace=chain.namespace)  # type: ignore[arg-type]
            with pytest.raises(e.InvalidInput):
                await c.fetch(chain.keys[0], fingerprint=b"\x02" * 3, namespace=chain.namespace)  # type: ignore[arg-type]
            unknown_fp = ModelFingerprint(bytes(range(100, 132)))
            with pytest.raises((e.FingerprintMismatch, e.NotFound)):
                await c.fetch(chain.keys[0], fingerprint=unknown_fp, namespace=chain.namespace)
            # one message above the edge's bound (8 MiB): refused by gRPC itself
            with pytest.raises(e.MessageTooLarge):
                await c.put(b"\x00" * (9 << 20), key=chain.keys[0], fingerprint=chain.fingerprint,
                            namespace=chain.namespace, piece=9 << 20)
            # a declared size above the artifact bound
            channel = grpc.aio.insecure_channel(address)
            stub = pbg.EdgeServiceStub(channel)
            header = pb.PutHeader(fingerprint=bytes(chain.fingerprint), namespace=pb.Namespace(tenant="default"),
                                  key=bytes(chain.keys[0]), total_size=1 << 40)
            with pytest.raises(grpc.RpcError) as info:
                await stub.Put(iter([pb.PutChunk(header=header, data=b"x")]), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await channel.close()
            # a corrupt artifact is refused and not stored
            bad = bytearray(chain.blobs[0])
            bad[-30] ^= 0xFF
            with pytest.raises(e.ArtifactCorrupt):
                await c.put(bytes(bad), key=chain.keys[0], fingerprint=chain.fingerprint, namespace=chain.namespace)
            # still healthy, and the real artifact is served intact
            await c.wait_ready(timeout=5)
            assert await c.fetch(chain.keys[0], fingerprint=chain.fingerprint, namespace=chain.namespace) == chain.blobs[0]

    asyncio.run(main())


async def _fetch_with_failover(addresses: list[str], clients: dict[str, AsyncEdgeClient], chain: Chain, i: int,
                               stats: dict[str, int]) -> None:
    for n, address in enumerate(addresses):
        try:
            data = await clients[address].fetch(chain.keys[i], fingerprint=chain.fingerprint, namespace=chain.namespace)
        except e.Unavailable:
            stats["failovers"] += 1
            continue
        if data != chain.blobs[i]:
            stats["wrong"] += 1
        stats["ok"] += 1
        return
    stats["failed"] += 1


def test_sigkill_an_edge_under_load_then_restart_it_with_its_disk_tier(origin: Any, cluster: dict[str, Any]) -> None:
    edges: dict[str, EdgeProc] = cluster["edges"]
    chain = seed_origin(origin, 16, seed=105)
    b = edges["b"]

    async def warm_b() -> list[str]:
        async with AsyncEdgeClient(b.address) as c:
            for i in range(8):
                await c.fetch(chain.keys[i], fingerprint=chain.fingerprint, namespace=chain.namespace)
            resp = await c.lookup(chain.keys[:8], fingerprint=chain.fingerprint, namespace=chain.namespace, local_only=True)
            return [loc.tier for loc in resp.locations]

    tiers_before = asyncio.run(warm_b())
    assert len(tiers_before) == 8 and "disk" in tiers_before  # b's memory holds ~3 of them

    stats = {"ok": 0, "wrong": 0, "failovers": 0, "failed": 0}

    async def load() -> None:
        addrs = [p.address for p in edges.values()]
        clients = {a: AsyncEdgeClient(a, deadline_s=3.0) for a in addrs}
        rng = random.Random(7)
        stop_at = time.monotonic() + 2.5

        async def worker(start: int) -> None:
            order = addrs[start:] + addrs[:start]  # this client's own edge first, then the others
            while time.monotonic() < stop_at:
                await _fetch_with_failover(order, clients, chain, rng.randrange(16), stats)

        async def killer() -> None:
            await asyncio.sleep(0.6)
            b.kill()

        await asyncio.gather(*(worker(i % 3) for i in range(9)), killer())
        for c in clients.values():
            await c.close()

    asyncio.run(load())
    assert stats["wrong"] == 0, stats
    assert stats["failed"] == 0, stats
    assert stats["ok"] > 50 and stats["failovers"] > 0, stats

    async def survivors_know() -> None:
        for nid in ("a", "c"):
            async with AsyncEdgeClient(edges[nid].address) as c:
                for i in range(16):  # every key still served by the survivors
                    assert await c.fetch(chain.keys[i], fingerprint=chain.fingerprint, namespace=chain.namespace) == chain.blobs[i]

    asyncio.run(survivors_know())

    # restart b on the same disk directory: what was on disk is there again
    fetches_before = origin_fetches(origin)
    b.spawn()
    b.wait_ready()
    write_peers(cluster["peers_file"], edges)

    async def after_restart() -> None:
        async with AsyncEdgeClient(b.address) as c:
            on_disk = []
            for i in range(16):  # memory (<= 3 artifacts) died with the process; the disk tier did not
                resp = await c.lookup([chain.keys[i]], fingerprint=chain.fingerprint, namespace=chain.namespace,
                                      local_only=True)
                if resp.available:
                    assert resp.locations[0].tier == "disk"
                    on_disk.append(i)
            assert len(on_disk) >= 4, on_disk
            for i in on_disk:
                data, source = await c.fetch_with_source(chain.keys[i], fingerprint=chain.fingerprint,
                                                         namespace=chain.namespace)
                assert data == chain.blobs[i] and source == "disk"
        await wait_peers(edges["a"].address, 2)

    asyncio.run(after_restart())
    assert origin_fetches(origin) == fetches_before


def test_corrupt_blob_on_disk_is_dropped_and_fetched_again(origin: Any, cluster: dict[str, Any]) -> None:
    b: EdgeProc = cluster["edges"]["b"]
    chain = seed_origin(origin, 6, seed=106)

    async def main() -> None:
        async with AsyncEdgeClient(b.address) as c:
            for i in range(6):
                await c.fetch(chain.keys[i], fingerprint=chain.fingerprint, namespace=chain.namespace)
            resp = await c.lookup(chain.keys, fingerprint=chain.fingerprint, namespace=chain.namespace, local_only=True)
            on_disk = [i for i, loc in enumerate(resp.locations) if loc.tier == "disk"]
            assert on_disk
            i = on_disk[0]
            hexkey = bytes(chain.keys[i]).hex()
            paths = [p for p in b.disk.rglob("*") if p.is_file() and hexkey in p.name]
            assert len(paths) == 1
            raw = bytearray(paths[0].read_bytes())
            raw[len(raw) // 2] ^= 0x10
            paths[0].write_bytes(bytes(raw))
            before = (await c.stats()).counters["store_corrupt_dropped"]
            data, source = await c.fetch_with_source(chain.keys[i], fingerprint=chain.fingerprint, namespace=chain.namespace)
            assert data == chain.blobs[i] and source in ("peer", "origin")
            assert (await c.stats()).counters["store_corrupt_dropped"] == before + 1

    asyncio.run(main())


def _certs(tmp: Path) -> dict[str, Path]:
    """A CA, a valid server cert, an expired server cert, a valid and an expired client cert."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=kdn-test-ca", "-days", "2")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, days in (("server", "2"), ("server_expired", "-1"), ("client", "2"), ("client_expired", "-1")):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", days, "-extfile", "san.ext")
    return {p.stem: p for p in tmp.iterdir()}


def test_tokens_and_tls(origin: Any, tmp_path: Path) -> None:
    from kdn.edge.config import EdgeConfig
    from kdn.edge.server import EdgeServer

    chain = seed_origin(origin, 1, seed=107, tenant="acme")
    _certs(tmp_path)
    fp = chain.fingerprint

    async def main() -> None:
        # bearer tokens: wrong token / foreign namespace -> UNAUTHENTICATED, whether or not the artifact exists
        cfg = EdgeConfig(node_id="auth", origin=origin.address, tokens={"tok-acme": ["acme"], "tok-globex": ["globex"]},
                         shm=False)
        async with EdgeServer(cfg) as srv:
            async with AsyncEdgeClient(srv.address, token="tok-acme") as c:
                assert await c.fetch(chain.keys[0], fingerprint=fp, namespace=chain.namespace) == chain.blobs[0]
            answers = set()
            for token in ("wrong", "tok-globex", None):
                async with AsyncEdgeClient(srv.address, token=token) as c:
                    for key in (chain.keys[0], make_chain(1, seed=999).keys[0]):
                        with pytest.raises(e.Unauthorized) as info:
                            await c.fetch(key, fingerprint=fp, namespace=chain.namespace)
                        answers.add((token, str(info.value)))
            assert len(answers) == 3  # per token, one answer for existing and missing keys alike

        # TLS with an expired server certificate: the client refuses the handshake -> Unavailable
        expired = EdgeConfig(node_id="tls-old", tls_cert=str(tmp_path / "server_expired.pem"),
                             tls_key=str(tmp_path / "server_expired.key"), shm=False)
        async with EdgeServer(expired) as srv:
            async with AsyncEdgeClient(srv.address, tls=TlsFiles(ca=tmp_path / "ca.pem"), deadline_s=3) as c:
                with pytest.raises(e.Unavailable):
                    await c.stats()

        # mTLS: a valid client cert works, an expired one is refused, the server keeps serving
        mtls = EdgeConfig(node_id="mtls", tls_cert=str(tmp_path / "server.pem"), tls_key=str(tmp_path / "server.key"),
                          tls_ca=str(tmp_path / "ca.pem"), shm=False)
        async with EdgeServer(mtls) as srv:
            good = TlsFiles(cert=tmp_path / "client.pem", key=tmp_path / "client.key", ca=tmp_path / "ca.pem")
            old = TlsFiles(cert=tmp_path / "client_expired.pem", key=tmp_path / "client_expired.key", ca=tmp_path / "ca.pem")
            async with AsyncEdgeClient(srv.address, tls=old, deadline_s=3) as c:
                with pytest.raises(e.Unavailable):
                    await c.stats()
            async with AsyncEdgeClient(srv.address, tls=TlsFiles(ca=tmp_path / "ca.pem"), deadline_s=3) as c:
                with pytest.raises(e.Unavailable):
                    await c.stats()  # no client cert at all
            async with AsyncEdgeClient(srv.address, tls=good, deadline_s=3) as c:
                assert (await c.stats()).node_id == "mtls"

    asyncio.run(main())


def test_metrics_endpoint_per_server(origin: Any) -> None:
    import urllib.request

    from kdn.edge.config import EdgeConfig
    from kdn.edge.server import EdgeServer

    chain = seed_origin(origin, 2, seed=110)

    async def main() -> None:
        servers = [EdgeServer(EdgeConfig(node_id=f"m{i}", origin=origin.address, metrics_port=0, shm=False)) for i in range(2)]
        for srv in servers:
            await srv.start()
        try:
            async with AsyncEdgeClient(servers[0].address) as c:
                for _ in range(3):
                    await c.fetch(chain.keys[0], fingerprint=chain.fingerprint, namespace=chain.namespace)
            texts = [
                await asyncio.to_thread(lambda p=srv.metrics_port: urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=5).read().decode())
                for srv in servers
            ]
        finally:
            for srv in servers:
                await srv.stop()
        assert 'kdn_edge_hits_total{tier="memory"} 2.0' in texts[0]
        assert 'kdn_edge_upstream_fetches_total{outcome="ok",target="origin"} 1.0' in texts[0]
        assert "kdn_edge_rpc_seconds_bucket" in texts[0] and "kdn_edge_store_evictions" in texts[0]
        assert "kdn_edge_hits_total{" not in texts[1]  # its own registry: nothing leaks between servers

    asyncio.run(main())


def test_cli_stats_and_hints(origin: Any, cluster: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from kdn.edge.cli import main, main_stats

    chain = seed_origin(origin, 2, seed=109)
    address = cluster["edges"]["c"].address
    keys = [bytes(k).hex() for k in chain.keys]
    fp = bytes(chain.fingerprint).hex()
    assert main(["pin", "--edge", address, "--fingerprint", fp, "--json", *keys]) == 0
    assert json.loads(capsys.readouterr().out) == {"command": "pin", "affected": 2, "schedule_id": ""}
    assert main(["ttl", "--edge", address, "--seconds", "3600", "--json", keys[0]]) == 0
    assert json.loads(capsys.readouterr().out)["affected"] == 1
    assert main(["schedule", "--edge", address, "--cron", "0 8 * * 1-5", "--json", *keys]) == 0
    sid = json.loads(capsys.readouterr().out)["schedule_id"]
    assert main(["cancel", "--edge", address, "--schedule-id", sid, "--json"]) == 0
    assert main(["schedule", "--edge", address, "--cron", "99 * * * *", "--json", keys[0]]) == 1
    assert "minute" in json.loads(capsys.readouterr().out.splitlines()[-1])["message"]
    assert main(["pin", "--edge", address, "--json", "nothex"]) == 1
    capsys.readouterr()
    assert main_stats(["--edge", address, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["node_id"] == "c" and stats["counters"]["store_pinned"] >= 2
    assert main_stats(["--edge", address]) == 0
    assert "origin: available" in capsys.readouterr().out


def test_origin_down_edges_serve_what_they_hold(origin: Any, cluster: dict[str, Any]) -> None:
    """Runs last in this module: it stops the shared origin."""
    chain = seed_origin(origin, 3, seed=108)
    a = cluster["edges"]["a"]

    async def fetch_held() -> None:
        async with AsyncEdgeClient(a.address) as c:
            for i in range(2):
                await c.fetch(chain.keys[i], fingerprint=chain.fingerprint, namespace=chain.namespace)

    asyncio.run(fetch_held())
    origin.stop()

    async def main() -> None:
        async with AsyncEdgeClient(a.address, deadline_s=5) as c:
            for i in range(2):
                assert await c.fetch(chain.keys[i], fingerprint=chain.fingerprint, namespace=chain.namespace) == chain.blobs[i]
            with pytest.raises(e.Unavailable):
                await c.fetch(chain.keys[2], fingerprint=chain.fingerprint, namespace=chain.namespace)
            st = await c.stats()
            assert st.counters["origin_configured"] == 1 and st.counters["origin_available"] == 0
            assert st.details["origin"]["available"] is False

    asyncio.run(main())
