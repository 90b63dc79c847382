"""``kdn simulate`` and ``kdn tune``: the simulator's command line.

Errors from KDN (a bad scenario, a missing trace) are printed as one line on stderr with exit
code 2; nothing is simulated before the scenario has been validated in full.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kdn.console import report_error
from kdn.errors import KdnError

__all__ = ["main", "main_simulate", "main_tune"]


def _common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("scenario", type=Path, help="scenario YAML (see kdn/simulator/scenarios/)")
    ap.add_argument("--out", type=Path, default=None, help="folder for PNG plots (default: out/<scenario name>)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--requests", type=int, default=None, metavar="N", help="simulate only the first N requests")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")


def _out_dir(args: argparse.Namespace, name: str) -> Path:
    out = args.out if args.out is not None else Path("out") / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def main_simulate(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kdn simulate", description="Simulate a KDN deployment over a WAN and compare placement policies.")
    _common(ap)
    ap.add_argument("--policy", action="append", default=None, help="run only this policy (repeatable)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the hit-ratio-vs-cache-size sweep")
    args = ap.parse_args(argv)
    try:
        from kdn.simulator import report
        from kdn.simulator.runner import cache_sweep, prepare, simulate
        from kdn.simulator.scenario import POLICY_NAMES

        if args.requests is not None and args.requests < 1:
            raise KdnError("--requests must be >= 1")
        for name in args.policy or []:
            if name not in POLICY_NAMES:
                raise KdnError(f"--policy: unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
        prep = prepare(args.scenario, limit=args.requests)
        progress = not args.no_progress
        rep = simulate(prep, policies=args.policy, progress=progress)
        out = _out_dir(args, prep.scenario.name)
        plots = {
            "ttft_cdf": str(report.plot_ttft_cdf(rep.results, out / "ttft_cdf.png", f"({prep.scenario.name})")),
            "cost_vs_p90": str(
                report.plot_cost_vs_p90(
                    [(r.policy, r.cost_usd, r.ttft_p90_s) for r in rep.results], out / "cost_vs_p90.png", title=f"({prep.scenario.name})"
                )
            ),
        }
        sizes = prep.scenario.report.cache_sweep_gb
        sweep_s = 0.0
        if sizes and not args.no_sweep:
            t_sweep = time.perf_counter()
            sweep = cache_sweep(prep, sizes, policies=[r.policy for r in rep.results], progress=progress)
            sweep_s = time.perf_counter() - t_sweep
            plots["hit_vs_cache"] = str(report.plot_hit_vs_cache(sweep, out / "hit_vs_cache.png", f"({prep.scenario.name})"))
    except KdnError as exc:
        if args.json:  # one JSON object on stdout, as every --json command reports errors (kdn.console)
            report_error("simulate", exc, as_json=True)
        else:
            print(f"kdn simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.report_json(rep, plots)))
    else:
        report.render_table(rep)
        sim = f"simulation {rep.wall_s + sweep_s:.1f} s" + (f" ({rep.wall_s:.2f} s policies + {sweep_s:.2f} s cache sweep)" if sweep_s else "")
        print(f"setup {rep.setup_s:.1f} s, {sim}; plots: " + ", ".join(plots.values()))
    return 0


def main_tune(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kdn tune", description="Search replication, cache sizes, codecs and prefetch depth; print the cost vs p90 TTFT Pareto front.")
    _common(ap)
    ap.add_argument("--max-configs", type=int, default=None, help="override tune.max_configs")
    ap.add_argument("--p90-target", type=float, default=None, help="override tune.p90_target_s (seconds)")
    args = ap.parse_args(argv)
    try:
        from tqdm import tqdm

        from kdn.simulator import report
        from kdn.simulator.runner import Prepared, prepare
        from kdn.simulator.tuner import tune

        prep = prepare(args.scenario, limit=args.requests)
        t = prep.scenario.tune
        upd = {}
        if args.max_configs is not None:
            if args.max_configs < 1:
                raise KdnError("--max-configs must be >= 1")
            upd["max_configs"] = args.max_configs
        if args.p90_target is not None:
            if args.p90_target <= 0:
                raise KdnError("--p90-target must be > 0")
            upd["p90_target_s"] = args.p90_target
        if upd:
            sc = prep.scenario.model_copy(update={"tune": t.model_copy(update=upd)})
            prep = Prepared(sc, prep.topology, prep.requests, prep.presets, prep.setup_s)
        bar = tqdm(desc="tune", unit="config", disable=args.no_progress, leave=False)

        def on_config(n: int, total: int) -> None:
            bar.total = total
            bar.n = n
            bar.refresh()

        res = tune(prep, on_config=on_config)
        bar.close()
        out = _out_dir(args, prep.scenario.name)
        plot = report.plot_cost_vs_p90(
            [(q.config.policy, q.cost_usd, q.ttft_p90_s) for q in res.points],
            out / "tune_pareto.png",
            front=[(q.cost_usd, q.ttft_p90_s) for q in res.front],
            recommended=(res.recommended.cost_usd, res.recommended.ttft_p90_s),
            title=f"({prep.scenario.name})",
        )
    except KdnError as exc:
        if args.json:
            report_error("tune", exc, as_json=True)
        else:
            print(f"kdn tune: error: {exc}", file=sys.stderr)
        return 2

    def pt(q) -> dict:  # type: ignore[no-untyped-def]
        return {**q.config.as_dict(), "cost_usd": q.cost_usd, "ttft_p90_s": q.ttft_p90_s, "ttft_p50_s": q.ttft_p50_s,
                "hit_ratio": q.hit_ratio, "wan_bytes": q.wan_bytes, "min_agreement": q.min_agreement}

    if args.json:
        print(json.dumps({
            "scenario": prep.scenario.name, "requests": res.requests, "grid_size": res.grid_size,
            "evaluated": len(res.points), "front": [pt(q) for q in res.front],
            "recommended": pt(res.recommended), "rule": res.rule, "plot": str(plot),
        }))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{prep.scenario.name}: Pareto front of cost vs p90 TTFT ({len(res.points)} of {res.grid_size} configurations, {res.requests:,} requests each)")
    for head in ("configuration", "cost $", "p90 s", "p50 s", "edge hit", "WAN TB", "agreement"):
        table.add_column(head, justify="left" if head == "configuration" else "right")
    for q in res.front:
        mark = " *" if q is res.recommended else ""
        table.add_row(q.config.label() + mark, f"{q.cost_usd:,.0f}", f"{q.ttft_p90_s:.3f}", f"{q.ttft_p50_s:.3f}",
                      f"{q.hit_ratio:.1%}", f"{q.wan_bytes / 1e12:.2f}", f"{q.min_agreement:.2%}")
    Console(width=max(Console().width, 140)).print(table)
    c = res.recommended.config
    print(f"recommended: {res.rule}")  # the rule may hold parentheses of its own: none around it
    # as scenario YAML; only the knobs the recommended policy reads (label() shows the same ones)
    params = {"replicas": c.replicas} if c.policy == "consistent_hash" else {}
    if c.policy == "hint_prefetch":
        params["prefetch_depth"] = c.prefetch_depth
    print(f"  policies: [{c.policy}]\n  cache: {{edge_cache_gb: {c.edge_cache_gb:g}}}\n"
          f"  codecs: {{regional: {c.regional_codec}, long_haul: {c.long_haul_codec}}}"
          + ("\n  params: {" + ", ".join(f"{k}: {v}" for k, v in params.items()) + "}" if params else ""))
    print(f"plot: {plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m simulator.cli simulate|tune ARGS...``"""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("simulate", "tune"):
        print("usage: python -m simulator.cli {simulate,tune} SCENARIO.yaml [options]", file=sys.stderr)
        return 2
    return (main_simulate if argv[0] == "simulate" else main_tune)(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
