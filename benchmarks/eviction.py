"""Eviction policies on the Mooncake conversation trace and four synthetic traces: prefix-token hit rate.

Each hash id in the trace is one 512-token KV block; a request can only use the *leading* run of
its blocks that the cache holds (a block whose prefix is gone is worthless). Per request: count the
hit tokens of the leading cached run (the last block may be partial), then access every block of the
request in order (parent = the previous block), so misses are inserted and hits touched.

Traces: Mooncake's (shipped in kdn/simulator/scenarios/traces) and the synthetic documents,
conversations, agents and scans traces of kdn.simulator.reuse_traces (different reuse structure).
Capacities are 1%, 5%, 10% and 20% of the unique blocks. Policies: every registered one plus
Belady's block-level optimum (evict the block whose next use is farthest). Figures are reported as
ratios against LRU measured in the same run.

    .venv/bin/python benchmarks/eviction.py [--quick] [--trace PATH] [--no-append]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kdn.edge.eviction import POLICIES, Belady, EvictionPolicy, PrefixAware, make_policy
from kdn.simulator.cache import BoundedCache

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / "kdn" / "simulator" / "scenarios" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK_TOKENS = 512
FRACTIONS = (0.01, 0.05, 0.10, 0.20)
ORDER = ("lru", "s3fifo", "sieve", "prefix", "adaptive")
DEFAULT = "adaptive"  # the policy the goal is checked for


@dataclass(frozen=True, slots=True)
class Request:
    input_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, limit: int | None = None) -> list[Request]:
    reqs = []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            reqs.append(Request(int(obj["input_length"]), tuple(obj["hash_ids"])))
            if limit is not None and len(reqs) >= limit:
                break
    return reqs


def replay(reqs: Sequence[Request], capacity_blocks: int, policy: EvictionPolicy) -> float:
    """Prefix-token hit rate of ``policy`` with room for ``capacity_blocks`` blocks."""
    cache = BoundedCache(capacity_blocks, policy)
    access = cache.access
    hit = total = 0
    for r in reqs:
        ids = r.hash_ids
        k = 0
        for x in ids:
            if x not in cache:
                break
            k += 1
        hit += r.input_length if k == len(ids) else min(BLOCK_TOKENS * k, r.input_length)
        total += r.input_length
        parent = None
        for x in ids:
            access(x, 1, parent)
            parent = x
    return hit / total if total else 0.0


def policy_factories(reqs: Sequence[Request]) -> dict[str, Callable[[], EvictionPolicy]]:
    accesses = [x for r in reqs for x in r.hash_ids]
    names = [n for n in ORDER if n in POLICIES] + sorted(set(POLICIES) - set(ORDER))
    out: dict[str, Callable[[], EvictionPolicy]] = {n: (lambda n=n: make_policy(n)) for n in names}
    out["belady"] = lambda: Belady(accesses)
    return out


def plot(results: dict[str, list[float]], fractions: Sequence[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [100 * f for f in fractions]
    # one colour, marker and line style per policy, the same in every plot, so equal curves
    # (e.g. prefix and adaptive where they agree) stay visible on top of each other
    styles = {"lru": ("C0", "o", "-"), "s3fifo": ("C1", "s", "--"), "sieve": ("C2", "^", "-."), "prefix": ("C3", "D", ":"),
              "adaptive": ("C4", "x", "-"), "belady": ("C7", "v", "--")}
    for k, (name, rates) in enumerate(results.items()):
        color, marker, line = styles.get(name, (f"C{5 + k % 3}", "P", "-"))
        ax.plot(xs, [100 * r for r in rates], line, color=color, marker=marker, markersize=7 - k * 0.6, label=name, alpha=0.85)
    ax.set_xlabel("cache size (% of unique blocks)")
    ax.set_ylabel("prefix-token hit rate (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def traces(args: argparse.Namespace) -> dict[str, list[Request]]:
    """The Mooncake trace and the synthetic ones (kdn.simulator.reuse_traces), by name."""
    from kdn.simulator.reuse_traces import TRACES

    n = 3000 if args.quick else None
    out = {"mooncake": load_trace(args.trace, n)}
    for name, make in TRACES.items():
        out[name] = [Request(r.input_length, r.hash_ids) for r in make(**({"n": n} if n else {}))]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/eviction.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=Path(os.environ.get("KDN_TRACE", DEFAULT_TRACE)))
    ap.add_argument("--quick", action="store_true", help="first 3000 requests of each trace only")
    ap.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    ap.add_argument(
        "--sensitivity", action="store_true", help="also run the prefix policy at 0.5x and 2x its default half-life"
    )
    ap.add_argument("--plot", type=Path, default=REPO / "benchmarks" / "results" / "eviction.png")
    args = ap.parse_args(argv)

    if not args.trace.exists():
        print(f"trace not found: {args.trace} (pass --trace or set KDN_TRACE)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    sections: list[str] = []
    gains: dict[str, list[float]] = {}
    ok_all = True
    suffix = "-quick" if args.quick else ""
    for tname, reqs in traces(args).items():
        unique = len({x for r in reqs for x in r.hash_ids})
        caps = [max(1, round(f * unique)) for f in FRACTIONS]
        print(f"trace {tname}: {len(reqs)} requests, {unique} unique blocks, capacities {caps}")
        results: dict[str, list[float]] = {}
        for name, factory in policy_factories(reqs).items():
            t = time.perf_counter()
            results[name] = [replay(reqs, cap, factory()) for cap in caps]
            print(f"  {name:8s} {time.perf_counter() - t:6.1f}s")
        plotted = dict(results)
        if args.sensitivity:
            default = PrefixAware().half_life
            for mult in (0.5, 2.0):
                hl = default * mult
                results[f"prefix (half_life {hl:g})"] = [replay(reqs, cap, PrefixAware(half_life=hl)) for cap in caps]
        lru = results["lru"]
        head = "| policy | " + " | ".join(f"{100 * f:g}%" for f in FRACTIONS) + " |"
        lines = [head, "|---" * (len(FRACTIONS) + 1) + "|"]
        for name, rates in results.items():
            cells = [f"{100 * r:.2f}% ({r / l:.3f}x)" if l else f"{100 * r:.1f}%" for r, l in zip(rates, lru)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        table = "\n".join(lines)
        print(table)
        d = results[DEFAULT]
        ratios = [x / l if l else 1.0 for x, l in zip(d, lru)]
        gains[tname] = ratios
        ok = all(x >= l for x, l in zip(d, lru)) and (tname != "mooncake" or ratios[0] >= 1.3)
        ok_all = ok_all and ok
        plot_path = args.plot.with_name(f"{args.plot.stem}-{tname}{suffix}{args.plot.suffix}")
        plot(plotted, FRACTIONS, plot_path, f"{tname} trace ({len(reqs)} requests)")
        sections.append(
            f"\n### Trace `{tname}`: {len(reqs)} requests, {unique} unique blocks, capacities {caps} blocks\n\n{table}\n\n"
            f"`{DEFAULT}` vs LRU: " + ", ".join(f"{r:.3f}x" for r in ratios)
            + f" ({'>= LRU everywhere' if all(r >= 1 for r in ratios) else 'BELOW LRU somewhere'}). Plot: `{plot_path.relative_to(REPO)}`.\n"
        )
    elapsed = time.perf_counter() - t0
    lo = min(min(r) for r in gains.values())
    hi = max(max(r) for r in gains.values())
    at1 = {t: r[0] for t, r in gains.items()}
    verdict = (
        f"goal (`{DEFAULT}` >= LRU at every size on every trace, >= 1.3x at 1% on Mooncake): {'MET' if ok_all else 'NOT MET'}; "
        f"`{DEFAULT}` / LRU ranges {lo:.3f}x-{hi:.3f}x over traces and sizes; at 1%: "
        + ", ".join(f"{t} {r:.2f}x" for t, r in at1.items())
    )
    print(verdict)
    print(f"replay time, all traces, policies and sizes: {elapsed:.1f}s")
    if not args.no_append:
        cmd = "python benchmarks/eviction.py" + (" --quick" if args.quick else "") + (" --sensitivity" if args.sensitivity else "")
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        text = (
            f"\n## Eviction policies on five traces ({stamp})\n\n"
            f"Command: `.venv/bin/{cmd}`. Prefix-token hit rate, ratio vs LRU in the same run; capacities 1/5/10/20% of each "
            f"trace's unique 512-token blocks. Traces: the Mooncake conversation trace (in-repo) and four synthetic ones "
            f"(kdn.simulator.reuse_traces: documents, conversations, agents, scans). Replay took {elapsed:.0f} s.\n\n"
            f"{verdict}.\n" + "".join(sections)
        )
        with (REPO / "BENCHMARKS.md").open("a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
