"""`kdn query` without an edge (no sockets): argument handling, JSON shape, clear errors."""

from __future__ import annotations

import json

from kdn.ops.query import main


def test_query_without_edge_recomputes_and_reports_the_breakdown(capsys):
    code = main(["--model", "tiny", "--prompt", "hello " * 50, "--max-new-tokens", "3", "--compare", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["reused_tokens"] == 0 and out["computed_tokens"] == out["prompt_tokens"] == 300
    assert len(out["tokens"]) <= 3 and out["outputs_match"] and not out["warnings"]
    assert {"keys_s", "lookup_s", "fetch_s", "decode_s", "build_s", "prefill_s", "first_token_s", "ttft_s"} <= set(
        out["timings"])


def test_query_renders_a_table(capsys, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document. ")
    assert main(["--model", "tiny", "--prompt-file", str(doc), "--prompt", "Q?", "--max-new-tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert "time to first token" in text and "reused 0" in text


def test_query_errors_are_clear(capsys, tmp_path):
    assert main(["--model", "tiny", "--json"]) == 2
    assert "--prompt" in json.loads(capsys.readouterr().out)["message"]
    assert main(["--model", "tiny", "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["--model", "no-such-model", "--prompt", "x", "--json"]) == 2
    assert "UnknownModel" in json.loads(capsys.readouterr().out)["error"]
    assert main(["--model", "tiny", "--prompt", "x", "--tenant", "bad tenant!", "--json"]) == 2
    assert "tenant" in json.loads(capsys.readouterr().out)["message"]


def test_a_prompt_longer_than_the_window_is_a_clear_error(capsys, tmp_path, monkeypatch):
    """Issue 19 item 5: a 5 MB prompt is refused with one line (never run past the model's
    positions, never a torch traceback), and the tokenizer only sees about a window of it."""
    from kdn.models import ByteTokenizer

    seen: list[int] = []
    real = ByteTokenizer.encode
    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, text: seen.append(len(text)) or real(self, text))
    doc = tmp_path / "huge.txt"
    doc.write_text("lorem ipsum " * 440_000)  # ~5 MB
    assert main(["--model", "tiny", "--prompt-file", str(doc), "--max-new-tokens", "2", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert "InvalidInput" in out["error"] and "prompt too long" in out["message"] and "8192 positions" in out["message"]
    assert seen and max(seen) <= 1 << 20
    # 2x the window (no longer runs past the positions, exit 0)
    assert main(["--model", "tiny", "--prompt", "x" * 16384, "--max-new-tokens", "2", "--json"]) == 2
    assert "prompt too long" in json.loads(capsys.readouterr().out)["message"]
    # the prompt and the answer must both fit
    assert main(["--model", "tiny", "--prompt", "x" * 8190, "--max-new-tokens", "3", "--json"]) == 2
    assert "prompt too long" in json.loads(capsys.readouterr().out)["message"]
