"""Handlers of ``/v1/adapters/...``: publish, list, metadata, bytes, PEFT export, tags, delete."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import Any, cast

from aiohttp import web

from ...fleet.replica import not_the_writer
from ...format.adapter import UNSPECIFIED_BASE
from ...format.names import check_name, check_version
from ...peft.directory import load_peft_files
from ...results import Location, PublishResult
from ..deadlines import write_outcome
from ..errors import BadRequest
from ..state import principal_of, state_of
from .export import build_export, send_tar
from .parsing import int_param, json_body, route_label
from .uploads import UploadLimits, receive_upload

routes = web.RouteTableDef()
_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")


def _tenant(request: web.Request, role: str) -> str:
    """The path's tenant, checked against the caller before anything is looked up."""
    tenant = check_name(request.match_info["tenant"], "tenant")
    principal_of(request).require(role, tenant)
    return tenant


def _name(request: web.Request) -> str:
    return check_name(request.match_info["name"])


VERSIONS_PAGE = 1000  # the most versions one listing answers


def _version(request: web.Request) -> int:
    return check_version(request.match_info["version"])


@routes.put("/v1/adapters/{tenant}/{name}")
async def publish(request: web.Request) -> web.Response:
    st = state_of(request)
    tenant, name = _tenant(request, "write"), _name(request)
    if not st.store.writable:  # before receiving a body that could never be stored: name the writer
        raise await st.run(not_the_writer, st.store.storage)
    base = check_name(request.query.get("base", UNSPECIFIED_BASE), "base")
    tag = request.query.get("tag")
    if tag is not None:
        check_name(tag, "tag")
    cfg = st.config
    started = time.perf_counter()
    limits = UploadLimits(body=cfg.body_limit, config=cfg.config_limit, read_timeout=cfg.read_timeout,
                          buffer=cfg.upload_buffer, rearm=cfg.request_timeout)
    # the tenant's own share while the body arrives; a global slot only for a complete body
    async with st.tenant_slots.hold(tenant), receive_upload(
        request, limits=limits, executor=st.executor, tmp_dir=cfg.upload_dir,
        on_bytes=st.metrics.bytes_received.inc, on_buffered=st.metrics.note_upload_buffered,
    ) as upload, st.uploads, \
            st.decode_budget.hold(upload.decode_nbytes, principal_of(request).label):
        # decode and hand the row to the writer in one executor call: the decoded tensors
        # are dropped there, only the row waits for the group commit. From the decode on, the
        # answer is the commit's (a 408 while it lands would invite a resend: a second version)
        result = await write_outcome(request, _decode_submit_wait(st, tenant, name, upload, base, tag),
                                     cfg.request_timeout)
    st.metrics.publish_seconds.observe(time.perf_counter() - started)
    body = result.to_dict() | {"upload_sha256": upload.weights_sha256}
    who = principal_of(request)
    if not who.is_admin:  # the store's seq counts every tenant's commits: the tenant's own numbering
        body["seq"] = await st.run(st.tenant_seqs.track(who).number_of, st.store.events, result.seq)
    location = f"/v1/adapters/{tenant}/{name}/versions/{result.version}"
    return web.json_response(body, status=201, headers={"Location": location})


async def _decode_submit_wait(st: Any, tenant: str, name: str, upload: Any, base: str,
                              tag: str | None) -> PublishResult:
    """Decode on the executor, hand the row to the writer, then wait for its group commit here."""
    fut = await st.run(_decode_and_submit, st.store, tenant, name, upload.config, upload.weights_path, base, tag)
    return cast(PublishResult, await asyncio.wrap_future(fut))


@routes.get("/v1/adapters/{tenant}", allow_head=False)
async def list_names(request: web.Request) -> web.Response:
    st = state_of(request)
    tenant = _tenant(request, "read")
    prefix = request.query.get("prefix", "")
    if len(prefix) > 64 or not set(prefix) <= _PREFIX_CHARS:
        raise BadRequest(f"invalid prefix {prefix!r}: use characters of [a-z0-9._-]")
    after = request.query.get("after") or request.query.get("cursor")
    if after is not None:
        check_name(after, "cursor")
    limit = int_param(request, "limit", default=100, low=1, high=1000)
    names = await st.run(st.store.names, tenant, prefix=prefix, after=after, limit=limit)
    return web.json_response(
        {"tenant": tenant, "names": names, "next": names[-1] if len(names) == limit else None}
    )


@routes.get("/v1/adapters/{tenant}/{name}", allow_head=False)
async def latest(request: web.Request) -> web.Response:
    st = state_of(request)
    tenant, name = _tenant(request, "read"), _name(request)
    info = await st.run(st.store.version, f"{tenant}/{name}")
    return web.json_response(info.to_dict() | {"peft_config": info.peft_config})


