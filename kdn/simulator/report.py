"""Terminal tables, JSON objects and PNG plots of simulation and tuning results."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kdn.simulator.runner import SimulationReport
from kdn.simulator.tally import PolicyResult

__all__ = ["policy_rows", "render_table", "report_json", "plot_ttft_cdf", "plot_hit_vs_cache", "plot_cost_vs_p90", "markdown_table"]

COLUMNS_TABLE = """
policy      | policy          | {}     | 1
TTFT p50 s  | ttft_p50_s      | {:.3f} | 1
p90 s       | ttft_p90_s      | {:.3f} | 1
p99 s       | ttft_p99_s      | {:.3f} | 1
edge hit    | hit_ratio       | {:.1%} | 1
local       | hit_ratio_local | {:.1%} | 1
peer        | hit_ratio_peer  | {:.1%} | 1
origin      | origin_ratio    | {:.1%} | 1
recompute   | recompute_ratio | {:.1%} | 1
WAN TB      | wan_bytes       | {:.2f} | 1e12
GPU-h saved | gpu_s_saved     | {:.1f} | 3600
cost $      | cost_usd        | {:,.0f} | 1
wall s      | wall_s          | {:.1f} | 1
"""
"""The policy table: heading | ``PolicyResult`` field | format | the field is divided by this."""

COLUMNS: tuple[tuple[str, str, str, float], ...] = tuple(
    (head.strip(), attr.strip(), fmt.strip(), float(scale))
    for head, attr, fmt, scale in (line.split("|") for line in COLUMNS_TABLE.strip().splitlines())
)


def policy_rows(results: Sequence[PolicyResult]) -> list[list[str]]:
    rows = []
    for r in results:
        row = []
        for _, attr, fmt, scale in COLUMNS:
            v = getattr(r, attr)
            row.append(fmt.format(v / scale if scale != 1.0 else v))
        rows.append(row)
    return rows


def render_table(rep: SimulationReport) -> None:
    from rich.console import Console
    from rich.table import Table

    sc = rep.scenario
    title = f"{sc.name}: {rep.requests:,} requests, {rep.unique_chunks:,} unique chunks, model {sc.model} on {sc.gpu}"
    table = Table(title=title)
    for head, *_ in COLUMNS:
        table.add_column(head, justify="left" if head == "policy" else "right")
    for row in policy_rows(rep.results):
        table.add_row(*row)
    console = Console()
    Console(width=max(console.width, 160)).print(table)


def markdown_table(results: Sequence[PolicyResult]) -> str:
    heads = [c[0] for c in COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(row) + " |" for row in policy_rows(results)]
    return "\n".join(lines)


def report_json(rep: SimulationReport, plots: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "scenario": rep.scenario.name,
        "requests": rep.requests,
        "unique_chunks": rep.unique_chunks,
        "setup_s": rep.setup_s,
        "wall_s": rep.wall_s,
        "policies": {r.policy: r.summary() for r in rep.results},
        "plots": plots or {},
    }


# One colour, marker and line style per placement policy, the same in every plot (the TTFT CDF,
# hit ratio vs cache size, cost vs p90), so a policy is recognised across plots and two policies
# whose curves coincide (popularity_push over nearest_edge, when pushes rarely add hits) stay
# visible: different markers and dashes on top of each other, the later one drawn thinner.
POLICY_STYLE: dict[str, tuple[str, str, str]] = {
    "origin_only": ("C7", "o", "-"),
    "nearest_edge": ("C0", "s", "-"),
    "consistent_hash": ("C2", "^", "--"),
    "popularity_push": ("C1", "D", ":"),
    "hint_prefetch": ("C3", "v", "-."),
    "prefix_route": ("C4", "<", "--"),
    "kv_route": ("C6", ">", "-"),
}


def style_of(policy: str) -> dict[str, Any]:
    color, marker, line = POLICY_STYLE.get(policy, ("C5", "P", "-"))
    return {"color": color, "marker": marker, "linestyle": line}


@contextmanager
def _figure(path: Path, title: str, xlabel: str, ylabel: str, *, log_x: bool = False) -> Iterator[Any]:
    """Axes to draw on; on leaving, labelled, gridded, with a legend, saved to ``path`` as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title.strip())
        ax.grid(True, which="both" if log_x else "major", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def plot_ttft_cdf(results: Sequence[PolicyResult], path: Path, title: str = "") -> Path:
    with _figure(path, f"TTFT CDF per policy {title}", "TTFT (s)", "fraction of requests", log_x=True) as ax:
        for k, r in enumerate(results):
            x = np.sort(r.ttft)
            if x.size == 0:
                continue
            y = np.arange(1, x.size + 1) / x.size
            step = max(1, x.size // 2000)
            ax.plot(x[::step], y[::step], label=f"{r.policy} (p90 {r.ttft_p90_s:.3f} s)", markevery=max(1, x[::step].size // 12),
                    lw=2.2 - 0.3 * k, markersize=6, **style_of(r.policy))
    return path


def plot_hit_vs_cache(sweep: dict[str, list[tuple[float, float]]], path: Path, title: str = "") -> Path:
    with _figure(path, f"Hit ratio vs cache size {title}", "edge cache size (GB per edge)", "edge hit ratio (chunks)", log_x=True) as ax:
        for k, (name, pts) in enumerate(sweep.items()):
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, lw=2.2 - 0.3 * k, markersize=8 - k, **style_of(name))
        ax.set_ylim(0, 1)
    return path


def plot_cost_vs_p90(
    points: Sequence[tuple[str, float, float]],
    path: Path,
    *,
    front: Sequence[tuple[float, float]] = (),
    recommended: tuple[float, float] | None = None,
    title: str = "",
) -> Path:
    """``points``: (label, cost_usd, p90_s). ``front``: Pareto points, joined by a line."""
    with _figure(path, f"Cost vs p90 TTFT {title}", "p90 TTFT (s)", "cost (USD, simulated span)") as ax:
        for lab in sorted({p[0] for p in points}):
            xs = [p[2] for p in points if p[0] == lab]
            ys = [p[1] for p in points if p[0] == lab]
            st = style_of(lab)
            ax.scatter(xs, ys, label=lab, s=30, alpha=0.8, color=st["color"], marker=st["marker"])
        if front:
            f = sorted(front, key=lambda q: q[1])
            ax.plot([q[1] for q in f], [q[0] for q in f], "k--", lw=1, label="Pareto front")
        if recommended is not None:
            ax.scatter([recommended[1]], [recommended[0]], marker="*", s=250, c="red", label="recommended", zorder=5)
    return path
