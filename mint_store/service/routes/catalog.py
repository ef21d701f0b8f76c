"""Read-only routes for people (the web console, dashboards): tenants, adapter summaries,
compaction state. Same auth rules as the rest of the API; nothing here writes."""

from __future__ import annotations

from aiohttp import web

from ...format.names import check_name
from ...maintenance.catalog import adapter_summaries, compaction_state
from ...maintenance.compaction import CompactionPolicy
from ..errors import BadRequest
from ..state import principal_of, state_of
from .parsing import int_param

routes = web.RouteTableDef()
_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")


@routes.get("/v1/tenants", allow_head=False)
async def tenants(request: web.Request) -> web.Response:
    """The tenants this token may read (an admin: every tenant with adapters), and its role."""
    st = state_of(request)
    who = principal_of(request)
    names = await st.run(st.store.tenants) if who.is_admin else sorted(who.tenants)
    return web.json_response({"tenants": names, "role": who.role, "principal": who.label,
                              "auth": st.tokens is not None})


@routes.get("/v1/catalog/{tenant}", allow_head=False)
async def catalog(request: web.Request) -> web.Response:
    """One summary row per adapter (latest version, tags, base, rank, size, last publish)."""
    st = state_of(request)
    tenant = check_name(request.match_info["tenant"], "tenant")
    principal_of(request).require("read", tenant)  # before anything is looked up
    prefix = request.query.get("prefix", "")
    if len(prefix) > 64 or not set(prefix) <= _PREFIX_CHARS:
        raise BadRequest(f"invalid prefix {prefix!r}: use characters of [a-z0-9._-]")
    after = request.query.get("after")
    if after is not None:
        check_name(after, "cursor")
    limit = int_param(request, "limit", default=100, low=1, high=1000)
    rows = await st.run(adapter_summaries, st.store, tenant, prefix=prefix, after=after, limit=limit)
    return web.json_response(
        {"tenant": tenant, "adapters": rows, "next": rows[-1]["name"] if len(rows) == limit else None}
    )


@routes.get("/v1/admin/compaction", allow_head=False)
async def compaction(request: web.Request) -> web.Response:
    """What the default compaction policy would move now, retired shards awaiting the sweep,
    the last compaction and sweep, and the service's background maintenance settings."""
    st = state_of(request)
    principal_of(request).require("admin")
    cfg = st.config
    state = await st.run(compaction_state, st.store, CompactionPolicy(grace_s=cfg.compact_grace_s))
    return web.json_response(state | {
        "auto_compact": bool(cfg.auto_compact and st.store.writable),
        "interval_s": cfg.compact_interval_s,
        "grace_s": cfg.compact_grace_s,
        "writable": st.store.writable,
    })
