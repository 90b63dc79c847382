"""The edge's tiered store: memory over disk, byte budgets, eviction, pins, TTLs and priorities.

An entry is one verified artifact owned by one tenant (:class:`~kdn.edge.store.tiers.EntryId`) and lives in
exactly one tier at a time (exclusive tiering):

* **put** verifies every checksum first (:func:`kdn.artifact.verify_artifact`; a corrupt artifact
  or one for another model raises and nothing is stored), then places the entry in the highest
  tier that admits it (the tier's policy :meth:`~kdn.edge.eviction.EvictionPolicy.admit`) and can make
  room for it. A tier that is over budget *demotes* its policy's victim to the next tier
  (memory -> disk), and the last tier drops it. An artifact bigger than a tier's budget skips that
  tier; when no tier can make room (everything pinned, or bigger than every budget) the put raises
  :class:`~kdn.errors.StorageFull` and nothing already stored changes.
* **get** serves from whichever tier holds the entry. Bytes from a ``durable`` tier (disk) are
  verified again on every read; a corrupt or vanished blob is dropped, counted
  (``corrupt_dropped``/``lost``) and reported as a miss, so the caller fetches it again. A disk hit
  is promoted to the top tier.
* **Tenants.** Entries are keyed by *(tenant, key)*: a tenant asking for another tenant's key gets
  exactly what it gets for an absent key (None, a miss), and cannot overwrite it.

Operator hints (all idempotent, all return how many *resident* entries they applied to):

* **pin** — a pinned entry is never evicted or demoted (it stays in its tier until unpinned,
  deleted or its TTL runs out). Pinned bytes count against the budget; a put that finds the top
  tier full of pins goes to the next tier.
* **TTL** — ``set_ttl(keys, seconds)`` drops the entries that long from now, on the monotonic
  clock; expiry is checked lazily on every read and in bulk by :meth:`TieredStore.expire`. A TTL
  wins over a pin (both are explicit operator intent; "pin until tonight" is pin + TTL).
* **priority** — an integer, default 0. Eviction in a tier takes its policy's victim among the
  lowest-priority class present; a higher class is touched only when every lower-class entry of
  the tier is pinned (or being written). Within a class the policy's order rules. A newcomer is
  judged with the residents, so a priority-0 put into a memory tier full of higher-priority
  entries goes straight down to disk. Keep the number of classes small (each costs a victim scan).

**Stop and restart.** A graceful close (:meth:`TieredStore.close`: the edge's SIGTERM/SIGINT
path) moves every memory-tier entry down to the disk tier, coldest first, as demotion would (an
entry that finds no room on disk is dropped), so a restart brings back every acknowledged entry
the disk budget holds. A SIGKILL (or a crash, or a power cut) skips that: memory-tier entries are
lost, and only what was already on disk comes back (every acknowledged Put that landed on disk
does: 0 lost over 8 SIGKILLs under load in the issue-19 probes). A store without a disk tier
keeps nothing across a restart.

Hints are saved (atomically, as JSON: :data:`~kdn.edge.store.retention.RETENTION_FILE`) in the state directory of the first tier
that has one — the disk tier's root — whenever they change, and re-applied on restart to the
entries the disk brought back; a TTL is saved as a wall-clock deadline, so an entry whose TTL ran
out while the edge was down is dropped on start. Hints of memory-only entries die with them.

Concurrency: every method is thread-safe behind one lock, and no big disk I/O happens under it —
reads of disk blobs and their verification run outside; writes to a disk tier (a put that lands
on disk, or a demotion) are *staged*: the entry is indexed and readable from the staged bytes at
once, and the calling thread writes the blob after releasing the lock. At most one write per
entry is in flight; a staged entry is neither evicted nor promoted until its write is done.
Unlinks (small) do happen under the lock.

Counters in :meth:`TieredStore.stats`: ``hits_<tier>``/``misses_<tier>`` (a disk hit is a memory
miss), ``bytes_<tier>``, ``capacity_<tier>``, ``entries_<tier>``, ``pinned_bytes_<tier>``, and
``hits``, ``misses``, ``puts``, ``duplicate_puts``, ``evictions`` (dropped to make room),
``demotions``, ``promotions``, ``corrupt_dropped``, ``lost`` (blob vanished under us),
``expired``, ``deleted``, ``admission_rejected``, ``write_failures``, ``pinned`` (entries),
``entries``.

Where each part lives (one idea per file):

* :mod:`.tiers` — what an entry is (``EntryId``, ``EntryMeta``) and the tier interface;
  :mod:`.memory` and :mod:`.disk` — the two tiers;
* :mod:`.index` — the index and its per-tier accounting; :mod:`.expiry` — the TTL deadlines;
* :mod:`.placement` — placement, eviction/demotion, promotion and staged writes;
* :mod:`.retention` — hints saved across restarts;
* :mod:`.tiered` — :class:`TieredStore`, the lock and the public API;
* :mod:`.build` — :func:`build_store`, the store an ``EdgeConfig`` describes.
"""

from kdn.edge.store.build import build_store
from kdn.edge.store.disk import DiskTier
from kdn.edge.store.index import EntryState
from kdn.edge.store.memory import MemoryTier
from kdn.edge.store.retention import RETENTION_FILE
from kdn.edge.store.tiered import PolicyFactory, TieredStore
from kdn.edge.store.tiers import EntryId, EntryMeta, StorageTier

__all__ = [
    "RETENTION_FILE",
    "DiskTier",
    "EntryId",
    "EntryMeta",
    "EntryState",
    "MemoryTier",
    "PolicyFactory",
    "StorageTier",
    "TieredStore",
    "build_store",
]
