"""Bearer tokens: who may read or write which tenants.

The token file is a public surface::

    {"tokens": [{"token": "...", "tenants": ["acme"], "role": "write"}]}

Roles are ordered read < write < admin; write implies read; an admin acts on every
tenant (its ``tenants`` may be empty). A token naming a tenant it does not hold gets 403
before anything is looked up, so the answer is the same whether or not the adapter
exists. Content-addressed routes (``/v1/blobs/{id}``, ``sha:`` refs) have no tenant in
the path: they answer 404 unless a live version of one of the token's tenants holds the
content, which hides whether another tenant has it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..format import strict_json
from ..format.names import check_name
from .errors import Forbidden, Unauthorized

ROLES = ("read", "write", "admin")
_RANK = {role: i for i, role in enumerate(ROLES)}
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller a request acts for."""

    label: str
    role: str
    tenants: frozenset[str]

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def allows(self, role: str) -> bool:
        return _RANK[self.role] >= _RANK[role]

    def holds(self, tenant: str) -> bool:
        return self.is_admin or tenant in self.tenants

    def require(self, role: str, tenant: str | None = None) -> None:
        """Raise Forbidden unless this principal has ``role`` (on ``tenant`` when given)."""
        if tenant is not None and not self.holds(tenant):
            raise Forbidden(f"this token does not hold tenant {tenant!r}")
        if not self.allows(role):
            raise Forbidden(f"this token has role {self.role!r}; {role!r} is needed")

    def owner_filter(self) -> frozenset[str] | None:
        """Tenants whose content this principal may read by content id (None: all)."""
        return None if self.is_admin else self.tenants


LOOPBACK_ADMIN = Principal("loopback (no token file)", "admin", frozenset())


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True, slots=True)
class TokenTable:
    """Tokens by their SHA-256, so no lookup compares the secret itself byte by byte."""

    by_digest: Mapping[bytes, Principal]

    @classmethod
    def parse(cls, doc: Any, *, source: str = "token file") -> TokenTable:
        if not isinstance(doc, dict) or not isinstance(doc.get("tokens"), list):
            raise ValueError(f'{source}: expected {{"tokens": [{{"token", "tenants", "role"}}, ...]}}')
        out: dict[bytes, Principal] = {}
        for i, entry in enumerate(doc["tokens"]):
            where = f"{source}: tokens[{i}]"
            if not isinstance(entry, dict) or set(entry) - {"token", "tenants", "role", "name"}:
                raise ValueError(f"{where}: expected an object with token, tenants, role (and an optional name)")
            token, tenants, role = entry.get("token"), entry.get("tenants", []), entry.get("role")
            if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or not token.isprintable():
                raise ValueError(f"{where}: token must be a printable string of at least {MIN_TOKEN_CHARS} chars")
            if role not in ROLES:
                raise ValueError(f"{where}: role must be one of {ROLES}, not {role!r}")
            if not isinstance(tenants, list) or (not tenants and role != "admin"):
                raise ValueError(f"{where}: tenants must be a non-empty list (empty only for admin)")
            try:
                held = frozenset(check_name(t, "tenant") for t in tenants)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            digest = _digest(token)
            if digest in out:
                raise ValueError(f"{where}: duplicate token")
            label = str(entry.get("name") or f"token #{i} ({role} on {','.join(sorted(held)) or 'all'})")
            out[digest] = Principal(label, role, held)
        return cls(out)

    @classmethod
    def load(cls, path: str) -> TokenTable:
        with open(path, encoding="utf-8") as f:
            try:
                doc = strict_json.loads(f.read())  # bounded: a hostile file is an error, not a crash
            except ValueError as e:
                raise ValueError(f"token file {path}: not valid JSON ({e})") from None
        return cls.parse(doc, source=f"token file {path}")

    def authenticate(self, header: str | None) -> Principal:
        """The principal of an ``Authorization: Bearer <token>`` header, or Unauthorized."""
        if not header:
            raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
        if not token.isprintable():  # tokens are printable (parse); a header's
            # undecodable bytes come in as lone surrogates, which no str.encode() takes
            raise Unauthorized("unknown token")
        # looked up by digest: timing can reveal at most a digest prefix, which does not help guess a token
        principal = self.by_digest.get(_digest(token))
        if principal is None:
            raise Unauthorized("unknown token")
        return principal
