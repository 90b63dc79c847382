"""The one place protobuf messages and KDN's types meet: keys, fingerprints, namespaces, requests.

Clients build every request here and servicers parse every request here, so a field means the
same thing on both sides of each hop (host → edge, edge → peer edge, edge → origin, admin → edge).

Rules, stated once:

- **Keys and fingerprints** are 32 raw bytes on the wire; anything else is ``InvalidInput``
  (:func:`kdn.keys.parse_key`). A list of keys longer than the receiver's limit is
  ``MessageTooLarge`` *before* any key is parsed.
- **Namespaces**: every request names its tenant. An empty tenant is not a wildcard and not a
  default: it fails :class:`kdn.keys.Namespace`'s validation (``InvalidInput``), at the edge and
  at the origin alike — before the token is checked, so auth never sees an unnamed tenant. Every
  KDN client always names one.
- **Put** streams a header first, then data; the declared size bounds what is accepted.

Nothing here does I/O or touches gRPC itself: the functions are pure and cheap, and the Fetch
answer is not converted here at all (it is hand-framed by :mod:`kdn.wire.frames`, zero-copy).
"""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass, replace
from typing import Any, AsyncIterable, Callable, Iterator, Sequence

from kdn.errors import InvalidInput, KdnError, MessageTooLarge
from kdn.keys import ChunkKey, ModelFingerprint, Namespace, parse_fingerprint, parse_key
from kdn.proto import kdn_pb2 as pb
from kdn.wire.channel import STREAM_PIECE, split_pieces

# -- our types -> messages ---------------------------------------------------------------------


def namespace_msg(namespace: Namespace) -> pb.Namespace:
    return pb.Namespace(tenant=namespace.tenant, salt=namespace.salt)


def key_bytes(keys: Sequence[ChunkKey]) -> list[bytes]:
    return [bytes(k) for k in keys]


def fetch_request(
    key: ChunkKey,
    *,
    fingerprint: ModelFingerprint,
    namespace: Namespace,
    next_keys: Sequence[ChunkKey] = (),
    codec: str = "",
    require_lossless: bool = False,
    local_only: bool = False,
    shm: bool = False,
) -> pb.FetchRequest:
    return pb.FetchRequest(
        fingerprint=bytes(fingerprint), namespace=namespace_msg(namespace), key=bytes(key), next_keys=key_bytes(next_keys),
        codec=codec, require_lossless=require_lossless, local_only=local_only, shm=shm,
    )


def lookup_request(
    keys: Sequence[ChunkKey], *, fingerprint: ModelFingerprint, namespace: Namespace, local_only: bool = False,
    probe: bool = False,
) -> pb.LookupRequest:
    return pb.LookupRequest(
        fingerprint=bytes(fingerprint), namespace=namespace_msg(namespace), keys=key_bytes(keys), local_only=local_only,
        probe=probe,
    )


def prefetch_request(
    keys: Sequence[ChunkKey] = (), *, fingerprint: ModelFingerprint, namespace: Namespace, document: str = ""
) -> pb.PrefetchRequest:
    return pb.PrefetchRequest(
        fingerprint=bytes(fingerprint), namespace=namespace_msg(namespace), keys=key_bytes(keys), document=document
    )


def document_request(document: str, *, fingerprint: ModelFingerprint, namespace: Namespace,
                     emphasis: str = "") -> pb.DocumentRequest:
    return pb.DocumentRequest(namespace=namespace_msg(namespace), document=document, fingerprint=bytes(fingerprint),
                              emphasis=emphasis)


def hint_request(
    action: int, *, fingerprint: ModelFingerprint, namespace: Namespace, keys: Sequence[ChunkKey] = (),
    document: str = "", ttl_s: float = 0.0, priority: int = 0, cron: str = "", schedule_id: str = "",
    emphasis: str = "",
) -> pb.HintRequest:
    return pb.HintRequest(
        action=action, fingerprint=bytes(fingerprint), namespace=namespace_msg(namespace), keys=key_bytes(keys),
        document=document, ttl_s=ttl_s, priority=priority, cron=cron, schedule_id=schedule_id, emphasis=emphasis,
    )


