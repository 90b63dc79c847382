"""Time to the first line of output of the README quick start's first command, from a fresh clone.

Goal: a new user who pastes the first quick-start command sees a line within 10 s.
This clones the repository (HEAD) into a temporary directory and runs, in it:

- ``quick start``: the README's first quick-start command, verbatim;
- ``baseline``: the same command without its leading ``echo`` (venv creation, then pip);
- ``old (-q)``: the baseline with ``pip install -q``, as the quick start was (bounded by ``--limit``).

Each is stopped (its whole process group) once it has printed ``--lines`` lines or after
``--limit`` seconds, so no run installs anything in full. Prints the times and the ratio to the
baseline, with the load average, and records them as ``quickstart`` (``benchmarks/_results.py``).

    python benchmarks/quickstart.py [--lines 2] [--limit 30] [--no-append]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import Record

REPO = Path(__file__).resolve().parents[1]

METHOD = """Each command runs in a fresh `git clone` of HEAD and is stopped (its whole process group) once
it has printed its first lines or after a time limit, so nothing is installed in full. The quick
start's first command, verbatim, is timed to its first line of output, against the same command
without its leading `echo` (venv creation, then pip) as the baseline of the same run, and against
that baseline with `pip install -q`."""


def first_command(readme: str) -> str:
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()[0]


def first_lines(cmd: str, cwd: Path, lines: int, limit: float) -> tuple[float | None, list[str]]:
    """Seconds to the first output line (None: nothing within ``limit``) and the lines seen."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    seen: list[str] = []
    first = None
    timer = None
    try:
        import threading

        timer = threading.Timer(limit, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        for line in proc.stdout:  # type: ignore[union-attr]
            if first is None:
                first = time.perf_counter() - t0
            seen.append(f"{time.perf_counter() - t0:6.1f}s {line.rstrip()[:100]}")
            if len(seen) >= lines:
                break
    finally:
        if timer is not None:
            timer.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return first, seen


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=2, help="stop each run after this many output lines")
    ap.add_argument("--limit", type=float, default=30.0, help="stop each run after this many seconds")
    ap.add_argument("--no-append", action="store_true", help="print only; record nothing")
    args = ap.parse_args(argv)
    rec = None if args.no_append else Record(__file__, "quickstart",
                                             "Quick start: time to the first line of output, fresh clone", argv)

    cmd = first_command((REPO / "README.md").read_text(encoding="utf-8"))
    baseline = cmd.split(" && ", 1)[1] if cmd.startswith("echo ") else cmd
    old = baseline.replace("pip install -e", "pip install -q -e")
    load = os.getloadavg()[0]
    rows = []
    for name, c in (("quick start", cmd), ("baseline (no echo)", baseline), ("old (pip -q)", old)):
        with tempfile.TemporaryDirectory(prefix="kdn-quickstart-") as tmp:
            clone = Path(tmp) / "kdn"
            subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
            first, seen = first_lines(c, clone, args.lines, args.limit)
        rows.append((name, first, seen))
        print(f"{name}: first line after {first:.1f}s" if first is not None else f"{name}: nothing in {args.limit:.0f}s")
        for s in seen:
            print("   ", s)
    base = rows[1][1]

    def cell(v: float | None) -> str:
        return f"{v:.1f} s" if v is not None else f"> {args.limit:.0f} s (nothing)"

    def ratio(v: float | None) -> str:
        return f"{v / base:.2f}x" if v is not None and base else "-"

    md = ["| command | first line | vs baseline |", "|---|---|---|"]
    md += [f"| {name} | {cell(v)} | {ratio(v)} |" for name, v, _ in rows]
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("\n".join(md))
    if rec is not None:
        first = rows[0][1]
        rec.goal("quick start command: first line of output", "≤ 10 s",
                 median=first if first is not None else args.limit, unit="s", digits=1,
                 met=first is not None and first <= 10)
        rec.markdown(md)
        rec.save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
