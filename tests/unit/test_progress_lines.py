"""Issue 17 item 2: long commands are never silent when stderr is not a terminal (a pipe, a log, CI).

Run in-process: under pytest's capture stderr is not a TTY, as in a pipe. No Ray, no sockets.
"""

from __future__ import annotations

import io
import json
import re
import threading
from pathlib import Path

import pytest

from kdn.console import StageLines
from kdn.origin.ingest.report import Progress
from kdn.origin.worker import DocumentResult

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(\w+) \[\s*\d+\.\d+s\] ")


def _docs(tmp_path: Path, n: int = 3) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(n):
        (docs / f"doc{i}.md").write_text(f"Document {i} about caches and what they keep. " * 20)
    return docs


def test_ingest_without_a_tty_prints_a_line_per_stage_and_per_document(tmp_path, capsys):
    from kdn.origin.cli import main_ingest

    docs = _docs(tmp_path)
    code = main_ingest([str(docs), "--model", "tiny", "--store", str(tmp_path / "store"), "--codec", "raw", "--workers", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.err.splitlines()
    assert lines and all(LINE.match(line) for line in lines), lines  # every line says which command and when
    text = "\n".join(lines)
    assert "found 3 document(s)" in text
    assert "prefilling in this process, no Ray (--workers 0): loading tiny" in text and "model loaded" in text
    assert "3 document(s) to prefill with tiny in this process" in text
    for i in range(3):  # one line per document, with its id and status, as each finishes
        assert re.search(rf"\d/3 stored \S*doc{i}\.md: \d+ tokens", text), text
    assert "3 stored" in captured.out  # the summary stays on stdout


def test_ingest_no_progress_is_silent(tmp_path, capsys):
    from kdn.origin.cli import main_ingest

    docs = _docs(tmp_path, 1)
    assert main_ingest([str(docs), "--model", "tiny", "--store", str(tmp_path / "store"), "--codec", "raw",
                        "--workers", "0", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ingest_heartbeat_names_the_document_in_flight_after_a_quiet_spell():
    clock, out = _Clock(), io.StringIO()
    bar = Progress(2, "lines", stream=out, heartbeat_s=20.0, clock=clock, background=False)
    bar.started("/docs/big.md")
    clock.now += 19.0
    assert not bar.tick() and out.getvalue() == ""  # not quiet for long enough yet
    clock.now += 2.0
    assert bar.tick()
    assert "0/2 done; still working: prefilling /docs/big.md (21s so far)" in out.getvalue()
    assert not bar.tick()  # the heartbeat itself restarts the quiet spell
    bar.update(DocumentResult("/docs/big.md", "stored", n_tokens=600, n_chunks=2, computed_chunks=2))
    assert "1/2 stored /docs/big.md: 600 tokens, 2 chunks (2 computed)" in out.getvalue()
    assert bar.in_flight == {}
    bar.close()


@pytest.mark.parametrize("mode", ["off", False])
def test_ingest_progress_off_writes_nothing(mode):
    clock, out = _Clock(), io.StringIO()
    bar = Progress(1, mode, stream=out, clock=clock, background=False)
    bar.started("a")
    clock.now += 100
    assert not bar.tick()
    bar.update(DocumentResult("a", "stored", n_tokens=1))
    bar.close()
    assert out.getvalue() == ""


class _Sink(io.StringIO):
    """A stream that signals when a heartbeat line arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.beat = threading.Event()

    def write(self, s: str) -> int:
        if "still busy" in s:
            self.beat.set()
        return super().write(s)


def test_a_long_step_keeps_saying_it_is_busy():
    sink = _Sink()
    stages = StageLines(sink, prog="query")
    with stages.ongoing("full recompute of 4000 prompt tokens", every_s=0.01):
        assert sink.beat.wait(10), sink.getvalue()  # waits for the line; no assertion on timing
    lines = sink.getvalue().splitlines()
    assert LINE.match(lines[0]) and lines[0].endswith("full recompute of 4000 prompt tokens")
    assert "still busy: full recompute of 4000 prompt tokens (" in lines[1]


def test_query_compare_says_what_it_recomputes(capsys):
    from kdn.ops.query import main

    assert main(["--model", "tiny", "--prompt", "hello " * 50, "--max-new-tokens", "2", "--compare", "--json"]) == 0
    err = capsys.readouterr().err
    assert "loading tiny in this process" in err
    assert "300 prompt tokens, no edge: full prefill" in err
    assert "--compare: full recompute of 300 prompt tokens" in err


def test_demo_says_how_long_it_takes_before_importing_anything_slow(capsys, monkeypatch):
    from kdn.errors import KdnError
    from kdn.ops import demo

    def fail(args, progress):
        raise KdnError("stopped by the test")

    monkeypatch.setattr(demo, "run", fail)
    assert demo.main(["--model", "tiny"]) == 1
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert "a few minutes on an idle 2-core CPU" in first and "3 documents with tiny" in first
    assert "about two minutes" not in demo.build_parser().format_help()


def test_quick_start_is_two_commands_that_print_as_they_go():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = block.strip().splitlines()
    assert len(commands) == 2
    demo_cmd, test_cmd = commands
    assert demo_cmd.startswith("echo ") and demo_cmd.endswith("kdn demo")  # a first line at once
    assert test_cmd in (REPO / ".ci" / "run").read_text(encoding="utf-8")  # CI runs the same command
    for cmd in commands:
        assert "pip install -q" not in cmd  # pip says what it installs: minutes, not a silence


def _demo_out(load: dict) -> dict:
    q = dict(document="lease_policy.txt", question="On which days are bins emptied?", correct=True,
             prompt_tokens=4558, reused_tokens=4352, ttft_recompute_s=10.6,
             ttft_kdn_cold_s=1.48, ttft_kdn_s=0.74, speedup=14.3, outputs_match=True, via="edge", text="cccc",
             warnings=[], kdn_timings={}, kdn_cold_timings={})
    return {"model": "small-125m", "dtype": "float32", "fingerprint": "ab" * 32, "origin": "127.0.0.1:1", "edge": "127.0.0.1:2",
            "edge_placement": "Ray actor", "ingest": {"documents": 1, "tokens": 4558, "chunks": 17, "seconds": 9.0},
            "queries": [q], "all_outputs_match": True, "seconds": 80.0, "load_average": load}


def test_demo_table_shows_the_load_average_and_says_speedups_depend_on_it(capsys):
    """Issue 17 item 4: the load average (1 min, at the start and the end) and the cores beside the table."""
    from kdn.ops.demo import render

    render(_demo_out({"start_1min": 1.52, "end_1min": 3.04, "cpus": 2}))
    text = " ".join(capsys.readouterr().out.split())  # rich wraps to the terminal's width
    assert "load average 1.5 → 3.0 (1 min) on 2 CPUs" in text
    assert "speedups depend on the load" in text
    render(_demo_out({"start_1min": None, "end_1min": None, "cpus": 4}))
    assert "4 CPUs (load average unavailable here)" in " ".join(capsys.readouterr().out.split())


def test_demo_says_the_builtin_model_is_untrained_where_the_answers_appear(capsys):
    """Issue 17 item 3: random weights answer noise; the table's note says so and points at 'same'."""
    from kdn.ops.demo import render

    out = _demo_out({"start_1min": 1.0, "end_1min": 1.0, "cpus": 2})
    render({**out, "untrained": True})
    text = " ".join(capsys.readouterr().out.split())
    assert "small-125m has random, untrained weights" in text and "not meant to be read" in text
    assert "exactly the tokens of a full recompute" in text and "'cccc'" in text
    render({**out, "untrained": False})
    assert "untrained" not in capsys.readouterr().out


def test_demo_with_a_trained_model_prints_each_question_and_its_answer(capsys):
    from kdn.ops.demo import render

    out = _demo_out({"start_1min": 1.0, "end_1min": 1.0, "cpus": 2})
    q = {**out["queries"][0], "text": "The bins are emptied on Tuesday and Friday mornings."}
    render({**out, "model": "smollm2-135m", "untrained": False, "queries": [q]})
    text = " ".join(capsys.readouterr().out.split())
    assert "On which days are bins emptied?" in text and "Tuesday and Friday mornings" in text
    assert "correct" in text and "the answer states the fact the document gives" in text


def test_query_says_the_builtin_model_is_untrained_beside_its_answer(capsys, tmp_path):
    from kdn.ops.query import main

    assert main(["--model", "tiny", "--prompt", "Question: what is a cache? Answer:", "--max-new-tokens", "2"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "generated:" in text and "tiny has random, untrained weights" in text and "not meant to be read" in text
    assert main(["--model", "tiny", "--prompt", "x", "--max-new-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["untrained"] is True
