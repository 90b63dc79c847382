"""Terminal tables, JSON objects and PNG plots of simulation and tuning results."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kdn.simulator.engine import PolicyResult
from kdn.simulator.runner import SimulationReport

__all__ = ["policy_rows", "render_table", "report_json", "plot_ttft_cdf", "plot_hit_vs_cache", "plot_cost_vs_p90", "markdown_table"]

COLUMNS = (
    ("policy", "policy", "{}"),
    ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
    ("p90 s", "ttft_p90_s", "{:.3f}"),
    ("p99 s", "ttft_p99_s", "{:.3f}"),
    ("edge hit", "hit_ratio", "{:.1%}"),
    ("local", "hit_ratio_local", "{:.1%}"),
    ("peer", "hit_ratio_peer", "{:.1%}"),
    ("origin", "origin_ratio", "{:.1%}"),
    ("recompute", "recompute_ratio", "{:.1%}"),
    ("WAN TB", "wan_bytes", "{:.2f}"),
    ("GPU-h saved", "gpu_s_saved", "{:.1f}"),
    ("cost $", "cost_usd", "{:,.0f}"),
    ("wall s", "wall_s", "{:.1f}"),
)


def policy_rows(results: Sequence[PolicyResult]) -> list[list[str]]:
    rows = []
    for r in results:
        row = []
        for _, attr, fmt in COLUMNS:
            v = getattr(r, attr)
            if attr == "wan_bytes":
                v = v / 1e12
            elif attr == "gpu_s_saved":
                v = v / 3600.0
            row.append(fmt.format(v))
        rows.append(row)
    return rows


def render_table(rep: SimulationReport) -> None:
    from rich.console import Console
    from rich.table import Table

    sc = rep.scenario
    title = f"{sc.name}: {rep.requests:,} requests, {rep.unique_chunks:,} unique chunks, model {sc.model} on {sc.gpu}"
    table = Table(title=title)
    for head, _, _ in COLUMNS:
        table.add_column(head, justify="left" if head == "policy" else "right")
    for row in policy_rows(rep.results):
        table.add_row(*row)
    console = Console()
    Console(width=max(console.width, 160)).print(table)


def markdown_table(results: Sequence[PolicyResult]) -> str:
    heads = [h for h, _, _ in COLUMNS]
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


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(results: Sequence[PolicyResult], path: Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        x = np.sort(r.ttft)
        if x.size == 0:
            continue
        y = np.arange(1, x.size + 1) / x.size
        step = max(1, x.size // 2000)
        ax.plot(x[::step], y[::step], label=f"{r.policy} (p90 {r.ttft_p90_s:.3f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF per policy {title}".strip())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_hit_vs_cache(sweep: dict[str, list[tuple[float, float]]], path: Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sweep.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("edge cache size (GB per edge)")
    ax.set_ylabel("edge hit ratio (chunks)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Hit ratio vs cache size {title}".strip())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
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
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = sorted({p[0] for p in points})
    for lab in labels:
        xs = [p[2] for p in points if p[0] == lab]
        ys = [p[1] for p in points if p[0] == lab]
        ax.scatter(xs, ys, label=lab, s=30, alpha=0.8)
    if front:
        f = sorted(front, key=lambda q: q[1])
        ax.plot([q[1] for q in f], [q[0] for q in f], "k--", lw=1, label="Pareto front")
    if recommended is not None:
        ax.scatter([recommended[1]], [recommended[0]], marker="*", s=250, c="red", label="recommended", zorder=5)
    ax.set_xlabel("p90 TTFT (s)")
    ax.set_ylabel("cost (USD, simulated span)")
    ax.set_title(f"Cost vs p90 TTFT {title}".strip())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
