"""Service paths clients rely on: paging of the name list, the PUT reply's Location and
upload_sha256, and If-Range on ranged reads."""

from __future__ import annotations

import hashlib

import aiohttp

from tests.support.factories import random_adapter
from tests.support.service import expect_error, peft_form, publish, store_of


async def test_names_page_through_cursor_limit_and_next(server, http: aiohttp.ClientSession) -> None:
    store = store_of(server)
    names = ["b0", "b1", "n0", "n1", "n2", "n3", "n4"]
    for i, name in enumerate(names):
        store.publish("acme", name, random_adapter(i))
    store.publish("beta", "n9", random_adapter(9))  # another tenant's name never shows up
    url = f"{server.url}/v1/adapters/acme"

    async def page(**params: str) -> dict:
        async with http.get(url, params=params) as r:
            assert r.status == 200
            return dict(await r.json())

    got, cursor = [], None
    for _ in range(10):  # page by 3 with the cursor the last page returned
        body = await page(limit="3", **({"cursor": cursor} if cursor else {}))
        got.append(body["names"])
        cursor = body["next"]
        if cursor is None:
            break
    assert got == [["b0", "b1", "n0"], ["n1", "n2", "n3"], ["n4"]]
    # a full last page still names a cursor; the page after it is empty and ends the walk
    assert await page(prefix="n", limit="5") == {"tenant": "acme", "names": ["n0", "n1", "n2", "n3", "n4"],
                                                 "next": "n4"}
    assert await page(prefix="n", after="n4", limit="5") == {"tenant": "acme", "names": [], "next": None}
    # `after` is the same cursor under its other name, and it combines with a prefix
    assert (await page(prefix="n", after="n1", limit="2"))["names"] == ["n2", "n3"]
    assert (await page())["names"] == names  # default limit: everything here
    for bad in ({"limit": "0"}, {"limit": "1001"}, {"cursor": "../x"}, {"prefix": "N*"}):
        async with http.get(url, params=bad) as r:
            await expect_error(r, 400, "invalid_name" if "cursor" in bad else "bad_request")


async def test_put_answers_location_and_the_sha256_of_the_weights(
    server, http: aiohttp.ClientSession, peft_files: dict[str, bytes]
) -> None:
    for version in (1, 2):
        async with http.put(f"{server.url}/v1/adapters/acme/chat", data=peft_form(peft_files)) as r:
            body = await r.json()
            assert r.status == 201, body
            location = r.headers["Location"]
        assert location == f"/v1/adapters/acme/chat/versions/{version}"
        assert body["upload_sha256"] == hashlib.sha256(peft_files["adapter_model.safetensors"]).hexdigest()
        async with http.get(f"{server.url}{location}") as r:  # the Location names what was just stored
            stored = await r.json()
        assert (stored["version"], stored["content_id"]) == (version, body["content_id"])


async def test_if_range_sends_the_range_only_for_the_current_etag(
    server, http: aiohttp.ClientSession, peft_files: dict[str, bytes]
) -> None:
    got = await publish(http, server, peft_files)
    url = f"{server.url}/v1/adapters/acme/chat/versions/1/content"
    async with http.get(url) as r:
        full, etag = await r.read(), r.headers["ETag"]
    assert etag == f'"{got["content_id"]}"'
    async with http.get(url, headers={"Range": "bytes=4-9", "If-Range": etag}) as r:
        assert r.status == 206 and await r.read() == full[4:10]
        assert r.headers["Content-Range"] == f"bytes 4-9/{len(full)}"
    # another entity tag, a weak one (If-Range compares strongly) or a date: the whole row, 200
    for other in ('"0123456789abcdef0123456789abcdef"', f"W/{etag}", "Tue, 01 Dec 2026 00:00:00 GMT"):
        async with http.get(url, headers={"Range": "bytes=4-9", "If-Range": other}) as r:
            assert r.status == 200, other
            assert "Content-Range" not in r.headers and await r.read() == full
