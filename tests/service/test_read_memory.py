"""Answers that hold a row in memory while a client reads them (several ranges of a row, a PEFT
export) share one byte budget (``read_memory``): a client that reads slowly keeps its buffer,
so without the budget N such clients held N rows at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from yarl import URL

from mint_store.service import RunningServer
from mint_store.service.state import STATE
from tests.support.service import ServerFactory
from tests.support.targets import StoreTarget


async def _until(check: Callable[[], bool], what: str) -> None:  # a bounded wait, not a timing assertion
    for _ in range(600):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def _stalled_get(server: RunningServer, path: str, headers: str) -> tuple[asyncio.StreamReader,
                                                                                asyncio.StreamWriter]:
    """A GET whose client reads the status line, then nothing."""
    url = URL(server.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{headers}\r\n".encode())
    await writer.drain()
    assert (await reader.readline()).startswith(b"HTTP/1.1 2")
    return reader, writer


async def test_buffered_answers_wait_for_the_byte_budget_and_head_reads_nothing(
        make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession) -> None:
    from engine_client import MintClient
    from tests.support.factories import random_adapter

    server = await make_server(local_target, read_memory=1)  # one answer at a time (one alone always is)
    budget = server.app[STATE].rows.buffers
    adapter = random_adapter(3, rank=64, hidden=2048, layers=4)  # a 16 MiB row: more than socket buffers take
    row = adapter.to_row()[1].tobytes()
    async with MintClient(server.url) as client:
        got = await client.publish("acme", "big", adapter)
    blob = f"/v1/blobs/{got.content_id}"
    n = len(row)
    reader, writer = await _stalled_get(server, blob, f"Range: bytes=0-9,20-{n - 1}\r\n")
    await _until(lambda: budget.used > 0, "the first answer holds its ranges")

    async def small() -> bytes:
        async with http.get(server.url + blob, headers={"Range": "bytes=0-0,2-2"}) as r:
            assert r.status == 206
            return await r.read()

    second = asyncio.create_task(small())
    async with http.head(server.url + blob, headers={"Range": "bytes=0-0,2-2"}) as r:  # no bytes held
        assert r.status == 206 and int(r.headers["Content-Length"]) > 2
    await _until(lambda: budget.waiting == 1, "the next answer waits for the budget")
    assert not second.done()  # waiting for the budget, not answered past it
    body = await reader.read()
    writer.close()
    assert row[:10] in body and row[20:] in body
    reply = await second
    assert row[0:1] in reply and row[2:3] in reply
    await _until(lambda: budget.used == 0, "every hold released")

    # a PEFT export holds the adapter too: it waits behind a stalled multi-range answer
    reader, writer = await _stalled_get(server, blob, f"Range: bytes=0-9,20-{n - 1}\r\n")
    await _until(lambda: budget.used > 0, "the answer holds its ranges")

    async def export() -> int:
        async with http.get(f"{server.url}/v1/adapters/acme/big/versions/1/peft") as r:
            assert r.status == 200
            return len(await r.read())

    tar = asyncio.create_task(export())
    await _until(lambda: budget.waiting == 1, "the next answer waits for the budget")
    assert not tar.done()
    await reader.read()
    writer.close()
    assert await tar > n
    await _until(lambda: budget.used == 0, "every hold released")


async def test_hub_downloads_hold_their_file_under_the_same_budget(
        make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession) -> None:
    """A Hub file download keeps its file in memory while the client reads it (even once the
    render cache has let it go): a stalled one makes a multi-range answer wait, as an export does."""
    from engine_client import MintClient
    from tests.support.factories import random_adapter

    server = await make_server(local_target, read_memory=1)
    budget = server.app[STATE].rows.buffers
    async with MintClient(server.url) as client:
        got = await client.publish("acme", "big", random_adapter(4, rank=64, hidden=2048, layers=4))
    async with http.get(f"{server.url}/hf/api/models/acme/big") as r:
        commit = (await r.json())["sha"]
    await _until(lambda: budget.used == 0, "the render's hold released")
    reader, writer = await _stalled_get(server, f"/hf/acme/big/resolve/{commit}/adapter_model.safetensors", "")
    await _until(lambda: budget.used > 0, "the download holds its file")

    async def ranges() -> bytes:
        async with http.get(f"{server.url}/v1/blobs/{got.content_id}", headers={"Range": "bytes=0-0,2-2"}) as r:
            assert r.status == 206
            return await r.read()

    second = asyncio.create_task(ranges())
    await _until(lambda: budget.waiting == 1, "the next answer waits for the budget")
    assert not second.done()
    assert len(await reader.read()) > 16 * 2**20  # the whole 16 MiB file (and the headers left)
    writer.close()
    await second
    await _until(lambda: budget.used == 0, "every hold released")


async def test_a_tenant_holding_the_budget_does_not_hold_up_another_tenant(
        make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession,
        tokens_file: str) -> None:
    """acme's slow reader holds its 16 MiB answer and acme asks for another that does not fit:
    beta's answer, which fits, is sent past it (each caller's share is half the budget here)."""
    from engine_client import MintClient
    from tests.support.factories import random_adapter
    from tests.support.service import TOKENS, auth

    server = await make_server(local_target, read_memory=20 * 2**20, caller_share=0.5, tokens_file=tokens_file)
    budget = server.app[STATE].rows.buffers
    for tenant, seed in (("acme", 3), ("beta", 4)):
        async with MintClient(server.url, token=TOKENS[tenant]) as client:
            await client.publish(tenant, "big", random_adapter(seed, rank=64, hidden=2048, layers=4))  # 16 MiB
            n = (await client.resolve(f"{tenant}/big")).length
    path = "/v1/adapters/{}/big/versions/1/content"
    two = f"bytes=0-9,20-{n - 1}"
    reader, writer = await _stalled_get(server, path.format("acme"),
                                        f"Authorization: Bearer {TOKENS['acme']}\r\nRange: {two}\r\n")
    await _until(lambda: budget.used > 0, "acme's first answer holds its ranges")

    async def ranges(tenant: str, spec: str) -> bytes:
        async with http.get(server.url + path.format(tenant), headers=auth(tenant) | {"Range": spec}) as r:
            assert r.status == 206
            return await r.read()

    second = asyncio.create_task(ranges("acme", two))  # 16 MiB more: over the budget, waits
    await _until(lambda: budget.waiting == 1, "acme's second answer waits for the budget")
    assert len(await ranges("beta", "bytes=0-0,2-2")) > 2  # answered while acme's wait goes on
    assert budget.waiting == 1 and not second.done()
    await reader.read()
    writer.close()
    assert len(await second) > 16 * 2**20
    await _until(lambda: budget.used == 0, "every hold released")
