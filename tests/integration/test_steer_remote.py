"""Steered KV over real sockets (issue 14): an origin on loopback holds an ingested document; a
`kdn edge` process asked `kdn edge emphasize` has the origin compute the variant and fetches it;
`kdn query --steer ID` reuses it through the edge, and a plain query reuses the plain chain."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kdn.edge.cli import main as edge_main
from kdn.ops.query import main as query_main
from kdn.origin.config import OriginConfig
from kdn.origin.ingest.documents import read_text
from kdn.origin.server import OriginServer
from kdn.origin.worker import DocumentTask
from tests.children import reap
from tests.stored import whole_document_tokens

pytestmark = pytest.mark.integration

TEXT = "".join(f"{'POLICY: keep the cache warm' if i % 4 == 1 else 'a line of plain filler text'} {i}\n"
               for i in range(40))  # ~1,200 bytes: 4 chunks of 256 byte tokens


def test_emphasize_through_a_real_edge_then_query_the_variant(tmp_path, tiny_model, capsys) -> None:
    doc = tmp_path / "policy.md"
    doc.write_text(TEXT)
    cfg = OriginConfig(store_dir=str(tmp_path / "store"), models=["tiny"], codecs=["raw"], listen="127.0.0.1:0",
                       fsync=False)
    srv = OriginServer(cfg, preloaded=(tiny_model,))
    d = read_text(doc)
    assert srv.compute.ingest(tiny_model.fingerprint, DocumentTask(str(doc), d.text, d.digest, "default")).keys
    srv.start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdn.edge.cli", "--listen", "127.0.0.1:0", "--node-id", "steer-edge",
         "--origin", srv.address, "--no-shm"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        edge = json.loads(proc.stdout.readline())["address"]
        fp = bytes(tiny_model.fingerprint).hex()
        assert edge_main(["emphasize", "--edge", edge, "--fingerprint", fp, "--document", "policy.md",
                          "--method", "re-read", "--regex", "^POLICY", "--deadline", "60", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        whole = whole_document_tokens(tiny_model, d.text)  # 4 chunks, then the tail's pieces
        assert out["fetched"] == 4 + (whole - 4 * 256) // 32 and len(out["steer_variant"]) == 64
        base = ["--edge", edge, "--model", "tiny", "--prompt-file", str(doc), "--prompt", "Q?", "--max-new-tokens", "1",
                "--no-write-back", "--json"]
        assert query_main([*base, "--steer", out["steer_variant"]]) == 0
        steered = json.loads(capsys.readouterr().out)
        assert steered["reused_tokens"] == whole  # the variant's chunks and its tail pieces
        assert query_main(base) == 0  # plain: the plain chain, which the edge gets from the origin
        plain = json.loads(capsys.readouterr().out)
        assert plain["reused_tokens"] == whole  # the chain and its tail pieces
    finally:
        proc.terminate()
        reap(proc)
        proc.stdout.close()
        srv.stop()