def put_header(
    data: bytes | memoryview, *, key: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace
) -> pb.PutHeader:
    """What a Put declares before its bytes (the gRPC stream's first message, the bulk path's request)."""
    return pb.PutHeader(
        fingerprint=bytes(fingerprint), namespace=namespace_msg(namespace), key=bytes(key), total_size=len(data)
    )


def put_messages(
    data: bytes | memoryview, *, key: ChunkKey, fingerprint: ModelFingerprint, namespace: Namespace,
    piece: int = STREAM_PIECE,
) -> Iterator[pb.PutChunk]:
    """The Put stream: the header rides on the first message (with the first piece, if any)."""
    header = put_header(data, key=key, fingerprint=fingerprint, namespace=namespace)
    first = True
    for view in split_pieces(data, piece) if len(data) else [b""]:
        yield pb.PutChunk(header=header, data=bytes(view)) if first else pb.PutChunk(data=bytes(view))
        first = False


@dataclass(frozen=True, slots=True)
class FetchSpec:
    """What to fetch, the same record at every hop (host → edge → peer → origin). ``local_only``
    asks a peer to answer from its own store (no further hops)."""

    key: ChunkKey
    fingerprint: ModelFingerprint
    namespace: Namespace
    codec: str = ""
    require_lossless: bool = False
    local_only: bool = False

    def to_proto(self, next_keys: Sequence[ChunkKey] = (), *, shm: bool = False) -> pb.FetchRequest:
        return fetch_request(
            self.key, fingerprint=self.fingerprint, namespace=self.namespace, next_keys=next_keys, codec=self.codec,
            require_lossless=self.require_lossless, local_only=self.local_only, shm=shm,
        )

    @classmethod
    def from_proto(cls, request: pb.FetchRequest, namespace: Namespace) -> "FetchSpec":
        """The request's spec; ``namespace`` is the one already parsed and authorized."""
        return cls(
            parse_key(request.key), parse_fingerprint(request.fingerprint), namespace,
            codec=request.codec, require_lossless=request.require_lossless, local_only=request.local_only,
        )

    def local(self) -> "FetchSpec":
        return replace(self, local_only=True)


# -- messages -> our types ---------------------------------------------------------------------


def parse_namespace(msg: pb.Namespace) -> Namespace:
    """The request's namespace; an empty or malformed tenant is ``InvalidInput`` (see above)."""
    return Namespace(msg.tenant, msg.salt)


def parse_keys(raw: Sequence[bytes], *, limit: int) -> list[ChunkKey]:
    """Keys from the wire, at most ``limit`` of them (``MessageTooLarge`` before parsing more)."""
    if len(raw) > limit:
        raise MessageTooLarge(f"{len(raw)} keys in one request (limit {limit})")
    return [parse_key(k) for k in raw]


def chain_keys(raw: Sequence[bytes]) -> list[ChunkKey]:
    """Keys an upstream answered with (already bounded by the message size)."""
    return [parse_key(k) for k in raw]


@dataclass(frozen=True, slots=True)
class PutHeader:
    """A parsed Put header: where the bytes that follow go."""

    key: ChunkKey
    fingerprint: ModelFingerprint
    namespace: Namespace
    total_size: int


def parse_put_header(chunk: pb.PutChunk, *, limit: int, authorize: Callable[[Namespace], None]) -> PutHeader:
    """The first Put message's header. ``authorize(namespace)`` runs before anything else is read."""
    if not chunk.HasField("header"):
        raise InvalidInput("the first Put message must carry the header")
    h = chunk.header
    ns = parse_namespace(h.namespace)
    authorize(ns)
    key, fp = parse_key(h.key), parse_fingerprint(h.fingerprint)
    if h.total_size > limit:
        raise MessageTooLarge(f"Put declares {h.total_size} bytes (limit {limit})")
    return PutHeader(key, fp, ns, h.total_size)


