"""The origin's gRPC server: ``OriginService`` + the standard health service over the origin store.

In-process, no Ray (tests, a standalone origin beside a GPU host)::

    with OriginServer(OriginConfig(store_dir=d, models=["tiny"], listen="127.0.0.1:0")) as srv:
        srv.address                       # "127.0.0.1:PORT", health SERVING
        keys = srv.ingest_text("...", doc_id="doc-1")

``start()``/``stop()`` run the server on a private event loop in a background thread;
``await astart()``/``await astop()`` run it on the caller's loop instead. On Ray,
:func:`kdn.origin.ray_origin.start_origin_actor` places this same server in an actor on a
``kdn_origin`` node, and ``kdn origin --workers N`` serves with prefill on ``N`` Ray workers.

RPCs (kdn/proto/kdn.proto):

- ``Lookup``: how many leading keys of a chain are stored (tier ``origin``).
- ``Fetch``: stream the stored container in ``STREAM_PIECE`` pieces; first message carries
  ``total_size`` and ``source="origin"``. ``codec=""`` serves what is stored (lossless first);
  another codec is transcoded from a lossless copy (decode + re-encode), stored, then served.
- ``Compute``: the whole chain's tokens + a fingerprint this origin serves -> every missing full
  chunk is prefilled and stored; returns all keys. Unknown fingerprint -> ``FAILED_PRECONDITION``.
- ``Document``: the chunk keys of an ingested document.
- ``Blend``: a prompt's tokens -> the keys of its *blend variant* (:mod:`kdn.origin.blend`): the
  documents it holds as segments, found by content (or at the spans the request names), joined
  and partly recomputed on a prefill worker; the variant's chunks are kept in memory and served
  by ``Fetch`` under their own keys. A refusal (no passing verdict, no stored document, a bad
  segment) is an answer with a code, counted as ``blend_refused_<code>``.
- ``Stats``: counters.
- ``SignalService`` (``Announce``/``Send``/``Receive``, :mod:`kdn.wire.signal`): discovery and
  WebRTC offer/answer mailboxes for edges behind NAT, which can all dial the origin. Edges only:
  calls are signed with ``OriginConfig.cluster_key``, and each edge acts only as itself.

Auth: ``OriginConfig.tokens`` maps bearer tokens to tenants (same rule as the edge,
:mod:`kdn.wire.auth`): with tokens configured, every call's namespace must be granted to its token,
checked before anything is looked up; a key of another tenant is ``NOT_FOUND``.

Errors: handlers raise KdnErrors; the :func:`kdn.wire.service.rpc` envelope turns them into statuses
(a compute timeout is ``UNAVAILABLE``). Requests are parsed and answers built by :mod:`kdn.wire.origin`
(an empty tenant is ``INVALID_ARGUMENT``, as at the edge); Fetch answers are framed by :mod:`kdn.wire.frames`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from typing import Any, AsyncIterator

import grpc
import numpy as np

from kdn.wire.auth import SIGNAL_NODE, EdgeKey, TokenAuth
from kdn.artifact import read_header, transcode
from kdn.codecs import get_codec
from kdn.errors import (
    ConfigError, FingerprintMismatch, InvalidInput, KdnError, LossyRefused, NotFound, Unavailable,
)
from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.models import LoadedModel
from kdn.wire.channel import STREAM_PIECE, check_bindable, grpc_options
from kdn.wire.frames import encode_frames
from kdn.wire.health import Health
from kdn.wire.origin import (
    BlendResponse, StatsResponse, blend_refusal, blend_response, compute_response, document_response,
    origin_lookup_response, origin_stats_response, parse_blend, parse_compute, parse_document, parse_origin_fetch,
    parse_origin_lookup,
)
from kdn.wire.service import Servicer, add_servicer, rpc
from kdn.wire.signal import SignalBoard, SignalServicer
from kdn.origin.blend import NO_ROOM, BlendCache, Refusal, check_spans, plan_blend
from kdn.origin.compute import ComputeBackend, LocalCompute
from kdn.origin.config import OriginConfig
from kdn.origin.ingest.documents import document_matches, not_ingested
from kdn.origin.segments import SegmentCatalog
from kdn.origin.steer import steering_details
from kdn.origin.store import OriginStore, StoredArtifact
from kdn.origin.worker import DocumentTask

__all__ = ["OriginServer", "OriginServicer"]

log = logging.getLogger(__name__)

SERVICE_NAME = "kdn.v1.OriginService"
_MAX_CHAIN_KEYS = 1 << 16


class OriginServicer(Servicer):
    """``OriginService`` over the origin: every handler runs in the :func:`kdn.wire.service.rpc` envelope."""

    def __init__(self, server: "OriginServer") -> None:
        self._s = server

    @property
    def auth(self) -> TokenAuth:
        return self._s.auth

    @property
    def label(self) -> str:
        return f"origin {self._s.config.node_id}"

    def translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, asyncio.TimeoutError):
            return Unavailable(f"compute took longer than {self._s.config.compute_timeout_s}s")
        if isinstance(exc, ValueError) and not isinstance(exc, KdnError):
            return InvalidInput(str(exc))
        return exc

    def refused(self, rpc_name: str, code: grpc.StatusCode, exc: BaseException) -> None:
        self._s.count("errors")

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- RPCs ----------------------------------------------------------------------------------

    @rpc
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ask = parse_origin_lookup(request, limit=_MAX_CHAIN_KEYS, authorize=self.authorizer(context))
        keys = ask.keys
        stored = await self._run(lambda: self._s.store.stored_keys(keys, tenant=ask.namespace.tenant))
        n = 0
        while n < len(keys) and keys[n] in stored:
            n += 1
        self._s.count("lookups")
        return origin_lookup_response(n, node_id=self._s.config.node_id, address=self._s.address or "")

    @rpc
    async def Fetch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        ask = parse_origin_fetch(request, authorize=self.authorizer(context))
        data = await self._run(self._s.artifact_bytes, ask.key, ask.namespace, ask.fingerprint, ask.codec,
                               ask.require_lossless)
        self._s.count("fetches")
        self._s.count("fetch_bytes", len(data))
        for frame in encode_frames(data, piece=STREAM_PIECE, source="origin"):
            yield frame

    @rpc
    async def Compute(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ask = parse_compute(request, max_tokens=self._s.config.max_compute_tokens, authorize=self.authorizer(context))
        codecs = self._s.codecs_for(ask.codec)
        t0 = time.perf_counter()
        res = await asyncio.wait_for(
            self._run(self._s.compute.compute, ask.fingerprint, ask.tokens, ask.namespace, codecs),
            timeout=self._s.config.compute_timeout_s,
        )
        self._s.count("computes")
        self._s.count("computed_chunks", res.computed)
        self._s.count("compute_seconds", time.perf_counter() - t0)
        return compute_response(res.keys, computed=res.computed, already_stored=res.already_stored)

    @rpc
    async def Document(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ask = parse_document(request, authorize=self.authorizer(context))
        ns, document = ask.namespace, ask.document
        fp = ask.fingerprint if ask.fingerprint is not None else self._s.default_fingerprint
        rec = await self._run(self._s.store.document, ns.tenant, fp, document)
        if rec is None:
            ids = await self._run(self._s.store.document_ids, ns.tenant, fp)
            matches = document_matches(document, ids)
            if len(matches) != 1:
                raise NotFound(not_ingested(document, matches, ids))
            rec = await self._run(self._s.store.document, ns.tenant, fp, matches[0])
            if rec is None:  # removed in between
                raise NotFound(not_ingested(document, [], ids))
        if ask.emphasis:
            t0 = time.perf_counter()
            keys, variant = await asyncio.wait_for(
                self._run(self._s.emphasize, rec.doc_id, rec.content_hash, ask.emphasis, ns, fp),
                timeout=self._s.config.compute_timeout_s)
            self._s.count("emphasized")
            self._s.count("compute_seconds", time.perf_counter() - t0)
            return document_response(keys, steer_variant=variant)
        return document_response(rec.keys)

    @rpc
    async def Blend(self, request: Any, context: grpc.aio.ServicerContext) -> BlendResponse:
        ask = parse_blend(request, max_tokens=self._s.config.max_compute_tokens, authorize=self.authorizer(context))
        spans = check_spans(ask.documents)
        return await asyncio.wait_for(
            self._run(self._s.blend, ask.fingerprint, ask.tokens, ask.namespace, spans, ask.codec),
            timeout=self._s.config.compute_timeout_s)

    @rpc
    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> StatsResponse:
        self.authorize_admin(context)
        return await self._run(self._s.stats)



def served_model(models: dict[ModelFingerprint, dict[str, Any]], fingerprint: ModelFingerprint) -> dict[str, Any]:
    """What the compute backend says of the model ``fingerprint`` names; FingerprintMismatch, naming
    the models it serves, when it serves no such model."""
    info = models.get(ModelFingerprint(bytes(fingerprint)))
    if info is None:
        raise FingerprintMismatch(f"this origin does not serve model {bytes(fingerprint).hex()[:16]}…; it serves "
                                  + ", ".join(f"{i['spec']} ({bytes(fp).hex()[:16]}…)" for fp, i in models.items()))
    return info


class OriginServer:
    """An origin: store + compute backend + gRPC server. See the module docstring."""

    def __init__(
        self,
        config: OriginConfig,
        *,
        compute: ComputeBackend | None = None,
        preloaded: tuple[LoadedModel, ...] = (),
    ) -> None:
        self.config = config
        if config.server_tls is not None:
            config.server_tls.check_server_files()  # before the store and the model: a clear line naming the file
        self.auth = TokenAuth.from_config(config.tokens)
        self.store = OriginStore(config.store_path, fsync=config.fsync, verify=config.verify_on_start)
        self.compute: ComputeBackend = compute or LocalCompute.from_config(config, preloaded=preloaded)
        models = self.compute.models()
        self.default_fingerprint = next(iter(models))
        self.address: str | None = None
        self.port: int | None = None
        self._counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self._server: grpc.aio.Server | None = None
        self._health: Health | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started_at = time.time()
        self.blends = BlendCache(config.blend_cache_bytes)  # blend variants, served from memory only
        self.segment_catalog = SegmentCatalog(config.store_path)
        self.signal_board = SignalBoard()  # edges behind NAT: announcements and WebRTC mailboxes
        key = config.cluster_key
        self.edge_key = EdgeKey(key.get_secret_value(), SIGNAL_NODE) if key is not None else None

    # -- in-process API ------------------------------------------------------------------------

    def model(self, fingerprint: ModelFingerprint | None = None) -> LoadedModel:
        """The loaded model (in-process compute only)."""
        if not isinstance(self.compute, LocalCompute):
            raise ConfigError("the model lives on Ray workers, not in this process")
        return self.compute.worker(fingerprint or self.default_fingerprint).lm

    def ingest_text(
        self, text: str, *, namespace: Namespace | None = None, doc_id: str = "", fingerprint: ModelFingerprint | None = None
    ) -> list[ChunkKey]:
        """Ingest one text as a document; returns its chunk keys (all stored when this returns)."""
        import hashlib

        ns = namespace or self.config.default_namespace
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        task = DocumentTask(doc_id or f"text:{digest}", text, digest, ns.tenant, ns.salt)
        res = self.compute.ingest(fingerprint or self.default_fingerprint, task)
        if res.status == "failed":
            raise InvalidInput(f"ingest of {task.doc_id} failed: {res.message}")
        return [ChunkKey(bytes.fromhex(k)) for k in res.keys]

    def emphasize(self, doc_id: str, content_hash: str, emphasis: str, ns: Namespace,
                  fingerprint: ModelFingerprint) -> tuple[list[ChunkKey], str]:
        """Store (or find) the steered variant ``emphasis`` of an ingested document; its keys and id.

        The store keeps keys, not text: the text is read again from the path the document was
        ingested from, and must still hash as it did then (else: re-ingest with ``--emphasize``)."""
        from pathlib import Path

        from kdn.origin.ingest.documents import read_text
        from kdn.origin.ingest.pipeline import BYTES_PER_TOKEN
        from kdn.steer import Emphasis

        em = Emphasis.from_json(emphasis)  # a clear InvalidInput for a bad one
        path = Path(doc_id)
        if not path.is_absolute() or not path.is_file():
            raise NotFound(f"document {doc_id!r} is not a file on the origin any more; run `kdn ingest --emphasize` "
                           "where it is")
        window = int(self.compute.models().get(fingerprint, {}).get("max_positions", 0) or 0)
        doc = read_text(path, window * BYTES_PER_TOKEN if window > 0 else None)
        if doc.digest != content_hash:
            raise InvalidInput(f"document {doc_id!r} changed since it was ingested; ingest it again first")
        task = DocumentTask(doc_id, doc.text, doc.digest, ns.tenant, ns.salt, complete=doc.complete,
                            emphasize=em.to_json())
        res = self.compute.ingest(fingerprint, task)
        if not res.steer_variant:
            raise InvalidInput(f"steered variant of {doc_id!r} not stored: {res.message}")
        return [ChunkKey(bytes.fromhex(k)) for k in (*res.steer_keys, *res.steer_piece_keys)], res.steer_variant

    def blend(self, fingerprint: ModelFingerprint, tokens: np.ndarray, ns: Namespace,
              spans: list[tuple[int, int]] | None = None, codec: str = "") -> BlendResponse:
        """The blend variant of ``tokens`` (see :mod:`kdn.origin.blend`): computed unless every chunk
        of it is still in memory; a refusal is a response with ``refused`` set, counted."""
        t0 = time.perf_counter()
        info = served_model(self.compute.models(), fingerprint)
        codec = get_codec(codec).spec if codec else "raw"
        plan = plan_blend(self.segment_catalog, self.store, tokens, fingerprint=fingerprint, namespace=ns,
                          chunk_size=int(info["chunk_size"]), documents=spans or (),
                          window=int(info.get("max_positions") or 0))
        if isinstance(plan, Refusal):
            return self._refused(plan)
        self.count("blends")
        cached = self.blends.holds(ns.tenant, plan.keys, codec)  # held in another codec: made again
        stats: dict[str, Any] = {}
        if not cached:
            out = self.compute.blend(fingerprint, tokens, ns, plan.to_dict(), codec)
            if out.get("refused"):
                return self._refused(Refusal(out["refused"], out["reason"]))
            if not self.blends.put_variant(ns.tenant, plan.keys, out["artifacts"]):  # answered keys: fetchable
                return self._refused(Refusal(NO_ROOM, f"the origin's blend memory ({self.blends.max_bytes} bytes, "
                                                      "blend_cache_bytes) cannot hold the whole variant"))
            stats = out
            self.count("blend_computed")
            self.count("blend_segments_computed", int(out.get("computed_segments", 0)))
        else:
            self.count("blend_cached")
        self.count("blend_seconds", time.perf_counter() - t0)
        return blend_response(
            plan.keys, covered_tokens=plan.covered, variant=bytes(plan.root).hex(),
            documents=len(plan.pieces), document_tokens=sum(p.end - p.start for p in plan.pieces),
            recomputed_tokens=int(stats.get("recomputed", 0)), ratio=plan.ratio, cached=cached)

    def _refused(self, r: Refusal) -> BlendResponse:
        self.count("blend_refused")
        self.count(f"blend_refused_{r.code}")
        log.warning("origin %s: blend refused (%s): %s", self.config.node_id, r.code, r.reason)
        return blend_refusal(r.code, r.reason)

    def codecs_for(self, requested: str) -> list[str]:
        specs = list(self.config.codecs)
        if requested:
            spec = get_codec(requested).spec
            if spec not in specs:
                specs.append(spec)
        return specs

    def artifact_bytes(
        self, key: ChunkKey, ns: Namespace, fingerprint: ModelFingerprint | None, codec: str, require_lossless: bool
    ) -> bytes:
        """The container to serve for ``key``: a blend variant's chunk held in memory, stored as
        asked, or transcoded (then stored)."""
        held = self.blends.get(ns.tenant, key)
        if held is not None:
            header = read_header(memoryview(held))
            if fingerprint is not None and header.fingerprint != bytes(fingerprint):
                raise FingerprintMismatch(f"artifact {bytes(key).hex()[:16]}… was made for another model")
            if require_lossless and header.lossy:
                raise LossyRefused(f"blend variant chunk {bytes(key).hex()[:16]}… is held in lossy codec "
                                   f"{header.codec} but lossless was required")
            self.count("blend_fetches")
            return held
        variants = self.store.variants(key, tenant=ns.tenant)
        if not variants:
            raise NotFound(f"artifact {bytes(key).hex()[:16]}… is not stored here")
        if fingerprint is not None and bytes(variants[0].fingerprint) != bytes(fingerprint):
            raise FingerprintMismatch(
                f"artifact {bytes(key).hex()[:16]}… was made for model {bytes(variants[0].fingerprint).hex()[:16]}…"
            )
        if codec:
            want = get_codec(codec)
            if require_lossless and want.lossy:
                raise LossyRefused(f"codec {want.spec} is lossy but lossless was required")
            for v in variants:
                if v.codec == want.spec:
                    return self._get(v, ns)
            return self._transcode(variants, want.spec, ns)
        usable = [v for v in variants if not (require_lossless and v.lossy)]
        if not usable:
            raise LossyRefused(f"artifact {bytes(key).hex()[:16]}… is stored only in lossy codecs")
        return self._get(usable[0], ns)

    def _get(self, v: StoredArtifact, ns: Namespace) -> bytes:
        return self.store.get(v.key, v.codec, tenant=ns.tenant)

    def _transcode(self, variants: list[StoredArtifact], spec: str, ns: Namespace) -> bytes:
        sources = [v for v in variants if not v.lossy]
        if not sources:
            raise NotFound(f"not stored in {spec}, and no lossless copy to transcode from")
        blob = transcode(self._get(sources[0], ns), spec)  # a steered variant stays that variant
        self.store.put(blob, tenant=ns.tenant)  # cache the transcoded artifact too
        self.count("transcodes")
        return blob

    def count(self, name: str, n: float = 1) -> None:
        with self._counter_lock:
            self._counters[name] += n

    def stats(self) -> StatsResponse:
        totals = self.store.totals()
        with self._counter_lock:
            counters = {**{k: float(v) for k, v in self._counters.items()}, **{f"store_{k}": float(v) for k, v in totals.items()}}
        details = {
            "models": {bytes(fp).hex(): info for fp, info in self.compute.models().items()},
            "steering": steering_details(self.store, self.compute.models()),
            "codecs": list(self.config.codecs),
            "store_dir": str(self.config.store_path),
            "uptime_s": round(time.time() - self._started_at, 1),
            "check": None if self.store.check is None else {
                f: getattr(self.store.check, f) for f in self.store.check.__dataclass_fields__
            },
        }
        return origin_stats_response(self.config.node_id, counters, details)

    # -- lifecycle -----------------------------------------------------------------------------

    async def astart(self) -> str:
        """Bind and serve on the running loop; returns the address once health says SERVING."""
        server = grpc.aio.server(options=grpc_options())
        add_servicer(server, OriginServicer(self), "OriginService")
        # WebRTC signalling for edges behind NAT (kdn.wire.signal): every edge can dial the origin
        add_servicer(server, SignalServicer(self.signal_board, self.auth, "origin", edges=self.edge_key), "SignalService")
        health = self._health = Health(server)
        listen = self.config.listen
        tls = self.config.server_tls
        try:
            check_bindable(listen)  # before gRPC, which logs its own complaint on stderr first
        except OSError as exc:
            raise ConfigError(f"cannot listen on {listen}: the port is in use ({exc})") from None
        try:
            if tls is not None:
                port = server.add_secure_port(listen, tls.server_credentials())
            else:
                port = server.add_insecure_port(listen)
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            port = 0
            why = str(exc).split(";")[0]
        else:
            why = ""
        if not port:
            causes = "the port is in use or the address is not local" + (", or the TLS key and cert do not match" if tls else "")
            raise ConfigError(f"cannot listen on {listen}: {causes}" + (f" ({why})" if why else ""))
        await server.start()
        await health.serving(SERVICE_NAME)
        self._server = server
        host = listen.rsplit(":", 1)[0]
        self.port = port
        self.address = f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '') else host}:{port}"
        log.info("origin %s serving on %s", self.config.node_id, self.address)
        return self.address

    async def astop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            if self._health is not None:
                await self._health.shutdown()
            await self._server.stop(grace_s)
            self._server = None

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve from a background thread with its own event loop; returns the address."""
        if self._thread is not None:
            assert self.address is not None
            return self.address
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.astart())
            except BaseException as exc:  # reported to the caller of start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"origin-{self.config.node_id}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"origin did not start within {timeout_s}s")
        if failure:
            self._thread = None
            raise failure[0]
        assert self.address is not None
        return self.address

    def close(self) -> None:
        """Close the store and the compute backend (after ``astop``). Idempotent."""
        self.compute.close()
        self.segment_catalog.close()
        self.store.close()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving, then close the store and compute backend. Idempotent."""
        if self._thread is not None and self._loop is not None:
            fut = asyncio.run_coroutine_threadsafe(self.astop(grace_s), self._loop)
            try:
                fut.result(timeout=grace_s + 10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
                self._thread = None
                self._loop = None
        self.close()

    def __enter__(self) -> "OriginServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
