"""The vLLM connector's blend requests: a request that opts in gets its documents' *blend variant*
from the store (:mod:`kdn.origin.blend`) and loads it like any prefix. Nothing in vLLM changes.

A request opts in with ``kv_transfer_params`` ``{"kdn_blend": true}`` (or every request does, with
``blend: true`` in ``kv_connector_extra_config``) and carries a ``cache_salt`` beginning with
:data:`BLEND_SALT_PREFIX`. The salt is what keeps vLLM's own prefix cache apart: the engine hashes
its cached blocks with the request's ``cache_salt``, so blended blocks can be found again only by
requests with that salt, never by a plain request (no salt or another one). Optional
``"kdn_documents": [[start, end], ...]`` names the documents' token spans (the store then makes
any segment it lacks); without it the store recognises them by content.

How one request goes:

- scheduler, ``get_num_new_matched_tokens``: the first call sends ``Blend`` to the origin
  (``blend_origin``) on the connector's loop thread and answers ``None`` ("not known yet"): vLLM
  skips the request this step and asks again, so the scheduler keeps serving other requests while
  the store computes. Each later call waits at most ``blend_poll_s`` for the answer. Once it
  arrives, the request's state holds the variant's chunk keys; the match is its whole chunks
  (ending before the prompt's last token, which vLLM computes) and the load is the ordinary
  layer-by-layer one, fetched from the origin;
- no write-back, ever: a request that opted in, or whose salt is a blend salt, saves nothing (its
  KV, or the KV it attended to, is not what a prefill of its tokens produces);
- a refusal (no passing verdict, no stored document, a bad segment: the origin's code), an error
  or a timeout (``blend_timeout_s``) is logged once, counted (``blend_refused``,
  ``blend_refused_<code>``, ``blend_errors``, ``blend_timeouts``, ``blend_no_salt``) and the
  request goes on as a plain one: exact KV from the edge, or a prefill.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Coroutine

import numpy as np

from kdn.errors import InvalidInput
from kdn.keys import ChunkKey, ModelFingerprint, Namespace

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kdn.integrations.store_blend import StoreBlend

LOG = logging.getLogger("kdn.vllm")
BLEND_SALT_PREFIX = "kdn-blend"

MAX_SPAN_BOUND = 1 << 31
"""Span bounds are token positions: JSON integers in ``[0, 2**31)``."""


def document_spans(value: Any) -> list[tuple[int, int]]:
    """``kdn_documents`` as ``[(start, end), ...]``: a list of ``[start, end]`` pairs of JSON integers
    in ``[0, 2**31)`` (not floats, not booleans); None or absent is no spans. Whether the spans fit
    the prompt is the store's to judge (:func:`kdn.origin.blend.plan_blend`); anything else raises
    :class:`InvalidInput`."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidInput(f"kdn_documents must be a list of [start, end] pairs, not {type(value).__name__}")
    spans = []
    for span in value:
        if (not isinstance(span, (list, tuple)) or len(span) != 2
                or not all(type(b) is int and 0 <= b < MAX_SPAN_BOUND for b in span)):
            raise InvalidInput(f"kdn_documents: {span!r} is not a [start, end] pair of token positions")
        spans.append((span[0], span[1]))
    return spans

@dataclass(frozen=True, slots=True)
class BlendHost:
    """What the connector lends its blend requests, handed over when it builds them.

    ``config``: its ``KdnConnectorConfig``; ``fingerprint`` and ``block_size``: the engine's;
    ``states``: its request states by request id (the same dict: a variant's state is put there);
    ``count(name, n)``: bumps one of its counters; ``submit(coro)``: runs ``coro`` on its loop
    thread, a ``concurrent.futures.Future``; ``new_state``: builds a request state (its
    ``ReqState``); ``namespace_of``: its ``request_namespace``."""

    config: Any
    fingerprint: ModelFingerprint
    block_size: int
    states: dict[str, Any]
    count: Callable[..., None]
    submit: Callable[[Coroutine[Any, Any, Any]], concurrent.futures.Future]
    new_state: Callable[..., Any]
    namespace_of: Callable[..., Namespace | None]


@dataclass(slots=True)
class _Pending:
    future: concurrent.futures.Future
    ns: Namespace
    started: float


