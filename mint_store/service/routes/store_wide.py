"""Handlers without a tenant in the path: resolve, blobs, layouts, bases, events, admin, ops."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from aiohttp import web

from ...errors import BaseNotFound, MintError, NotFound
from ...format.names import check_content_id, check_name
from ...maintenance.compaction import compact as compact_store
from ...results import Location
from ..auth import Principal
from ..console import CONSOLE_PATHS
from ..deadlines import deadline_paused
from ..errors import BadRequest
from ..local_copy import LOCAL_COPY
from ..metrics import CONTENT_TYPE
from ..openapi import document
from ..ref_answers import answers, screen
from ..standby import STANDBY
from ..state import ServiceState, principal_of, state_of
from .parsing import float_param, int_param, json_body, route_label

routes = web.RouteTableDef()
# /metrics is not public: its figures (commits, versions, requests, bytes) sum every
# tenant's activity, so with a token file it takes an admin token. The console's page
# holds no data.
PUBLIC_PATHS = frozenset({"/healthz", "/openapi.json"}) | CONSOLE_PATHS
RESOLVE_BYTES_PER_REF = 256  # JSON bytes of one ref, on average, a resolve body may spend


@routes.post("/v1/resolve")
async def resolve(request: web.Request) -> web.Response:
    st = state_of(request)
    who = principal_of(request)
    # a valid ref is at most ~200 bytes of JSON: a body sized for max_resolve of them, not json_limit
    # (16 MiB of one-character refs took ~0.3 s of the event loop to parse and walk, answered 400)
    limit = min(st.config.json_limit, RESOLVE_BYTES_PER_REF * st.config.max_resolve + 1024)
    body = await json_body(request, limit, read_timeout=st.config.read_timeout, rearm=st.config.request_timeout)
    refs = body.get("refs") if isinstance(body, dict) else None
    if isinstance(refs, list) and len(refs) > st.config.max_resolve:  # counted before anything is walked
        raise BadRequest(f"{len(refs)} refs in one call; the limit is {st.config.max_resolve}")
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise BadRequest('expected a JSON body {"refs": ["tenant/name", "tenant/name@3", "tenant/name:prod", '
                         '"sha:<content id>", ...]}')
    # refs of tenants the caller does not hold are refused in place, before the lookup (ref_answers.py)
    screened, allowed = screen(refs, who)
    found = await st.run(st.store.resolve_many, allowed, owners=who.owner_filter())
    return web.json_response({"results": answers(refs, screened, found, who)})


@routes.get("/v1/blobs/{content_id}", allow_head=True)
async def blob(request: web.Request) -> web.StreamResponse:
    st = state_of(request)
    ref = f"sha:{check_content_id(request.match_info['content_id'])}"
    owners = principal_of(request).owner_filter()

    async def lookup() -> Location:
        return await st.resolver.resolve(ref, owners)

    return await st.rows.send(request, await lookup(), lookup, route=route_label(request),
                              owner=principal_of(request).label)


@routes.get("/v1/layouts/{layout_id}", allow_head=False)
async def layout(request: web.Request) -> web.Response:
    st = state_of(request)
    layout_id = request.match_info["layout_id"]
    if len(layout_id) != 32 or not all(c in "0123456789abcdef" for c in layout_id):
        raise BadRequest(f"invalid layout id {layout_id!r}: expected 32 lowercase hex digits")
    # a tenant token: only layouts of its own live versions, else the 404 of an unknown id (that
    # some tenant stores this rank and target set is not its business)
    lay = await st.run(st.store.layout, layout_id, owners=principal_of(request).owner_filter())
    return web.json_response({"layout_id": lay.layout_id, **lay.to_dict()})


@routes.put("/v1/bases/{base}")
async def put_base(request: web.Request) -> web.Response:
    st = state_of(request)
    principal_of(request).require("admin")  # bases are shared by every tenant
    base = check_name(request.match_info["base"], "base")
    shapes = await json_body(request, st.config.json_limit, read_timeout=st.config.read_timeout,
                                  rearm=st.config.request_timeout)
    if not isinstance(shapes, dict):
        raise BadRequest('expected a JSON body {"module.path": [in, out] | [in, out, experts], ...}')
    try:
        before = await st.run(st.store.base, base)
    except BaseNotFound:
        before = None
    if before is None or before != shapes:  # re-registering the same shapes writes nothing
        await st.write(request, st.store.register_base, base, shapes)
    return web.json_response({"base": base, "modules": len(shapes)}, status=201 if before is None else 200)


@routes.get("/v1/bases/{base}", allow_head=False)
async def get_base(request: web.Request) -> web.Response:
    st = state_of(request)
    base = check_name(request.match_info["base"], "base")
    return web.json_response({"base": base, "shapes": await st.run(st.store.base, base)})


@routes.get("/v1/bases", allow_head=False)
async def list_bases(request: web.Request) -> web.Response:
    """Registered bases and their module counts (shared by every tenant, like GET of one base)."""
    st = state_of(request)
    bases = await st.run(st.store.bases)
    return web.json_response({"bases": [{"base": k, "modules": n} for k, n in sorted(bases.items())]})


@routes.get("/v1/events", allow_head=False)
async def events(request: web.Request) -> web.Response:
    """Long poll of the change feed: returns as soon as something visible is committed.

    An admin gets the store's seqs. A tenant token gets its own numbering (tenant_feed.py):
    ``seq`` n is the n-th event it can see, ``after``, ``last_seq`` and ``head`` count the same
    way, so nothing in the answer counts other tenants' commits.
    """
    st = state_of(request)
    who = principal_of(request)
    after = int_param(request, "after", default=0, low=0, high=2**62)
    wait = float_param(request, "wait", default=0.0, low=0.0, high=st.config.max_event_wait)
    limit = int_param(request, "limit", default=1000, low=0, high=1000)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    st.metrics.event_waiters.inc()
    try:
        if not who.is_admin:
            return web.json_response(await _tenant_events(request, st, who, after, deadline, limit))
        cursor, shown = after, []
        while limit:
            scanned = await st.run(st.store.events, cursor, limit=limit)
            if scanned:
                cursor = int(scanned[-1]["seq"])
            shown = scanned
            if shown or st.feed.closed or loop.time() >= deadline:
                break
            await _wait_for_commit(request, st, cursor, deadline)
    finally:
        st.metrics.event_waiters.dec()
    return web.json_response({"events": shown, "last_seq": cursor, "head": max(st.feed.seq, cursor)})


async def _wait_for_commit(request: web.Request, st: ServiceState, seq: int, deadline: float) -> None:
    # waiting is the client's choice (wait <= max_event_wait), not server work: the
    # whole-request deadline resumes, with its full length, once the wait ends
    with deadline_paused(request, st.config.request_timeout):
        await st.feed.wait_beyond(seq, deadline - asyncio.get_running_loop().time())


async def _tenant_events(request: web.Request, st: ServiceState, who: Principal, after: int, deadline: float,
                         limit: int) -> dict[str, Any]:
    """A tenant's answer, in its own numbering: its events after its seq ``after``."""
    track = st.tenant_seqs.track(who)
    loop = asyncio.get_running_loop()
    while True:
        upto = st.feed.seq
        shown, head = await st.run(track.page, st.store.events, upto, after, limit)
        if shown or not limit or st.feed.closed or loop.time() >= deadline:
            break
        await _wait_for_commit(request, st, upto, deadline)  # other tenants' commits wake it too
    last_seq = int(shown[-1]["seq"]) if shown else after
    return {"events": shown, "last_seq": last_seq, "head": max(head, last_seq)}


