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


def _one_line_error(capsys, code: int) -> str:
    """The command failed with exit 2 and one line on stderr (no traceback)."""
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _doc(tmp_path):
    (tmp_path / "doc.md").write_text("A good document about caches. " * 20)
    return str(tmp_path / "doc.md")


def _ingest(*args: str) -> int:
    return main_ingest([*args, "--model", "tiny", "--codec", "raw", "--workers", "0", "--no-progress"])


def test_ingest_into_a_store_that_is_a_file_is_one_line(tmp_path, capsys):
    """Issue 19 item 8: --store that is a file (or lies under one) is a clear error."""
    (tmp_path / "afile").write_text("x")
    err = _one_line_error(capsys, _ingest(_doc(tmp_path), "--store", str(tmp_path / "afile")))
    assert "ConfigError" in err and "not a directory" in err
    err = _one_line_error(capsys, _ingest(_doc(tmp_path), "--store", str(tmp_path / "afile" / "sub")))
    assert "ConfigError" in err and "is a file" in err


def test_ingest_into_a_store_with_a_corrupt_manifest_is_one_line(tmp_path, capsys):
    """Issue 19 item 8: a corrupt manifest.sqlite is a clear error saying what to do."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.sqlite").write_bytes(b"this is not a database" * 100)
    err = _one_line_error(capsys, _ingest(_doc(tmp_path), "--store", str(store)))
    assert "manifest" in err and "move it" in err


def test_ingest_with_a_binary_config_file_is_one_line(tmp_path, capsys):
    """Issue 19 item 8: a binary --config file is a clear error."""
    (tmp_path / "origin.yaml").write_bytes(b"\x00\x01\x02\xff\xfe binary")
    err = _one_line_error(capsys, _ingest(_doc(tmp_path), "--config", str(tmp_path / "origin.yaml"),
                                          "--store", str(tmp_path / "store")))
    assert "ConfigError" in err and "not UTF-8" in err


def test_ingest_of_zero_documents_fails_and_leaves_no_store(tmp_path, capsys):
    """Issue 19 item 8: zero documents (an empty directory, a missing path) is a non-zero exit
    with one line, and no store directory is created."""
    (tmp_path / "empty").mkdir()
    store = tmp_path / "store"
    err = _one_line_error(capsys, _ingest(str(tmp_path / "empty"), "--store", str(store)))
    assert "nothing to ingest" in err
    assert not store.exists()
    err = _one_line_error(capsys, _ingest(str(tmp_path / "missing.txt"), "--store", str(store)))
    assert "nothing to ingest" in err and "does not exist" in err
    assert not store.exists()
