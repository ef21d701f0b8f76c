"""engine_client.MintClient: one interface over the service and over a store opened directly."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from engine_client import MintClient, SyncMintClient
from engine_client.errors import (
    AdapterNotFound,
    ConnectionFailed,
    HTTPError,
    IntegrityError,
    InvalidName,
    ServiceUnavailable,
    TagNotFound,
    VersionDeleted,
)
from mint_store import Location
from mint_store.errors import MintError
from mint_store.peft.directory import load_peft_dir
from mint_store.service import RunningServer
from tests.support.service import ServerFactory, until_parked
from tests.support.targets import StoreTarget, make_bucket, s3_options

SERVER = pytest.StashKey[RunningServer]()  # the http client's server, for tests that watch its state


@pytest.fixture(params=["http", "store-local", "store-s3"])
async def client(request: pytest.FixtureRequest, make_server: ServerFactory, local_target: StoreTarget,
                 ) -> AsyncIterator[MintClient]:
    if request.param == "http":
        server = await make_server(local_target)
        request.node.stash[SERVER] = server
        c = MintClient(server.url, resolve_batch=2)
    elif request.param == "store-local":
        c = MintClient(local_target.url, index_dir=local_target.index_dir, resolve_batch=2)
    else:
        endpoint = request.getfixturevalue("s3_endpoint")  # moto starts only for this case
        url = f"s3://{make_bucket(endpoint)}/mint"
        c = MintClient(url, index_dir=local_target.index_dir, storage_options=s3_options(endpoint), resolve_batch=2)
    async with c:
        yield c


async def test_the_same_interface_everywhere(client: MintClient, peft_dir: Path, peft_dir2: Path,
                                             tmp_path: Path) -> None:
    first = await client.publish("acme", "chat", peft_dir, tag="prod")
    adapter2 = load_peft_dir(peft_dir2)
    second = await client.publish("acme", "chat", adapter2)
    assert (first.version, second.version) == (1, 2)
    assert first.content_id == load_peft_dir(peft_dir).content_id()
    assert second.content_id == adapter2.content_id()

    loc = await client.resolve("acme/chat:prod")
    assert loc.content_id == first.content_id
    got = await client.resolve_many(["acme/chat", "acme/chat@1", "acme/nope", "Bad", f"sha:{first.content_id}"])
    assert isinstance(got[0], Location) and got[0].content_id == second.content_id
    assert isinstance(got[1], Location) and got[1].content_id == first.content_id
    assert isinstance(got[2], AdapterNotFound) and isinstance(got[3], InvalidName)
    assert isinstance(got[4], Location)

    out = np.zeros(loc.length + 100, dtype=np.uint8)  # a caller buffer, larger than the row
    loc2, row = await client.read("acme/chat:prod", out)
    assert row is out and loc2 == loc
    expected = load_peft_dir(peft_dir).to_row()[1]
    assert bytes(out[: loc.length]) == expected.tobytes()
    into = bytearray(loc.length)
    assert await client.read_row(loc, into) is into and bytes(into) == expected.tobytes()

    info = await client.version("acme/chat:prod")
    assert (info.version, info.tags, info.content_id) == (1, ("prod",), first.content_id)
    assert (await client.version("acme/chat")).version == 2
    assert [v.version for v in await client.versions("acme", "chat")] == [1, 2]
    if client.url.startswith("http"):  # pages of one version: the client follows the service's cursor
        import engine_client.client.http_transport as http_client

        page, http_client.VERSIONS_PAGE = http_client.VERSIONS_PAGE, 1
        try:
            assert [v.version for v in await client.versions("acme", "chat")] == [1, 2]
        finally:
            http_client.VERSIONS_PAGE = page
    assert await client.names("acme") == ["chat"]
    assert (await client.layout(second.layout_id)).layout_id == adapter2.layout.layout_id
    assert (await client.load("acme/chat@2")).content_id() == adapter2.content_id()

    pulled = await client.pull("acme/chat:prod", tmp_path / "pulled")
    assert load_peft_dir(pulled).content_id() == first.content_id

    assert await client.tag("acme/chat@2", "prod") == 2
    assert (await client.resolve("acme/chat:prod")).content_id == second.content_id
    await client.untag("acme", "chat", "prod")
    with pytest.raises(TagNotFound):
        await client.resolve("acme/chat:prod")
    assert await client.delete("acme/chat@1") == 1
    with pytest.raises(VersionDeleted):
        await client.read("acme/chat@1")
    with pytest.raises(AdapterNotFound):
        await client.version("acme/other")

    batch = await client.events(0)
    assert [e["kind"] for e in batch.events] == ["publish", "publish", "tag", "untag", "delete"]
    assert batch.last_seq == batch.head == 5


async def test_load_pairs_a_row_with_its_own_config_when_a_tag_moves_meanwhile(
        client: MintClient, peft_dir: Path, peft_dir2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load(tenant/name:tag) resolves once: a tag moved between its steps must not give one
    version's row with another's PEFT config (pull writes them side by side)."""
    await client.publish("acme", "chat", peft_dir, tag="prod")
    second = await client.publish("acme", "chat", peft_dir2)
    version = client.version

    async def tag_moves_first(ref: str) -> Any:  # the race, made certain: another client moves the tag
        monkeypatch.setattr(client, "version", version)
        await client.tag("acme/chat@2", "prod")
        return await version(ref)

    monkeypatch.setattr(client, "version", tag_moves_first)
    got = await client.load("acme/chat:prod")
    want = load_peft_dir(peft_dir2)
    assert got.content_id() == second.content_id == want.content_id()
    assert got.peft_config == (await client.version("acme/chat@2")).peft_config


