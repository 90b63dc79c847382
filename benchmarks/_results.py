"""How a benchmark records its figures: one JSON file per benchmark, one history line per run.

Every script in ``benchmarks/`` ends the same way::

    from _results import Record                      # benchmarks/ is on sys.path when a script runs

    rec = Record(__file__, "ttft", "TTFT with KDN reuse", argv)   # load average and UTC time taken now
    rec.goal("edge hit vs full recompute, 4096 tokens", ">= 20x", per_round_ratios, at_least=20)
    rec.table(["context", "recompute", ...], rows, title="Per context")
    rec.note("Breakdown of a bulk hit at 4096 (ms): ...")   # a generated line of figures, never prose
    rec.plot(png_path)
    rec.save()                                       # results/ttft.json, history.jsonl, BENCHMARKS.md

:meth:`Record.save` writes ``benchmarks/results/<name>.json`` (the latest run only, replacing the
previous one), appends one line to ``benchmarks/results/history.jsonl`` and regenerates
``BENCHMARKS.md`` with ``benchmarks/report.py``. A script's ``--no-append`` flag skips all three.

The method (how the figure is measured, in a short paragraph) is not part of the record: it is the
script's top-level ``METHOD`` string (or a dict of them, by record name, for a script that records
several benchmarks), which ``report.py`` reads from the source without importing the script.

A record (``"schema": "kdn.benchmark/1"``) holds::

    name       file stem, also the section's anchor       "ttft"
    title      section heading                            "TTFT with KDN reuse"
    script     the script, relative to the repository     "benchmarks/ttft.py"
    method     key into the script's METHOD dict, if any  "ttft"
    command    what ran                                   "python benchmarks/ttft.py --sizes 4096"
    utc        when it started                            "2026-12-01 04:38 UTC"
    load       1-minute load average, cores and the CPU   {"start": 1.7, "end": 2.0, "cpus": 2,
                                                           "cpu": "Intel(R) Xeon(R) Processor (AVX-512, AMX)"}
    rounds     rounds measured (null: not round-based)    7
    goals      one per goal line: what, goal, median, min, max, unit, rounds, met (true/false/null)
    body       in order: {"kind": "table", title, columns, rows} (cells as the script formatted
               them), {"kind": "note", text} (a generated line of figures), {"kind": "heading", text}
    plots      image paths relative to the repository
    data       optional raw figures (not rendered)

Figures are ratios or rates measured within one run; ``median``/``min``/``max`` are of per-round
values (``min``/``max`` null when the script measured one value).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
HISTORY = RESULTS / "history.jsonl"
SCHEMA = "kdn.benchmark/1"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


def plot_dir(recorded: bool) -> Path:
    """Where a run writes its plots: ``benchmarks/results`` when the run is recorded; a run that
    records nothing (``--no-append``) writes them under the system's temporary directory, so the
    plot beside a record always belongs to that record."""
    if recorded:
        return RESULTS
    import tempfile

    out = Path(tempfile.gettempdir()) / "kdn-bench-plots"
    out.mkdir(parents=True, exist_ok=True)
    return out


def now_utc() -> str:
    return f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_model(cpuinfo: str | None = None) -> str | None:
    """The CPU's model name and the vector units that move CPU figures most (AVX-512, AMX), e.g.
    ``"Intel(R) Xeon(R) Processor (AVX-512, AMX)"``: ratios measured on different CPUs differ, so a
    record says which one it ran on. None where ``/proc/cpuinfo`` is not readable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    name = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    if name is None:
        return None
    have = set(flags.group(1).split()) if flags else set()
    units = [label for label, flag in (("AVX-512", "avx512f"), ("AMX", "amx_tile")) if flag in have]
    if not units and "avx2" in have:
        units = ["AVX2"]
    text = " ".join(name.group(1).split())
    return f"{text} ({', '.join(units)})" if units else text


