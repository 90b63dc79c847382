"""Kill the whole ``kdn ingest`` midway (SIGKILL), rerun it: it finishes, skipping what is done,
and nothing partial is ever visible. Runs the real CLI in a subprocess (in-process workers, so the
test does not pay for a Ray cluster; the Ray worker-death case is in test_origin_ray.py)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdn.artifact import verify_artifact
from kdn.origin.store import OriginStore
from tests.children import reap

pytestmark = pytest.mark.integration


def _docs(root: Path, n: int) -> Path:
    d = root / "docs"
    d.mkdir()
    for i in range(n):
        (d / f"doc-{i:02d}.md").write_text(f"# Doc {i}\n" + f"Paragraph {i} about KV reuse. " * 100)
    return d


def _documents_recorded(store: Path) -> int:
    db = store / "manifest.sqlite"
    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            return con.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _ingest_cmd(docs: Path, store: Path) -> list[str]:
    return [sys.executable, "-m", "kdn.ops.cli", "ingest", str(docs), "--model", "tiny", "--store", str(store),
            "--codec", "raw", "--workers", "0", "--json"]


def test_killed_ingest_reruns_to_completion(tmp_path):
    n = 10
    docs = _docs(tmp_path, n)
    store = tmp_path / "store"
    proc = subprocess.Popen(_ingest_cmd(docs, store), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _documents_recorded(store) < 2:
            assert proc.poll() is None, "ingest finished before it could be killed: make the documents longer"
            assert time.monotonic() < deadline, "ingest made no progress"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        reap(proc)
    done_before = _documents_recorded(store)
    assert 2 <= done_before < n

    rerun = subprocess.run(_ingest_cmd(docs, store), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    by = summary["by_status"]
    assert by["skipped"] >= done_before and by["stored"] + by["skipped"] == n and summary["failed"] == 0
    assert summary["computed_chunks"] < summary["chunks"]  # the finished part was not redone

    s = OriginStore(store)  # self-check: nothing to drop
    try:
        assert s.check is not None and s.check.dropped_corrupt == 0 and s.check.removed_orphans == 0
        rows = s.artifacts()
        pieces = sum(r["pieces"] for r in summary["results"])  # each document's tail after its chunks
        assert len(rows) == summary["chunks"] + pieces == len({r.key for r in rows})
        for r in rows:
            verify_artifact(s.get(r.key, r.codec, tenant="default"))
        assert len(s.documents()) == n
    finally:
        s.close()
