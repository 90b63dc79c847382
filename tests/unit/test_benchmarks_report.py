"""BENCHMARKS.md is generated: benchmarks/report.py from benchmarks/results/*.json, the same bytes
every time, and what is on disk is what the results make."""

from __future__ import annotations

import importlib
import os
import re
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("report")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def results(report):
    return importlib.import_module("_results")


def test_benchmarks_md_is_what_the_results_make(report) -> None:
    text = report.render(report.load())
    assert (REPO / "BENCHMARKS.md").read_text(encoding="utf-8") == text, \
        "BENCHMARKS.md differs from the results: run python benchmarks/report.py"
    assert report.render(report.load()) == text  # the same bytes again


def test_report_script_is_byte_identical_when_rerun(tmp_path: Path) -> None:
    """`python benchmarks/report.py` twice on the same results, in a copy of benchmarks/ (the
    scripts, whose METHOD the report reads, and a link to the results)."""
    (tmp_path / "benchmarks").mkdir()
    for f in BENCH.glob("*.py"):
        (tmp_path / "benchmarks" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "benchmarks" / "results").symlink_to(BENCH / "results")
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "benchmarks/report.py"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        outs.append((tmp_path / "BENCHMARKS.md").read_bytes())
    assert outs[0] == outs[1] == (REPO / "BENCHMARKS.md").read_bytes()
    check = subprocess.run([sys.executable, "benchmarks/report.py", "--check"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def test_every_record_names_its_script_and_plots(report) -> None:
    records = report.load()
    assert records
    for doc in records:
        assert (REPO / doc["script"]).is_file(), doc["name"]
        for p in doc["plots"]:
            assert (REPO / p).is_file(), (doc["name"], p)
        for g in doc["goals"]:
            assert g["met"] in (True, False, None), (doc["name"], g)


def test_record_round_trip(tmp_path: Path, results, report) -> None:
    rec = results.Record(BENCH / "overlay.py", "probe", "A probe", ["--quick"])
    rec.goal("ratio", ">= 2x", [1.5, 2.5, 3.0], at_least=2)
    rec.goal("latency", "<= 5 ms", [6.0], at_most=5, unit="ms")
    rec.goal("diagnostic", "—", median=7.0)
    rec.goal("peer missing", ">= 1x", met=False)
    rec.markdown(["Intro with figures:", "", "| a | b |", "|---|---|", "| 1 | 2 |", "", "### Part two", "- item"])
    path = rec.save(report=False, load_end=1.5, results=tmp_path)
    doc = json.loads(path.read_text())
    assert doc["command"] == "python benchmarks/overlay.py --quick"
    assert [g["met"] for g in doc["goals"]] == [True, False, None, False]
    assert doc["goals"][0]["median"] == 2.5 and doc["goals"][0]["min"] == 1.5 and doc["goals"][0]["rounds"] == 3
    assert [b["kind"] for b in doc["body"]] == ["table", "heading", "note"]
    assert doc["body"][0]["title"] == "Intro with figures"
    hist = (tmp_path / "history.jsonl").read_text().splitlines()
    assert len(hist) == 1 and json.loads(hist[0])["name"] == "probe"
    rec.save(report=False, results=tmp_path)
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == 2  # history grows, the record is replaced
    text = report.render(report.load(tmp_path))
    assert "| ratio | >= 2x | 2.50x [1.50–3.00] | 3 | MET |" in text
    assert "| latency | <= 5 ms | 6.00 ms | 1 | **NOT MET** |" in text
    assert "### Part two" in text
    assert "| peer missing | >= 1x | not measured | — | **NOT MET** |" in text
    with pytest.raises(ValueError, match="give values or median"):
        rec.goal("nothing", ">= 1x")


def test_a_record_names_the_cpu_it_ran_on(tmp_path: Path, results, report) -> None:
    intel = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)  Processor\n"
             "flags\t\t: fpu sse2 avx2 avx512f avx512bw amx_tile amx_bf16\n")
    amd = "model name\t: AMD EPYC 7B13 64-Core Processor\nflags\t\t: fpu sse2 avx2\n"
    assert results.cpu_model(intel) == "Intel(R) Xeon(R) Processor (AVX-512, AMX)"
    assert results.cpu_model(amd) == "AMD EPYC 7B13 64-Core Processor (AVX2)"
    assert results.cpu_model("flags\t: avx2\n") is None  # no model name: nothing is claimed
    rec = results.Record(BENCH / "overlay.py", "probe", "A probe", [])
    rec.doc["load"]["cpu"] = results.cpu_model(amd)
    rec.goal("ratio", ">= 2x", [2.5], at_least=2)
    rec.save(report=False, load_end=1.5, results=tmp_path)
    text = report.render(report.load(tmp_path))
    assert f"on {os.cpu_count()} CPUs (AMD EPYC 7B13 64-Core Processor (AVX2))" in text


def test_a_bad_record_is_a_clear_error(tmp_path: Path, report) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "kdn.benchmark/1", "name": "bad"}))
    with pytest.raises(report.ResultsError, match=r"bad\.json: field 'title'"):
        report.load(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(report.ResultsError, match=r"bad\.json: not JSON"):
        report.load(tmp_path)


SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in ("_results.py", "report.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_records_through_the_helper(script: Path, report) -> None:
    """A script states its method (METHOD) and records through _results; none appends to BENCHMARKS.md."""
    source = script.read_text(encoding="utf-8")
    assert report._methods(script.relative_to(REPO).as_posix()), f"{script.name} has no top-level METHOD"
    assert "from _results import Record" in source, f"{script.name} does not record through benchmarks/_results.py"
    assert not re.search(r"BENCHMARKS\.md[\"']?\)?\s*,\s*[\"']a[\"']|BENCHMARKS\.md[\"']?\)\.open\([\"']a", source), \
        f"{script.name} appends to BENCHMARKS.md"


def test_a_figure_too_small_for_its_decimals_shows_how_small(report) -> None:
    assert report.num(5.5e-21, 4) == "5.5e-21"  # a p-value, not "0.0000"
    assert report.num(0.0, 4) == "0.0000" and report.num(0.2891, 4) == "0.2891"
    assert report.num(12345.6) == "12,346" and report.num(-0.004, 2) == "−0.004"


def test_a_run_that_records_nothing_leaves_the_recorded_plots_alone(results) -> None:
    assert results.plot_dir(True) == results.RESULTS
    scratch = results.plot_dir(False)
    assert scratch.is_dir() and results.RESULTS not in (scratch, *scratch.parents)
