"""Bearer tokens -> tenants.

Policy (one rule, the same for every RPC): a request names a namespace; its tenant must be
granted to the caller's token. A missing token, an unknown token, and a known token asking for a
tenant it was not granted are all refused with ``Unauthorized`` (gRPC ``UNAUTHENTICATED``) and
the same message shape, *before* anything is looked up — so the answer cannot depend on whether
the artifact exists, and a tenant cannot probe another tenant's namespace. (Keys are chained over
the namespace too, so even a granted tenant never reaches another tenant's bytes: the store
answers "absent" for a key owned by someone else, which is ``NOT_FOUND`` exactly like a key that
never existed.)

With no tokens configured, authentication is off and every tenant is allowed.

Edges prove they are edges with the **cluster key** (``cluster_key`` in the edge and origin
configs), a secret only the edges and the origin hold and no tenant token can stand in for
(:class:`EdgeKey`). It never crosses a wire itself: every request an edge sends to a peer edge,
and every signalling call it makes, carries a fresh token minted with it, ``kdn-edge1.`` + hex of
the sender's node id + hex of the receiver's + the time in ms + a random nonce + an
HMAC-SHA256 over all of them and a scope (``tenant:<name>`` for the data calls of that tenant,
``signal`` for signalling). The receiver checks the MAC, that it is the receiver named, that the
time is within :data:`EDGE_TOKEN_WINDOW_S` of its clock, and that it has not seen the nonce
before. So a token is good for one request, to one node, for one tenant, for a minute: a process
that receives one (a peer address taken over by something else) can do nothing with it
elsewhere, and nothing twice. A valid edge token grants its scope's tenant (an edge forwards
misses for every tenant); who sent it is the node id it names, which is what the signalling
service binds announcements and mailboxes to (:mod:`kdn.wire.signal`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping

from kdn.errors import Unauthorized

__all__ = ["EDGE_TOKEN_PREFIX", "EdgeKey", "SIGNAL_NODE", "SIGNAL_SCOPE", "TokenAuth", "tenant_scope"]

ANY_TENANT = "*"
EDGE_TOKEN_PREFIX = "kdn-edge1."
EDGE_TOKEN_WINDOW_S = 60.0
"""An edge token is accepted this long before and after the time it names (clocks in NTP sync)."""
SIGNAL_NODE = "kdn-signal"
"""The receiver named in signalling tokens (the origin's ``SignalService``)."""
SIGNAL_SCOPE = "signal"
_MAX_SEEN = 1 << 17  # nonces remembered; past it the oldest go (only MAC-valid tokens are kept)


def tenant_scope(tenant: str) -> str:
    """The scope of an edge token for a data call of ``tenant``."""
    return f"tenant:{tenant}"


class EdgeKey:
    """The cluster key of one node (``node_id``): mints tokens for requests to other nodes and
    checks the tokens sent to this one. See the module docstring for the token."""

    def __init__(self, key: str | bytes, node_id: str, *, window_s: float = EDGE_TOKEN_WINDOW_S,
                 clock: Callable[[], float] = time.time, max_seen: int = _MAX_SEEN) -> None:
        raw = key.encode() if isinstance(key, str) else bytes(key)
        if len(raw) < 16:
            raise ValueError("the cluster key must be at least 16 bytes")
        self._key = hashlib.sha256(b"kdn-cluster-key\0" + raw).digest()
        self.node_id = node_id
        self._window = window_s
        self._clock = clock
        self._max_seen = max_seen
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()  # (sender, nonce) -> forget after
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EdgeKey(node {self.node_id!r})"  # never the key

    def _mac(self, sender: str, dest: str, ms: str, nonce: str, scope: str) -> str:
        msg = "\0".join(("kdn-edge1", sender, dest, ms, nonce, scope)).encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def mint(self, dest: str, scope: str) -> str:
        """A one-use token for a request from this node to ``dest`` within ``scope``."""
        ms = str(int(self._clock() * 1000))
        nonce = secrets.token_hex(12)
        mac = self._mac(self.node_id, dest, ms, nonce, scope)
        return EDGE_TOKEN_PREFIX + ".".join((self.node_id.encode().hex(), dest.encode().hex(), ms, nonce, mac))

    def credential(self, dest: str) -> Callable[[str], str]:
        """``tenant -> token`` for data calls to ``dest`` (what peer upstreams send)."""
        return lambda tenant: self.mint(dest, tenant_scope(tenant))

    def verify(self, token: str | None, scope: str) -> str:
        """The sending node's id, once ``token`` is a fresh edge token to this node for ``scope``;
        else ``Unauthorized`` (one message for every reason: nothing to probe)."""
        refused = Unauthorized("not a valid edge token for this node")
        if not token or not token.startswith(EDGE_TOKEN_PREFIX) or len(token) > 2048:
            raise refused
        parts = token[len(EDGE_TOKEN_PREFIX):].split(".")
        if len(parts) != 5:
            raise refused
        sender_hex, dest_hex, ms, nonce, mac = parts
        try:
            sender, dest = bytes.fromhex(sender_hex).decode(), bytes.fromhex(dest_hex).decode()
            sent = int(ms) / 1000
        except ValueError:
            raise refused from None
        now = self._clock()
        if dest != self.node_id or abs(now - sent) > self._window or not sender:
            raise refused
        if not hmac.compare_digest(self._mac(sender, dest, ms, nonce, scope), mac):
            raise refused
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if (sender, nonce) in self._seen:
                raise refused  # a replay
            self._seen[(sender, nonce)] = now + 2 * self._window + 1
            while len(self._seen) > self._max_seen:
                self._seen.popitem(last=False)
        return sender


def is_edge_token(token: str | None) -> bool:
    return bool(token) and token.startswith(EDGE_TOKEN_PREFIX)  # type: ignore[union-attr]


@dataclass(frozen=True, slots=True)
class TokenAuth:
    """Maps bearer tokens to the tenants they may use. Empty mapping = auth off."""

    grants: Mapping[str, frozenset[str]] = field(default_factory=dict)
    edges: EdgeKey | None = None  # accepts other edges' tokens (see the module docstring)

    @classmethod
    def from_config(cls, tokens: Mapping[str, list[str]], edges: EdgeKey | None = None) -> "TokenAuth":
        return cls({tok: frozenset(tenants) for tok, tenants in tokens.items()}, edges)

    @property
    def enabled(self) -> bool:
        return bool(self.grants)

    def _tenants(self, token: str | None) -> frozenset[str] | None:
        if token is None:
            return None
        # constant-time comparison against every token: no timing hint about which prefix matched
        found = None
        for known, tenants in self.grants.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenants
        return found

    def check(self, token: str | None, tenant: str) -> None:
        """Raise ``Unauthorized`` unless ``token`` may act for ``tenant``."""
        if not self.enabled:
            return
        if self.edges is not None and is_edge_token(token):
            self.edges.verify(token, tenant_scope(tenant))
            return
        tenants = self._tenants(token)
        if tenants is None or not (ANY_TENANT in tenants or tenant in tenants):
            raise Unauthorized(f"token does not grant namespace {tenant!r}")

    def scope(self, token: str | None) -> frozenset[str] | None:
        """The tenants ``token`` may see node-wide answers (Stats) for: None = every tenant (auth
        off, or a ``*`` token: an operator). Call after :meth:`check_admin`."""
        if not self.enabled:
            return None
        tenants = self._tenants(token) or frozenset()
        return None if ANY_TENANT in tenants else tenants

    def check_admin(self, token: str | None) -> None:
        """Node-wide calls (Stats): any valid token."""
        if self.enabled and self._tenants(token) is None:
            raise Unauthorized("missing or unknown bearer token")

    def is_operator(self, token: str | None) -> bool:
        """Whether ``token`` sees every tenant: auth off, or a token granted ``*``."""
        return self.scope(token) is None
