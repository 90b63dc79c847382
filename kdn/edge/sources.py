"""Where an edge's misses go: the other live owners, then the origin (:class:`Sources`).

The order, for one key (the node runs it once per key per burst, under its ``SingleFlight``):

- the other live owners are asked in bounded-load order (:meth:`Overlay.balanced_peers`): the
  preferred owner first unless this node already sent it more than ``bounded_load_c`` times its
  share of requests, so a hot key's reads spread over its replicas;
- if this node is one of the key's owners: ask the other live owners for their local copy, then
  the origin;
- otherwise: ask the first live owner to fetch it (it goes to the origin and keeps a copy, so the
  whole overlay fetches a key from the origin once), then the next owners' local copies, then the
  origin directly.

A peer that fails and then fails a health check is marked down (the overlay skips it until a
backoff passes); bytes from any source that this edge cannot use for any reason (checksum, size,
a codec it does not know, hostile codec metadata, a newer version, another key) are dropped and
the next source is tried. What came from upstream is verified (header key/fingerprint, a decode
of every section when ``decode_check`` is on, then every checksum by ``TieredStore.put``) before
it is stored or served.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from kdn.artifact import PB_TO_DTYPE, ArtifactReader, read_header
from kdn.edge.config import EdgeConfig
from kdn.edge.metrics import EdgeMetrics
from kdn.edge.overlay import Member, Overlay
from kdn.edge.store import TieredStore
from kdn.edge.tasks import cancel_and_wait
from kdn.edge.upstream import FetchSpec, Upstream
from kdn.errors import (
    ArtifactCorrupt,
    ArtifactError,
    FingerprintMismatch,
    InvalidInput,
    KdnError,
    MessageTooLarge,
    NotFound,
    StorageFull,
    Unavailable,
)
from kdn.keys import ChunkKey, ModelFingerprint, Namespace

log = logging.getLogger(__name__)
DOCUMENT_TOKENS = 8192  # a long document: a full window of the built-in trained model
FEW_DOCUMENTS = 4  # the memory tier should hold at least this many of them

_DECODE_PIECE = 1 << 20  # bytes fed to the decode check at a time
_MAX_LOOKUP_HOPS = 8  # peer Lookups per chain before the rest is asked of the origin


def _drop(section: object) -> None:
    return None


def check_decodes(data: bytes | bytearray | memoryview, fingerprint: bytes | None = None) -> None:
    """Decode every section of ``data`` (one at a time, then dropped): checksums are unkeyed, so a
    checksum-valid container may still not decode, and the edge must not keep what no reader can
    use (the first writer of a key wins, so a poisoned entry would shadow every honest Put after
    it). Raises a KdnError; a codec's own exception on hostile bytes becomes ``ArtifactCorrupt``."""
    # sections borrowed, not kept: the raw codec's check is its length (no copy), the others decode
    reader = ArtifactReader(expect_fingerprint=fingerprint, sink=_drop)  # type: ignore[arg-type]
    view = memoryview(data)
    try:
        for at in range(0, len(view), _DECODE_PIECE):  # piecewise: a few sections' KV alive at once
            reader.feed(view[at : at + _DECODE_PIECE])
        reader.finish()
    except KdnError:
        raise
    except Exception as exc:  # noqa: BLE001 - a codec tripping over crafted bytes
        raise ArtifactCorrupt(f"artifact does not decode: {type(exc).__name__}: {str(exc)[:200]}") from exc


@dataclass(frozen=True, slots=True)
class Located:
    """Where one available key of a Lookup lives."""

    tier: str  # "memory" | "disk" | "peer" | "origin"
    node_id: str
    address: str


