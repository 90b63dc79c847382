"""The policies an edge (or the simulator) can be configured with, by name."""

from __future__ import annotations

from typing import Any

from kdn.edge.eviction.adaptive import AdaptivePrefix
from kdn.edge.eviction.base import EvictionPolicy
from kdn.edge.eviction.lru import LRU
from kdn.edge.eviction.prefix import PrefixAware
from kdn.edge.eviction.s3fifo import S3FIFO
from kdn.edge.eviction.sieve import Sieve
from kdn.errors import InvalidInput

__all__ = ["POLICIES", "make_policy", "policy_class"]

POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRU, S3FIFO, Sieve, PrefixAware, AdaptivePrefix)}


def policy_class(name: str) -> type[EvictionPolicy]:
    """The policy registered as ``name``.

    Raises :class:`~kdn.errors.InvalidInput` for an unknown name; it is a ``ValueError``, so a
    pydantic validator can call this and have the message reported against its field.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidInput(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return cls


def make_policy(name: str, *, whole_chains: bool = True, **kw: Any) -> EvictionPolicy:
    """Build the policy registered as ``name`` with keyword options ``kw``, for a cache that holds
    whole prefix chains or only parts of them (see :meth:`EvictionPolicy.for_tier`).

    Raises :class:`~kdn.errors.InvalidInput` for an unknown name or options the policy does not take.
    """
    cls = policy_class(name)
    try:
        return cls.for_tier(whole_chains=whole_chains, **kw)
    except TypeError as exc:
        raise InvalidInput(f"bad options for eviction policy {name!r}: {exc}") from exc
