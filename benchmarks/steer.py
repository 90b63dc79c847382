"""Steered KV on the trained model: the deficit, the steering table by mark kind and depth, and the
same variant served through an edge into vLLM (answers, TTFT).

    kdn eval-steer --out DIR --threads 2                       # the evaluation (hours on 2 cores; resumable)
    python benchmarks/steer.py --eval-out DIR                   # record its figures
    python benchmarks/steer.py --eval-out DIR --serving --haystacks 4   # + vLLM and transformers through an edge

``--eval-out`` reads the summary of a ``kdn eval-steer`` run (:mod:`kdn.lab.steer_eval`) and records
``steer``. ``--serving`` runs ``tests/vllm/steer_cases.py`` in ``.venv-vllm`` (``--vllm-python``)
with the calibration that run chose: haystacks of the test split ingested with ``kdn ingest
--emphasize key-edit``, an edge pulling from the origin, and every question answered by the
transformers path and by vLLM, plain and steered; it records ``steer-serving``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _results import Record, load_average, now_utc

REPO = Path(__file__).resolve().parents[1]
DEPTHS = ("0", "0.25", "0.5", "0.75", "1")

METHOD = {
    "steer": """SmolLM2-135M-Instruct, fp32. A haystack is 5 slices of Python standard-library files (about
2,300 tokens), stored as a chat's system message; each slice carries one lookalike note (`# NOTE: the
access code for the cobalt vault is 4821.`, another vault and code in each). A question asks one
vault's code; the answer is right when all four digits are the greedy tokens. The asked note sits
in document 1, 2, 3, 4 or 5 (depth 0, 0.25, 0.5, 0.75, 1); one haystack gives one question per
depth. Calibration haystacks come from the corpus's train files, test haystacks from its held-out
files. Reuse as the product does it: the stored full chunks (plain or steered) are loaded, the
partial last chunk and the question prefilled on top. Marks: realistic = the operator's rule
`--emphasize-regex '^# NOTE:'` (every note, without seeing the question); oracle = the asked note;
wrong = another note; random = as many non-note lines, drawn at random; everything = the whole
document; ceiling = the asked note's document alone. The method and strength are chosen on the
calibration split with realistic marks. Accuracy with 95% Wilson intervals; Δ = paired difference
from plain on the same questions, +gained/−lost questions and the exact McNemar p.""",
    "steer-serving": """Test haystacks ingested at an origin with `kdn ingest --layout system --emphasize key-edit
