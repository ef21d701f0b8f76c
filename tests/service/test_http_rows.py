"""engine_client.client.http_rows: a row over HTTP read by the calling thread, same semantics
as the async client's read_row (typed errors, retries, every byte checked)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from aiohttp import web

from engine_client import MintClient
from engine_client.client.http_rows import PIECE, HttpRowReader
from engine_client.errors import ConnectionFailed, IntegrityError
from mint_store import Location
from mint_store.errors import BlobNotFound, MintError, NotFound
from tests.support.factories import random_adapter
from tests.support.service import TOKENS, ServerFactory
from tests.support.targets import StoreTarget

FAST = {"backoff": 0.001, "max_backoff": 0.005}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def fake(serve_app: Callable[[web.Application], Awaitable[str]],
               ) -> Callable[[Handler], Awaitable[tuple[str, list[int]]]]:
    """A server whose ``GET /v1/blobs/{cid}`` is the handler given; the hits it counted."""

    async def start(handler: Handler) -> tuple[str, list[int]]:
        hits = [0]

        async def counted(request: web.Request) -> web.StreamResponse:
            hits[0] += 1
            return await handler(request)

        app = web.Application()
        app.router.add_get("/v1/blobs/{cid}", counted)
        return await serve_app(app), hits

    return start


def _row(seed: int = 0, rank: int = 48) -> tuple[Location, bytes]:
    adapter = random_adapter(seed, rank=rank, layers=4, hidden=512)  # a row of several pieces
    layout, row = adapter.to_row()
    return Location(adapter.content_id(), layout.layout_id, "k", 0, layout.row_nbytes, 0), row.tobytes()


async def test_reads_the_services_rows_into_the_buffer_on_one_connection(
        make_server: ServerFactory, local_target: StoreTarget, tokens_file: str) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    adapters = [random_adapter(s, rank=48, layers=4, hidden=512) for s in range(2)]
    async with MintClient(server.url, token=TOKENS["acme"]) as c:
        locs = [await c.resolve(f"sha:{(await c.publish('acme', f'x{i}', a)).content_id}")
                for i, a in enumerate(adapters)]
        want = [bytes(await c.read_row(loc)) for loc in locs]
    assert locs[0].length > 2 * PIECE
    reader = HttpRowReader(server.url, TOKENS["acme-read"])

    def read_all() -> list[bytes]:
        out = []
        for loc in locs * 2:  # a kept-alive connection serves one row after another
            buf = np.full(loc.length + 3, 0xEE, np.uint8)
            assert reader.read_row(loc, buf) is buf
            assert (buf[loc.length :] == 0xEE).all()
            out.append(buf[: loc.length].tobytes())
        return out

    assert await asyncio.to_thread(read_all) == want * 2
    gone = Location("0" * 32, locs[0].layout_id, "k", 0, 10, 0)
    with pytest.raises(BlobNotFound):
        await asyncio.to_thread(reader.read_row, gone)
    with pytest.raises(PermissionError):  # (the service's 401, typed)
        await asyncio.to_thread(HttpRowReader(server.url).read_row, locs[0])
    reader.close()


async def test_corrupted_or_wrongly_sized_bodies_are_never_returned(fake) -> None:
    loc, row = _row()
    bad = bytearray(row)
    bad[len(row) - 5] ^= 0xFF
    bodies = {"flipped": bytes(bad), "short": row[:-1], "long": row + b"x"}
    mode = [""]

    async def blob(request: web.Request) -> web.Response:
        return web.Response(body=bodies[mode[0]])

    url, hits = await fake(blob)
    reader = HttpRowReader(url, retries=2, **FAST)
    for what, match in [("flipped", "does not match"), ("short", "expected"), ("long", "expected")]:
        mode[0] = what
        with pytest.raises(IntegrityError, match=match):
            await asyncio.to_thread(reader.read_row, loc, np.empty(loc.length, np.uint8))
    assert hits == [3]  # an integrity error is never retried


async def test_5xx_and_dropped_connections_are_retried_4xx_never(fake) -> None:
    loc, row = _row()
    plan: list[str] = []

    async def blob(request: web.Request) -> web.StreamResponse:
        step = plan.pop(0) if plan else "ok"
        if step == "503":
            return web.json_response({"error": "service_unavailable", "message": "busy"}, status=503)
        if step == "404":
            return web.json_response({"error": "blob_not_found", "message": "gone"}, status=404)
        if step == "drop":  # half the body, then the connection closes
            resp = web.StreamResponse(headers={"Content-Length": str(len(row))})
            await resp.prepare(request)
            await resp.write(row[: len(row) // 2])
            assert request.transport is not None
            request.transport.close()
            return resp
        return web.Response(body=row)

    url, hits = await fake(blob)
    reader = HttpRowReader(url, retries=3, **FAST)
    plan[:] = ["503", "drop", "503"]
    got = await asyncio.to_thread(reader.read_row, loc)
    assert bytes(got) == row and hits == [4]
    plan[:] = ["404"]
    with pytest.raises(BlobNotFound, match="gone"):
        await asyncio.to_thread(reader.read_row, loc)
    assert hits == [5]
    plan[:] = ["503"] * 4
    with pytest.raises(MintError) as e:
        await asyncio.to_thread(reader.read_row, loc)
    assert e.value.code == "service_unavailable" and hits == [9]


async def test_a_refused_connection_is_retried_then_typed() -> None:
    loc, _ = _row()
    with socket.socket() as s:  # bound, never listening: connections are refused while we hold it
        s.bind(("127.0.0.1", 0))
        reader = HttpRowReader(f"http://127.0.0.1:{s.getsockname()[1]}", retries=2, **FAST)
        with pytest.raises(ConnectionFailed):
            await asyncio.to_thread(reader.read_row, loc)
    with pytest.raises(ValueError, match="http"):
        HttpRowReader("/not/a/service")


async def test_a_kept_alive_connection_the_server_closed_is_replaced_at_once(fake) -> None:
    """The server drops an idle keep-alive connection (its idle timeout): the next read goes on
    a new connection, not counted as a failed attempt (retries=0 here)."""
    loc, row = _row()
    transports = []

    async def blob(request: web.Request) -> web.Response:
        transports.append(request.transport)
        return web.Response(body=row)

    url, hits = await fake(blob)
    reader = HttpRowReader(url, retries=0)

    def read() -> bytes:
        return bytes(reader.read_row(loc))

    assert await asyncio.to_thread(read) == row
    for t in transports:
        t.close()
    await asyncio.sleep(0.05)
    assert await asyncio.to_thread(read) == row
    assert hits == [2] and len({id(t) for t in transports}) == 2


async def test_a_row_is_read_by_its_content_id_alone_and_a_ref_resolved_on_the_calling_thread(
        make_server: ServerFactory, local_target: StoreTarget, tokens_file: str) -> None:
    """What vLLM's resolver and worker ask on a cold load: one resolve, one GET by content id
    (the answer's headers give the layout id and length the check needs)."""
    server = await make_server(local_target, tokens_file=tokens_file)
    adapter = random_adapter(3, rank=48, layers=4, hidden=512)
    async with MintClient(server.url, token=TOKENS["acme"]) as c:
        cid = (await c.publish("acme", "blob", adapter, tag="prod")).content_id
        want_loc = await c.resolve(f"sha:{cid}")
        want = bytes(await c.read_row(want_loc))
    async with MintClient(server.url, token=TOKENS["beta"]) as c:
        await c.publish("beta", "other", random_adapter(4, rank=4, layers=1, hidden=64))
    reader = HttpRowReader(server.url, TOKENS["acme-read"])
    sizes: list[int] = []

    def alloc(n: int) -> np.ndarray:
        sizes.append(n)
        return np.full(n + 5, 0xEE, np.uint8)

    loc, buf = await asyncio.to_thread(reader.read_blob, cid, alloc)
    assert (loc.content_id, loc.layout_id, loc.length) == (cid, want_loc.layout_id, want_loc.length)
    assert sizes == [loc.length] and buf[: loc.length].tobytes() == want and (buf[loc.length :] == 0xEE).all()
    for ref in ("acme/blob", "acme/blob:prod", "acme/blob@1", f"sha:{cid}"):
        got = await asyncio.to_thread(reader.resolve, ref)
        assert (got.content_id, got.layout_id, got.length) == (cid, want_loc.layout_id, want_loc.length)
    with pytest.raises(BlobNotFound):
        await asyncio.to_thread(reader.read_blob, "0" * 32, alloc)
    with pytest.raises(ValueError):
        await asyncio.to_thread(reader.read_blob, "../v1/tenants", alloc)
    with pytest.raises(NotFound):
        await asyncio.to_thread(reader.resolve, "acme/nothing-here")
    with pytest.raises(PermissionError):  # another tenant's ref, refused by the service, typed
        await asyncio.to_thread(reader.resolve, "beta/other")
    reader.close()


async def test_a_row_read_by_content_id_is_checked_against_it_whatever_the_headers_say(fake) -> None:
    loc, row = _row()
    other, _ = _row(seed=1)
    headers = {"ok": {"X-Mint-Layout-Id": loc.layout_id}, "lying": {"X-Mint-Layout-Id": "ab" * 16},
               "none": {}}
    mode = ["ok"]

    async def blob(request: web.Request) -> web.Response:
        return web.Response(body=row, headers=headers[mode[0]])

    url, hits = await fake(blob)
    reader = HttpRowReader(url, retries=2, **FAST)
    got, buf = await asyncio.to_thread(reader.read_blob, loc.content_id, lambda n: np.empty(n, np.uint8))
    assert bytes(buf) == row and (got.layout_id, got.length) == (loc.layout_id, loc.length)
    for what, cid, match in [("lying", loc.content_id, "does not match"), ("none", loc.content_id, "no length or"),
                             ("ok", other.content_id, "does not match")]:
        mode[0] = what
        with pytest.raises(IntegrityError, match=match):
            await asyncio.to_thread(reader.read_blob, cid, lambda n: np.empty(n, np.uint8))
    assert hits == [4]  # never retried


async def test_typed_refusals_are_never_retried_and_one_buffer_serves_every_attempt(
        serve_app: Callable[[web.Application], Awaitable[str]]) -> None:
    """401 and 403 are PermissionErrors (OSErrors in Python): still answers, not connection
    failures. A retried read by content id fills the buffer it was given first."""
    loc, row = _row()
    hits = {"resolve": 0, "blob": 0}
    plan: list[str] = []

    async def resolve(request: web.Request) -> web.Response:
        hits["resolve"] += 1
        step = plan.pop(0) if plan else "401"
        status = {"401": 401, "403": 403}[step]
        return web.json_response({"error": "unauthorized" if status == 401 else "forbidden", "message": step},
                                 status=status)

    async def blob(request: web.Request) -> web.StreamResponse:
        hits["blob"] += 1
        step = plan.pop(0) if plan else "ok"
        if step in ("401", "403"):
            return web.json_response({"error": "unauthorized" if step == "401" else "forbidden"}, status=int(step))
        headers = {"X-Mint-Layout-Id": loc.layout_id, "Content-Length": str(len(row))}
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        if step == "drop":
            await resp.write(row[: len(row) // 3])
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write(row)
        return resp

    app = web.Application()
    app.router.add_post("/v1/resolve", resolve)
    app.router.add_get("/v1/blobs/{cid}", blob)
    url = await serve_app(app)
    reader = HttpRowReader(url, retries=3, **FAST)
    for step in ("401", "403"):
        plan[:] = [step]
        with pytest.raises(PermissionError):
            await asyncio.to_thread(reader.resolve, "acme/x")
        plan[:] = [step]
        with pytest.raises(PermissionError):
            await asyncio.to_thread(reader.read_blob, loc.content_id, lambda n: np.empty(n, np.uint8))
    assert hits == {"resolve": 2, "blob": 2}  # one request each: none retried
    given: list[np.ndarray] = []

    def alloc(n: int) -> np.ndarray:
        given.append(np.empty(n, np.uint8))
        return given[-1]

    plan[:] = ["drop", "drop"]
    got, buf = await asyncio.to_thread(reader.read_blob, loc.content_id, alloc)
    assert got.length == len(row)
    assert buf is given[0] and len(given) == 1 and bytes(buf) == row and hits["blob"] == 5


async def test_close_closes_every_threads_connection(fake) -> None:
    loc, row = _row()

    async def blob(request: web.Request) -> web.Response:
        return web.Response(body=row)

    url, _ = await fake(blob)
    reader = HttpRowReader(url)
    await asyncio.gather(*(asyncio.to_thread(reader.read_row, loc) for _ in range(3)))
    conns = list(reader._conns)
    assert conns and all(c.sock is not None for c in conns)
    await asyncio.to_thread(reader.close)  # (from another thread than the ones that read)
    assert all(c.sock is None for c in conns) and not list(reader._conns)
    assert bytes(await asyncio.to_thread(reader.read_row, loc)) == row  # a later read opens a new one
    reader.close()
