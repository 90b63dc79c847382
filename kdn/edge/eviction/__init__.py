"""Eviction and admission policies for the edge's cache tiers, behind one small interface.

One policy per file, all behind :class:`~kdn.edge.eviction.base.EvictionPolicy` (whose docstring
states the contract every policy keeps). Registry :data:`POLICIES`, factory :func:`make_policy`:

``lru``     the baseline (:mod:`.lru`).
``s3fifo``  S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO with reinsertion,
            and a ghost FIFO of recently evicted keys (:mod:`.s3fifo`).
``sieve``   SIEVE (Zhang et al., NSDI'24): one FIFO, a visited bit and a moving hand (:mod:`.sieve`).
``prefix``  prefix-aware, for chained KV chunks (:mod:`.prefix`): evicts only leaves of the
            cached prefix forest, by frequency with dynamic aging, so a chunk is never dropped while
            chunks that depend on it stay, and shared roots survive.
``adaptive`` ``prefix``'s leaves ordered by recency (LRU that never breaks a chain) or by decayed
            frequency, whichever miniature simulations of both on 1 in 4 keys say wins, decided
            once per two reuse distances (:mod:`.adaptive`); the default of edges and scenarios.

A cache that holds only part of each chain says so through ``make_policy(name, whole_chains=False)``
(:meth:`~kdn.edge.eviction.base.EvictionPolicy.for_tier`); no caller tests a policy's name.

:class:`Belady` (the offline optimum, which needs the future access sequence) is exported but not
registered, since no online cache can construct it. The byte-budget cache the simulator and the
eviction benchmark drive these policies with is :class:`kdn.simulator.cache.BoundedCache`.
"""

from kdn.edge.eviction.adaptive import AdaptivePrefix
from kdn.edge.eviction.base import EvictionPolicy, Key, SkipFn
from kdn.edge.eviction.belady import Belady
from kdn.edge.eviction.lru import LRU
from kdn.edge.eviction.prefix import PrefixAware
from kdn.edge.eviction.registry import POLICIES, make_policy, policy_class
from kdn.edge.eviction.s3fifo import S3FIFO
from kdn.edge.eviction.sieve import Sieve

__all__ = [
    "POLICIES",
    "AdaptivePrefix",
    "Belady",
    "EvictionPolicy",
    "Key",
    "LRU",
    "PrefixAware",
    "S3FIFO",
    "SkipFn",
    "Sieve",
    "make_policy",
    "policy_class",
]