async def test_follow_yields_new_commits(client: MintClient, peft_dir: Path, request: pytest.FixtureRequest) -> None:
    await client.publish("acme", "chat", peft_dir)
    seen: list[dict[str, Any]] = []

    head = (await client.events(0, limit=0)).head
    assert head == 1

    async def follow() -> None:
        async for event in client.follow(head, wait=10):
            seen.append(event)
            if len(seen) == 2:
                return

    task = asyncio.create_task(follow())
    server = request.node.stash.get(SERVER, None)
    if server is not None:  # over HTTP: the follow's long poll sleeps in the feed before the commits
        await until_parked(server)
    await client.tag("acme/chat@1", "prod")
    await client.publish("acme", "chat", peft_dir)
    await asyncio.wait_for(task, 60)
    assert [e["kind"] for e in seen] == ["tag", "publish"]
    assert [e["seq"] for e in seen] == [2, 3]


async def test_sync_client(make_server: ServerFactory, local_target: StoreTarget, peft_dir: Path) -> None:
    server = await make_server(local_target)

    def flow() -> tuple[int, bytes, list[str]]:
        with SyncMintClient(server.url) as c:
            r = c.publish("acme", "chat", peft_dir, tag="prod")
            _, row = c.read("acme/chat:prod")
            kinds = [e["kind"] for e in c.events(0).events]
            return r.version, bytes(row), kinds

    version, row, kinds = await asyncio.to_thread(flow)  # its own loop: never block the server's
    assert version == 1 and kinds == ["publish"]
    assert row == load_peft_dir(peft_dir).to_row()[1].tobytes()


# -- retries, against a real (hand-written, misbehaving) server --------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def fake(serve_app: Callable[[web.Application], Awaitable[str]],
               ) -> Callable[[dict[str, Handler]], Awaitable[tuple[str, dict[str, int]]]]:
    async def start(handlers: dict[str, Handler]) -> tuple[str, dict[str, int]]:
        hits: dict[str, int] = {}
        app = web.Application()
        for spec, handler in handlers.items():
            method, path = spec.split(" ", 1)

            async def counted(request: web.Request, handler: Handler = handler, spec: str = spec) -> Any:
                hits[spec] = hits.get(spec, 0) + 1
                return await handler(request)

            app.router.add_route(method, path, counted)
        return await serve_app(app), hits

    return start


def _err(status: int, code: str) -> web.Response:
    return web.json_response({"error": code, "message": f"{code} (test)"}, status=status)


def _flaky(failures: int, then: Callable[[], web.StreamResponse] | Handler, status: int = 503,
           code: str | None = "service_unavailable") -> Handler:
    """Answers ``failures`` errors, then ``then()`` (a response) or ``then(request)`` (a handler)."""
    left = [failures]

    async def handler(request: web.Request) -> web.StreamResponse:
        if left[0] > 0:
            left[0] -= 1
            return _err(status, code) if code else web.Response(status=status, text="oops")
        if isinstance(then, _Forward):
            return await then(request)
        return then()  # type: ignore[call-arg]

    return handler


