"""What an operator asks of an edge with the Hint RPC: pin / unpin / TTL / priority on keys or
documents, and scheduled prefetch. (The RPC's wire side is in ``kdn.edge.server``; the store
applies the hints, :mod:`kdn.edge.schedules` keeps the schedules.)

Key hints go straight to the store (they apply to *resident* entries; ``affected`` says how many).
A document is resolved to its chunk keys by the origin first. ``SCHEDULE_PREFETCH`` registers a
cron schedule ("M H DOM MON DOW", UTC) with :class:`kdn.edge.schedules.HintScheduler` under the named
action ``prefetch``; when it fires, the document (re-resolved each time, so a re-ingested document
is followed) or key list is offered to the prefetcher. Named schedules are persisted by the
scheduler as JSON beside the disk tier (``.hint-schedules.json``) and come back on restart. Tokens are never
written to disk: a schedule restored after a restart fetches with the edge's ``upstream_token``
(configure one when the origin requires auth). ``SET_TTL`` with ``ttl_s == 0`` clears the TTL.

Schedule ids are per tenant: the id a tenant chooses (or is given) is kept as ``tenant/id``, so two
tenants may use the same id, and no answer tells one tenant whether another holds an id. A
schedules file that cannot be read does not stop the edge: it is moved aside (``.bad`` suffix)
with a warning and the edge starts with no schedules, as with the retention file.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kdn.edge.clock import Clock, MonotonicClock
from kdn.edge.schedules import HintScheduler, schedules_file
from kdn.errors import ConfigError, InvalidInput, NotFound
from kdn.keys import ChunkKey, ModelFingerprint, Namespace, parse_fingerprint, parse_key
from kdn.wire.convert import HintAction, HintAsk

if TYPE_CHECKING:
    from kdn.edge.node import EdgeNode

log = logging.getLogger(__name__)

A = HintAction
PREFETCH_ACTION = "prefetch"
_SID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def scoped_id(tenant: str, schedule_id: str) -> str:
    """The scheduler's id of ``tenant``'s schedule ``schedule_id`` (tenant names hold no ``/``)."""
    if not _SID_RE.match(schedule_id):
        raise InvalidInput(f"schedule id must match {_SID_RE.pattern}, got {schedule_id!r}")
    return f"{tenant}/{schedule_id}"


def _open_scheduler(clock: Clock, path: Path | None, actions: Mapping[str, Any]) -> HintScheduler:
    try:
        return HintScheduler(clock, path=path, actions=actions)
    except ConfigError as exc:
        assert path is not None
        aside = path.with_name(path.name + ".bad")
        try:
            path.replace(aside)
            where = f"moved to {aside}"
        except OSError as move_exc:
            where = f"could not be moved aside ({move_exc}); schedules are kept in memory only"
        log.warning("ignoring the hint schedules file (%s; %s): the edge starts with no schedules", exc, where)
        return HintScheduler(clock, path=None if path.exists() and not aside.exists() else path, actions=actions)


class HintService:
    def __init__(self, node: "EdgeNode", *, disk_dir: str | None, clock: Clock | None = None) -> None:
        self._node = node
        self._clock = clock or MonotonicClock()
        self._tokens: dict[str, str | None] = {}  # in memory only
        self.scheduler = _open_scheduler(
            self._clock, schedules_file(disk_dir) if disk_dir else None, {PREFETCH_ACTION: self._fire}
        )
        self.fired = 0
        for info in self.scheduler.list():  # a file of an edge before per-tenant ids: scope them
            tenant = info.params.get("tenant", "")
            if "/" not in info.schedule_id and tenant and info.action == PREFETCH_ACTION:
                self.scheduler.add(scoped_id(tenant, info.schedule_id), info.cron, PREFETCH_ACTION, params=info.params)
                self.scheduler.cancel(info.schedule_id)

    async def _fire(self, params: Mapping[str, Any]) -> int:
        node = self._node
        ns = Namespace(params["tenant"], params.get("salt", ""))
        fp_hex = params.get("fingerprint", "")
        fp = parse_fingerprint(fp_hex) if fp_hex else ModelFingerprint(bytes(32))
        token = self._tokens.get(f"{ns.tenant}/{params.get('schedule_id', '')}")
        keys = await node.resolve_keys(
            [parse_key(k) for k in params.get("keys", ())], params.get("document", ""),
            fingerprint=fp, namespace=ns, token=token,
        )
        self.fired += 1
        return node.prefetch(keys, fingerprint=fp, namespace=ns, codec=params.get("codec", ""), token=token)

    async def run_due(self) -> int:
        """Expire TTL'd entries and run every schedule that is due; returns how many ran."""
        self._node.store.expire()
        results = await self.scheduler.run_due()
        return sum(1 for r in results.values() if r is None)

    def describe(self, tenants: frozenset[str] | None = None) -> list[dict[str, Any]]:
        """The schedules, each with the id its tenant knows it by; only ``tenants``' when given."""
        return [
            {"schedule_id": i.params.get("schedule_id", i.schedule_id), "cron": i.cron,
             "next_fire": i.next_fire.isoformat(), "runs": i.runs,
             "tenant": i.params.get("tenant", ""), "document": i.params.get("document", ""),
             "keys": len(i.params.get("keys", ()))}
            for i in self.scheduler.list()
            if tenants is None or i.params.get("tenant", "") in tenants
        ]

    async def _fetch_missing(
        self, keys: list[ChunkKey], fp: ModelFingerprint, ns: Namespace, token: str | None
    ) -> None:
        from kdn.edge.upstream import FetchSpec

        node = self._node
        missing = [k for k in keys if not node.store.contains(k, tenant=ns.tenant)]
        for start in range(0, len(missing), 8):  # a few at a time: the RPC has a deadline
            await asyncio.gather(
                *(node.fetch_bytes(FetchSpec(k, fp, ns), token=token) for k in missing[start : start + 8])
            )

    async def _emphasize(self, req: HintAsk, ns: Namespace, token: str | None) -> tuple[int, str]:
        """EMPHASIZE: the origin computes (or finds) the steered variant of ``req.document`` and
        this edge fetches it; returns (artifacts now held: chunks and tail pieces, variant id). The edge only stores keys."""
        if not req.document or not req.emphasis:
            raise InvalidInput("an emphasize hint needs a document and an emphasis")
        if not req.fingerprint:
            raise InvalidInput("an emphasize hint needs the model fingerprint")
        if self._node.origin is None:
            raise InvalidInput("this edge has no origin: a steered variant is computed by the origin")
        fp = parse_fingerprint(req.fingerprint)
        keys, variant = await self._node.origin.emphasize(req.document, req.emphasis, fingerprint=fp, namespace=ns,
                                                          token=token)
        await self._fetch_missing(keys, fp, ns, token)
        return sum(1 for k in keys if self._node.store.contains(k, tenant=ns.tenant)), variant

    # -- the RPC -------------------------------------------------------------------------------

    async def apply(
        self, req: HintAsk, ns: Namespace, token: str | None, keys: list[ChunkKey]
    ) -> tuple[int, str]:
        node = self._node
        store = node.store
        action = req.action
        if action == A.SCHEDULE_PREFETCH:
            if not keys and not req.document:
                raise InvalidInput("a scheduled prefetch needs keys or a document")
            fp_hex = parse_fingerprint(req.fingerprint).hex() if req.fingerprint else ""
            if req.document and not fp_hex:
                raise InvalidInput("a document schedule needs the model fingerprint")
            sid = req.schedule_id or secrets.token_hex(6)
            scoped = scoped_id(ns.tenant, sid)  # the tenant's own id namespace: nothing to squat or probe
            params = {"schedule_id": sid, "tenant": ns.tenant, "salt": ns.salt, "fingerprint": fp_hex,
                      "document": req.document, "keys": [bytes(k).hex() for k in keys]}
            self.scheduler.add(scoped, req.cron, PREFETCH_ACTION, params=params)  # InvalidInput names a bad field
            self._tokens[scoped] = token
            return 1, sid
        if action == A.CANCEL_SCHEDULE:
            scoped = scoped_id(ns.tenant, req.schedule_id)
            if self.scheduler.get(scoped) is None:
                raise NotFound(f"no schedule {req.schedule_id!r}")
            self.scheduler.cancel(scoped)
            self._tokens.pop(scoped, None)
            return 1, req.schedule_id
        if action == A.EMPHASIZE:
            return await self._emphasize(req, ns, token)
        if req.document and not keys:
            keys = await node.resolve_keys(
                keys, req.document, fingerprint=parse_fingerprint(req.fingerprint), namespace=ns, token=token
            )
        tenant = ns.tenant
        if action == A.PIN:
            if req.fingerprint:  # with the model named, pinning also fetches what is not held yet
                await self._fetch_missing(keys, parse_fingerprint(req.fingerprint), ns, token)
            return store.pin(keys, tenant=tenant), ""
        if action == A.UNPIN:
            return store.unpin(keys, tenant=tenant), ""
        if action == A.SET_TTL:
            if not math.isfinite(req.ttl_s) or req.ttl_s < 0:  # NaN would otherwise clear every TTL
                raise InvalidInput(f"ttl_s must be a finite number >= 0 (0 clears the TTL), got {req.ttl_s}")
            return store.set_ttl(keys, req.ttl_s if req.ttl_s > 0 else None, tenant=tenant), ""
        if action == A.SET_PRIORITY:
            return store.set_priority(keys, req.priority, tenant=tenant), ""
        raise InvalidInput(f"unknown hint action {action}")
