"""What a resolve answers its caller: ``POST /v1/resolve``, and ``resolve`` on the same-machine socket.

Both answer alike, so a client gets the same locations and the same typed errors either way:

- a ref of a tenant the caller does not hold is refused in place (``forbidden``), before any
  lookup;
- the rest are looked up with the caller's owner filter (``Store.resolve_many``);
- a location shows a tenant's token no shard, offset or row: where a row lies tells whether its
  bytes were stored before (another tenant's identical adapter: an old row of an old shard,
  where new bytes get a new one), so clients that are not admin read by content id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import MintError
from ..results import Location
from .auth import Principal
from .errors import error_body


def screen(refs: Sequence[str], who: Principal) -> tuple[list[dict[str, Any] | None], list[str]]:
    """Per ref, its answer where it is refused before the lookup (else None), and the refs to look up."""
    allowed: list[str] = []
    results: list[dict[str, Any] | None] = []
    for ref in refs:
        tenant = ref.split("/", 1)[0] if "/" in ref and not ref.startswith("sha:") else None
        if tenant is not None and not who.holds(tenant):
            results.append({"ref": ref, "error": "forbidden", "message": f"this token does not hold tenant {tenant!r}"})
        else:
            results.append(None)
            allowed.append(ref)
    return results, allowed


def answers(refs: Sequence[str], screened: Sequence[dict[str, Any] | None], found: Sequence[Location | MintError],
            who: Principal) -> list[dict[str, Any]]:
    """Each ref's answer: the refused ones as :func:`screen` left them, the others from ``found``
    (``resolve_many`` of the refs it allowed, in order)."""
    looked = iter(found)
    out = []
    for ref, res in zip(refs, screened, strict=True):
        if res is None:
            got = next(looked, None)
            if got is None:
                raise RuntimeError("resolve_many returned fewer results than refs")
            res = {"ref": ref, **error_body(got)} if isinstance(got, MintError) else {
                "ref": ref, "location": location_for(got, who)}
        out.append(res)
    return out


def location_for(loc: Location, who: Principal) -> dict[str, Any]:
    """A location as ``who`` may see it (an admin: all of it; a tenant: no shard, offset or row)."""
    d = loc.to_dict()
    return d if who.is_admin else d | {"shard_key": "", "offset": 0, "row": 0}
