"""Bad input gets the right 4xx and a JSON error, stores nothing, and leaves the server serving."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load, save
from yarl import URL

from mint_store.service import RunningServer
from tests.support.service import ServerFactory, expect_error, peft_form, publish, snapshot, still_serving, upload_dir
from tests.support.targets import StoreTarget

W, C = "adapter_model.safetensors", "adapter_config.json"


def _tensors(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    return dict(load(files[W]))


def _with_weights(files: dict[str, bytes], tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {C: files[C], W: save(tensors)}


def _with_config(files: dict[str, bytes], **changes: Any) -> dict[str, bytes]:
    return {C: json.dumps(json.loads(files[C]) | changes).encode(), W: files[W]}


def _nan(files: dict[str, bytes]) -> dict[str, bytes]:
    t = _tensors(files)
    key = sorted(t)[0]
    t[key] = t[key].clone()
    t[key].view(-1)[0] = float("nan")
    return _with_weights(files, t)


def _float64(files: dict[str, bytes]) -> dict[str, bytes]:
    t = _tensors(files)
    return _with_weights(files, {k: v.double() for k, v in t.items()})


def _rank_mismatch(files: dict[str, bytes]) -> dict[str, bytes]:
    t = _tensors(files)
    key = next(k for k in sorted(t) if "lora_B" in k)
    t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 1)
    return _with_weights(files, t)


def _edit_header(files: dict[str, bytes], edit: Any) -> dict[str, bytes]:
    """Rewrite the safetensors JSON header (the data section is kept as it is)."""
    raw = files[W]
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header, sorted(k for k in header if k != "__metadata__"))
    blob = json.dumps(header).encode()
    return {C: files[C], W: struct.pack("<Q", len(blob)) + blob + raw[8 + n :]}


def _overlapping(files: dict[str, bytes]) -> dict[str, bytes]:
    def edit(h: dict[str, Any], names: list[str]) -> None:
        h[names[1]]["data_offsets"] = h[names[0]]["data_offsets"]
    return _edit_header(files, edit)


def _out_of_range(files: dict[str, bytes]) -> dict[str, bytes]:
    def edit(h: dict[str, Any], names: list[str]) -> None:
        last = max(names, key=lambda k: h[k]["data_offsets"][1])
        h[last]["data_offsets"][1] += 4096
    return _edit_header(files, edit)


def _shape_bytes_mismatch(files: dict[str, bytes]) -> dict[str, bytes]:
    def edit(h: dict[str, Any], names: list[str]) -> None:
        h[names[0]]["shape"] = [h[names[0]]["shape"][0] * 2, *h[names[0]]["shape"][1:]]
    return _edit_header(files, edit)


BAD_ADAPTERS = {
    "garbage": (lambda f: {C: f[C], W: b"definitely not a safetensors file"}, "limit_exceeded"),
    "too short": (lambda f: {C: f[C], W: b"\x01\x02"}, "invalid_adapter"),
    "truncated weights": (lambda f: {C: f[C], W: f[W][: len(f[W]) // 2]}, "invalid_adapter"),
    "header past the end": (lambda f: {C: f[C], W: struct.pack("<Q", 10**6) + b"{}"}, "invalid_adapter"),
    "header over 100 MB": (lambda f: {C: f[C], W: struct.pack("<Q", 101 * 2**20) + b"{}"}, "limit_exceeded"),
    "overlapping offsets": (_overlapping, "invalid_adapter"),
    "offsets out of range": (_out_of_range, "invalid_adapter"),
    "shape and byte count disagree": (_shape_bytes_mismatch, "invalid_adapter"),
    "nan values": (_nan, "invalid_adapter"),
    "float64": (_float64, "unsupported_adapter"),
    "ranks differ": (_rank_mismatch, "invalid_adapter"),
    "config not json": (lambda f: {C: b"{not json", W: f[W]}, "invalid_adapter"),
    "config names missing modules": (lambda f: _with_config(f, target_modules=["q_proj", "gate_proj"]),
                                     "invalid_adapter"),
    "dora": (lambda f: _with_config(f, use_dora=True), "unsupported_adapter"),
    "modules_to_save": (lambda f: _with_config(f, modules_to_save=["lm_head"]), "unsupported_adapter"),
}


async def _check_nothing_stored(http: aiohttp.ClientSession, server: RunningServer, before: tuple) -> None:
    assert snapshot(server) == before
    assert upload_dir(server) == []
    await still_serving(http, server)


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
async def test_bad_adapters_are_refused(server, http, peft_files: dict[str, bytes], case: str) -> None:
    await publish(http, server, peft_files, name="existing")
    make, code = BAD_ADAPTERS[case]
    before = snapshot(server)
    async with http.put(f"{server.url}/v1/adapters/acme/chat", data=peft_form(make(peft_files))) as r:
        await expect_error(r, 422, code)
    await _check_nothing_stored(http, server, before)


async def test_multipart_shape_errors(server, http, peft_files: dict[str, bytes]) -> None:
    url = f"{server.url}/v1/adapters/acme/chat"
    before = snapshot(server)
    cases = {
        "missing part": {C: peft_files[C]},
        "extra part": {**peft_files, "README.md": b"hello"},
    }
    for files in cases.values():
        async with http.put(url, data=peft_form(files)) as r:
            await expect_error(r, 400, "bad_request")
    form = peft_form(peft_files)
    form.add_field(W, peft_files[W], filename=W)
    async with http.put(url, data=form) as r:  # a part twice
        await expect_error(r, 400, "bad_request")
    async with http.put(url, json={"adapter_config.json": "{}"}) as r:  # not multipart
        await expect_error(r, 415, "unsupported_media_type")
    async with http.put(url, data=peft_form(peft_files, **{W: "text/html"})) as r:
        await expect_error(r, 415, "unsupported_media_type")
    await _check_nothing_stored(http, server, before)


async def test_truncated_multipart_body(server, http, peft_files: dict[str, bytes]) -> None:
    before = snapshot(server)
    boundary = "mintboundary1234"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{C}\"; filename=\"{C}\"\r\n\r\n").encode()
    body += peft_files[C] + f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"{W}\"\r\n\r\n".encode()
    body += peft_files[W][:100]  # ... and no closing boundary
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    async with http.put(f"{server.url}/v1/adapters/acme/chat", data=body, headers=headers) as r:
        await expect_error(r, 400, "bad_request")
    await _check_nothing_stored(http, server, before)


@pytest.mark.parametrize("boundary,value", [("b", "u" * 40), ("x" * 40, "utf-8")], ids=["long value", "long boundary"])
async def test_a_charset_part_is_a_bad_request(server, http, boundary: str, value: str) -> None:
    """aiohttp reads a `_charset_` part itself and raised RuntimeError or AssertionError: a 500."""
    before = snapshot(server)
    body = f'--{boundary}\r\nContent-Disposition: form-data; name="_charset_"\r\n\r\n{value}\r\n--{boundary}--\r\n'
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    async with http.put(f"{server.url}/v1/adapters/acme/chat", data=body.encode(), headers=headers) as r:
        await expect_error(r, 400, "bad_request")
    await _check_nothing_stored(http, server, before)


async def test_body_limits(make_server: ServerFactory, local_target: StoreTarget, http, peft_files) -> None:
    server = await make_server(local_target, body_limit=64 * 1024, config_limit=4096)
    url = f"{server.url}/v1/adapters/acme/chat"
    before = snapshot(server)
    big = {C: peft_files[C], W: b"\0" * (200 * 1024)}
    async with http.put(url, data=peft_form(big)) as r:  # declared length over the limit
        await expect_error(r, 413, "body_too_large")

    boundary = "b0undary"
    head = f'--{boundary}\r\nContent-Disposition: form-data; name="{W}"\r\n\r\n'.encode()

    async def stream() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        yield head
        for _ in range(100):
            yield b"\0" * 4096

    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    async with http.put(url, data=stream(), headers=headers) as r:
        assert "Content-Length" not in r.request_info.headers
        await expect_error(r, 413, "body_too_large")
    async with http.put(url, data=peft_form({C: b" " * 5000, W: peft_files[W]})) as r:  # one part over
        await expect_error(r, 413, "body_too_large")
    await _check_nothing_stored(http, server, before)
    await publish(http, server, peft_files)  # within the limits: fine


@pytest.mark.parametrize(("path", "code"), [
    ("/v1/adapters/acme/%2e%2e", "invalid_name"),
    ("/v1/adapters/%2E%2E/chat", "invalid_name"),
    ("/v1/adapters/acme/a..b", "invalid_name"),
    ("/v1/adapters/%D0%B0cme/chat", "invalid_name"),  # Cyrillic a
    ("/v1/adapters/acme/ch%C3%A4t", "invalid_name"),
    ("/v1/adapters/ACME/chat", "invalid_name"),
    ("/v1/adapters/acme/chat%2Fx", "invalid_name"),
    ("/v1/adapters/acme/-chat", "invalid_name"),
    ("/v1/adapters/acme/chat?tag=..", "invalid_name"),
    ("/v1/adapters/acme/chat?base=B%C3%A4se", "invalid_name"),
])
async def test_bad_names_on_upload(server, http, peft_files, path: str, code: str) -> None:
    before = snapshot(server)
    async with http.put(URL(server.url + path, encoded=True), data=peft_form(peft_files)) as r:
        await expect_error(r, 400, code)
    await _check_nothing_stored(http, server, before)


@pytest.mark.parametrize(("path", "status", "code"), [
    ("/v1/adapters/acme/..", 400, "invalid_name"),
    ("/v1/adapters/../chat", 400, "invalid_name"),
    ("/v1/adapters/acme/../chat", 404, "route_not_found"),  # raw dot segments match no route
    ("/v1/adapters/acme/chat/../../beta/chat", 404, "route_not_found"),
])
async def test_dot_dot_segments_never_reach_the_store(server, http, peft_files, path, status, code) -> None:
    before = snapshot(server)
    async with http.put(URL(server.url + path, encoded=True), data=peft_form(peft_files)) as r:
        await expect_error(r, status, code)
    await _check_nothing_stored(http, server, before)


@pytest.mark.parametrize("version", ["abc", "0", "-1", "1.5", "99999999999999999999", "%D9%A1"])
async def test_bad_versions(server, http, peft_files, version: str) -> None:
    await publish(http, server, peft_files)
    before = snapshot(server)
    base = f"{server.url}/v1/adapters/acme/chat"
    for method, path in (("GET", f"/versions/{version}"), ("GET", f"/versions/{version}/content"),
                         ("DELETE", f"/versions/{version}")):
        async with http.request(method, URL(base + path, encoded=True)) as r:
            await expect_error(r, 400, "invalid_name")
    async with http.put(f"{base}/tags/prod", json={"version": version}) as r:
        await expect_error(r, 400, "invalid_name")
    async with http.put(f"{base}/tags/prod", json={"version": 0}) as r:
        await expect_error(r, 400, "invalid_name")
    await _check_nothing_stored(http, server, before)


async def _raw(server: RunningServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    url = URL(server.url)
    return await asyncio.open_connection(url.host, url.port)


def _upload_head(length: int, boundary: str = "slowboundary") -> bytes:
    return (f"PUT /v1/adapters/acme/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
            f'--{boundary}\r\nContent-Disposition: form-data; name="{W}"\r\n\r\n').encode()


async def test_client_disconnecting_mid_upload_leaves_nothing(server, http, peft_files) -> None:
    before = snapshot(server)
    _reader, writer = await _raw(server)
    writer.write(_upload_head(10_000_000) + b"\0" * 2_000_000)  # well past the first temp-file write
    await writer.drain()
    for _ in range(500):  # until the server holds the temp file
        if upload_dir(server):
            break
        await asyncio.sleep(0.01)
    assert upload_dir(server), "the upload never reached the server"
    writer.close()
    for _ in range(500):  # the temp file goes when the server notices
        if not upload_dir(server):
            break
        await asyncio.sleep(0.01)
    await _check_nothing_stored(http, server, before)


async def test_slow_client_gets_request_timeout(make_server: ServerFactory, local_target: StoreTarget, http) -> None:
    server = await make_server(local_target, read_timeout=0.5)
    before = snapshot(server)
    reader, writer = await _raw(server)
    writer.write(_upload_head(1000))
    await writer.drain()

    async def trickle() -> None:  # a few bytes, then nothing: the per-read deadline (read_timeout) ends it
        writer.write(b"\0" * 10)
        await writer.drain()

    sender = asyncio.create_task(trickle())
    try:
        status_line = await asyncio.wait_for(reader.readline(), 30)
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        body = json.loads(await reader.readexactly(int(headers["content-length"])))
    finally:
        sender.cancel()
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 408")
    assert body["error"] == "request_timeout" and body["message"]
    assert headers.get("connection", "").lower() == "close"
    await _check_nothing_stored(http, server, before)


async def test_slow_headers_are_cut_off(make_server: ServerFactory, local_target: StoreTarget, http) -> None:
    server = await make_server(local_target, idle_timeout=0.3)
    reader, writer = await _raw(server)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 30) == b""  # closed, no answer
    writer.close()
    await still_serving(http, server)


async def test_json_bodies_are_bounded_and_typed(make_server: ServerFactory, local_target: StoreTarget, http):
    server = await make_server(local_target, json_limit=1024)
    async with http.post(f"{server.url}/v1/resolve", json={"refs": ["acme/x"] * 500}) as r:
        await expect_error(r, 413, "body_too_large")
    async with http.post(f"{server.url}/v1/resolve", data=b"{nope", headers={"Content-Type": "application/json"}) as r:
        await expect_error(r, 400, "bad_request")
    async with http.post(f"{server.url}/v1/resolve", data=b"refs", headers={"Content-Type": "text/plain"}) as r:
        await expect_error(r, 415, "unsupported_media_type")
    await still_serving(http, server)


async def test_a_resolve_body_is_bounded_by_its_ref_count_not_the_json_limit(
    make_server: ServerFactory, local_target: StoreTarget, http
) -> None:
    """max_resolve refs of the longest valid form fit; a body far past that (16 MiB of tiny refs
    parsed and walked on the loop, then refused) is refused as too large before it is parsed."""
    server = await make_server(local_target, max_resolve=100)
    longest = f"{'t' * 64}/{'n' * 64}:{'g' * 64}"
    async with http.post(f"{server.url}/v1/resolve", json={"refs": [longest] * 100}) as r:
        body = await r.json()
        assert r.status == 200 and len(body["results"]) == 100
    async with http.post(f"{server.url}/v1/resolve", json={"refs": ["a"] * 100_000}) as r:
        await expect_error(r, 413, "body_too_large")
    async with http.post(f"{server.url}/v1/resolve", json={"refs": ["a/b"] * 101}) as r:
        doc = await expect_error(r, 400, "bad_request")
        assert "101 refs" in doc["message"]
    await still_serving(http, server)


async def test_a_large_json_body_is_parsed_off_the_event_loop(server, http, monkeypatch) -> None:
    """Bounding a body's numbers runs Python per value (~0.4 s per MiB of small ones): on the
    event loop, one body under the limit would stall every other request while it is parsed.
    The real parser runs, held open until the test has seen the service answer meanwhile."""
    import threading

    from mint_store.service.routes import parsing as request_parsing

    entered, release = threading.Event(), threading.Event()
    parse = request_parsing.strict_json.loads

    def held(buf: bytes) -> object:
        if len(buf) > request_parsing.INLINE_JSON_BYTES:
            entered.set()
            release.wait(10)  # on the event loop this would block it (and so the test) 10 s
        return parse(buf)

    monkeypatch.setattr(request_parsing.strict_json, "loads", held)
    body = b"[" + b"1," * 100_000 + b"1]"  # 200 KB: over the inline size, under the limit
    reader, writer = await _raw(server)
    writer.write(b"POST /v1/resolve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    resolve = asyncio.create_task(reader.read())
    while not entered.is_set():  # (bounded by the test's own timeout)
        await asyncio.sleep(0.01)
    assert not resolve.done()  # the parse is held...
    await still_serving(http, server)  # ...and the service answers meanwhile
    assert not resolve.done()
    release.set()
    status = (await resolve).split(b"\r\n", 1)[0]
    writer.close()
    assert status.startswith(b"HTTP/1.1 400"), status  # (a list, not {"refs": [...]})


async def test_oversized_part_headers(server, http, peft_files) -> None:
    before = snapshot(server)
    boundary = "hdrboundary"
    body = f"--{boundary}\r\n".encode() + b"".join(f"X-Junk-{i}: {'y' * 50}\r\n".encode() for i in range(200))
    body += f'Content-Disposition: form-data; name="{W}"\r\n\r\n'.encode() + peft_files[W]
    body += f"\r\n--{boundary}--\r\n".encode()
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    async with http.put(f"{server.url}/v1/adapters/acme/chat", data=body, headers=headers) as r:
        await expect_error(r, 400, "bad_request")
    await _check_nothing_stored(http, server, before)
