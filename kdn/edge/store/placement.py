"""Where bytes go: placement of new entries, eviction and demotion, promotion, and staged writes.

Exclusive tiering: an entry lives in exactly one tier. A new entry goes to the first tier that
admits it (its policy's ``admit``) and can make room; a tier over budget demotes its policy's
victim to the next tier, and the last tier drops it. Victims come from the lowest priority class
present, passing over pinned entries and entries whose write is still in flight.

Writes to a slow tier are *staged*: under the store's lock the entry is indexed and a
:class:`StagedWrite` recorded (readers are served its bytes); the calling thread then performs the
write with :meth:`Placement.run_writes` after releasing the lock. At most one write per entry is in
flight. A read of a slow tier (:meth:`Placement.read_slow`) reads and verifies outside the lock, then
accounts for the hit and promotes the entry under it. Every other method runs under the store's lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kdn.artifact import verify_artifact
from kdn.edge.store.index import Entry, StoreIndex
from kdn.edge.store.tiers import EntryId, EntryMeta
from kdn.errors import KdnError, StorageFull

__all__ = ["MOVED", "Placement", "StagedWrite"]

MOVED = object()
"""What :meth:`Placement.read_slow` returns when the entry moved to another tier during the read."""


@dataclass(slots=True, eq=False)
class StagedWrite:
    """A staged write of ``data`` into slow tier ``tier`` for ``entry``."""

    eid: EntryId
    entry: Entry
    data: bytes
    tier: int
    own: bool  # the artifact of the put that staged it: its failure is that caller's error
    done: threading.Event = field(default_factory=threading.Event)


class Placement:
    """Moves entries between the tiers of one store, keeping :class:`StoreIndex` in step."""

    def __init__(self, index: StoreIndex, lock: threading.Lock) -> None:
        self._ix = index
        self._lock = lock
        self.staging: dict[EntryId, StagedWrite] = {}

    def place(self, i: int, eid: EntryId, entry: Entry, data: bytes, writes: list[StagedWrite], own: bool = False) -> None:
        """Put ``entry`` into tier ``i`` (room already made): memory now, slow tiers staged."""
        self._ix.attach(i, eid, entry)
        tier = self._ix.tiers[i]
        if tier.slow:
            w = StagedWrite(eid, entry, data, i, own)
            self.staging[eid] = w
            writes.append(w)
        else:
            tier.put(entry.meta, data)

    def place_new(self, eid: EntryId, entry: Entry, data: bytes, writes: list[StagedWrite]) -> bool:
        """Place a new entry in the first tier that admits it and has room (see ``TieredStore.put``).

        A fast tier takes it first and then evicts down to budget, so the policy judges the new
        entry beside the old ones (the new one may be demoted at once, as a bounded cache would
        drop it); a slow tier makes room first, since the new bytes are only staged.
        """
        ix = self._ix
        size, parent = entry.meta.size, entry.meta.parent_eid
        no_room: list[str] = []
        for i, tier in enumerate(ix.tiers):
            if not ix.fits(i, size):
                no_room.append(f"{tier.name}: {size} B > {tier.capacity_bytes - ix.pinned_bytes[i]} B unpinned budget")
                continue
            if not ix.policies[i].admit(eid, size, parent):
                continue
            if tier.slow:
                if not self.make_room(i, size, writes):
                    no_room.append(f"{tier.name}: could not make room")
                    continue
                ix.remember(eid, entry)
                self.place(i, eid, entry, data, writes, own=True)
            else:
                ix.remember(eid, entry)
                self.place(i, eid, entry, data, writes)
                if not self.shrink(i, writes) and ix.entries.get(eid) is entry and entry.tier == i:
                    # Nothing else evictable (cannot happen with a policy that keeps its contract,
                    # since fits() counted the pins): take it back out and try the next tier.
                    ix.detach(i, eid, entry)
                    tier.delete(eid)
                    ix.forget(eid, entry)
                    no_room.append(f"{tier.name}: could not make room")
                    continue
            ix.count["puts"] += 1
            return True
        if no_room:
            raise StorageFull(f"no tier can take {size} bytes ({'; '.join(no_room)})")
        ix.count["admission_rejected"] += 1
        return False

    def make_room(self, i: int, size: int, writes: list[StagedWrite]) -> bool:
        """Evict from tier ``i`` until ``size`` more bytes fit; False if it cannot."""
        ix = self._ix
        if not ix.fits(i, size):
            return False
        cap = ix.tiers[i].capacity_bytes
        while ix.used[i] + size > cap:
            victim = self.victim(i)
            if victim is None:
                return False
            self.evict(i, victim, writes)
        return True

    def shrink(self, i: int, writes: list[StagedWrite]) -> bool:
        """Evict from tier ``i`` until it is within budget; False if it cannot."""
        return self.make_room(i, 0, writes)

    def victim(self, i: int) -> EntryId | None:
        ix = self._ix
        policy = ix.policies[i]
        classes = sorted(ix.prio[i])
        entries, staging = ix.entries, self.staging
        if len(classes) <= 1 and not staging and not ix.pinned_bytes[i]:
            return policy.victim()
        for level in classes:

            def skip(eid: EntryId, level: int = level) -> bool:
                e = entries[eid]
                return e.pinned or e.priority > level or eid in staging

            victim = policy.victim(skip)
            if victim is not None:
                return victim
        return None

    def evict(self, i: int, eid: EntryId, writes: list[StagedWrite]) -> None:
        """Move ``eid`` out of tier ``i``: demote it to tier ``i + 1`` if that can make room, else drop."""
        ix = self._ix
        entry = ix.entries[eid]
        size = entry.meta.size
        nxt = i + 1
        data = None
        if nxt < len(ix.tiers) and ix.fits(nxt, size):
            data = ix.tiers[i].get(eid)
        ix.detach(i, eid, entry)
        ix.tiers[i].delete(eid)
        if data is not None and self.make_room(nxt, size, writes):
            self.place(nxt, eid, entry, data, writes)
            ix.count["demotions"] += 1
        else:
            ix.forget(eid, entry)
            ix.count["evictions"] += 1

    def flush_down(self, writes: list[StagedWrite]) -> int:
        """Move every entry of a tier that does not survive a restart (memory) down to a tier
        below it that does (disk), coldest first; for a graceful close. An entry that finds no
        room below is dropped, as eviction would. Returns how many entries were moved."""
        ix = self._ix
        moved = 0
        for i, tier in enumerate(ix.tiers):
            if tier.durable or not any(t.durable for t in ix.tiers[i + 1 :]):
                continue
            while True:
                eid = self.victim(i)
                if eid is None:  # pinned or staged entries are never victims: take them too
                    eid = next((e for e, entry in ix.entries.items() if entry.tier == i and e not in self.staging), None)
                if eid is None:
                    break
                before = ix.count["demotions"]
                self.evict(i, eid, writes)
                moved += ix.count["demotions"] - before
        return moved

    def drop(self, eid: EntryId, entry: Entry) -> None:
        """Remove a resident entry for good (delete, expiry, corruption)."""
        ix = self._ix
        ix.forget(eid, entry)
        ix.detach(entry.tier, eid, entry)
        if eid not in self.staging:  # else the writer sees it gone and removes the blob
            try:
                ix.tiers[entry.tier].delete(eid)
            except OSError:
                pass

    def promote(self, eid: EntryId, entry: Entry, data: bytes, writes: list[StagedWrite]) -> None:
        ix = self._ix
        size, src = entry.meta.size, entry.tier
        if not ix.fits(0, size) or not ix.policies[0].admit(eid, size, entry.meta.parent_eid):
            return
        ix.detach(src, eid, entry)
        if self.make_room(0, size, writes):
            ix.tiers[src].delete(eid)
            self.place(0, eid, entry, data, writes)
            ix.count["promotions"] += 1
        else:
            ix.attach(src, eid, entry)
            self.shrink(src, writes)  # demotions may have filled it meanwhile

    def read_slow(self, eid: EntryId, entry: Entry, i: int, promote: bool) -> object:
        """Read and verify tier ``i``'s blob of ``entry`` (caller does NOT hold the lock); then account
        for it (and promote it) under the lock. The bytes and the tier's name, None, or :data:`MOVED`.

        A durable tier's bytes must pass every checksum *and* describe the entry the index holds
        (key, model fingerprint, parent, codec, lossiness, size...): a valid container of another
        model or codec put in the blob's place is dropped like a corrupt one, never served or
        promoted under the entry's metadata."""
        ix = self._ix
        tier = ix.tiers[i]
        try:
            data = tier.get(eid)
        except OSError:
            data = None
        ok = False
        if data is not None:
            try:
                if tier.durable:
                    header = verify_artifact(data, expect_key=eid.key)
                    ok = EntryMeta.from_header(header, tenant=eid.tenant, size=len(data)) == entry.meta
                else:
                    ok = True
            except KdnError:
                ok = False
        writes: list[StagedWrite] = []
        try:
            with self._lock:
                current = ix.entries.get(eid)
                same = current is entry and entry.tier == i and eid not in self.staging
                if not ok:
                    if same:
                        self.drop(eid, entry)
                        ix.count["corrupt_dropped" if data is not None else "lost"] += 1
                    elif current is not None:
                        return MOVED
                    ix.record_miss()
                    return None
                ix.record_hit(i)
                if same:
                    ix.policies[i].touch(eid)
                    if promote and i > 0:
                        self.promote(eid, entry, data, writes)  # type: ignore[arg-type]
                return data, tier.name
        finally:
            self.run_writes(writes)

    def run_writes(self, writes: list[StagedWrite]) -> BaseException | None:
        """Perform staged writes (caller does NOT hold the lock). Returns the own write's error."""
        ix = self._ix
        own_error: BaseException | None = None
        for w in writes:
            tier = ix.tiers[w.tier]
            error: BaseException | None = None
            try:
                tier.put(w.entry.meta, w.data)
            except (OSError, KdnError) as exc:
                error = exc
            with self._lock:
                if self.staging.get(w.eid) is w:
                    del self.staging[w.eid]
                current = ix.entries.get(w.eid)
                if error is None:
                    if current is not w.entry:  # deleted or expired while being written
                        try:
                            tier.delete(w.eid)
                        except OSError:
                            pass
                else:
                    ix.count["write_failures"] += 1
                    if current is w.entry:
                        ix.forget(w.eid, w.entry)
                        ix.detach(w.tier, w.eid, w.entry)
                        if not w.own:
                            ix.count["evictions"] += 1
            w.done.set()
            if error is not None and w.own:
                own_error = error
        return own_error
