"""Names and refs: the grammar every tenant, name, tag and ref must follow."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ..errors import InvalidName

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_CONTENT_ID_RE = re.compile(r"[0-9a-f]{32}")
_MAX_VERSION = 2**53


def check_name(value: object, what: str = "name") -> str:
    """Return ``value`` if it is a valid tenant/name/tag, else raise InvalidName.

    ASCII only on purpose: look-alike unicode, ``..``, ``/`` and empty names are all refused.
    """
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or ".." in value:
        raise InvalidName(
            f"invalid {what} {value!r}: use 1-64 characters of [a-z0-9._-], starting with a "
            "letter or digit, without '..'"
        )
    return value


def check_version(value: object) -> int:
    """Parse a version: a positive integer (``7`` or ``"7"``)."""
    if isinstance(value, bool):
        raise InvalidName(f"invalid version {value!r}: versions are integers >= 1")
    if isinstance(value, str):
        if not value.isascii() or not value.isdigit() or len(value) > 16:
            raise InvalidName(f"invalid version {value!r}: versions are integers >= 1")
        value = int(value)
    if not isinstance(value, int) or not 1 <= value < _MAX_VERSION:
        raise InvalidName(f"invalid version {value!r}: versions are integers >= 1")
    return value


def check_content_id(value: object) -> str:
    if not isinstance(value, str) or not _CONTENT_ID_RE.fullmatch(value):
        raise InvalidName(f"invalid content id {value!r}: expected 32 lowercase hex digits")
    return value


@dataclass(frozen=True, slots=True)
class Ref:
    """A parsed ref. Exactly one of: latest, ``version``, ``tag``, or ``content_id`` alone."""

    tenant: str | None = None
    name: str | None = None
    version: int | None = None
    tag: str | None = None
    content_id: str | None = None

    def __str__(self) -> str:
        if self.content_id is not None:
            return f"sha:{self.content_id}"
        base = f"{self.tenant}/{self.name}"
        if self.version is not None:
            return f"{base}@{self.version}"
        if self.tag is not None:
            return f"{base}:{self.tag}"
        return base


def parse_ref(text: object) -> Ref:
    """Parse ``tenant/name``, ``tenant/name@N``, ``tenant/name:tag`` or ``sha:<content_id>``."""
    if isinstance(text, Ref):
        return text
    if not isinstance(text, str) or len(text) > 256:
        raise InvalidName(f"invalid ref {text!r}")
    if text.startswith("sha:"):
        return Ref(content_id=check_content_id(text[4:]))
    tenant, sep, rest = text.partition("/")
    if not sep:
        raise InvalidName(
            f"invalid ref {text!r}: expected tenant/name, tenant/name@VERSION, tenant/name:TAG "
            "or sha:CONTENT_ID"
        )
    check_name(tenant, "tenant")
    if "@" in rest:
        name, _, v = rest.partition("@")
        return Ref(tenant, check_name(name), version=check_version(v))
    if ":" in rest:
        name, _, tag = rest.partition(":")
        return Ref(tenant, check_name(name), tag=check_name(tag, "tag"))
    return Ref(tenant, check_name(rest))


@functools.lru_cache(maxsize=65_536)
def parse_ref_cached(text: str) -> Ref:
    """:func:`parse_ref` for the hot path: engines resolve the same refs again and again."""
    return parse_ref(text)


def split_full_name(text: str) -> tuple[str, str]:
    """``tenant/name`` -> (tenant, name), validated."""
    tenant, sep, name = text.partition("/")
    if not sep:
        raise InvalidName(f"invalid adapter name {text!r}: expected TENANT/NAME")
    return check_name(tenant, "tenant"), check_name(name)