class _Forward:
    """A handler that passes the request to the real service at ``url`` and its answer back."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def __call__(self, request: web.Request) -> web.Response:
        import aiohttp

        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type",)}
        async with aiohttp.ClientSession() as s, s.request(request.method, self.url + request.path_qs, data=body,
                                                           headers=headers) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)


class _ForwardThenDrop(_Forward):
    """Passes the first ``drops`` requests to the real service, then closes the connection
    instead of answering (the server acted; its answer was lost); later ones are answered."""

    def __init__(self, url: str, drops: int = 1) -> None:
        super().__init__(url)
        self.drops = drops

    async def __call__(self, request: web.Request) -> web.Response:
        answer = await super().__call__(request)
        if self.drops:
            self.drops -= 1
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
        return answer


FAST: dict[str, Any] = {"backoff": 0.001, "max_backoff": 0.005}
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


async def test_retries_5xx_then_succeeds(fake, peft_dir: Path) -> None:
    layout = load_peft_dir(peft_dir).layout
    url, hits = await fake({
        "GET /v1/layouts/{id}": _flaky(2, lambda: web.json_response(layout.to_dict())),
        "GET /v1/bases/{b}": _flaky(10, lambda: web.json_response({}), status=500, code=None),
    })
    async with MintClient(url, retries=3, **FAST) as c:
        assert (await c.layout(layout.layout_id)).layout_id == layout.layout_id
        with pytest.raises(HTTPError) as e:
            await c.base("x")
    assert hits == {"GET /v1/layouts/{id}": 3, "GET /v1/bases/{b}": 4}
    assert e.value.status == 500


async def test_never_retries_4xx_or_terminal_errors(fake) -> None:
    url, hits = await fake({
        "POST /v1/resolve": lambda r: _async(_err(400, "invalid_name")),
        "GET /v1/adapters/{t}/{n}": lambda r: _async(_err(500, "integrity_error")),
        "GET /v1/bases/{b}": lambda r: _async(_err(404, "base_not_found")),
    })
    async with MintClient(url, retries=5, **FAST) as c:
        with pytest.raises(InvalidName, match="invalid_name"):
            await c.resolve("acme/x")
        with pytest.raises(IntegrityError):
            await c.version("acme/x")
        with pytest.raises(MintError) as e:
            await c.base("b")
    assert type(e.value).__name__ == "BaseNotFound"
    assert hits == {"POST /v1/resolve": 1, "GET /v1/adapters/{t}/{n}": 1, "GET /v1/bases/{b}": 1}


async def test_publish_retries_only_where_nothing_can_have_happened(
        fake, make_server: ServerFactory, local_target: StoreTarget, peft_dir: Path) -> None:
    """A 503 says the server did nothing (store_unavailable): sent again, and the real service
    behind then stores it once. A 500, or a commit in doubt, could have committed: not resent."""
    server = await make_server(local_target)
    url, hits = await fake({
        "PUT /v1/adapters/a/x": lambda r: _async(_err(500, "internal_error")),
        "PUT /v1/adapters/a/y": _flaky(2, _Forward(server.url), code="store_unavailable"),
        "PUT /v1/adapters/a/z": lambda r: _async(_err(503, "commit_in_doubt")),
    })
    async with MintClient(url, retries=3, **FAST) as c:
        with pytest.raises(HTTPError):
            await c.publish("a", "x", peft_dir)
        got = await c.publish("a", "y", peft_dir)
        from mint_store.errors import CommitInDoubt

        with pytest.raises(CommitInDoubt):
            await c.publish("a", "z", peft_dir)
    assert hits == {"PUT /v1/adapters/a/x": 1, "PUT /v1/adapters/a/y": 3, "PUT /v1/adapters/a/z": 1}
    assert got.version == 1 and got.content_id == load_peft_dir(peft_dir).content_id()
    async with MintClient(server.url) as real:  # stored once, as the client was told
        assert [v.version for v in await real.versions("a", "y")] == [1]
        assert (await real.resolve("a/y")).content_id == got.content_id


async def test_connection_errors_are_retried_then_typed() -> None:
    with socket.socket() as s:  # bound, never listening: connections are refused while we hold it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        async with MintClient(f"http://127.0.0.1:{port}", retries=2, **FAST) as c:
            with pytest.raises(ConnectionFailed):
                await c.resolve("acme/x")
    assert issubclass(ConnectionFailed, ConnectionError) and not issubclass(ServiceUnavailable, ConnectionError)


async def test_stale_location_is_resolved_again_once(fake, peft_dir: Path) -> None:
    adapter = load_peft_dir(peft_dir)
    layout, row = adapter.to_row()
    cid = adapter.content_id()
    old = Location("f" * 32, layout.layout_id, "packs/x/rows/c/0/0", 0, layout.row_nbytes, 0)
    new = Location(cid, layout.layout_id, "packs/x/rows/c/1/0", 0, layout.row_nbytes, 4)
    answers = iter([old, new])

    async def resolve(request: web.Request) -> web.Response:
        return web.json_response({"results": [{"ref": "a/x", "location": next(answers).to_dict()}]})

    async def blob(request: web.Request) -> web.Response:
        if request.match_info["cid"] != cid:
            return _err(404, "blob_not_found")
        return web.Response(body=row.tobytes(), content_type="application/octet-stream")

    url, hits = await fake({"POST /v1/resolve": resolve, "GET /v1/blobs/{cid}": blob})
    async with MintClient(url, **FAST) as c:
        loc, got = await c.read("a/x")
    assert loc == new and bytes(got) == row.tobytes()
    assert hits == {"POST /v1/resolve": 2, "GET /v1/blobs/{cid}": 2}


async def test_a_layout_table_that_is_not_its_id_is_refused(fake, peft_dir: Path) -> None:
    """A row is checked against its content id; the table that maps its bytes onto modules is
    checked against the layout id (its hash): another table of the same row size would put one
    module's factors into another."""
    layout, _ = load_peft_dir(peft_dir).to_row()
    table = layout.to_dict()
    answers = iter([dict(table, base="another-base"), table])

    async def serve(request: web.Request) -> web.Response:
        return web.json_response(next(answers))

    url, hits = await fake({"GET /v1/layouts/{lid}": serve})
    async with MintClient(url, **FAST) as c:
        with pytest.raises(IntegrityError, match="another layout"):
            await c.layout(layout.layout_id)
        assert await c.layout(layout.layout_id) == layout  # the wrong answer was not cached
        assert await c.layout(layout.layout_id) == layout
    assert hits == {"GET /v1/layouts/{lid}": 2}


