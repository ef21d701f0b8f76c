"""Helpers of the service tests (fixtures are in tests/service/conftest.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from mint_store.service import RunningServer
from mint_store.service.state import STATE
from mint_store.store import Store

TOKENS = {
    "acme": "acme-writer-token-0001",
    "beta": "beta-writer-token-0002",
    "acme-read": "acme-reader-token-0003",
    "admin": "admin-token-000000004",
}
PEFT_NAMES = ("adapter_config.json", "adapter_model.safetensors")

ServerFactory = Callable[..., Awaitable[RunningServer]]  # the make_server fixture


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


def store_of(server: RunningServer) -> Store:
    return server.app[STATE].store


def snapshot(server: RunningServer) -> tuple[Any, ...]:
    """What a bad request must leave unchanged: last seq, every version, every stored object."""
    store = store_of(server)
    return (store.last_seq, [v.to_dict() for v in store.iter_versions()], store.storage.list(""))


def upload_dir(server: RunningServer) -> list[str]:
    d = server.app[STATE].config.upload_dir
    return sorted(os.listdir(d)) if d else []


def peft_form(files: dict[str, bytes], **types: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    for name, data in files.items():
        form.add_field(name, data, filename=name, content_type=types.get(name, "application/octet-stream"))
    return form


def read_peft(d: Path) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in PEFT_NAMES}


async def publish(
    http: aiohttp.ClientSession, server: RunningServer, files: dict[str, bytes], tenant: str = "acme",
    name: str = "chat", *, headers: dict[str, str] | None = None, query: str = "",
) -> dict[str, Any]:
    async with http.put(f"{server.url}/v1/adapters/{tenant}/{name}{query}", data=peft_form(files),
                        headers=headers) as r:
        body = await r.json()
        assert r.status == 201, body
        return dict(body)


async def expect_error(resp: aiohttp.ClientResponse, status: int, code: str) -> dict[str, Any]:
    body = await resp.json(content_type=None)
    assert resp.status == status, body
    assert set(body) == {"error", "message"} and body["error"] == code and body["message"], body
    return dict(body)


async def still_serving(http: aiohttp.ClientSession, server: RunningServer) -> None:
    async with http.get(f"{server.url}/healthz") as r:
        assert r.status == 200


async def until_parked(server: RunningServer, polls: int = 1) -> None:
    """Return once ``polls`` long polls sleep in the server's change feed (fail after 30 s)."""
    feed = server.app[STATE].feed
    async with asyncio.timeout(30):
        while feed.parked < polls:
            await asyncio.sleep(0.005)
