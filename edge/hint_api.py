"""The Hint RPC's logic: pin / unpin / TTL / priority on keys or documents, and scheduled prefetch.

Key hints go straight to the store (they apply to *resident* entries; ``affected`` says how many).
A document is resolved to its chunk keys by the origin first. ``SCHEDULE_PREFETCH`` registers a
cron schedule ("M H DOM MON DOW", UTC) with :class:`edge.hints.HintScheduler`; when it fires, the
document (re-resolved each time, so re-ingested documents are followed) or key list is offered to
the prefetcher. Schedules are persisted as JSON beside the disk tier (``schedules.json``) and
re-registered on restart. Tokens are never written to disk: a schedule restored after a restart
fetches with the edge's ``upstream_token`` (configure one when the origin requires auth).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.clock import Clock, MonotonicClock
from kdn.errors import InvalidInput, KdnError, NotFound
from kdn.keys import ChunkKey, ModelFingerprint, Namespace, parse_fingerprint, parse_key
from kdn.proto import kdn_pb2 as pb

if TYPE_CHECKING:
    from edge.node import EdgeNode

log = logging.getLogger(__name__)

A = pb.HintRequest
SCHEDULES_FILE = "schedules.json"


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What a scheduled prefetch fetches (JSON-able; no token)."""

    schedule_id: str
    cron: str
    tenant: str
    salt: str = ""
    fingerprint: str = ""  # hex
    document: str = ""
    keys: tuple[str, ...] = field(default_factory=tuple)  # hex
    codec: str = ""


class HintService:
    def __init__(self, node: "EdgeNode", *, disk_dir: str | None, clock: Clock | None = None) -> None:
        from edge.hints import HintScheduler

        self._node = node
        self._clock = clock or MonotonicClock()
        self._path = Path(disk_dir) / SCHEDULES_FILE if disk_dir else None
        self._specs: dict[str, ScheduleSpec] = {}
        self._tokens: dict[str, str | None] = {}  # in memory only
        self.scheduler = HintScheduler(self._clock)
        self.fired = 0
        self._load()

    # -- persistence ---------------------------------------------------------------------------

    def _load(self) -> None:
        if self._path is None or not self._path.exists():
            return
        try:
            raw = json.loads(self._path.read_text())
            specs = [ScheduleSpec(**{**d, "keys": tuple(d.get("keys", ()))}) for d in raw.get("schedules", [])]
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", self._path, exc)
            return
        for spec in specs:
            try:
                self._register(spec)
            except KdnError as exc:
                log.warning("dropping schedule %s: %s", spec.schedule_id, exc)

    def _save(self) -> None:
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".json.tmp")
        body = json.dumps({"schedules": [asdict(s) for s in self._specs.values()]}, indent=1, sort_keys=True)
        with open(tmp, "w") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self._path)

    # -- scheduling ----------------------------------------------------------------------------

    def _register(self, spec: ScheduleSpec) -> None:
        self.scheduler.add(spec.schedule_id, spec.cron, lambda s=spec: self._fire(s))
        self._specs[spec.schedule_id] = spec

    async def _fire(self, spec: ScheduleSpec) -> int:
        node = self._node
        ns = Namespace(spec.tenant, spec.salt)
        fp = parse_fingerprint(spec.fingerprint) if spec.fingerprint else ModelFingerprint(bytes(32))
        token = self._tokens.get(spec.schedule_id)
        keys = await node.resolve_keys(
            [parse_key(k) for k in spec.keys], spec.document, fingerprint=fp, namespace=ns, token=token
        )
        self.fired += 1
        return node.prefetch(keys, fingerprint=fp, namespace=ns, codec=spec.codec, token=token)

    async def run_due(self) -> int:
        """Run every schedule that is due now, and expire TTL'd entries; returns schedules run."""
        self._node.store.expire()
        ran = 0
        for action in self.scheduler.due(self._clock.now()):
            try:
                result = action()
                if hasattr(result, "__await__"):
                    await result
                ran += 1
            except KdnError as exc:
                log.warning("%s: scheduled prefetch failed: %s", self._node.node_id, exc)
        return ran

    def describe(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self._specs.values()]

    # -- the RPC -------------------------------------------------------------------------------

    async def apply(
        self, req: pb.HintRequest, ns: Namespace, token: str | None, keys: list[ChunkKey]
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
            spec = ScheduleSpec(sid, req.cron, ns.tenant, ns.salt, fp_hex, req.document, tuple(bytes(k).hex() for k in keys))
            if sid in self._specs:
                self.scheduler.cancel(sid)
            self._register(spec)  # validates the cron expression (InvalidInput names the field)
            self._tokens[sid] = token
            self._save()
            return 1, sid
        if action == A.CANCEL_SCHEDULE:
            spec = self._specs.get(req.schedule_id)
            if spec is None or spec.tenant != ns.tenant:
                raise NotFound(f"no schedule {req.schedule_id!r}")
            self.scheduler.cancel(req.schedule_id)
            del self._specs[req.schedule_id]
            self._tokens.pop(req.schedule_id, None)
            self._save()
            return 1, req.schedule_id
        if req.document and not keys:
            keys = await node.resolve_keys(
                keys, req.document, fingerprint=parse_fingerprint(req.fingerprint), namespace=ns, token=token
            )
        tenant = ns.tenant
        if action == A.PIN:
            return store.pin(keys, tenant=tenant), ""
        if action == A.UNPIN:
            return store.unpin(keys, tenant=tenant), ""
        if action == A.SET_TTL:
            if req.ttl_s < 0:
                raise InvalidInput(f"ttl_s must be >= 0, got {req.ttl_s}")
            return store.set_ttl(keys, req.ttl_s if req.ttl_s > 0 else None, tenant=tenant), ""
        if action == A.SET_PRIORITY:
            return store.set_priority(keys, req.priority, tenant=tenant), ""
        raise InvalidInput(f"unknown hint action {action}")
