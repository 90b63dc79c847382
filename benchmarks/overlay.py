"""The overlay's hashing (kdn.placement): balance, key movement on join, weights, lookups/s.

Baseline in the same run: uhashring's ketama ring (the de-facto standard consistent-hash ring) on
the same node names and keys. Keys are 32-byte BLAKE2b digests, like KDN chunk keys.

    .venv/bin/python benchmarks/overlay.py [--quick] [--no-append]

Records the run as ``overlay`` (``benchmarks/_results.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from _results import Record
from kdn.placement import BoundedLoadPlacement, Node, Placement

REPO = Path(__file__).resolve().parents[1]

METHOD = """Keys are 32-byte BLAKE2b digests, like KDN chunk keys; the baseline is uhashring's ketama
ring (the de-facto standard consistent-hash ring) on the same node names and keys. Balance is the
most-loaded node's key count over the mean, for the plain ring and with bounded loads (c = 1.05);
movement is the share of keys that change owner when one node joins, times N+1 (1.0 is the
minimum any consistent hash can move); lookups per second are the best of 3 interleaved rounds on
100 nodes, single-key and batched."""


def rate(fn, n: int, repeat: int = 3) -> float:
    """Best of ``repeat`` runs of ``fn`` (which does n lookups), in lookups per second."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return n / best


def imbalance(owners) -> float:
    counts = np.array(list(Counter(owners).values()))
    return float(counts.max() / counts.mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/overlay.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20k keys instead of 100k")
    ap.add_argument("--no-append", action="store_true", help="print only; record nothing")
    args = ap.parse_args(argv)
    rec = None if args.no_append else Record(__file__, "overlay", "Overlay hashing, kdn.placement", argv)
    try:
        import uhashring
    except ImportError:  # the reference is a dev dependency
        uhashring = None

    n_keys = 20_000 if args.quick else 100_000
    keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest() for i in range(n_keys)]
    hexkeys = [k.hex() for k in keys]
    lines = []

    def out(s: str = "") -> None:
        print(s)
        lines.append(s)

    out(f"{n_keys} keys (32-byte digests); ring with {Placement().vnodes} vnodes per unit weight; c = 1.05")
    out()
    out("| N | max/mean plain ring | max/mean bounded (c=1.05) | keys moved on join x (N+1) | uhashring moved x (N+1) | uhashring max/mean |")
    out("|---|---|---|---|---|---|")
    worst_bounded = worst_moved = 0.0
    for n in (10, 50, 100):
        names = [f"edge-{i}" for i in range(n)]
        ring = Placement(Node(x) for x in names)
        plain = ring.owners_batch(keys)[:, 0]
        bounded = BoundedLoadPlacement((Node(x) for x in names), c=1.05)
        for k in keys:
            bounded.assign(k)
        loads = np.array(list(bounded.loads.values()))
        ring.add(Node(f"edge-{n}"))
        moved = float((ring.owners_batch(keys)[:, 0] != plain).mean()) * (n + 1)
        if uhashring is not None:
            ua_ring = uhashring.HashRing(nodes=names, hash_fn="ketama")
            ua = [ua_ring.get_node(k) for k in hexkeys]
            ua_ring.add_node(f"edge-{n}")
            ub = [ua_ring.get_node(k) for k in hexkeys]
            uh_moved = f"{np.mean([a != b for a, b in zip(ua, ub)]) * (n + 1):.3f}"
            uh_imb = f"{imbalance(ua):.3f}"
        else:
            uh_moved = uh_imb = "n/a"
        out(
            f"| {n} | {imbalance(plain):.3f} | {loads.max() / loads.mean():.3f} | {moved:.3f} | {uh_moved} | {uh_imb} |"
        )
        worst_bounded = max(worst_bounded, float(loads.max() / loads.mean()))
        worst_moved = max(worst_moved, moved)

    w = Placement([Node("big", 2.0)] + [Node(f"edge-{i}") for i in range(9)])
    counts = Counter(w.owners_batch(keys)[:, 0])
    wr = counts["big"] / np.mean([counts[f"edge-{i}"] for i in range(9)])
    out()
    out(f"weights: a weight-2 node among 9 weight-1 nodes gets {wr:.2f}x their mean key count")

    ring = Placement(Node(f"edge-{i}") for i in range(100))
    ring.owners_batch(keys[:10], 3)  # build the r=3 successor table outside the timing
    uh = uhashring.HashRing(nodes=[f"edge-{i}" for i in range(100)], hash_fn="ketama") if uhashring else None
    cases = {
        "uhashring ketama get_node, single key (baseline)": (lambda: [uh.get_node(k) for k in hexkeys]) if uh else None,
        "owners(key), r=1, single key": lambda: [ring.owners(k) for k in keys],
        "owners(key, 3), single key": lambda: [ring.owners(k, 3) for k in keys],
        "owners_batch(keys), r=1": lambda: ring.owners_batch(keys),
        "owners_batch(keys, 3)": lambda: ring.owners_batch(keys, 3),
    }
    best: dict[str, float] = {}
    for _ in range(3):  # interleaved rounds, best of each: fair on a machine shared with other work
        for label, fn in cases.items():
            if fn is not None:
                best[label] = max(best.get(label, 0.0), rate(fn, n_keys, repeat=1))
    bl = BoundedLoadPlacement((Node(f"edge-{i}") for i in range(100)), c=1.05)
    best["BoundedLoadPlacement.assign, single key"] = rate(lambda: [bl.assign(k) for k in keys], n_keys, repeat=1)
    base = best.pop("uhashring ketama get_node, single key (baseline)", None)
    out()
    out("lookups/s on 100 nodes (best of 3 interleaved rounds):")
    if base:
        out(f"- uhashring ketama get_node, single key (baseline): {base:,.0f}/s")
    for label, r in best.items():
        ratio = f" ({r / base:.1f}x uhashring)" if base else ""
        out(f"- {label}: {r:,.0f}/s{ratio}")
    single1, batch1 = best["owners(key), r=1, single key"], best["owners_batch(keys), r=1"]
    via = "single-key and batch paths" if single1 >= 500_000 else "batch path" if batch1 >= 500_000 else ""
    out()
    out(
        f"goal >= 500k lookups/s: {'MET by the ' + via if via else 'NOT MET'} "
        f"(single-key r=1 {single1 / 1e3:,.0f}k/s, batch {batch1 / 1e6:,.1f}M/s; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
    )

    if rec is not None:
        rec.set_rounds(3)
        rec.goal("max/mean load with bounded load (c = 1.05), worst of 10/50/100 nodes", "≤ 1.05", median=worst_bounded,
                 at_most=1.05, unit="", digits=3)
        rec.goal("keys moved on join x (N+1), worst of 10/50/100 nodes", "≤ 1.1", median=worst_moved, at_most=1.1,
                 unit="", digits=3)
        rec.goal("lookups/s, owners_batch r=1, 100 nodes", "≥ 500k/s", median=batch1, at_least=500_000, unit="/s", digits=0)
        rec.goal("lookups/s, owners(key) r=1 single key, 100 nodes", "—", median=single1, unit="/s", digits=0)
        rec.markdown(lines[:-1])  # the last line is the goal line, recorded above
        rec.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