async def test_pulled_files_are_checked_against_the_versions_content_id(fake, peft_dir: Path, peft_dir2: Path,
                                                                        tmp_path: Path) -> None:
    """pull writes files only if they import to the version's content id, as every row read is
    checked; a wrong export (another version's files) leaves the destination as it was."""
    import io
    import tarfile

    from mint_store import VersionInfo

    want = load_peft_dir(peft_dir)
    layout, _ = want.to_row()
    info = VersionInfo("a", "x", 1, want.content_id(), layout.layout_id, layout.row_nbytes, want.base, 0.0,
                       False, False)

    def tar_of(d: Path) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name in PEFT_FILES:
                tar.add(d / name, arcname=name)
        return buf.getvalue()

    exports = iter([tar_of(peft_dir2), tar_of(peft_dir)])

    async def version(request: web.Request) -> web.Response:
        return web.json_response(info.to_dict())

    async def export(request: web.Request) -> web.Response:
        return web.Response(body=next(exports), content_type="application/x-tar")

    url, _ = await fake({"GET /v1/adapters/a/x/versions/1": version, "GET /v1/adapters/a/x/versions/1/peft": export})
    dest = tmp_path / "pulled"
    async with MintClient(url, **FAST) as c:
        with pytest.raises(IntegrityError, match="not the version's"):
            await c.pull("a/x@1", dest)
        assert not dest.exists()
        await c.pull("a/x@1", dest)
    assert load_peft_dir(dest).content_id() == want.content_id()


async def test_corrupted_bytes_are_never_returned(fake, peft_dir: Path) -> None:
    adapter = load_peft_dir(peft_dir)
    layout, row = adapter.to_row()
    loc = Location(adapter.content_id(), layout.layout_id, "k", 0, layout.row_nbytes, 0)
    bad = bytearray(row.tobytes())
    bad[7] ^= 0xFF

    async def blob(request: web.Request) -> web.Response:
        return web.Response(body=bytes(bad))

    url, _ = await fake({"GET /v1/blobs/{cid}": blob})
    async with MintClient(url, **FAST) as c:
        with pytest.raises(IntegrityError):
            await c.read_row(loc)


async def _async(resp: web.StreamResponse) -> web.StreamResponse:
    return resp


async def test_a_publish_whose_answer_is_lost_is_not_resent_and_an_untag_resent_succeeds(
        fake, make_server: ServerFactory, local_target: StoreTarget, peft_dir: Path) -> None:
    """The service stored the publish (and removed the tag) and the connection dropped before
    its answer: the publish is not sent again (aiohttp's own resend of a PUT included: it stored
    a second version), and the untag sent again finds its tag gone, which is its success."""
    server = await make_server(local_target)
    async with MintClient(server.url) as real:
        await real.publish("a", "t", peft_dir, tag="prod")
    url, hits = await fake({
        "PUT /v1/adapters/a/w": _ForwardThenDrop(server.url),
        "DELETE /v1/adapters/a/t/tags/prod": _ForwardThenDrop(server.url),
        "DELETE /v1/adapters/a/t/tags/none": _Forward(server.url),
    })
    async with MintClient(url, retries=3, **FAST) as c:
        with pytest.raises(ConnectionFailed):
            await c.publish("a", "w", peft_dir)
        await c.untag("a", "t", "prod")
        with pytest.raises(TagNotFound):  # not resent: a missing tag is the caller's error
            await c.untag("a", "t", "none")
    assert hits == {"PUT /v1/adapters/a/w": 1, "DELETE /v1/adapters/a/t/tags/prod": 2,
                    "DELETE /v1/adapters/a/t/tags/none": 1}
    async with MintClient(server.url) as real:
        assert [v.version for v in await real.versions("a", "w")] == [1]  # stored once
        assert (await real.version("a/t@1")).tags == ()