@routes.post("/v1/admin/compact")
async def compact(request: web.Request) -> web.Response:
    st = state_of(request)
    principal_of(request).require("admin")
    # ?grace=S also sweeps shards retired more than S seconds ago
    grace = request.query.get("grace")
    try:
        grace_s = None if grace is None else float(grace)
    except ValueError:
        raise BadRequest(f"grace must be a number of seconds, not {grace!r}") from None
    if grace_s is not None and not grace_s >= 0:
        raise BadRequest("grace must be >= 0")

    def run() -> dict[str, Any]:
        out: dict[str, Any] = compact_store(st.store).to_dict()
        if grace_s is not None:
            out["swept"] = st.store.sweep(grace_s=grace_s)
        return out

    return web.json_response(await st.run(run))


@routes.get("/v1/admin/stats", allow_head=False)
async def stats(request: web.Request) -> web.Response:
    st = state_of(request)
    principal_of(request).require("admin")
    from ...maintenance.stats import store_stats

    index = await st.run(st.store.index_stats)
    return web.json_response({
        "index": index,
        "store_stats": await st.run(lambda: store_stats(st.store)),
        "store": st.store.storage.url,
        "writable": st.store.writable,
        "replica": st.store.health().get("replica"),  # a read-only store: following, what it skipped
        "uptime_s": round(time.time() - st.started, 3),
        "auth": st.tokens is not None,
    })