class _PrefixCheck:
    """Parses a Put's container as its bytes arrive (magic, version, header, then each section's
    length and checksum, without decoding), so a stream of junk is refused at the first message
    that holds a bad byte instead of after it was buffered whole. The reader keeps at most one
    unfinished section of its own; the store verifies the complete bytes again."""

    def __init__(self, limit: int) -> None:
        from kdn.artifact import ArtifactReader  # late: the artifact reader brings torch

        self._reader: Any = ArtifactReader(decode=False, max_bytes=limit)

    def feed(self, piece: bytes) -> None:
        if self._reader is None:
            return
        try:
            self._reader.feed(piece)
        except KdnError:
            raise
        except (ValueError, OverflowError, RecursionError) as exc:
            raise InvalidInput(f"Put: unusable artifact header: {type(exc).__name__}") from exc
        if self._reader.complete:
            self._reader = None  # all verified: drop what the reader held


async def receive_put(
    messages: AsyncIterable[pb.PutChunk],
    *,
    limit: int,
    authorize: Callable[[Namespace], None],
    reserve: Callable[[int], None] | None = None,
    check_container: bool = False,
) -> tuple[PutHeader, bytes]:
    """Read a whole Put stream, bounded by ``limit`` and by the declared size. The token is checked
    (``authorize``) as soon as the header names the tenant, before any data is buffered.

    ``check_container``: parse the artifact (magic, version, header, section lengths and
    checksums) as it arrives and refuse the stream at the first bad byte (the rest is never read). ``reserve(n)`` is called
    before ``n`` more bytes are held (each piece, then once for the joined result, which is the
    one copy made): it raises to refuse the Put (the edge's budget across concurrent Puts)."""
    header: PutHeader | None = None
    pieces: list[bytes] = []
    size = 0
    check: _PrefixCheck | None = None
    async for chunk in messages:
        if header is None:
            header = parse_put_header(chunk, limit=limit, authorize=authorize)
            check = _PrefixCheck(limit) if check_container else None
        elif chunk.HasField("header"):
            raise InvalidInput("only the first Put message may carry a header")
        piece = chunk.data
        size += len(piece)
        if size > limit or (header.total_size and size > header.total_size):
            raise MessageTooLarge(f"Put sent more bytes than declared/allowed ({size})")
        if check is not None:
            check.feed(piece)
        if piece:
            if reserve is not None:
                reserve(len(piece))
            pieces.append(piece)
    if header is None:
        raise InvalidInput("empty Put stream")
    if header.total_size and size != header.total_size:
        raise InvalidInput(f"Put declared {header.total_size} bytes but sent {size}")
    if len(pieces) == 1:
        return header, pieces[0]
    if reserve is not None:
        reserve(size)
    data = b"".join(pieces)
    pieces.clear()
    return header, data


@dataclass(frozen=True, slots=True)
class NodeStats:
    """A ``Stats`` answer: counters and the JSON details, parsed."""

    node_id: str
    counters: dict[str, float]
    details: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "counters": self.counters, "details": self.details}


def parse_stats(resp: pb.StatsResponse) -> NodeStats:
    return NodeStats(resp.node_id, dict(resp.counters), json.loads(resp.json) if resp.json else {})


# -- client side: what a host client sends and reads -------------------------------------------


def fetch_request_bytes(spec: FetchSpec, next_keys: Sequence[ChunkKey] = (), *, shm: bool = False) -> bytes:
    """``spec``'s ``FetchRequest``, serialized: the request the bulk byte path carries. The same
    request (a hot key fetched again) is serialized once: building and serializing it was ~15 us
    of a shared-memory fetch's ~300."""
    return _request_bytes(spec, tuple(next_keys), shm)