@routes.get("/v1/adapters/{tenant}/{name}/versions", allow_head=False)
async def versions(request: web.Request) -> web.Response:
    st = state_of(request)
    tenant, name = _tenant(request, "read"), _name(request)
    # a page at a time (a policy published every training step has thousands): versions above
    # ?after, at most ?limit; "next" is the cursor of the following page, null on the last
    after = int_param(request, "after", default=0, low=0, high=2**62)
    limit = int_param(request, "limit", default=VERSIONS_PAGE, low=1, high=VERSIONS_PAGE)
    infos = await st.run(st.store.versions, tenant, name, after=after, limit=limit)
    return web.json_response({"tenant": tenant, "name": name, "versions": [i.to_dict() for i in infos],
                              "next": infos[-1].version if len(infos) == limit else None})


@routes.get("/v1/adapters/{tenant}/{name}/versions/{version}", allow_head=False)
async def version(request: web.Request) -> web.Response:
    st = state_of(request)
    tenant, name, v = _tenant(request, "read"), _name(request), _version(request)
    info = await st.run(st.store.version, f"{tenant}/{name}@{v}")
    return web.json_response(info.to_dict() | {"peft_config": info.peft_config})


@routes.get("/v1/adapters/{tenant}/{name}/versions/{version}/content", allow_head=True)
async def content(request: web.Request) -> web.StreamResponse:
    st = state_of(request)
    ref = f"{_tenant(request, 'read')}/{_name(request)}@{_version(request)}"

    async def resolve() -> Location:
        return await st.resolver.resolve(ref)

    return await st.rows.send(request, await resolve(), resolve, route=route_label(request),
                              owner=principal_of(request).label)


@routes.get("/v1/adapters/{tenant}/{name}/versions/{version}/peft", allow_head=False)
async def peft(request: web.Request) -> web.StreamResponse:
    st = state_of(request)
    tenant, name, v = _tenant(request, "read"), _name(request), _version(request)
    ref = f"{tenant}/{name}@{v}"
    loc = await st.resolver.resolve(ref)  # its size: the export holds the whole adapter while it is sent
    async with st.rows.buffers.hold(loc.length, principal_of(request).label):
        export = await st.run(build_export, st.store, ref)
        return await send_tar(request, export, f"{tenant}-{name}-v{v}.tar", st.config.read_timeout)


def _decode_and_submit(store: Any, tenant: str, name: str, config: bytes, weights_path: str, base: str,
                       tag: str | None) -> Future[PublishResult]:
    adapter = load_peft_files(config, weights_path, base=base, limits=store.config.limits)
    return cast("Future[PublishResult]", store.publish_async(tenant, name, adapter, tag=tag))


@routes.get("/v1/adapters/{tenant}/{name}/tags/{tag}", allow_head=False)
async def get_tag(request: web.Request) -> web.Response:
    st = state_of(request)
    tenant, name = _tenant(request, "read"), _name(request)
    tag = check_name(request.match_info["tag"], "tag")
    info = await st.run(st.store.version, f"{tenant}/{name}:{tag}")
    return web.json_response(info.to_dict() | {"peft_config": info.peft_config})


@routes.put("/v1/adapters/{tenant}/{name}/tags/{tag}")
async def put_tag(request: web.Request) -> web.Response:
    st = state_of(request)
    tenant, name = _tenant(request, "write"), _name(request)
    tag = check_name(request.match_info["tag"], "tag")
    body = await json_body(request, st.config.json_limit, read_timeout=st.config.read_timeout,
                                  rearm=st.config.request_timeout)
    if not isinstance(body, dict) or set(body) != {"version"}:
        raise BadRequest('expected a JSON body {"version": N}')
    v = check_version(body["version"])
    got = await st.write(request, st.store.tag, f"{tenant}/{name}@{v}", tag)
    return web.json_response({"tenant": tenant, "name": name, "tag": tag, "version": got})


@routes.delete("/v1/adapters/{tenant}/{name}/tags/{tag}")
async def delete_tag(request: web.Request) -> web.Response:
    st = state_of(request)
    tenant, name = _tenant(request, "write"), _name(request)
    tag = check_name(request.match_info["tag"], "tag")
    await st.write(request, st.store.untag, tenant, name, tag)
    return web.json_response({"tenant": tenant, "name": name, "tag": tag, "deleted": True})


@routes.delete("/v1/adapters/{tenant}/{name}/versions/{version}")
async def delete_version(request: web.Request) -> web.Response:
    st = state_of(request)
    tenant, name, v = _tenant(request, "write"), _name(request), _version(request)
    got = await st.write(request, st.store.delete, f"{tenant}/{name}@{v}")
    return web.json_response({"tenant": tenant, "name": name, "version": got, "deleted": True})
