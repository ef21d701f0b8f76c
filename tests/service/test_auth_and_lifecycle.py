"""Tokens, content ownership across tenants, config validation, startup and graceful shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from mint_store.service import ServiceConfig, serve
from mint_store.service.auth import TokenTable
from mint_store.service.state import STATE
from mint_store.store import Store
from tests.support.service import ServerFactory, auth, expect_error, peft_form, publish, read_peft, until_parked
from tests.support.targets import StoreTarget

C, W = "adapter_config.json", "adapter_model.safetensors"


async def test_identical_content_is_readable_by_each_owner_until_it_deletes(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    theirs = await publish(http, server, peft_files, "beta", "m", headers=auth("beta"))
    blob = f"{server.url}/v1/blobs/{theirs['content_id']}"
    async with http.get(blob, headers=auth("acme")) as r:
        await expect_error(r, 404, "blob_not_found")
    mine = await publish(http, server, peft_files, "acme", "m", headers=auth("acme"))
    # one row for both, but beta's bytes are not reported to acme (item 10 of issue 12)
    assert not mine["deduplicated"] and mine["content_id"] == theirs["content_id"]
    async with http.get(blob, headers=auth("acme")) as r:  # acme holds these bytes now too
        assert r.status == 200
    async with http.delete(f"{server.url}/v1/adapters/acme/m/versions/1", headers=auth("acme")) as r:
        assert r.status == 200
    async with http.get(blob, headers=auth("acme")) as r:
        await expect_error(r, 404, "blob_not_found")
    async with http.get(blob, headers=auth("beta")) as r:
        assert r.status == 200


@pytest.mark.parametrize(("doc", "why"), [
    ({"tokens": [{"token": "short", "tenants": ["a"], "role": "read"}]}, "at least 16"),
    ({"tokens": [{"token": "x" * 20, "tenants": ["a"], "role": "owner"}]}, "role must be"),
    ({"tokens": [{"token": "x" * 20, "tenants": [], "role": "write"}]}, "non-empty"),
    ({"tokens": [{"token": "x" * 20, "tenants": ["A/B"], "role": "read"}]}, "invalid tenant"),
    ({"tokens": [{"token": "x" * 20, "tenants": ["a"], "role": "read"}] * 2}, "duplicate"),
    ({"tokens": [{"token": "x" * 20, "tenants": ["a"], "role": "read", "extra": 1}]}, "expected an object"),
    ({"keys": []}, "expected"),
])
def test_token_file_is_validated(doc: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        TokenTable.parse(doc)


def test_config_refuses_public_bind_without_tokens(tmp_path: Path, tokens_file: str) -> None:
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.org"):
        with pytest.raises(ValueError, match="without a token file"):
            ServiceConfig(host=host)
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert ServiceConfig(host=host).port == 8470
    assert ServiceConfig(host="0.0.0.0", tokens_file=tokens_file).host == "0.0.0.0"
    for bad in ({"port": 70000}, {"body_limit": 0}, {"request_timeout": -1}, {"tokens_file": str(tmp_path / "no")},
                {"workers": True}):
        with pytest.raises(ValueError):
            ServiceConfig(**bad)


async def test_serve_says_loopback_only_and_stops_on_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(ServiceConfig(store=str(tmp_path / "store"), port=0), stop=stop))
    err = ""
    for _ in range(2000):
        err += capsys.readouterr().err
        if "serving" in err or task.done():
            break
        await asyncio.sleep(0.01)
    assert "no token file: serving loopback only" in err
    url = err.split(" on ", 1)[1].split()[0]
    async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as r:
        assert r.status == 200
    stop.set()
    await task
    assert "shutting down" in capsys.readouterr().err


async def test_graceful_shutdown_commits_the_request_in_flight(
    make_server: ServerFactory, local_target: StoreTarget, peft_dir2: Path, peft_files: dict[str, bytes]
) -> None:
    server = await make_server(local_target)
    state = server.app[STATE]
    other = read_peft(peft_dir2)
    async with aiohttp.ClientSession() as http:
        await publish(http, server, peft_files)
        poll = asyncio.create_task(http.get(f"{server.url}/v1/events", params={"after": "1", "wait": "30"}))
        await until_parked(server)  # asleep in the feed: only the shutdown can wake it
        with state.store.held_commits():  # the upload's commit waits here: it is surely in flight
            upload = asyncio.create_task(http.put(f"{server.url}/v1/adapters/acme/chat", data=peft_form(other)))
            size = len(peft_files[C]) + len(peft_files[W]) + len(other[C]) + len(other[W])
            for _ in range(3000):
                if state.metrics.registry.get_sample_value("mint_upload_bytes_total") == size:
                    break
                await asyncio.sleep(0.01)
            stopping = asyncio.create_task(server.stop())
            await asyncio.sleep(0.1)
            assert not upload.done() and not stopping.done()
        polled, uploaded = await poll, await upload
        await stopping
        assert polled.status == 200  # woken at shutdown, not cut off
        assert uploaded.status == 201  # finished and committed before the store closed
        version = (await uploaded.json())["version"]
    assert version == 2
    # the index was closed and the writer lock released: the store opens again, upload included
    with Store.open(local_target.url, index_dir=local_target.index_dir) as store:
        assert store.resolve("acme/chat").content_id == store.version("acme/chat@2").content_id
        assert store.version("acme/chat@2").content_id != store.version("acme/chat@1").content_id


async def test_a_read_only_replica_serves_and_follows_the_writer(
    make_server: ServerFactory, local_target: StoreTarget, peft_dir: Path
) -> None:
    from mint_store.peft.directory import load_peft_dir

    with Store.open(local_target.url, index_dir=local_target.index_dir) as writer:
        writer.publish("acme", "chat", load_peft_dir(peft_dir))
        replica = await make_server(local_target, readonly=True)
        async with aiohttp.ClientSession() as http:
            async with http.put(f"{replica.url}/v1/adapters/acme/chat", data=peft_form(read_peft(peft_dir))) as r:
                await expect_error(r, 405, "not_the_writer")
            poll = asyncio.create_task(http.get(f"{replica.url}/v1/events", params={"after": "1", "wait": "30"}))
            await until_parked(replica)  # asleep in the feed: only the other writer's commit can wake it
            await asyncio.to_thread(writer.tag, "acme/chat@1", "prod")  # another writer commits
            async with await poll as r:
                feed = await r.json()
            assert [e["kind"] for e in feed["events"]] == ["tag"]
            async with http.get(f"{replica.url}/v1/adapters/acme/chat/tags/prod") as r:
                assert (await r.json())["version"] == 1
