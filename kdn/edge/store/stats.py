"""The store's counters as ``stats()`` reports them: per tier, then store-wide, from its index."""

from __future__ import annotations

from kdn.edge.store.index import StoreIndex

__all__ = ["COUNTERS", "index_stats"]

COUNTERS = (
    "hits", "misses", "puts", "duplicate_puts", "evictions", "demotions", "promotions",
    "corrupt_dropped", "lost", "expired", "deleted", "admission_rejected", "write_failures",
)  # fmt: skip
"""The store-wide event counts ``stats()`` reports."""


def index_stats(ix: StoreIndex) -> dict[str, float]:
    """Hits, misses, bytes, capacity, entries and pinned bytes of each tier (suffixed by its name),
    the :data:`COUNTERS`, and the pinned and resident entry counts (caller holds the store's lock)."""
    out: dict[str, float] = {}
    for i, tier in enumerate(ix.tiers):
        out[f"hits_{tier.name}"] = ix.hits[i]
        out[f"misses_{tier.name}"] = ix.misses[i]
        out[f"bytes_{tier.name}"] = ix.used[i]
        out[f"capacity_{tier.name}"] = tier.capacity_bytes
        out[f"entries_{tier.name}"] = len(ix.policies[i])
        out[f"pinned_bytes_{tier.name}"] = ix.pinned_bytes[i]
    for name in COUNTERS:
        out[name] = ix.count[name]
    out["pinned"] = ix.pinned_count
    out["entries"] = len(ix.entries)
    return out
