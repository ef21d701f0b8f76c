"""The Hub routes' cache of rendered PEFT files: LRU by bytes, the newest always kept."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from mint_store.service.hub.routes import HUB
from tests.support.service import ServerFactory, publish, read_peft
from tests.support.targets import StoreTarget


async def _get(http: aiohttp.ClientSession, url: str) -> bytes:
    async with http.get(url) as r:  # follows the weights' redirect to the commit
        assert r.status == 200, await r.text()
        return await r.read()


async def test_rendered_files_are_kept_lru_by_bytes(make_server: ServerFactory, local_target: StoreTarget,
                                                    http: aiohttp.ClientSession, peft_dir: Path,
                                                    peft_dir2: Path) -> None:
    server = await make_server(local_target)
    await publish(http, server, read_peft(peft_dir), name="one")
    await publish(http, server, read_peft(peft_dir2), name="two")
    cache = server.app[HUB]
    size = {}
    for name in ("one", "two"):
        base = f"{server.url}/hf/acme/{name}/resolve/main"
        size[name] = len(await _get(http, f"{base}/adapter_model.safetensors")) + len(
            await _get(http, f"{base}/adapter_config.json"))
    assert len(cache) == 2 and cache.nbytes == size["one"] + size["two"]
    cache.budget = size["two"]  # room for one of them
    await _get(http, f"{server.url}/hf/acme/one/resolve/v1/adapter_model.safetensors")  # touched: now the newest
    await _get(http, f"{server.url}/hf/acme/one/resolve/main/README.md")
    assert len(cache) == 2  # hits change nothing
    cache.budget = 1  # every render is over it alone
    await publish(http, server, read_peft(peft_dir2), name="three")
    await _get(http, f"{server.url}/hf/acme/three/resolve/main/adapter_config.json")
    assert len(cache) == 1 and cache.nbytes == size["two"]  # only the newest render stays


async def test_an_unknown_commit_costs_only_the_versions_published_since_the_last_scan(
        make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession, peft_dir: Path,
        peft_dir2: Path, monkeypatch) -> None:
    """A commit id the cache does not know (pinned before a restart, or a guess) was looked for
    by hashing every version of the repo, on every request. Now a repo's commit ids are kept
    once scanned, and a later miss looks only at versions published since."""
    import secrets

    from mint_store.service.state import STATE

    server = await make_server(local_target)
    for d in (peft_dir, peft_dir2, peft_dir):
        await publish(http, server, read_peft(d), name="one")
    store = server.app[STATE].store
    scanned_after: list[int] = []
    versions = store.versions

    def spy(tenant: str, name: str, **kw):  # the real listing, its range recorded
        scanned_after.append(kw.get("after", 0))
        return versions(tenant, name, **kw)

    monkeypatch.setattr(store, "versions", spy)
    for _ in range(3):
        async with http.get(f"{server.url}/hf/acme/one/resolve/{secrets.token_hex(20)}/adapter_config.json") as r:
            assert r.status == 404 and r.headers["X-Error-Code"] == "RevisionNotFound"
    assert scanned_after == [0, 3, 3]  # all three versions once; then only newer ones (none)
    await publish(http, server, read_peft(peft_dir2), name="one")
    async with http.get(f"{server.url}/hf/api/models/acme/one/revision/v4") as r:
        sha = (await r.json())["sha"]
    server.app[HUB]._commits.clear()  # as after a restart: v4's commit is not remembered
    assert await _get(http, f"{server.url}/hf/acme/one/resolve/{sha}/adapter_config.json")
    assert scanned_after[-1] == 3  # found among the versions above the last scan
    async with http.get(f"{server.url}/hf/acme/one/resolve/{'0' * 40}/adapter_config.json") as r:
        assert r.status == 404
    assert scanned_after[-1] == 4