@functools.lru_cache(maxsize=1024)
def _request_bytes(spec: FetchSpec, next_keys: tuple[ChunkKey, ...], shm: bool) -> bytes:
    return spec.to_proto(next_keys, shm=shm).SerializeToString()


def put_header_bytes(data: bytes | memoryview, *, key: ChunkKey, fingerprint: ModelFingerprint,
                     namespace: Namespace) -> bytes:
    """The ``PutHeader`` of ``data``, serialized: the bulk byte path's Put request."""
    return put_header(data, key=key, fingerprint=fingerprint, namespace=namespace).SerializeToString()


@dataclass(frozen=True, slots=True)
class BulkOffer:
    """An ``OpenBulk`` answer: the bulk listener's port (0: the path is not offered), a ticket
    standing for the caller's token, how long the ticket lives, the bounds of the edge's
    shared-memory segments (0, 0: it serves none), and the abstract Unix socket the listener also
    serves on the edge's host (``"@name"``; "": none)."""

    port: int
    ticket: bytes
    ttl_s: float
    shm_segments: int = 0
    shm_bytes: int = 0
    local_socket: str = ""


def parse_bulk_offer(resp: pb.BulkOffer) -> BulkOffer:
    return BulkOffer(int(resp.port), bytes(resp.ticket), float(resp.ttl_s), int(resp.shm_segments),
                     int(resp.shm_bytes), str(resp.local_socket))


def parse_locations(resp: pb.LookupResponse, n: int) -> list[str]:
    """The tier named for each of the ``n`` leading available keys of a ``Lookup`` answer, as sent."""
    return [loc.tier for loc in resp.locations[:n]]


# ---------------------------------------------------------------------------------------------
# The edge's side: what its transports (gRPC, the bulk socket, the data channel) receive and
# answer. Each parser names the tenant first and calls ``authorize(namespace)`` before any other
# field is read, so a refused token is refused whatever else the request holds.


def _message(cls: Any, body: bytes) -> Any:
    try:
        return cls.FromString(body)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise InvalidInput(f"malformed {cls.__name__}: {type(exc).__name__}") from exc


def _named(cls: Any, request: Any, authorize: Callable[[Namespace], None]) -> tuple[Any, Namespace]:
    """The request (parsed when it came as bytes: the bulk socket, a data channel) and its
    namespace, once ``authorize(namespace)`` said yes."""
    if isinstance(request, (bytes, bytearray, memoryview)):
        request = _message(cls, bytes(request))
    ns = parse_namespace(request.namespace)
    authorize(ns)
    return request, ns


HintAction = enum.IntEnum("HintAction", dict(pb.HintRequest.Action.items()))  # type: ignore[misc]
"""A Hint's action (``HintAction.PIN`` ...), the wire's numbers."""


@dataclass(frozen=True, slots=True)
class FetchAsk:
    """A parsed Fetch: the spec, the chain's next keys (read-ahead) and whether shm is asked."""

    spec: FetchSpec
    next_keys: list[ChunkKey]
    shm: bool = False


def parse_fetch(request: Any, *, limit: int, authorize: Callable[[Namespace], None]) -> FetchAsk:
    """A ``FetchRequest`` (a message, or its bytes)."""
    request, ns = _named(pb.FetchRequest, request, authorize)
    spec = FetchSpec.from_proto(request, ns)
    return FetchAsk(spec, parse_keys(request.next_keys, limit=limit), request.shm)


@dataclass(frozen=True, slots=True)
class LookupAsk:
    keys: list[ChunkKey]
    fingerprint: ModelFingerprint
    namespace: Namespace
    local_only: bool = False
    probe: bool = False


def parse_lookup(request: Any, *, limit: int, authorize: Callable[[Namespace], None]) -> LookupAsk:
    """A ``LookupRequest`` (a message, or its bytes)."""
    request, ns = _named(pb.LookupRequest, request, authorize)
    fp = parse_fingerprint(request.fingerprint)
    return LookupAsk(parse_keys(request.keys, limit=limit), fp, ns, request.local_only, request.probe)


