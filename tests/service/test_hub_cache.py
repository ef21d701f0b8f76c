"""The Hub routes' cache of rendered PEFT files: LRU by bytes, the newest always kept."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from mint_store.service.hub import HUB
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
