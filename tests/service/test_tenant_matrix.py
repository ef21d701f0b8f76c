"""Tenant isolation: every route, with a token of one tenant, on another tenant's adapters.

A valid token naming a tenant it does not hold gets 403 before anything is looked up, so
an adapter that exists and one that does not get the same answer. Content-addressed
routes answer 404 (not found) for content no tenant of the token holds.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from mint_store.service import RunningServer, ServiceConfig, start_server
from tests.support.service import TOKENS, auth, expect_error, peft_form, publish, read_peft, snapshot
from tests.support.targets import StoreTarget

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass(frozen=True)
class World:
    server: RunningServer
    http: aiohttp.ClientSession
    files: dict[str, bytes]
    published: dict[str, dict[str, Any]]  # tenant -> publish result of "<tenant>/model"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory, peft_dir: Path, peft_dir2: Path) -> AsyncIterator[World]:
    root = tmp_path_factory.mktemp("matrix")
    (root / "uploads").mkdir()
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [
        {"token": TOKENS["acme"], "tenants": ["acme"], "role": "write"},
        {"token": TOKENS["beta"], "tenants": ["beta"], "role": "write"},
        {"token": TOKENS["acme-read"], "tenants": ["acme"], "role": "read"},
        {"token": TOKENS["admin"], "tenants": [], "role": "admin"},
    ]}))
    target = StoreTarget("local", str(root / "store"), str(root / "index"), None)
    server = await start_server(ServiceConfig(store=target.url, index_dir=target.index_dir, port=0,
                                              tokens_file=str(tokens), upload_dir=str(root / "uploads")))
    async with aiohttp.ClientSession() as http:
        published = {
            "acme": await publish(http, server, read_peft(peft_dir2), "acme", "model", headers=auth("acme"),
                                  query="?tag=prod"),
            "beta": await publish(http, server, read_peft(peft_dir), "beta", "model", headers=auth("beta"),
                                  query="?tag=prod"),
        }
        yield World(server, http, read_peft(peft_dir), published)
    await server.stop()


def tenant_routes(tenant: str, name: str) -> list[tuple[str, str, str]]:
    """(method, path, body kind) of every route with a tenant in its path."""
    a = f"/v1/adapters/{tenant}/{name}"
    return [
        ("PUT", a, "upload"),
        ("GET", f"/v1/adapters/{tenant}", ""),
        ("GET", a, ""),
        ("GET", f"{a}/versions", ""),
        ("GET", f"{a}/versions/1", ""),
        ("GET", f"{a}/versions/1/content", ""),
        ("HEAD", f"{a}/versions/1/content", ""),
        ("GET", f"{a}/versions/1/peft", ""),
        ("GET", f"{a}/tags/prod", ""),
        ("PUT", f"{a}/tags/canary", "json"),
        ("DELETE", f"{a}/tags/prod", ""),
        ("DELETE", f"{a}/versions/1", ""),
    ]


async def _send(w: World, method: str, path: str, body: str, token: str | None) -> aiohttp.ClientResponse:
    kwargs: dict[str, Any] = {"headers": auth(token) if token else {}}
    if body == "upload":
        kwargs["data"] = peft_form(w.files)
    elif body == "json":
        kwargs["json"] = {"version": 1}
    return await w.http.request(method, w.server.url + path, **kwargs)


PAIRS = [("acme", "beta"), ("beta", "acme"), ("acme-read", "beta")]
ROUTE_IDS = [f"{m} {p.replace('/v1/adapters/T/N', '')}" for m, p, _ in tenant_routes("T", "N")]


@pytest.mark.parametrize(("who", "other"), PAIRS)
@pytest.mark.parametrize("route", range(len(ROUTE_IDS)), ids=ROUTE_IDS)
@pytest.mark.parametrize("exists", [True, False], ids=["existing", "missing"])
async def test_a_token_never_touches_another_tenant(world: World, who: str, other: str, route: int,
                                                    exists: bool) -> None:
    method, path, body = tenant_routes(other, "model" if exists else "ghost")[route]
    before = snapshot(world.server)
    async with await _send(world, method, path, body, who) as r:
        if method == "HEAD":
            assert r.status == 403
        else:
            got = await expect_error(r, 403, "forbidden")
            assert got["message"] == f"this token does not hold tenant '{other}'"
    assert snapshot(world.server) == before


@pytest.mark.parametrize(("who", "other"), PAIRS)
async def test_content_addressed_routes_hide_other_tenants(world: World, who: str, other: str) -> None:
    theirs = world.published[other]
    url = world.server.url
    for method in ("GET", "HEAD"):
        async with world.http.request(method, f"{url}/v1/blobs/{theirs['content_id']}", headers=auth(who)) as r:
            assert r.status == 404
            if method == "GET":
                await expect_error(r, 404, "blob_not_found")
    refs = [f"{other}/model", f"{other}/model:prod", f"sha:{theirs['content_id']}"]
    async with world.http.post(f"{url}/v1/resolve", json={"refs": refs}, headers=auth(who)) as r:
        results = (await r.json())["results"]
    assert [x.get("error") for x in results] == ["forbidden", "forbidden", "blob_not_found"]
    assert not any("location" in x for x in results)
    async with world.http.get(f"{url}/v1/events", params={"after": "0"}, headers=auth(who)) as r:
        events = (await r.json())["events"]
    tenants = {i["tenant"] for e in events for i in e.get("items", [])} | {e["tenant"] for e in events if "tenant" in e}
    assert other not in tenants and tenants <= {who.split("-")[0]}


@pytest.mark.parametrize("who", ["acme", "beta", "acme-read"])
async def test_admin_routes_need_admin(world: World, who: str) -> None:
    url = world.server.url
    for method, path, body in (("POST", "/v1/admin/compact", None), ("GET", "/v1/admin/stats", None),
                               ("PUT", "/v1/bases/shared", {"m": [1, 2]})):
        async with world.http.request(method, url + path, headers=auth(who), json=body) as r:
            await expect_error(r, 403, "forbidden")
    async with world.http.get(f"{url}/v1/admin/stats", headers=auth("admin")) as r:
        assert r.status == 200


async def test_missing_or_wrong_token_is_401_everywhere(world: World) -> None:
    cid, layout_id = world.published["acme"]["content_id"], world.published["acme"]["layout_id"]
    routes = [
        *tenant_routes("acme", "model"),
        ("POST", "/v1/resolve", "json"), ("GET", f"/v1/blobs/{cid}", ""), ("GET", f"/v1/layouts/{layout_id}", ""),
        ("GET", "/v1/bases/x", ""), ("PUT", "/v1/bases/x", "json"), ("GET", "/v1/events", ""),
        ("POST", "/v1/admin/compact", ""), ("GET", "/v1/admin/stats", ""),
    ]
    before = snapshot(world.server)
    for header in ({}, {"Authorization": "Bearer not-a-real-token-at-all"}, {"Authorization": "Basic YTpi"},
                   {"Authorization": "Bearer"}):
        for method, path, _ in routes:
            async with world.http.request(method, world.server.url + path, headers=header) as r:
                assert r.status == 401, (method, path, header)
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
                if method != "HEAD":
                    await expect_error(r, 401, "unauthorized")
    assert snapshot(world.server) == before
    for path in ("/healthz", "/openapi.json"):  # public
        async with world.http.get(world.server.url + path) as r:
            assert r.status == 200
    async with world.http.get(world.server.url + "/metrics") as r:  # every tenant's figures: admins only
        await expect_error(r, 401, "unauthorized")


async def test_a_token_of_undecodable_bytes_is_401_not_a_server_error(world: World) -> None:
    """Header bytes that are not UTF-8 reach the service as lone surrogates: an unknown token."""
    import asyncio

    from yarl import URL

    url = URL(world.server.url)
    for token in (b"\xff\xfe" * 10, b"acme-writer-token-0001\x80"):
        reader, writer = await asyncio.open_connection(url.host, url.port)
        writer.write(b"GET /v1/adapters/acme/model/versions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     b"Authorization: Bearer " + token + b"\r\n\r\n")
        await writer.drain()
        response = await reader.read()
        writer.close()
        status, _, rest = response.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 401"), response[:300]
        assert b'"unauthorized"' in rest
    async with world.http.get(world.server.url + "/healthz") as r:
        assert r.status == 200


async def test_read_token_reads_but_never_writes(world: World) -> None:
    before = snapshot(world.server)
    for method, path, body in tenant_routes("acme", "model"):
        async with await _send(world, method, path, body, "acme-read") as r:
            if method in ("GET", "HEAD"):
                assert r.status == 200, path
            else:
                await expect_error(r, 403, "forbidden")
    assert snapshot(world.server) == before


async def test_own_tenant_blobs_and_layouts_are_readable_and_other_tenants_layouts_are_not(world: World) -> None:
    mine = world.published["acme"]
    url = world.server.url
    async with world.http.get(f"{url}/v1/blobs/{mine['content_id']}", headers=auth("acme")) as r:
        assert r.status == 200
    async with world.http.get(f"{url}/v1/layouts/{mine['layout_id']}", headers=auth("acme-read")) as r:
        assert r.status == 200 and (await r.json())["layout_id"] == mine["layout_id"]
    # beta's layout (another rank and target set) answers acme as an id nobody stores does: that
    # some tenant stores this rank and these modules is not acme's to learn
    theirs = world.published["beta"]["layout_id"]
    async with world.http.get(f"{url}/v1/layouts/{theirs}", headers=auth("acme")) as r:
        hidden = await expect_error(r, 404, "layout_not_found")
    async with world.http.get(f"{url}/v1/layouts/{'0' * 32}", headers=auth("acme")) as r:
        unknown = await expect_error(r, 404, "layout_not_found")
    assert hidden["message"].replace(theirs, "0" * 32) == unknown["message"]
    async with world.http.get(f"{url}/v1/layouts/{theirs}", headers=auth("admin")) as r:
        assert r.status == 200
