"""The console's server side: its files at /ui/ (public, strict CSP) and the read-only routes
it needs (/v1/tenants, /v1/catalog/{tenant}, /v1/admin/compaction) with the API's auth rules."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.support.service import ServerFactory, auth, expect_error, publish, read_peft, snapshot
from tests.support.targets import StoreTarget


async def test_console_files_are_public_and_locked_down(make_server: ServerFactory, local_target: StoreTarget,
                                                        tokens_file: str, http: aiohttp.ClientSession) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    async with http.get(f"{server.url}/ui/") as r:  # no token: the page holds no data
        assert r.status == 200 and r.content_type == "text/html"
        page = await r.text()
        csp = r.headers["Content-Security-Policy"]
    assert '<script type="module" src="app.js">' in page
    assert "script-src 'self'" in csp and "form-action 'none'" in csp and "default-src 'none'" in csp
    for asset, kind in (("app.js", "text/javascript"), ("style.css", "text/css"), ("dom.js", "text/javascript")):
        async with http.get(f"{server.url}/ui/{asset}") as r:
            assert r.status == 200 and r.content_type == kind, asset
            assert r.headers["X-Content-Type-Options"] == "nosniff"
    async with http.get(f"{server.url}/ui", allow_redirects=False) as r:
        assert r.status == 302 and r.headers["Location"] == "ui/"
    for bad in ("nope.js", "..%2fapp.py", "%2e%2e%2fconsole.py", "__init__.py"):
        async with http.get(f"{server.url}/ui/{bad}") as r:
            await expect_error(r, 404, "route_not_found")
    async with http.get(f"{server.url}/v1/tenants") as r:  # the data is not public
        await expect_error(r, 401, "unauthorized")


async def test_tenants_are_what_the_token_may_read(make_server: ServerFactory, local_target: StoreTarget,
                                                   tokens_file: str, http: aiohttp.ClientSession,
                                                   peft_files: dict[str, bytes]) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    for tenant in ("acme", "beta"):
        await publish(http, server, peft_files, tenant, headers=auth(tenant))
    expected = {"admin": (["acme", "beta"], "admin"), "acme": (["acme"], "write"),
                "beta": (["beta"], "write"), "acme-read": (["acme"], "read")}
    for who, (tenants, role) in expected.items():
        async with http.get(f"{server.url}/v1/tenants", headers=auth(who)) as r:
            body = await r.json()
        assert r.status == 200 and (body["tenants"], body["role"], body["auth"]) == (tenants, role, True), who


async def test_without_a_token_file_loopback_is_admin(server, http: aiohttp.ClientSession,
                                                      peft_files: dict[str, bytes]) -> None:
    await publish(http, server, peft_files, "zeta")
    async with http.get(f"{server.url}/v1/tenants") as r:
        body = await r.json()
    assert body == {"tenants": ["zeta"], "role": "admin", "principal": "loopback (no token file)", "auth": False}


async def test_catalog_rows_and_auth(make_server: ServerFactory, local_target: StoreTarget, tokens_file: str,
                                     http: aiohttp.ClientSession, peft_files: dict[str, bytes],
                                     peft_dir2: Path) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    h = auth("acme")
    first = await publish(http, server, peft_files, "acme", "chat", headers=h, query="?tag=prod")
    second = await publish(http, server, read_peft(peft_dir2), "acme", "chat", headers=h, query="?tag=canary")
    await publish(http, server, peft_files, "acme", "sum", headers=h)
    async with http.delete(f"{server.url}/v1/adapters/acme/sum/versions/1", headers=h) as r:
        assert r.status == 200
    async with http.get(f"{server.url}/v1/catalog/acme", headers=auth("acme-read")) as r:
        body = await r.json()
    assert r.status == 200 and body["tenant"] == "acme" and body["next"] is None
    chat, summ = body["adapters"]
    assert chat["name"] == "chat" and chat["latest"] == 2 and chat["versions"] == 2
    assert chat["tags"] == {"prod": 1, "canary": 2}
    assert chat["rank"] == 2 and chat["nbytes"] == second["nbytes"] and chat["content_id"] == second["content_id"]
    assert chat["updated"] > 0 and first["content_id"] != second["content_id"]
    # every version deleted: the adapter is still listed, with no latest
    assert summ == {"name": "sum", "latest": None, "versions": 0, "total_versions": 1, "tags": {}, "base": None,
                    "rank": None, "nbytes": None, "content_id": None, "updated": summ["updated"]}
    async with http.get(f"{server.url}/v1/catalog/acme?limit=1", headers=h) as r:
        page = await r.json()
    assert [a["name"] for a in page["adapters"]] == ["chat"] and page["next"] == "chat"
    async with http.get(f"{server.url}/v1/catalog/acme?limit=1&after=chat", headers=h) as r:
        assert [a["name"] for a in (await r.json())["adapters"]] == ["sum"]
    async with http.get(f"{server.url}/v1/catalog/acme?prefix=su", headers=h) as r:
        assert [a["name"] for a in (await r.json())["adapters"]] == ["sum"]
    before = snapshot(server)
    for who, url, status, code in (
        ("beta", "/v1/catalog/acme", 403, "forbidden"),
        ("beta", "/v1/catalog/nobody", 403, "forbidden"),
        ("acme", "/v1/catalog/acme?prefix=A*", 400, "bad_request"),
        ("acme", "/v1/catalog/acme?limit=0", 400, "bad_request"),
        ("acme", "/v1/catalog/Acme", 400, "invalid_name"),
    ):
        async with http.get(server.url + url, headers=auth(who)) as r:
            await expect_error(r, status, code)
    async with http.get(f"{server.url}/v1/catalog/acme") as r:
        await expect_error(r, 401, "unauthorized")
    assert snapshot(server) == before


async def test_compaction_state_is_admin_only_and_follows_compactions(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file, auto_compact=False)
    await publish(http, server, peft_files, "acme", "chat", headers=auth("acme"))
    url = f"{server.url}/v1/admin/compaction"
    for who in ("acme", "acme-read"):
        async with http.get(url, headers=auth(who)) as r:
            await expect_error(r, 403, "forbidden")
    async with http.get(url) as r:
        await expect_error(r, 401, "unauthorized")

    async def state() -> dict:
        async with http.get(url, headers=auth("admin")) as r:
            assert r.status == 200
            return dict(await r.json())

    got = await state()
    assert (got["pending_steps"], got["retired_shards"], got["last_compaction"]) == (0, 0, None)
    assert got["auto_compact"] is False and got["writable"] is True and got["grace_s"] == 600
    async with http.delete(f"{server.url}/v1/adapters/acme/chat/versions/1", headers=auth("acme")) as r:
        assert r.status == 200
    got = await state()  # the only row is dead: its shard is sparse
    assert (got["pending_steps"], got["pending_shards"], got["pending_rows"]) == (1, 1, 1)
    async with http.post(f"{server.url}/v1/admin/compact", headers=auth("admin")) as r:
        assert r.status == 200 and len((await r.json())["shards_retired"]) == 1
    got = await state()
    assert (got["pending_steps"], got["retired_shards"]) == (0, 1)
    assert got["last_compaction"]["seq"] == 3 and got["last_sweep"] is None


def test_the_console_is_self_contained() -> None:
    """No CDN, no build step: every module the page imports is a relative file the service serves."""
    import re
    from importlib import resources

    root = resources.files("mint_store.service") / "console"
    served = {p.name for p in root.iterdir()}
    index = (root / "index.html").read_text()
    refs = set(re.findall(r'(?:src|href)="([^"#]+)"', index)) - {"../openapi.json"}
    assert refs == {"style.css", "app.js"}
    for name in sorted(n for n in served if n.endswith(".js")):
        text = (root / name).read_text()
        imports = re.findall(r'^import .* from "([^"]+)";$', text, flags=re.M)
        assert all(i.startswith("./") and i[2:] in served for i in imports), (name, imports)
        urls = set(re.findall(r"https?://[^\s\"'`]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (name, urls)
        assert "innerHTML" not in text.replace('key === "innerHTML"', ""), name  # data goes in as text only
