"""The service end to end, on the local and the S3 (moto) backends."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from mint_store.peft.directory import load_peft_dir, load_peft_files
from mint_store.service.openapi import document
from tests.support.service import (
    PEFT_NAMES,
    ServerFactory,
    expect_error,
    peft_form,
    publish,
    read_peft,
    snapshot,
    store_of,
    until_parked,
)
from tests.support.targets import StoreTarget


async def test_upload_download_round_trip(
    make_server: ServerFactory, target: StoreTarget, http: aiohttp.ClientSession, peft_dir: Path
) -> None:
    server = await make_server(target)
    files = read_peft(peft_dir)
    got = await publish(http, server, files, query="?tag=prod")
    expected = load_peft_dir(peft_dir)
    assert got["version"] == 1 and not got["deduplicated"]
    assert got["content_id"] == expected.content_id()

    url = f"{server.url}/v1/adapters/acme/chat"
    async with http.get(url) as r:
        meta = await r.json()
    assert meta["version"] == 1 and meta["tags"] == ["prod"] and meta["content_id"] == got["content_id"]

    store = store_of(server)
    loc = store.resolve("acme/chat@1")
    async with http.get(f"{url}/versions/1/content") as r:
        assert r.status == 200
        assert r.headers["ETag"] == f'"{got["content_id"]}"'
        assert int(r.headers["Content-Length"]) == loc.length
        body = await r.read()
    # the bytes served at the recorded offset are Zarr's own row
    assert body == store.read_row_zarr(loc).tobytes()
    async with http.get(f"{server.url}/v1/blobs/{got['content_id']}") as r:
        assert await r.read() == body

    async with http.get(f"{url}/versions/1/peft") as r:
        assert r.status == 200 and r.content_type == "application/x-tar"
        data = await r.read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == sorted(PEFT_NAMES)
        config, weights = (tar.extractfile(n).read() for n in PEFT_NAMES)  # type: ignore[union-attr]
    assert load_peft_files(config, weights).content_id() == got["content_id"]

    # the same bytes under another name: a new version, stored once
    again = await publish(http, server, files, name="copy")
    assert again["version"] == 1 and again["deduplicated"] and again["content_id"] == got["content_id"]


async def test_ranges_etag_and_head(server, http: aiohttp.ClientSession, peft_files: dict[str, bytes]) -> None:
    got = await publish(http, server, peft_files)
    url = f"{server.url}/v1/adapters/acme/chat/versions/1/content"
    async with http.get(url) as r:
        full = await r.read()
    n = len(full)
    for header, (start, stop) in {
        "bytes=0-9": (0, 10), "bytes=10-": (10, n), "bytes=-16": (n - 16, n), f"bytes=5-{n + 100}": (5, n),
    }.items():
        async with http.get(url, headers={"Range": header}) as r:
            assert r.status == 206, header
            assert r.headers["Content-Range"] == f"bytes {start}-{stop - 1}/{n}"
            assert await r.read() == full[start:stop]
    for header in (f"bytes={n}-", f"bytes={n + 5}-{n + 10}", "bytes=-0"):
        async with http.get(url, headers={"Range": header}) as r:
            await expect_error(r, 416, "range_not_satisfiable")
            assert r.headers["Content-Range"] == f"bytes */{n}"
    # a header that does not parse, or overlapping ranges: the whole row (RFC 9110 allows ignoring);
    # several ranges in order are multipart/byteranges (tests/engine/test_tp_ranged.py)
    for header in ("items=0-1", "bytes=9-3", "bytes=0-5,3-4"):
        async with http.get(url, headers={"Range": header}) as r:
            assert r.status == 200 and await r.read() == full
    async with http.get(url, headers={"If-None-Match": f'"{got["content_id"]}"'}) as r:
        assert r.status == 304
    async with http.get(url, headers={"Range": "bytes=0-3", "If-Range": '"other"'}) as r:
        assert r.status == 200 and await r.read() == full
    async with http.head(url) as r:
        assert r.status == 200 and int(r.headers["Content-Length"]) == n
        assert await r.read() == b""


async def test_versions_tags_and_deletes(server, http: aiohttp.ClientSession, peft_dir: Path, peft_dir2: Path) -> None:
    await publish(http, server, read_peft(peft_dir))
    await publish(http, server, read_peft(peft_dir2))
    base = f"{server.url}/v1/adapters/acme/chat"
    async with http.put(f"{base}/tags/prod", json={"version": 1}) as r:
        assert r.status == 200 and (await r.json())["version"] == 1
    async with http.get(f"{base}/tags/prod") as r:
        assert (await r.json())["version"] == 1
    async with http.get(f"{base}/versions") as r:
        got = await r.json()
        assert [v["version"] for v in got["versions"]] == [1, 2] and got["next"] is None
    async with http.get(f"{base}/versions?limit=1") as r:  # a page: "next" is the cursor of the following one
        got = await r.json()
        assert [v["version"] for v in got["versions"]] == [1] and got["next"] == 1
    async with http.get(f"{base}/versions?after=1&limit=1") as r:
        got = await r.json()
        assert [v["version"] for v in got["versions"]] == [2] and got["next"] == 2
    async with http.get(f"{base}/versions?after=2") as r:
        assert await r.json() == {"tenant": "acme", "name": "chat", "versions": [], "next": None}
    for bad in ("limit=0", "limit=1001", "after=-1", "after=x"):
        async with http.get(f"{base}/versions?{bad}") as r:
            await expect_error(r, 400, "bad_request")
    async with http.get(f"{server.url}/v1/adapters/acme") as r:
        assert await r.json() == {"tenant": "acme", "names": ["chat"], "next": None}
    async with http.delete(f"{base}/versions/1") as r:
        assert r.status == 200 and (await r.json())["deleted"]
    before = snapshot(server)
    async with http.put(f"{base}/tags/canary", json={"version": 1}) as r:
        await expect_error(r, 409, "version_deleted")
    async with http.delete(f"{base}/versions/1") as r:
        await expect_error(r, 409, "version_deleted")
    async with http.get(f"{base}/versions/1/content") as r:
        await expect_error(r, 410, "version_deleted")
    async with http.get(f"{base}/tags/prod") as r:  # deleting a version drops its tags
        await expect_error(r, 404, "tag_not_found")
    async with http.get(f"{base}/versions/9") as r:
        await expect_error(r, 404, "version_not_found")
    async with http.get(f"{server.url}/v1/adapters/acme/other") as r:
        await expect_error(r, 404, "adapter_not_found")
    assert snapshot(server) == before
    async with http.get(base) as r:
        assert (await r.json())["version"] == 2


async def test_concurrent_publishes_of_one_name_get_distinct_versions(
    server, http: aiohttp.ClientSession, peft_files: dict[str, bytes]
) -> None:
    results = await asyncio.gather(*(publish(http, server, peft_files) for _ in range(12)))
    assert sorted(r["version"] for r in results) == list(range(1, 13))
    assert len({r["content_id"] for r in results}) == 1
    assert sum(not r["deduplicated"] for r in results) == 1


async def test_resolve_many_in_one_call(server, http: aiohttp.ClientSession, peft_files: dict[str, bytes]) -> None:
    got = await publish(http, server, peft_files, query="?tag=prod")
    refs = ["acme/chat", "acme/chat@1", "acme/chat:prod", f"sha:{got['content_id']}", "acme/nope", "Bad/ref"]
    refs = refs * 1666 + ["acme/chat"] * 4  # 10,000 exactly
    async with http.post(f"{server.url}/v1/resolve", json={"refs": refs}) as r:
        results = (await r.json())["results"]
    assert len(results) == 10_000
    assert {x["location"]["content_id"] for x in results if "location" in x} == {got["content_id"]}
    assert results[4]["error"] == "adapter_not_found" and results[5]["error"] == "invalid_name"
    async with http.post(f"{server.url}/v1/resolve", json={"refs": [*refs, "acme/chat"]}) as r:
        await expect_error(r, 400, "bad_request")
    async with http.post(f"{server.url}/v1/resolve", json=["acme/chat"]) as r:
        await expect_error(r, 400, "bad_request")


async def test_a_long_poll_longer_than_the_request_timeout_answers_200(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession
) -> None:
    """Waiting is the client's choice, not server work: a poll may wait up to max_event_wait
    whatever request_timeout is (it was cut at request_timeout with a 408)."""
    server = await make_server(local_target, request_timeout=0.5, max_event_wait=60)
    async with http.get(f"{server.url}/v1/events", params={"after": "0", "wait": "1.5"}) as r:
        assert r.status == 200 and await r.json() == {"events": [], "last_seq": 0, "head": 0}


async def test_a_write_that_outlasts_the_request_timeout_is_never_answered_408(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession, peft_files: dict[str, bytes]
) -> None:
    """408 is retryable, and a write that outlasts the deadline still commits: answered 408, a
    resent publish made a second version and a resent delete found its own first. Such a write
    is answered commit_in_doubt (503, which clients do not resend: look first), and it lands."""
    server = await make_server(local_target, request_timeout=0.5)
    first = await publish(http, server, peft_files)
    store = store_of(server)
    with store.held_commits():  # the writer is slow (a compaction step on S3, say)
        async with http.put(f"{server.url}/v1/adapters/acme/chat", data=peft_form(peft_files)) as r:
            await expect_error(r, 503, "commit_in_doubt")
        async with http.delete(f"{server.url}/v1/adapters/acme/chat/versions/1") as r:
            await expect_error(r, 503, "commit_in_doubt")
    for _ in range(3000):
        if store.last_seq >= first["seq"] + 2:
            break
        await asyncio.sleep(0.01)
    versions = {v.version: v.deleted for v in store.versions("acme", "chat")}
    assert versions == {1: True, 2: False}  # each write landed exactly once


async def test_events_long_poll_wakes_on_commit(
    make_server: ServerFactory, target: StoreTarget, http: aiohttp.ClientSession, peft_files: dict[str, bytes]
) -> None:
    server = await make_server(target)
    async with http.get(f"{server.url}/v1/events", params={"after": "0"}) as r:
        assert await r.json() == {"events": [], "last_seq": 0, "head": 0}

    async def poll() -> dict:
        async with http.get(f"{server.url}/v1/events", params={"after": "0", "wait": "30"}) as r:
            return dict(await r.json())

    waiting = asyncio.create_task(poll())
    await until_parked(server)  # the poll sleeps in the feed: only the commit can wake it
    assert not waiting.done()
    got = await publish(http, server, peft_files, query="?tag=prod")
    feed = await waiting
    assert feed["last_seq"] == 1 and len(feed["events"]) == 1
    item = feed["events"][0]["items"][0]
    assert (item["tenant"], item["name"], item["version"], item["tag"]) == ("acme", "chat", 1, "prod")
    assert item["content_id"] == got["content_id"]
    async with http.put(f"{server.url}/v1/adapters/acme/chat/tags/canary", json={"version": 1}) as r:
        assert r.status == 200
    async with http.get(f"{server.url}/v1/events", params={"after": "1", "wait": "5"}) as r:
        feed = await r.json()
    assert [e["kind"] for e in feed["events"]] == ["tag"] and feed["last_seq"] == 2
    for bad in ({"after": "-1"}, {"wait": "nan"}, {"wait": "1e9"}, {"limit": "5000"}):
        async with http.get(f"{server.url}/v1/events", params=bad) as r:
            await expect_error(r, 400, "bad_request")


async def test_bases_register_and_check(server, http: aiohttp.ClientSession, peft_files: dict[str, bytes]) -> None:
    shapes = {f"model.layers.{i}.self_attn.{m}": [32, 32 if m in ("q_proj", "o_proj") else 16]
              for i in range(2) for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    url = f"{server.url}/v1/bases/tiny-llama"
    async with http.put(url, json=shapes) as r:
        assert r.status == 201
    async with http.put(url, json=shapes) as r:
        assert r.status == 200
    async with http.get(url) as r:
        assert (await r.json())["shapes"] == shapes
    before = snapshot(server)
    async with http.put(url, json={"model.layers.0.self_attn.q_proj": [32, 33]}) as r:
        await expect_error(r, 409, "conflict")
    async with http.put(f"{server.url}/v1/bases/other", json={"m": [0, 1]}) as r:
        await expect_error(r, 422, "invalid_adapter")
    wrong = {k: [v[0] + 1, v[1]] for k, v in shapes.items()}
    async with http.put(f"{server.url}/v1/bases/wrong", json=wrong) as r:
        assert r.status == 201
    before = snapshot(server)
    async with http.put(f"{server.url}/v1/adapters/acme/chat?base=wrong", data=peft_form(peft_files)) as r:
        await expect_error(r, 422, "base_mismatch")
    assert snapshot(server) == before
    await publish(http, server, peft_files, query="?base=tiny-llama")
    async with http.get(f"{server.url}/v1/bases/none") as r:
        await expect_error(r, 404, "base_not_found")


async def test_openapi_matches_the_routes(server, http: aiohttp.ClientSession) -> None:
    app_routes = {
        (route.method.lower(), route.resource.canonical)
        for route in server.app.router.routes() if route.resource is not None
    }
    doc = document()
    doc_routes = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert app_routes == doc_routes
    assert doc["openapi"].startswith("3.1")
    async with http.get(f"{server.url}/openapi.json") as r:
        assert await r.json() == doc


async def test_metrics_and_health(server, http: aiohttp.ClientSession, peft_files: dict[str, bytes]) -> None:
    await publish(http, server, peft_files)
    async with http.get(f"{server.url}/v1/adapters/acme/chat/versions/1/content") as r:
        nbytes = len(await r.read())
    async with http.get(f"{server.url}/v1/adapters/acme/nope") as r:
        assert r.status == 404
    async with http.get(f"{server.url}/healthz") as r:
        assert await r.json() == {"status": "ok", "last_seq": 1, "writable": True}
    async with http.get(f"{server.url}/metrics") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        text = await r.text()
    lines = set(text.splitlines())
    content = "/v1/adapters/{tenant}/{name}/versions/{version}/content"
    assert f'mint_http_requests_total{{method="GET",route="{content}",status="200"}} 1.0' in lines
    assert 'mint_http_requests_total{method="PUT",route="/v1/adapters/{tenant}/{name}",status="201"} 1.0' in lines
    assert 'mint_http_requests_total{method="GET",route="/v1/adapters/{tenant}/{name}",status="404"} 1.0' in lines
    assert f'mint_bytes_served_total{{route="{content}"}} {float(nbytes)}' in lines
    assert "mint_publish_seconds_count 1.0" in lines
    assert "mint_group_commit_batch_size_count 1.0" in lines
    index_bytes = [ln for ln in lines if ln.startswith("mint_index_bytes ")]
    assert index_bytes and float(index_bytes[0].split()[1]) > 0
    assert 'mint_index_entries{db="versions"} 1.0' in lines


async def test_admin_stats_and_compact(server, http: aiohttp.ClientSession, peft_files: dict[str, bytes]) -> None:
    await publish(http, server, peft_files)
    async with http.get(f"{server.url}/v1/admin/stats") as r:
        stats = await r.json()
    assert stats["index"]["versions"] == 1 and stats["index"]["last_seq"] == 1
    assert stats["store_stats"]["versions"] == 1 and stats["store_stats"]["shards"] == 1
    await publish(http, server, peft_files, name="other")  # the same bytes: deduplicated, no new shard
    async with http.delete(f"{server.url}/v1/adapters/acme/chat/versions/1") as r:
        assert r.status == 200
    async with http.post(f"{server.url}/v1/admin/compact?grace=0") as r:
        assert r.status == 200
        report = await r.json()
    # one shard, still live (acme/other holds its row): nothing to rewrite, nothing retired
    assert (report["shards_before"], report["shards_after"], report["rows_moved"]) == (1, 1, 0)
    assert report["swept"] == [] == report["shards_retired"]
    async with http.post(f"{server.url}/v1/admin/compact?grace=soon") as r:
        await expect_error(r, 400, "bad_request")


async def test_many_concurrent_requests_from_one_client(server, peft_files: dict[str, bytes]) -> None:
    connector = aiohttp.TCPConnector(limit=64)  # bounded: 1,000 requests over 64 connections
    async with aiohttp.ClientSession(connector=connector) as http:
        got = await publish(http, server, peft_files)

        async def fetch(i: int) -> bytes:
            path = f"/v1/blobs/{got['content_id']}" if i % 2 else "/v1/adapters/acme/chat/versions/1/content"
            async with http.get(server.url + path) as r:
                assert r.status == 200
                return await r.read()

        bodies = await asyncio.gather(*(fetch(i) for i in range(1000)))
    row = store_of(server).read("acme/chat@1")[1]
    assert all(b == np.asarray(row).tobytes() for b in bodies)
    assert {len(b) for b in bodies} == {len(bodies[0])}


@pytest.mark.parametrize("path", ["/nope", "/v1/adapters"])
async def test_unknown_routes_answer_json(server, http: aiohttp.ClientSession, path: str) -> None:
    async with http.get(server.url + path) as r:
        await expect_error(r, 404, "route_not_found")
    async with http.post(f"{server.url}/v1/adapters/acme/chat") as r:
        await expect_error(r, 405, "method_not_allowed")
        assert "PUT" in r.headers["Allow"]


async def test_large_rows_stream_whole_and_in_ranges(
    make_server: ServerFactory, target: StoreTarget, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine_client import MintClient
    from mint_store.service.rows import serving as rows
    from tests.support.factories import random_adapter

    monkeypatch.setattr(rows, "S3_CHUNK", 100_000)  # several ranged GETs per S3 row
    server = await make_server(target)
    adapter = random_adapter(7, rank=16, hidden=512)  # a 512 KiB row: sendfile locally
    expected = adapter.to_row()[1].tobytes()
    assert len(expected) > rows.SMALL_ROW
    async with MintClient(server.url) as client:
        got = await client.publish("acme", "big", adapter)
        loc, row = await client.read("acme/big")
    assert bytes(row) == expected and loc.content_id == got.content_id
    url = f"{server.url}/v1/blobs/{got.content_id}"
    async with http.get(url) as r:
        assert await r.read() == expected
    n = len(expected)
    for start, stop in ((0, 1), (1000, 250_000), (n - 70_000, n), (123_457, 123_458)):
        async with http.get(url, headers={"Range": f"bytes={start}-{stop - 1}"}) as r:
            assert r.status == 206 and await r.read() == expected[start:stop]


async def test_background_compaction_merges_and_sweeps(make_server, local_target) -> None:
    from tests.support.factories import random_adapter

    with local_target.open() as store:  # three commits: three small shards, one of them dead
        for i in range(3):
            store.publish("acme", f"a{i}", random_adapter(i))
        store.delete("acme/a0")
        old = store.resolve("acme/a1")
    server = await make_server(local_target, compact_interval_s=0.05, compact_grace_s=0.0)
    store = store_of(server)
    for _ in range(400):  # bounded wait for the background task (not a timing assertion)
        if not store.storage.exists(old.shard_key):
            break
        await asyncio.sleep(0.05)
    from mint_store.maintenance.fsck import fsck
    from mint_store.maintenance.stats import store_stats

    assert not store.storage.exists(old.shard_key)  # retired, then swept
    s = store_stats(store)
    assert (s["shards"], s["retired_shards"], s["rows"]) == (1, 0, 2)
    for i in (1, 2):
        _, row = store.read(f"acme/a{i}")
        assert row.tobytes() == random_adapter(i).to_row()[1].tobytes()
    assert fsck(store).clean
