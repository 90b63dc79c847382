"""The one factory of the production store: the tiers an :class:`~kdn.edge.config.EdgeConfig` describes."""

from __future__ import annotations

from kdn.edge.clock import Clock
from kdn.edge.config import EdgeConfig
from kdn.edge.store.disk import DiskTier
from kdn.edge.store.memory import MemoryTier
from kdn.edge.store.tiered import TieredStore
from kdn.edge.store.tiers import StorageTier

__all__ = ["build_store"]


def build_store(config: EdgeConfig, *, clock: Clock | None = None) -> TieredStore:
    """A memory tier of ``memory_bytes``, then a disk tier under ``disk_dir`` if it is set
    (``disk_bytes``, ``disk_fsync``, ``disk_verify_on_open``), evicting by ``policy``."""
    tiers: list[StorageTier] = [MemoryTier(config.memory_bytes)]
    if config.disk_dir:
        tiers.append(
            DiskTier(
                config.disk_dir, config.disk_bytes, fsync=config.disk_fsync, verify_on_open=config.disk_verify_on_open
            )
        )
    return TieredStore(tiers, policy=config.policy, clock=clock)