class BlendRequests:
    """The scheduler-side state of blend requests and the worker side's origin clients, over what
    the connector lends them (:class:`BlendHost`)."""

    def __init__(self, host: BlendHost) -> None:
        self.host = host
        self._pending: dict[str, _Pending] = {}
        self._settled: set[str] = set()  # asked and answered (a variant or a refusal)
        self._clients: dict[str, "StoreBlend"] = {}

    # -- scheduler side ----------------------------------------------------------------------------

    def wants(self, request: "Request") -> bool:
        """The request asked for a blend: ``kdn_blend`` true (or the config's default), or present
        and not a boolean (a malformed ask: :meth:`_start` refuses it, and it is never saved)."""
        params = request.kv_transfer_params or {}
        if params.get("kdn") is False:
            return False
        ask = params.get("kdn_blend", self.host.config.blend)
        return ask is not False and ask is not None

    @staticmethod
    def blend_salted(request: "Request") -> bool:
        return bool(request.cache_salt) and str(request.cache_salt).startswith(BLEND_SALT_PREFIX)

    def never_save(self, request: "Request", st: Any) -> None:
        """A request that asked for blending, or carries a blend salt, writes nothing back."""
        if self.wants(request) or self.blend_salted(request):
            st.saved = st.first_saved = len(st.keys)
            st.pieces_saved = True

    def pending(self, request: "Request") -> bool:
        """True while the store computes the request's variant (vLLM asks again later). When the
        variant arrives the request's state is made here; on any failure the plain path runs."""
        rid = request.request_id
        if rid in self.host.states or rid in self._settled or not self.wants(request):
            return False
        p = self._pending.get(rid)
        if p is None:
            p = self._start(request)
            if p is None:
                self._settled.add(rid)
                return False
            self._pending[rid] = p
        try:
            answer = p.future.result(self.host.config.blend_poll_s)
        except concurrent.futures.TimeoutError:
            if time.monotonic() - p.started < self.host.config.blend_timeout_s:
                return True
            p.future.cancel()
            return self._give_up(rid, "blend_timeouts", f"the store did not answer within "
                                 f"{self.host.config.blend_timeout_s:g}s")
        except Exception as exc:  # KdnError from the call, or the loop went away: plain path
            return self._give_up(rid, "blend_errors", f"{type(exc).__name__}: {exc}")
        del self._pending[rid]
        self._settled.add(rid)
        if answer.refused:
            self.host.count("blend_refused")
            self.host.count(f"blend_refused_{answer.refused}")
            LOG.warning("KDN: blend refused for request %s (%s: %s); serving exact KV", rid, answer.refused,
                        answer.reason)
            return False
        self._adopt(request, p.ns, answer)
        return False

    def _give_up(self, rid: str, counter: str, why: str) -> bool:
        self._pending.pop(rid, None)
        self._settled.add(rid)
        self.host.count(counter)
        LOG.warning("KDN: blend for request %s failed (%s); serving exact KV", rid, why)
        return False

    def _start(self, request: "Request") -> _Pending | None:
        host = self.host
        rid = request.request_id
        if not host.config.blend_origin:
            host.count("blend_no_origin")
            LOG.warning("KDN: request %s asks for a blend but the connector has no blend_origin; serving exact KV", rid)
            return None
        if not self.blend_salted(request):
            host.count("blend_no_salt")
            LOG.warning("KDN: request %s asks for a blend without a cache_salt beginning with %r (vLLM's prefix cache "
                        "would hand its blended blocks to plain requests); serving exact KV", rid, BLEND_SALT_PREFIX)
            return None
        params = request.kv_transfer_params or {}
        try:  # the namespace of the documents: kv_transfer_params or the default, never the blend salt
            if not isinstance(params.get("kdn_blend", host.config.blend), bool):
                raise InvalidInput(f"kdn_blend must be true or false, not {params.get('kdn_blend')!r}")
            ns = host.namespace_of(None, params, host.config.namespace)
            docs = document_spans(params.get("kdn_documents"))
        except (InvalidInput, TypeError, ValueError) as exc:
            host.count("blend_errors")
            LOG.warning("KDN: request %s has malformed blend parameters (%s); serving exact KV", rid, exc)
            return None
        if ns is None:
            return None
        tokens = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        host.count("blend_requests")

        async def ask() -> Any:
            return await self._client(ns.tenant).blend(host.fingerprint, ns, tokens.tolist(), docs)

        return _Pending(host.submit(ask()), ns, time.monotonic())

    def _adopt(self, request: "Request", ns: Namespace, answer: Any) -> None:
        host = self.host
        C, bs = host.config.chunk_size, host.block_size
        tokens = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        keys = list(answer.keys)
        st = host.new_state(ns, keys, len(tokens), len(keys), saved=len(keys), first_saved=len(keys), tokens=tokens,
                             pieces_saved=True, blend=True)
        st.end = min(len(keys) * C, (max(0, len(tokens) - 1) // C) * C) // bs * bs
        host.states[request.request_id] = st
        host.count("blend_variants")
        host.count("blend_variant_tokens", st.end)
        LOG.info("KDN: request %s: blend variant %s… from %s: %d documents (%d tokens, %d recomputed at ratio %g)%s",
                 request.request_id, answer.variant[:16], host.config.blend_origin, answer.documents,
                 answer.document_tokens, answer.recomputed, answer.ratio, " (held from before)" if answer.cached else "")

    def finished(self, request_id: str) -> None:
        p = self._pending.pop(request_id, None)
        if p is not None:
            p.future.cancel()
        self._settled.discard(request_id)

    # -- both sides --------------------------------------------------------------------------------

    def _client(self, tenant: str) -> "StoreBlend":
        """The origin client of ``tenant`` (built on the loop thread, where its channel lives)."""
        from kdn.integrations.store_blend import StoreBlend

        c = self._clients.get(tenant)
        if c is None:
            cfg = self.host.config
            c = self._clients[tenant] = StoreBlend(cfg.blend_origin or "", token=cfg.tokens.get(tenant, cfg.token),
                                                   tls=cfg.tls(), blend_timeout_s=cfg.blend_timeout_s,
                                                   fetch_timeout_s=cfg.fetch_timeout_s)
        return c

    def fetch_stream(self, tenant: str, salt: str, key: ChunkKey) -> Any:
        """``(piece, via)`` of one chunk of a variant, from the origin (worker side, loop thread)."""
        return self._client(tenant).fetch(self.host.fingerprint, Namespace(tenant, salt), key,
                                          self.host.config.fetch_timeout_s)

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
