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
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Mapping

from kdn.errors import Unauthorized

ANY_TENANT = "*"


@dataclass(frozen=True, slots=True)
class TokenAuth:
    """Maps bearer tokens to the tenants they may use. Empty mapping = auth off."""

    grants: Mapping[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, tokens: Mapping[str, list[str]]) -> "TokenAuth":
        return cls({tok: frozenset(tenants) for tok, tenants in tokens.items()})

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