class Record:
    """The figures of one benchmark run, written by :meth:`save`."""

    def __init__(self, script: str | Path, name: str, title: str, argv: Sequence[str] | None = None, *,
                 method: str | None = None, command: str | None = None) -> None:
        if not _NAME.match(name):
            raise ValueError(f"record name {name!r}: lower-case letters, digits, '.', '_' and '-' only")
        path = Path(script).resolve()
        self.script = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(script)
        args = list(sys.argv[1:] if argv is None else argv)
        self.doc: dict[str, Any] = {
            "schema": SCHEMA,
            "name": name,
            "title": title,
            "script": self.script,
            "method": method,
            "command": command or shlex.join(["python", self.script, *args]),
            "utc": now_utc(),
            "load": {"start": load_average(), "end": None, "cpus": os.cpu_count(), "cpu": cpu_model()},
            "rounds": None,
            "goals": [],
            "body": [],
            "plots": [],
            "data": None,
        }

    @property
    def name(self) -> str:
        return self.doc["name"]

    def goal(self, what: str, goal: str, values: float | Iterable[float] | None = None, *,
             median: float | None = None, lo: float | None = None, hi: float | None = None,
             at_least: float | None = None, at_most: float | None = None, met: bool | None = None,
             unit: str = "x", rounds: int | None = None, digits: int | None = None) -> dict[str, Any]:
        """One goal line. ``values``: the per-round values (median, min and max are taken from them)
        or one value. ``at_least``/``at_most`` decide ``met`` from the median unless ``met`` is given;
        a line with neither and no ``met`` is a diagnostic (verdict "—"). ``digits``: decimals to
        show (default: 2 below 10, 1 below 100, else none)."""
        if values is not None:
            vals = [float(values)] if isinstance(values, (int, float)) else [float(v) for v in values]
            if not vals:
                raise ValueError(f"goal {what!r}: no values")
            median = statistics.median(vals)
            if len(vals) > 1:
                lo, hi = min(vals), max(vals)
            rounds = rounds if rounds is not None else len(vals)
        if median is None and met is None:
            raise ValueError(f"goal {what!r}: give values or median (or met=False for a goal that could not be measured)")
        if met is None and median is not None and (at_least is not None or at_most is not None):
            met = (at_least is None or median >= at_least) and (at_most is None or median <= at_most)
        median, lo, hi = (None if v is None else _round(v) for v in (median, lo, hi))
        line = {"what": what, "goal": goal, "median": median, "min": lo, "max": hi, "unit": unit,
                "rounds": rounds, "met": met}
        if digits is not None:
            line["digits"] = digits
        self.doc["goals"].append(line)
        return line

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> None:
        cols = [str(c) for c in columns]
        body = [[str(c) for c in r] for r in rows]
        for r in body:
            if len(r) != len(cols):
                raise ValueError(f"table {title or cols!r}: a row of {len(r)} cells under {len(cols)} columns")
        self.doc["body"].append({"kind": "table", "title": title, "columns": cols, "rows": body})

    def note(self, text: str) -> None:
        """A generated line of figures (what the run measured), never prose about the code."""
        if text.strip():
            self.doc["body"].append({"kind": "note", "text": text.strip()})

    def heading(self, text: str) -> None:
        """A sub-heading: the part of the run the tables and notes after it belong to."""
        self.doc["body"].append({"kind": "heading", "text": text.strip().lstrip("#").strip()})

    def markdown(self, lines: Iterable[str]) -> None:
        """Take the tables and lines a script printed as Markdown: each ``|``-table becomes a table
        (titled by the paragraph just above it when that ends in ``:`` or is all bold), ``#``
        lines become headings, other paragraphs notes."""
        for kind, title, payload in parse_markdown(lines):
            if kind == "table":
                cols, rows = payload
                self.table(cols, rows, title=title)
            elif kind == "heading":
                self.heading(payload)
            else:
                self.note(payload)

    def plot(self, path: str | Path) -> None:
        p = Path(path).resolve()
        self.doc["plots"].append(p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else str(path))

    def set_rounds(self, n: int | None) -> None:
        self.doc["rounds"] = n

    def data(self, obj: Any) -> None:
        self.doc["data"] = obj

    def save(self, *, report: bool = True, load_end: float | None = None, results: Path = RESULTS) -> Path:
        """Write the record, append its history line, regenerate BENCHMARKS.md; returns the record's path."""
        self.doc["load"]["end"] = load_average() if load_end is None else load_end
        path = write(self.doc, results)
        append_history(self.doc, results / HISTORY.name)
        print(f"recorded {path}")
        if report:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import report as _report

            _report.write()
            print("regenerated BENCHMARKS.md")
        return path


def _round(v: float) -> float:
    """Four significant digits: what a reader can compare across runs on a shared machine."""
    return float(f"{float(v):.4g}")


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def write(doc: dict[str, Any], results: Path = RESULTS) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{doc['name']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps(doc), encoding="utf-8")
    os.replace(tmp, path)
    return path


def history_line(doc: dict[str, Any]) -> str:
    keep = ("name", "utc", "command", "load", "rounds")
    line = {k: doc[k] for k in keep}
    line["goals"] = [{k: g[k] for k in ("what", "median", "min", "max", "unit", "met")} for g in doc["goals"]]
    return json.dumps(line, ensure_ascii=False, separators=(",", ":"))


def append_history(doc: dict[str, Any], history: Path = HISTORY) -> None:
    history.parent.mkdir(parents=True, exist_ok=True)
    with history.open("a", encoding="utf-8") as fh:
        fh.write(history_line(doc) + "\n")


_ROW = re.compile(r"^\s*\|.*\|\s*$")
_RULE = re.compile(r"^\s*\|(\s*:?-{3,}:?\s*\|)+\s*$")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_markdown(lines: Iterable[str]) -> list[tuple[str, str | None, Any]]:
    """``("table", title, (columns, rows))``, ``("heading", None, text)`` and ``("note", None,
    text)`` items, in order. Lines
    of text that follow each other form one note; a ``- `` item, a ``#`` heading or a blank line
    starts a new one. Images (``![...](...)``) are left out: a script names its plots with
    :meth:`Record.plot`."""
    lines = [ln.rstrip("\n") for ln in lines]
    out: list[tuple[str, str | None, Any]] = []
    para: list[str] = []

    def flush() -> None:
        if para:
            out.append(("note", None, " ".join(para)))
            para.clear()

    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if _ROW.match(line) and i + 1 < len(lines) and _RULE.match(lines[i + 1]):
            flush()
            cols = _cells(line)
            rows = []
            i += 2
            while i < len(lines) and _ROW.match(lines[i]):
                cells = _cells(lines[i])
                rows.append(cells + [""] * (len(cols) - len(cells)) if len(cells) < len(cols) else cells[:len(cols)])
                i += 1
            title = None
            if out and out[-1][0] == "note":
                prev = out[-1][2]
                if prev.endswith(":") or (prev.startswith("**") and prev.endswith("**") and prev.count("**") == 2):
                    title = prev.rstrip(":").strip()
                    if title.startswith("**") and title.endswith("**") and title.count("**") == 2:
                        title = title[2:-2].rstrip(":").strip()
                    out.pop()
            out.append(("table", title, (cols, rows)))
            continue
        if not line or line.startswith(("- ", "#", "![")):
            flush()
        if line.startswith("!["):
            pass
        elif line.startswith("#"):
            out.append(("heading", None, line.lstrip("#").strip()))
        elif line:
            para.append(line)
        i += 1
    flush()
    return out