class Sources:
    """One node's upstreams: a channel per peer (made on first use, kept while its address holds)
    and the origin; the miss plan over them (module docstring) and the check of what they send."""

    def __init__(
        self, config: EdgeConfig, *, store: TieredStore, overlay: Overlay, connect: Callable[[Member], Upstream],
        origin: Upstream | None, metrics: EdgeMetrics,
    ) -> None:
        self.config = config
        self.store = store
        self.overlay = overlay
        self.origin = origin
        self.metrics = metrics
        self.origin_available: bool | None = None
        self._connect = connect
        self._peers: dict[str, Upstream] = {}
        self._closing: list[asyncio.Task[None]] = []
        self._models_seen: set[bytes] = set()

    @property
    def node_id(self) -> str:
        return self.config.node_id

    def peer(self, member: Member) -> Upstream:
        """The upstream for ``member`` (made on first use, kept while its address holds)."""
        up = self._peers.get(member.node_id)
        if up is None or getattr(up, "address", member.address) != member.address:
            if up is not None:  # the member moved (restarted elsewhere): drop the old channel
                self._closing.append(asyncio.ensure_future(up.close()))
            up = self._connect(member)
            self._peers[member.node_id] = up
        return up

    async def peer_failed(self, member: Member, up: Upstream, exc: KdnError) -> None:
        if isinstance(exc, Unavailable) and not await up.healthy():
            log.info("%s: peer %s marked down: %s", self.node_id, member.node_id, exc)
            self.overlay.mark_down(member.node_id)

    async def close(self) -> None:
        await cancel_and_wait(self._closing)
        self._closing = []
        for up in list(self._peers.values()) + ([self.origin] if self.origin else []):
            try:
                await up.close()
            except Exception:  # closing is best effort
                pass
        self._peers.clear()

    # -- the miss path -------------------------------------------------------------------------

    async def fetch(self, spec: FetchSpec, token: str | None, forwarded: bool) -> tuple[bytes, str]:
        """Owners, then the origin (module docstring): verified bytes, and ``"peer"`` or ``"origin"``."""
        owners = self.overlay.owners(spec.key)
        peers = self.overlay.balanced_peers(spec.key, self.config.bounded_load_c)  # a hot key spreads
        # A non-owner asks the first owner that answers to fetch on its behalf (so the owner keeps
        # a copy and the overlay goes to the origin once); owners only ask each other's copies.
        forward = not forwarded and bool(peers) and len(peers) == len(owners)
        plan: list[Member | None] = [*peers, None]
        errors: list[str] = []
        unavailable = False
        for member in plan:
            sub = spec.local() if member is not None and not forward else replace(spec, local_only=False)
            if member is None:
                if self.origin is None:
                    errors.append("no origin configured")
                    break
                up: Upstream = self.origin
                target = "origin"
            else:
                up = self.peer(member)
                target = "peer"
                self.overlay.sent(member.node_id)
            try:
                data = await up.fetch(sub, token=self.config.upstream_token or token)
            except NotFound as exc:
                self.metrics.upstream.labels(target, "not_found").inc()
                errors.append(f"{up.name}: not found")
                if member is None:  # the origin is authoritative
                    self.origin_available = True
                    raise NotFound(f"{bytes(spec.key).hex()[:16]} not found (asked {len(errors)} sources)") from exc
                forward = False  # an owner answered: the others are asked for their own copies only
                continue
            except (Unavailable, MessageTooLarge, ArtifactError, InvalidInput) as exc:
                self.metrics.upstream.labels(target, type(exc).__name__).inc()
                errors.append(f"{up.name}: {exc}")
                unavailable = True
                if member is None:
                    self.origin_available = not isinstance(exc, Unavailable)
                else:
                    await self.peer_failed(member, up, exc)
                continue
            except KdnError as exc:
                self.metrics.upstream.labels(target, type(exc).__name__).inc()
                if member is not None:
                    # whatever a peer's answer was wrong with, the next source may do better (a peer
                    # of another version, a lossy copy where lossless is asked): try it
                    errors.append(f"{up.name}: {type(exc).__name__}: {exc}")
                    unavailable = True
                    continue
                # the origin's FingerprintMismatch, LossyRefused, Unauthorized: the answer itself
                self.origin_available = True
                raise
            if member is None:
                self.origin_available = True
            else:
                self.overlay.mark_up(member.node_id)
                forward = False
            try:
                await self.admit(data, spec)
            except KdnError as exc:
                # any project error about the bytes (checksum, size, unknown codec, hostile codec
                # metadata, newer version, wrong key or model): drop them and try the next source
                self.metrics.corrupt.inc()
                self.metrics.upstream.labels(target, "corrupt").inc()
                errors.append(f"{up.name}: {exc}")
                log.warning("%s: dropped bad artifact from %s: %s: %s", self.node_id, up.name, type(exc).__name__, exc)
                unavailable = True
                continue
            self.metrics.upstream.labels(target, "ok").inc()
            self.metrics.bytes_in.labels(target).inc(len(data))
            return data, target
        if unavailable:
            raise Unavailable(f"{bytes(spec.key).hex()[:16]}: no source could serve it ({'; '.join(errors)})")
        raise NotFound(f"{bytes(spec.key).hex()[:16]} not found ({'; '.join(errors)})")

    def note_model(self, header: Any) -> None:
        """Once per model fingerprint: warn when the memory tier holds fewer than
        :data:`FEW_DOCUMENTS` documents of :data:`DOCUMENT_TOKENS` tokens of that model's KV
        (most hits would then come from disk or upstream)."""
        fp = bytes(header.fingerprint)
        if fp in self._models_seen:
            return
        self._models_seen.add(fp)
        per_token = 2 * header.num_layers * header.num_kv_heads * header.head_dim * PB_TO_DTYPE[header.dtype].itemsize
        tokens = self.config.memory_bytes // max(1, per_token)
        if tokens < FEW_DOCUMENTS * DOCUMENT_TOKENS:
            log.warning("%s: the memory tier (%.2f GiB) holds about %d tokens of KV of model %s… (%d KB per token): "
                        "fewer than %d documents of %d tokens; raise --memory-bytes (memory_bytes) to keep more of "
                        "them in memory", self.node_id, self.config.memory_bytes / 2**30, tokens, fp.hex()[:16],
                        per_token // 1000, FEW_DOCUMENTS, DOCUMENT_TOKENS)

    async def admit(self, data: bytes, spec: FetchSpec) -> None:
        """Verify bytes from upstream and keep them. Raises on bad bytes; a full store only logs."""
        if len(data) > self.config.max_artifact_bytes:
            raise MessageTooLarge(f"artifact of {len(data)} bytes exceeds {self.config.max_artifact_bytes}")
        header = read_header(memoryview(data))
        if header.key != bytes(spec.key):
            raise FingerprintMismatch(f"upstream answered {header.key.hex()[:16]} for {bytes(spec.key).hex()[:16]}")
        self.note_model(header)
        if self.config.decode_check:
            await asyncio.to_thread(check_decodes, data, bytes(spec.fingerprint))
        try:
            await asyncio.to_thread(
                self.store.put, data, tenant=spec.namespace.tenant, expect_fingerprint=bytes(spec.fingerprint)
            )
        except StorageFull as exc:
            # verification happened before the budget check; serve it without keeping it
            log.info("%s: not caching %s: %s", self.node_id, bytes(spec.key).hex()[:16], exc)

    # -- lookups and documents -----------------------------------------------------------------

    async def lookup(
        self, keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None,
    ) -> list[Located]:
        """Where each of the leading available ``keys`` (none of them held here) is: on an owner,
        or at the origin."""
        tok = self.config.upstream_token or token
        found: list[Located] = []
        i = 0
        hops = 0
        while i < len(keys) and hops < _MAX_LOOKUP_HOPS:
            hops += 1
            peers = self.overlay.balanced_peers(keys[i], self.config.bounded_load_c)
            n = 0
            for member in peers:
                up = self.peer(member)
                self.overlay.sent(member.node_id)
                try:
                    n = await up.lookup(keys[i:], fingerprint=fingerprint, namespace=namespace, token=tok)
                except KdnError as exc:
                    await self.peer_failed(member, up, exc)
                    continue
                if n:
                    found += [Located("peer", member.node_id, member.address)] * n
                    break
            if not n:
                break
            i += n
        if i < len(keys) and self.origin is not None:
            try:
                n = await self.origin.lookup(keys[i:], fingerprint=fingerprint, namespace=namespace, token=tok)
                self.origin_available = True
            except Unavailable:
                self.origin_available = False
                n = 0
            except KdnError:
                n = 0
            found += [Located("origin", "origin", "")] * n
        return found

    async def document(
        self, document: str, *, fingerprint: ModelFingerprint, namespace: Namespace, token: str | None,
    ) -> list[ChunkKey]:
        """The chunk keys of ``document``, as the origin resolves them."""
        if self.origin is None:
            raise Unavailable("documents are resolved by the origin, and none is configured")
        try:
            out = await self.origin.document(
                document, fingerprint=fingerprint, namespace=namespace, token=self.config.upstream_token or token
            )
        except Unavailable:
            self.origin_available = False
            raise
        self.origin_available = True
        if len(out) > self.config.max_chain_keys:
            raise MessageTooLarge(f"document {document!r} has {len(out)} chunks (limit {self.config.max_chain_keys})")
        return out

    async def probe_origin(self) -> bool | None:
        if self.origin is None:
            return None
        self.origin_available = await self.origin.healthy()
        return self.origin_available
