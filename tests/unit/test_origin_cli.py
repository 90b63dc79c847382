"""``kdn ingest`` exit codes and JSON output (in-process workers: no Ray, no sockets)."""

from __future__ import annotations

import json

from kdn.origin.cli import main_ingest


def test_ingest_cli_exit_codes_and_json(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.md").write_text("A good document about caches. " * 20)
    store = tmp_path / "store"
    base = ["--model", "tiny", "--store", str(store), "--codec", "raw", "--workers", "0", "--json"]

    assert main_ingest([str(docs), *base]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["by_status"]["stored"] == 1 and out["failed"] == 0 and out["computed_chunks"] == 2

    (docs / "empty.txt").write_bytes(b"")
    assert main_ingest([str(docs), str(tmp_path / "missing"), *base]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["by_status"] == {"stored": 0, "skipped": 1, "truncated": 0, "short": 0, "failed": 2}
    messages = {r["doc_id"].rsplit("/", 1)[-1]: r["message"] for r in out["results"]}
    assert "empty" in messages["empty.txt"] and "does not exist" in messages["missing"]

    assert main_ingest([str(docs), "--model", "no-such-model", "--store", str(store), "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "UnknownModel" and "no-such-model" in err["message"]

    assert main_ingest([str(docs), "--model", "tiny", "--store", str(store), "--codec", "bogus", "--json"]) == 2
    assert "bogus" in json.loads(capsys.readouterr().out)["message"]