@routes.get("/healthz", allow_head=False)
async def healthz(request: web.Request) -> web.Response:
    """200 ``ok``; 503 ``degraded`` while a writable server's store takes no writes (and why),
    so that a load balancer moves writes elsewhere until the writer has recovered; 503
    ``degraded`` too while a replica (or a standby) is not following the log, ``reason`` a
    fixed code (``log_gap``, ``not_following``: fleet/replica_stats.py), so that reads go elsewhere."""
    st = state_of(request)
    # the store's commit count sums every tenant's activity, and errors carry paths and endpoints:
    # with tokens, for admins only (as /metrics)
    details = _admin_or_open(request, st)
    seq = {"last_seq": st.feed.seq} if details else {}
    role = request.app.get(STANDBY)
    health = st.store.health()
    replica = health.get("replica")  # a read-only store's view of the log (a replica, a waiting standby)
    stuck = replica["reason"] if replica is not None else None  # a fixed code, never error text
    degraded = (st.store.writable and not health["writable"]) or stuck is not None
    if role is not None and role.waiting:  # "standby", 200: it serves reads; writes go to writer_url
        body = role.health() | seq | ({"status": "degraded"} if degraded else {})
    else:
        body = {"status": "degraded" if degraded else "ok", **seq, "writable": health["writable"]}
    if stuck is not None and replica is not None:
        body.update(reason=stuck, since=replica["since"])
    elif degraded:
        body.update(reason=health.get("reason"), since=health.get("since"))
    if replica is not None and details:  # what it was built from, its last poll and error, what it skipped
        body["replica"] = {k: replica[k] for k in ("checkpoint_seq", "last_poll", "last_error", "reloads",
                                                   "failures", "foreign_log_objects", "gap")}
    return web.json_response(body, status=503 if degraded else 200)


@routes.get("/v1/local-socket", allow_head=False)
async def local_socket(request: web.Request) -> web.Response:
    """Where this server copies rows into callers' memory (``--local-socket``), the id its
    socket answers ``hello`` with and the user it runs as: a client on this machine checks it
    reached this server's socket, not another one at the same path (:mod:`..local_copy`). 404
    without a socket."""
    principal_of(request)  # (any token that may read: the path is of this machine, the id random)
    server = request.app.get(LOCAL_COPY)
    if server is None:
        raise NotFound("this service has no local socket (mint serve --local-socket PATH)")
    # the uid: a client checks the socket's peer runs as this server's user before it sends a token there
    return web.json_response({"path": str(server.path), "instance": server.instance, "uid": os.getuid()})


def _admin_or_open(request: web.Request, st: ServiceState) -> bool:
    """No token file (this machine only), or the request carries an admin token (/healthz is public)."""
    if st.tokens is None:
        return True
    try:
        return st.tokens.authenticate(request.headers.get("Authorization")).is_admin
    except MintError:
        return False


@routes.get("/metrics", allow_head=False)
async def metrics(request: web.Request) -> web.Response:
    st = state_of(request)
    principal_of(request).require("admin")
    text = st.metrics.render(await st.run(st.store.index_stats), replica=st.store.health().get("replica"))
    return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE})


@routes.get("/openapi.json", allow_head=False)
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(document())