--emphasize-regex '^# NOTE:'` and the calibration the evaluation chose; a `kdn edge` pulls from the
origin. Each question runs in transformers (fp32: full recompute, plain hit, steered hit) and in
vLLM 0.32 CPU with the KDN connector (fp32: alone, plain hit, steered hit naming the variant with
`kdn_steer` and a cache_salt containing it), greedy, 6 tokens, prefix cache reset before each
request. Same answers = identical token ids. TTFT ratio = steered hit / plain hit of the same
question, back to back: transformers' TTFT from `generate`, vLLM's the wall time of
`LLM.generate` (6 tokens).""",
}


def _pct(x: float) -> str:
    return f"{x * 100:.1f}"


def _acc(c: dict[str, Any]) -> str:
    return f"{c['accuracy']:.3f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]"


def _delta(c: dict[str, Any]) -> str:
    return f"{c['delta'] * 100:+.1f} (+{c['gained']}/−{c['lost']}, p={c['p']:.2g})"


def record_eval(summary: dict[str, Any], argv: list[str], command: str, load_start: float | None) -> Record:
    seed = int(summary.get("plan", {}).get("seed", 0))
    # each split keeps its own section: seed 0's is "steer", a fresh split's "steer-seed<N>"
    rid, title = ("steer", "") if seed == 0 else (f"steer-seed{seed}", f", split of seed {seed}")
    rec = Record(__file__, rid, f"Steered KV on the trained model (smollm2-135m){title}", argv, method="steer",
                 command=command)
    rec.doc["load"]["start"] = load_start
    load = summary.get("load")
    if load:
        rec.doc["load"]["start"], rec.doc["load"]["end"] = load["min"], load["max"]
        rec.note(f"1-minute load average over the evaluation's haystacks: min {load['min']}, median {load['median']}, "
                 f"max {load['max']}; compute per stage (h): "
                 + ", ".join(f"{k} {v / 3600:.2f}" for k, v in summary.get("stage_seconds", {}).items()) + ".")
    deficit = summary.get("deficit", {})
    if deficit:
        rows = [[f"{row['tokens']:.0f}", str(row["haystacks"]), *(_acc(row["depths"][d]) for d in DEPTHS)]
                for length, row in sorted(deficit.items(), key=lambda kv: int(kv[0]))]
        rec.table(["document tokens (median)", "haystacks", *(f"depth {d}" for d in DEPTHS)], rows,
                  title="Plain accuracy by depth and length (test haystacks)")
    test = summary.get("test")
    if test:
        t = test["table"]
        plain = t["plain"]
        best = max(c["accuracy"] for c in plain.values())
        worst_d = min(plain, key=lambda d: plain[d]["accuracy"])
        rec.goal(f"plain deficit: best depth {best:.3f} vs depth {worst_d} {plain[worst_d]['accuracy']:.3f} "
                 f"({test['haystacks']} questions per depth)", "≥ 10 points at some depth",
                 median=(best - plain[worst_d]["accuracy"]) * 100, at_least=10, unit="points", digits=1)
        c = test["claims"]
        r = c.get("realistic", {})
        weak = r.get("weak_depth")
        if weak is not None:
            cell = t["realistic"][weak]
            rec.goal(f"realistic marks, {test['setting']}: gain at weak depth {weak} (95% CI "
                     f"{cell['delta_ci95'][0] * 100:+.1f}..{cell['delta_ci95'][1] * 100:+.1f}; exact p={cell['p']:.2g})",
                     "≥ +5 points, p < 0.05", median=cell["delta"] * 100, lo=cell["delta_ci95"][0] * 100,
                     hi=cell["delta_ci95"][1] * 100, unit="points", digits=1,
                     met=bool(cell["delta"] >= 0.05 - 1e-9 and cell["p"] < 0.05))
            rec.goal("realistic marks: worst change at any other depth", "≥ −1 point",
                     median=r["worst_other"] * 100, at_least=-1, unit="points", digits=1)
        if "wrong" in c:
            worst = min(t["wrong"].values(), key=lambda x: x["delta"])
            rec.goal(f"wrong marks: largest loss (exact p={worst['p']:.2g})", "a loss with p < 0.05",
                     median=worst["delta"] * 100, unit="points", digits=1, met=bool(c["wrong"]["met"]))
        if "random" in c:
            worst = min(t["random"].values(), key=lambda x: x["delta"])
            rec.goal(f"random marks: largest loss (exact p={worst['p']:.2g})", "no loss > 1 point with p < 0.05",
                     median=worst["delta"] * 100, unit="points", digits=1, met=bool(c["random"]["met"]))
        rows = []
        for name, row in t.items():
            rows.append([name, *((_acc(row[d]) + ("" if name == "plain" else " " + _delta(row[d]))) for d in DEPTHS)])
        rec.table(["marks", *(f"depth {d}" for d in DEPTHS)], rows,
                  title=f"Test split, {test['haystacks']} questions per depth, {test['setting']}")
    cal = summary.get("calibration")
    if cal:
        rows = [[name, *(f"{row[d]['accuracy']:.3f}" + ("" if name == "plain" else f" ({row[d]['delta'] * 100:+.1f})")
                         for d in DEPTHS)] for name, row in cal["table"].items()]
        rec.table(["setting (realistic marks)", *(f"depth {d}" for d in DEPTHS)], rows,
                  title=f"Calibration split, {cal['haystacks']} haystacks: the grid; weak depths {cal['weak_depths']}, "
                        f"chosen {cal['chosen']['name']}")
    rec.data({"summary": summary})
    return rec


def run_serving(args: argparse.Namespace, summary: dict[str, Any]) -> dict[str, Any]:
    cal = (summary.get("calibration") or {}).get("path")
    if not cal or not Path(cal).is_file():
        raise SystemExit("the evaluation wrote no key-edit calibration (its chosen setting is not key-edit?)")
    out = Path(tempfile.mkdtemp(prefix="kdn-steer-serving-")) / "cases.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    subprocess.run([args.vllm_python, "-m", "tests.vllm.steer_cases", str(out), "--haystacks", str(args.haystacks),
                    "--length", str(args.length), "--calibration", cal], cwd=REPO, env=env, check=True, timeout=7200)
    return json.loads(out.read_text())


def record_serving(res: dict[str, Any], argv: list[str], command: str, load_start: float) -> Record:
    rec = Record(__file__, "steer-serving", "Steered KV served through an edge: vLLM vs transformers, TTFT", argv,
                 method="steer-serving", command=command)
    rec.doc["load"]["start"] = load_start
    ps = res["prompts"]
    n = len(ps)
    same = sum(p["vllm_steered"] == p["hf_steered"] for p in ps)
    loaded = sum(p["vllm_steered_cached"] >= p["stored"] // res["chunk"] * res["chunk"] for p in ps)
    changed = sum(p["hf_steered"] != p["hf_plain"] for p in ps)
    rec.goal(f"vLLM steered answer == transformers steered answer ({n} questions, {res['haystacks']} haystacks of "
             f"{res['length']} tokens; steered chain loaded from the edge in {loaded}/{n}; the variant changed the "
             f"answer in {changed}/{n})", "all", median=same / n * 100, unit="% same", digits=1, met=same == n)
    plain_same = sum(p["vllm_plain"] == p["hf_plain"] for p in ps)
    rec.goal("vLLM plain hit == transformers plain hit", "all", median=plain_same / n * 100, unit="% same", digits=1,
             met=plain_same == n)
    hf = [p["hf_steered_ttft_s"] / p["hf_plain_ttft_s"] for p in ps]
    rec.goal("transformers TTFT, steered hit / plain hit", "within noise (≤ 1.1x)", hf, at_most=1.1)
    vl = [p["vllm_steered_s"] / p["vllm_plain_s"] for p in ps]
    rec.goal("vLLM request time, steered hit / plain hit", "within noise (≤ 1.1x)", vl, at_most=1.1)
    bad = res["bad"]
    rec.note(f"Bad input in vLLM: a steered request without a cache_salt naming the variant got {bad['no_salt']['cached']} "
             f"cached tokens and {'the same answer as vLLM alone' if bad['no_salt']['tokens'] == ps[0]['vllm_alone'] else 'ANOTHER answer'}; "
             f"another tenant's request for the variant got {bad['other_tenant']['cached']} cached tokens and "
             f"{'the same answer as vLLM alone' if bad['other_tenant']['tokens'] == ps[0]['vllm_alone'] else 'ANOTHER answer'}.")
    rec.note(f"Medians: transformers TTFT plain hit {statistics.median(p['hf_plain_ttft_s'] for p in ps) * 1e3:.0f} ms, "
             f"steered hit {statistics.median(p['hf_steered_ttft_s'] for p in ps) * 1e3:.0f} ms; vLLM plain hit "
             f"{statistics.median(p['vllm_plain_s'] for p in ps) * 1e3:.0f} ms, steered hit "
             f"{statistics.median(p['vllm_steered_s'] for p in ps) * 1e3:.0f} ms, alone (recompute) "
             f"{statistics.median(p['vllm_alone_s'] for p in ps) * 1e3:.0f} ms; ingest with the variant {res['ingest_s']:.0f} s.")
    rec.set_rounds(n)
    rec.data(res)
    return rec


def eval_command(plan: dict[str, Any]) -> str:
    """The `kdn eval-steer` command line that made a run of ``plan`` (its plan.json), then this script."""
    from kdn.lab.steer_eval import HEAD_SETS, PROFILES, STRENGTHS, TEST_KINDS

    deficits = ",".join(str(x) for x in plan.get("deficit_lengths", []))
    parts = [f"kdn eval-steer --out DIR --length {plan.get('length')} --docs {plan.get('docs')} --test "
             f"{plan.get('test')} --calibration {plan.get('calibration')} --means {plan.get('means')} "
             f"--deficit-lengths {deficits or chr(39) * 2} --deficit-haystacks {plan.get('deficit_haystacks')}"]
    if plan.get("seed"):
        parts.append(f"--seed {plan['seed']}")
    edits = [st for st in plan.get("settings", []) if st.get("method") == "key-edit"]
    if edits:
        grid = {"strengths": sorted({float(st["strength"]) for st in edits}),
                "heads": sorted({st["heads"] for st in edits}), "profiles": sorted({st["profile"] for st in edits})}
        if grid["strengths"] != sorted(float(x) for x in STRENGTHS):
            parts.append("--strengths " + ",".join(f"{x:g}" for x in grid["strengths"]))
        if grid["heads"] != sorted(HEAD_SETS):
            parts.append("--heads " + ",".join(grid["heads"]))
        if grid["profiles"] != sorted(PROFILES):
            parts.append("--profiles " + ",".join(grid["profiles"]))
    if plan.get("settings") and not any(st.get("method") == "re-read" for st in plan["settings"]):
        parts.append("--no-re-read")
    if plan.get("kinds") and list(plan["kinds"]) != list(TEST_KINDS):
        parts.append("--kinds " + ",".join(plan["kinds"]))
    return " ".join(parts) + "; python benchmarks/steer.py --eval-out DIR"


def ship_calibration(summary: dict[str, Any]) -> Path:
    """Copy the run's calibration into :data:`kdn.steer.methods.SHIPPED_ROOT`: the one the run
    chose and tested (its digest the summary's, its notes holding the test's measured effect)."""
    import shutil

    from kdn.steer.methods import SHIPPED_ROOT, load_calibration

    chosen = summary.get("calibration", {})
    src = Path(chosen.get("path") or "")
    if not src.is_file():
        raise SystemExit("--ship: the run wrote no calibration (it ran with --no-calibration, or chose re-read)")
    cal = load_calibration(summary["fingerprint"], src.parent)
    if cal is None or cal.digest != chosen.get("digest"):
        raise SystemExit(f"--ship: {src} is not the calibration this run chose (another run overwrote it?)")
    if "measured" not in cal.notes:
        raise SystemExit("--ship: the calibration holds no measured effect: run the test stage first")
    SHIPPED_ROOT.mkdir(exist_ok=True)
    dst = SHIPPED_ROOT / src.name
    shutil.copyfile(src, dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eval-out", type=Path, required=True, help="the --out directory of a `kdn eval-steer` run")
    p.add_argument("--serving", action="store_true", help="also serve test haystacks through an edge into vLLM")
    p.add_argument("--haystacks", type=int, default=4, help="test haystacks for --serving (5 questions each)")
    p.add_argument("--length", type=int, default=2048, help="document tokens of the --serving haystacks")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--no-append", action="store_true", help="print only; record nothing")
    p.add_argument("--ship", action="store_true",
                   help="copy the calibration the run chose, with its measured effect, to kdn/steer/calibrations/ "
                        "(where KDN ships it for the model)")
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    path = args.eval_out / "summary.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no summary; run `kdn eval-steer --out {args.eval_out}` first")
    summary = json.loads(path.read_text())
    plan = json.loads((args.eval_out / "plan.json").read_text()) if (args.eval_out / "plan.json").is_file() else {}
    eval_cmd = eval_command(plan)
    load0 = load_average()
    rec = record_eval(summary, argv, eval_cmd, None)
    print(json.dumps({g["what"]: (g["median"], g["met"]) for g in rec.doc["goals"]}, indent=1))
    if not args.no_append:
        rec.save(load_end=rec.doc["load"]["end"] if summary.get("load") else None)
    if args.ship:
        print(f"[steer] shipped: {ship_calibration(summary).relative_to(REPO)}")
    if args.serving:
        res = run_serving(args, summary)
        srec = record_serving(res, argv, "python benchmarks/steer.py " + " ".join(argv), load0)
        print(json.dumps({g["what"]: (g["median"], g["met"]) for g in srec.doc["goals"]}, indent=1))
        if not args.no_append:
            srec.save()
    print(f"[steer] {now_utc()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