def lookup_response(found: Sequence[Any], *, node_id: str) -> pb.LookupResponse:
    """The Lookup answer for ``found`` (each with ``tier``, ``node_id``, ``address``)."""
    return pb.LookupResponse(
        available=len(found),
        locations=[pb.Location(tier=f.tier, node_id=f.node_id, address=f.address) for f in found],
        node_id=node_id,
    )


def lookup_response_bytes(found: Sequence[Any], *, node_id: str) -> bytes:
    return lookup_response(found, node_id=node_id).SerializeToString()


def parse_bulk_put(body: bytes, *, limit: int, authorize: Callable[[Namespace], None]) -> PutHeader:
    """The bulk socket's Put request (a ``PutHeader``'s bytes), which must declare its size."""
    header = parse_put_header(pb.PutChunk(header=_message(pb.PutHeader, body)), limit=limit, authorize=authorize)
    if not header.total_size:
        raise InvalidInput("a bulk Put must declare total_size")
    return header


@dataclass(frozen=True, slots=True)
class PrefetchAsk:
    keys: list[ChunkKey]
    document: str
    fingerprint: ModelFingerprint
    namespace: Namespace
    codec: str = ""


def parse_prefetch(request: pb.PrefetchRequest, *, limit: int, authorize: Callable[[Namespace], None]) -> PrefetchAsk:
    request, ns = _named(pb.PrefetchRequest, request, authorize)
    fp = parse_fingerprint(request.fingerprint)
    return PrefetchAsk(parse_keys(request.keys, limit=limit), request.document, fp, ns, request.codec)


@dataclass(frozen=True, slots=True)
class HintAsk:
    """A parsed Hint. ``fingerprint`` stays the raw bytes (empty when the request names no model:
    each action says whether it needs one)."""

    action: int
    namespace: Namespace
    keys: list[ChunkKey]
    fingerprint: bytes = b""
    document: str = ""
    ttl_s: float = 0.0
    priority: int = 0
    cron: str = ""
    schedule_id: str = ""
    emphasis: str = ""


def parse_hint(request: pb.HintRequest, *, limit: int, authorize: Callable[[Namespace], None]) -> HintAsk:
    request, ns = _named(pb.HintRequest, request, authorize)
    return HintAsk(
        request.action, ns, parse_keys(request.keys, limit=limit), request.fingerprint, request.document,
        request.ttl_s, request.priority, request.cron, request.schedule_id, request.emphasis,
    )


def hint_response(ask: HintAsk, affected: int, name: str) -> pb.HintResponse:
    """``name``: the steered variant of an EMPHASIZE, else the schedule id."""
    if ask.action == HintAction.EMPHASIZE:
        return pb.HintResponse(affected=affected, steer_variant=name)
    return pb.HintResponse(affected=affected, schedule_id=name)


def put_response() -> pb.PutResponse:
    return pb.PutResponse(stored=True)


def prefetch_response(queued: int) -> pb.PrefetchResponse:
    return pb.PrefetchResponse(queued=queued)


def bulk_offer(offer: BulkOffer | None = None) -> pb.BulkOffer:
    """The OpenBulk answer; the empty offer (None, or port 0) says the path is not offered."""
    if offer is None or not offer.port:
        return pb.BulkOffer()
    return pb.BulkOffer(port=offer.port, ticket=offer.ticket, ttl_s=offer.ttl_s, shm_segments=offer.shm_segments,
                        shm_bytes=offer.shm_bytes, local_socket=offer.local_socket)


def stats_request() -> pb.StatsRequest:
    return pb.StatsRequest()


def stats_response(node_id: str, counters: dict[str, float], details: dict[str, Any], *, role: str = "edge") -> pb.StatsResponse:
    return pb.StatsResponse(node_id=node_id, role=role, counters=counters,
                            json=json.dumps(details, sort_keys=True, default=str))
