"""Limits that keep one client or tenant from hurting the others, and what a tenant may learn.

Fair upload shares and per-read deadlines (a trickling tenant starves nobody else), every
byte of a body counted, bounded memory for uploads and PEFT exports (streamed tars),
dedup and the change feed reported per tenant, and a no-token server that answers only
this machine's loopback names and same-origin writes. Servers are real, on loopback;
slow clients are raw sockets that stop sending. (Past ~450 lines on purpose: the raw-socket
clients and server fixtures at its top serve every limit here.)
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from yarl import URL

from mint_store.service import RunningServer
from mint_store.service.state import STATE
from tests.support.service import (
    TOKENS,
    ServerFactory,
    auth,
    expect_error,
    peft_form,
    publish,
    snapshot,
    store_of,
    upload_dir,
)
from tests.support.targets import StoreTarget

W, C = "adapter_model.safetensors", "adapter_config.json"
LIVENESS = 60.0  # only ever a bound on a hang, never a measure of speed


def big_adapter(hidden: int = 1024, rank: int = 16, layers: int = 8, seed: int = 0) -> Any:
    """A larger adapter: layers x 4 projections of [rank, hidden] float32s."""
    from mint_store.format.adapter import make_adapter

    g = torch.Generator().manual_seed(seed)
    mods = {f"model.layers.{i}.self_attn.{m}": (torch.randn(rank, hidden, generator=g) * 0.01,
                                                  torch.randn(hidden, rank, generator=g) * 0.01, 2.0)
            for i in range(layers) for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    return make_adapter(mods)


def big_peft(**shape: int) -> dict[str, bytes]:
    """PEFT files of :func:`big_adapter`."""
    from mint_store.peft.directory import peft_files

    config, weights = peft_files(big_adapter(**shape))
    return {C: config, W: weights}


def metric(server: RunningServer, name: str) -> float | None:
    return server.app[STATE].metrics.registry.get_sample_value(name)


async def until(cond: Any, what: str) -> None:
    """Wait for server state (polled); LIVENESS bounds a hang only."""
    async with asyncio.timeout(LIVENESS):
        while not cond():
            await asyncio.sleep(0.01)


async def raw_upload_start(server: RunningServer, tenant: str, *, token: str | None = None,
                           declared: int = 10_000_000, first: bytes = b"\0" * 10,
                           ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An upload that sends its headers, the weights part's headers and ``first``, then stalls."""
    url = URL(server.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    b = "trickle"
    head = (f"PUT /v1/adapters/{tenant}/slow HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {declared}\r\n"
            f"Content-Type: multipart/form-data; boundary={b}\r\n"
            + (f"Authorization: Bearer {token}\r\n" if token else "") + "\r\n"
            + f'--{b}\r\nContent-Disposition: form-data; name="{W}"\r\n\r\n')
    writer.write(head.encode() + first)
    await writer.drain()
    return reader, writer


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status, headers, _ = await _head_only(reader)
    async with asyncio.timeout(LIVENESS):
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


# ------------------------------------------------------------- fair shares, per-read deadline


async def test_trickling_uploads_of_one_tenant_do_not_starve_another(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    # two commit slots, both of which acme's stalled uploads would hold if slots were taken
    # before the body: beta's publish must still go through while they stall
    server = await make_server(local_target, tokens_file=tokens_file, upload_slots=2)
    stalled = [await raw_upload_start(server, "acme", token=TOKENS["acme"]) for _ in range(2)]
    await until(lambda: metric(server, "mint_http_in_flight") == 2, "acme's uploads in flight")
    async with asyncio.timeout(LIVENESS):
        got = await publish(http, server, peft_files, "beta", "m", headers=auth("beta"))
    assert got["version"] == 1
    # acme's uploads are still stalled, holding acme's own places only, unanswered
    assert server.app[STATE].tenant_slots.active("acme") == 2
    assert metric(server, "mint_uploads_receiving") == 2
    for reader, _ in stalled:
        assert not reader.at_eof() and len(upload_dir(server)) == 2
    for _, writer in stalled:
        writer.close()
    await until(lambda: server.app[STATE].tenant_slots.total_active() == 0 and not upload_dir(server), "cleanup")


async def test_a_tenant_over_its_share_waits_behind_its_own_uploads_only(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file, tenant_uploads=1)
    st = server.app[STATE]
    _, writer = await raw_upload_start(server, "acme", token=TOKENS["acme"])
    await until(lambda: st.tenant_slots.active("acme") == 1, "acme's place taken")
    second = asyncio.create_task(publish(http, server, peft_files, "acme", "m", headers=auth("acme")))
    await until(lambda: metric(server, "mint_http_in_flight") == 2, "acme's second upload waiting")
    async with asyncio.timeout(LIVENESS):
        await publish(http, server, peft_files, "beta", "m", headers=auth("beta"))
    assert not second.done() and st.tenant_slots.active("acme") == 1  # acme's second still waits its turn
    writer.close()  # acme's first goes away: its place goes to acme's second
    async with asyncio.timeout(LIVENESS):
        assert (await second)["version"] == 1


async def test_a_stalled_body_gets_408_after_the_per_read_deadline(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession,
) -> None:
    server = await make_server(local_target, read_timeout=0.3, request_timeout=600)
    before = snapshot(server)
    reader, writer = await raw_upload_start(server, "acme")
    status, headers, body = await read_response(reader)
    writer.close()
    assert status == 408 and headers.get("connection", "").lower() == "close"
    doc = json.loads(body)
    assert doc["error"] == "request_timeout" and "read_timeout" in doc["message"]
    await until(lambda: server.app[STATE].tenant_slots.total_active() == 0 and not upload_dir(server), "cleanup")
    assert snapshot(server) == before


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/resolve"), ("PUT", "/v1/adapters/acme/chat/tags/prod"),
                                              ("PUT", "/v1/bases/b")])
async def test_a_stalled_json_body_gets_408_after_the_per_read_deadline(
    make_server: ServerFactory, local_target: StoreTarget, method: str, path: str,
) -> None:
    """A JSON body is read as an upload's: a client that stops sending is cut after read_timeout
    (it held the connection for the whole request_timeout), and its 408 says which limit."""
    server = await make_server(local_target, read_timeout=0.3, request_timeout=600)
    url = URL(server.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f'Content-Length: 100\r\n\r\n{{"refs"'.encode())
    await writer.drain()
    status, _, body = await read_response(reader)
    writer.close()
    doc = json.loads(body)
    assert status == 408 and doc["error"] == "request_timeout" and "read_timeout" in doc["message"]


async def test_a_slow_but_steady_body_is_not_cut_by_the_request_deadline(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    # the whole-request deadline (2 s) is for the server's work; a body that keeps arriving
    # (every 0.2 s, well within read_timeout) is not cut however long it takes in all (4 s)
    server = await make_server(local_target, request_timeout=2)
    data = b"".join(_multipart(peft_files, "steady"))
    pieces = [data[i : i + len(data) // 20 + 1] for i in range(0, len(data), len(data) // 20 + 1)]

    async def body() -> Any:
        for p in pieces:
            yield p
            await asyncio.sleep(0.2)

    headers = {"Content-Type": "multipart/form-data; boundary=steady"}
    async with http.put(f"{server.url}/v1/adapters/acme/chat", data=body(), headers=headers) as r:
        assert r.status == 201, await r.text()


# ------------------------------------------------------------- every byte counts


def _multipart(files: dict[str, bytes], boundary: str, *, preamble: bytes = b"",
               junk_headers: int = 0) -> list[bytes]:
    out = [preamble]
    for name, data in files.items():
        junk = "".join(f"X-Junk-{i}: {'j' * 1000}\r\n" for i in range(junk_headers))
        out.append(f'--{boundary}\r\n{junk}Content-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
                   f"Content-Type: application/octet-stream\r\n\r\n".encode())
        out.append(data + b"\r\n")
    out.append(f"--{boundary}--\r\n".encode())
    return out


@pytest.mark.parametrize("padding", ["preamble", "part_headers"])
async def test_preamble_and_part_headers_count_against_the_body_limit(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes], padding: str,
) -> None:
    real = sum(map(len, _multipart(peft_files, "b")))
    server = await make_server(local_target, body_limit=real + 4096)
    before = snapshot(server)
    if padding == "preamble":  # 4 MiB of lines before the first boundary
        parts = _multipart(peft_files, "b", preamble=(b"x" * 78 + b"\r\n") * (4 * 2**20 // 80))
    else:  # 90 KB of headers in each part
        parts = _multipart(peft_files, "b", junk_headers=90)
    assert sum(map(len, parts)) > real + 4096

    async def chunked() -> Any:  # no Content-Length: the limit must hold while reading
        for p in parts:
            for i in range(0, len(p), 65536):
                yield p[i : i + 65536]

    async with http.put(f"{server.url}/v1/adapters/acme/chat", data=chunked(),
                        headers={"Content-Type": "multipart/form-data; boundary=b"}) as r:
        await expect_error(r, 413, "body_too_large")
    assert snapshot(server) == before and not upload_dir(server)
    async with http.put(f"{server.url}/v1/adapters/acme/chat", data=peft_form(peft_files)) as r:
        assert r.status == 201  # the same files without padding fit


# ------------------------------------------------------------- bounded memory


async def test_a_big_upload_is_spooled_through_a_bounded_buffer(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession,
) -> None:
    files = big_peft()  # 4 MiB of weights
    assert len(files[W]) > 4 * 2**20
    server = await make_server(local_target, upload_buffer=65536)
    got = await publish(http, server, files)
    assert got["upload_sha256"] == hashlib.sha256(files[W]).hexdigest()
    peak = metric(server, "mint_upload_buffer_peak_bytes")
    # the buffer, one read of at most the buffer's size, and the small config part
    assert peak is not None and 0 < peak <= 2 * 65536 + len(files[C])


async def test_peft_export_is_a_streamed_tar_of_the_files_pull_writes(
    server: RunningServer, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    from mint_store.peft.directory import save_peft_dir

    got = await publish(http, server, big_peft())
    async with http.get(f"{server.url}/v1/adapters/acme/chat/versions/{got['version']}/peft") as r:
        assert r.status == 200 and r.headers["Content-Type"] == "application/x-tar"
        assert "chunked" not in r.headers.get("Transfer-Encoding", "")
        data = await r.read()
        assert int(r.headers["Content-Length"]) == len(data)
    pulled = save_peft_dir(store_of(server).load("acme/chat@1"), tmp_path / "pulled")  # what `mint pull` writes
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == [C, W]
        for name in (C, W):
            f = tar.extractfile(name)
            assert f is not None and f.read() == (pulled / name).read_bytes(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_streamed_tar_pieces_are_bounded_and_equal_tarfiles_own_archive(dtype: torch.dtype) -> None:
    from safetensors.torch import save

    from mint_store.service.routes.export import CHUNK, PeftExport, safetensors_layout, tar_chunks

    g = torch.Generator().manual_seed(1)
    tensors = {f"base_model.model.layers.{i}.{p}.weight": torch.randn(64, 9000, generator=g).to(dtype)
               for i in (10, 2, 1) for p in ("lora_B", "lora_A")}
    tensors["z.scalar_like"] = torch.ones(3, dtype=dtype)
    config = b'{"r": 64}'
    header, ordered = safetensors_layout(tensors, {"format": "pt"})
    st_file = save(tensors, metadata={"format": "pt"})
    size = len(header) + sum(t.numel() * t.element_size() for t in ordered)
    export = PeftExport(config, header, tuple(ordered), size)
    pieces = list(tar_chunks(export, mtime=1_700_000_000))
    assert max(len(p) for p in pieces) <= CHUNK
    streamed = b"".join(bytes(p) for p in pieces)
    assert len(streamed) == export.tar_size()
    buf = io.BytesIO()  # the archive tarfile writes for the same two files
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, blob in ((C, config), (W, st_file)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(blob), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(blob))
    assert streamed == buf.getvalue()


def test_the_declared_tar_size_counts_the_pax_header_of_weights_from_8_gib() -> None:
    """From 8 GiB a member's size needs a pax header (three blocks, not one): the declared
    Content-Length was 1,024 bytes short and the client got a truncated archive."""
    from mint_store.service.routes.export import PeftExport, tar_chunks

    header = b"\x08" + b"\0" * 7 + b"{}      "
    for size in (8**11 - 1, 8**11, 9 * 2**30 + 5):  # the data itself is not materialised
        export = PeftExport(b'{"r": 8}', header, (), size)
        streamed = sum(len(p) for p in tar_chunks(export, mtime=0)) + (size - len(header))
        assert streamed == export.tar_size() and export.tar_size() % tarfile.RECORDSIZE == 0
        pax = tarfile.TarInfo("adapter_model.safetensors")
        pax.size = size
        assert export.tar_size() >= len(pax.tobuf(tarfile.PAX_FORMAT)) + size


async def test_an_export_to_a_client_that_stops_reading_is_cut_off(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession,
) -> None:
    server = await make_server(local_target, read_timeout=0.3)
    # a 32 MiB tar: more than socket buffers hold (published in-process: no upload under the short deadline)
    await asyncio.to_thread(store_of(server).publish, "acme", "chat", big_adapter(hidden=4096, rank=32))
    url = URL(server.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(b"GET /v1/adapters/acme/chat/versions/1/peft HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    status, headers, _ = await _head_only(reader)
    assert status == 200
    total = int(headers["content-length"])
    # read nothing more until the server gave up on us, then drain what it had sent
    await until(lambda: metric(server, "mint_http_in_flight") == 0, "the export given up")
    got = await _drain(reader)
    writer.close()
    assert got < total  # cut off, not delivered in full
    async with http.get(f"{server.url}/healthz") as r:
        assert r.status == 200


async def _head_only(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], None]:
    async with asyncio.timeout(LIVENESS):
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
    return status, headers, None


# ------------------------------------------------------------- what a tenant may learn


async def test_dedup_is_reported_only_against_the_callers_own_tenant(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    first = await publish(http, server, peft_files, "acme", "m", headers=auth("acme"))
    shards = store_of(server).storage.list("packs/")
    theirs = await publish(http, server, peft_files, "beta", "m", headers=auth("beta"))
    # one stored row for both, but beta is not told that another tenant had these bytes
    assert theirs["content_id"] == first["content_id"] and store_of(server).storage.list("packs/") == shards
    assert not first["deduplicated"] and not theirs["deduplicated"]
    async with http.get(f"{server.url}/v1/adapters/beta/m/versions/1", headers=auth("beta")) as r:
        assert (await r.json())["deduplicated"] is False
    again = await publish(http, server, peft_files, "beta", "other", headers=auth("beta"))
    assert again["deduplicated"]  # beta's own bytes: reported


async def _events(http: aiohttp.ClientSession, server: RunningServer, who: str, **params: Any) -> dict[str, Any]:
    query = {k: str(v) for k, v in params.items()}
    async with http.get(f"{server.url}/v1/events", params=query, headers=auth(who)) as r:
        assert r.status == 200
        return dict(await r.json())


async def test_events_give_a_tenant_no_figure_about_other_tenants(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    await publish(http, server, peft_files, "acme", "m", headers=auth("acme"))  # seq 1
    for i in range(3):  # seqs 2..4
        await publish(http, server, peft_files, "beta", f"m{i}", headers=auth("beta"))
    got = await _events(http, server, "acme", after=0)
    assert [e["seq"] for e in got["events"]] == [1]
    assert (got["last_seq"], got["head"]) == (1, 1)  # not 4: beta's commits are not counted
    got = await _events(http, server, "acme", after=1)
    assert (got["events"], got["last_seq"], got["head"]) == ([], 1, 1)
    assert (await _events(http, server, "acme", after=0, limit=0))["head"] == 1
    assert (await _events(http, server, "beta", after=0, limit=0))["head"] == 3  # beta's own count
    assert (await _events(http, server, "admin", after=0, limit=0))["head"] == 4
    # the long poll: beta's commits wake it but show it nothing; acme's next commit ends it
    poll = asyncio.create_task(_events(http, server, "acme", after=1, wait=LIVENESS))
    await until(lambda: metric(server, "mint_event_waiters") == 1, "the poll waiting")
    await publish(http, server, peft_files, "beta", "m9", headers=auth("beta"))  # seq 5
    assert not poll.done()
    mine = await publish(http, server, peft_files, "acme", "m2", headers=auth("acme"))  # seq 6
    got = await poll
    # acme's second event (the store's seq 6): numbered in acme's own count, as its publish answer
    assert [e["seq"] for e in got["events"]] == [mine["seq"]] == [2]
    assert (got["last_seq"], got["head"]) == (2, 2)
    got = await _events(http, server, "acme", after=2)
    assert (got["events"], got["last_seq"], got["head"]) == ([], 2, 2)


async def test_a_polling_tenant_gets_its_event_past_a_page_of_other_tenants_events(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    """With wait=0 (the client's default) and a page or more of another tenant's events after the
    cursor, every poll rescanned the same page and answered nothing: the event never came."""
    server = await make_server(local_target, tokens_file=tokens_file)
    await publish(http, server, peft_files, "acme", "m", headers=auth("acme"))  # seq 1
    beta = await publish(http, server, peft_files, "beta", "b", headers=auth("beta"))  # seq 2
    for i in range(12):  # seqs 3..14: beta's tags, cheap
        async with http.put(f"{server.url}/v1/adapters/beta/b/tags/t{i}", json={"version": beta["version"]},
                            headers=auth("beta")) as r:
            assert r.status == 200
    mine = await publish(http, server, peft_files, "acme", "m2", headers=auth("acme"))  # seq 15: acme's 2nd
    page = await _events(http, server, "acme", after=1, limit=5)
    assert [e["seq"] for e in page["events"]] == [mine["seq"]] == [2] and page["head"] == 2


async def test_a_tenant_learns_nothing_of_other_tenants_from_locations_or_health(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    """Where a row lies told whether another tenant already held the same bytes (an old row of an
    old shard for a guess that hit, a new row for one that missed): a tenant's resolve gives no
    shard, offset or row. The public /healthz gave the store's commit count (every tenant's
    activity) to anyone: only an admin token sees it."""
    server = await make_server(local_target, tokens_file=tokens_file)
    await publish(http, server, peft_files, "beta", "secret", headers=auth("beta"))
    await publish(http, server, peft_files, "acme", "guess", headers=auth("acme"))  # the same bytes
    body = {"refs": ["acme/guess"]}
    async with http.post(f"{server.url}/v1/resolve", json=body, headers=auth("acme")) as r:
        loc = (await r.json())["results"][0]["location"]
    assert (loc["shard_key"], loc["offset"], loc["row"]) == ("", 0, 0) and loc["content_id"] and loc["length"] > 0
    async with http.post(f"{server.url}/v1/resolve", json=body, headers=auth("admin")) as r:
        assert (await r.json())["results"][0]["location"]["shard_key"].startswith("packs/")
    for headers in ({}, auth("acme"), {"Authorization": "Bearer not-a-token-at-all"}):
        async with http.get(f"{server.url}/healthz", headers=headers) as r:
            assert r.status == 200 and "last_seq" not in await r.json()
    async with http.get(f"{server.url}/healthz", headers=auth("admin")) as r:
        assert (await r.json())["last_seq"] == 2


# ------------------------------------------------------------- no token file: this machine only


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "127.0.0.1:{port}", "localhost:{port}",
                                  "[::1]:{port}", "LOCALHOST:{port}"])
async def test_no_token_server_answers_loopback_host_names(server: RunningServer, http: aiohttp.ClientSession,
                                                           host: str) -> None:
    headers = {"Host": host.format(port=URL(server.url).port)}
    async with http.get(f"{server.url}/healthz", headers=headers) as r:
        assert r.status == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example:{port}",
                                  "10.0.0.1:{port}", "[::2]:{port}"])
async def test_no_token_server_refuses_other_host_names(
    server: RunningServer, http: aiohttp.ClientSession, peft_files: dict[str, bytes], host: str,
) -> None:
    before = snapshot(server)
    headers = {"Host": host.format(port=URL(server.url).port)}
    async with http.get(f"{server.url}/v1/adapters/acme", headers=headers) as r:
        await expect_error(r, 421, "misdirected_request")
    async with http.put(f"{server.url}/v1/adapters/acme/chat", data=peft_form(peft_files), headers=headers) as r:
        await expect_error(r, 421, "misdirected_request")
    assert snapshot(server) == before


async def test_no_token_server_refuses_cross_origin_writes(
    server: RunningServer, http: aiohttp.ClientSession, peft_files: dict[str, bytes],
) -> None:
    port = URL(server.url).port
    await publish(http, server, peft_files)
    before = snapshot(server)
    base = f"{server.url}/v1/adapters/acme/chat"
    for origin in ("http://evil.example", f"http://evil.example:{port}", "null", f"http://127.0.0.1:{port + 1}",
                   f"https://127.0.0.1:{port}"):
        headers = {"Origin": origin}
        async with http.put(base, data=peft_form(peft_files), headers=headers) as r:
            await expect_error(r, 403, "forbidden")
        async with http.delete(f"{base}/versions/1", headers=headers) as r:
            await expect_error(r, 403, "forbidden")
        async with http.put(f"{base}/tags/prod", json={"version": 1}, headers=headers) as r:
            await expect_error(r, 403, "forbidden")
        async with http.get(base, headers=headers) as r:  # a read: the browser keeps the answer from the page
            assert r.status == 200
    assert snapshot(server) == before
    for own in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        async with http.put(f"{base}/tags/prod", json={"version": 1}, headers={"Origin": own}) as r:
            assert r.status == 200


async def test_a_token_server_answers_any_host(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    async with http.get(f"{server.url}/v1/adapters/acme", headers={"Host": "mint.example.com", **auth("acme")}) as r:
        assert r.status == 200


async def test_metrics_sum_every_tenant_so_a_token_server_shows_them_to_admins_only(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    await publish(http, server, peft_files, "beta", "m", headers=auth("beta"))
    async with http.get(f"{server.url}/metrics") as r:
        await expect_error(r, 401, "unauthorized")
    async with http.get(f"{server.url}/metrics", headers=auth("acme")) as r:  # would show beta's publish
        await expect_error(r, 403, "forbidden")
    async with http.get(f"{server.url}/metrics", headers=auth("admin")) as r:
        assert r.status == 200 and "mint_last_seq 1.0" in (await r.text()).splitlines()


async def test_a_row_reader_that_stops_reading_is_cut_off(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession,
) -> None:
    server = await make_server(local_target, read_timeout=0.3, request_timeout=600)
    # a 32 MiB row, sent with sendfile in pieces (published in-process: no upload under the short deadline)
    got = (await asyncio.to_thread(store_of(server).publish, "acme", "chat", big_adapter(hidden=4096, rank=32)))
    url = URL(server.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(f"GET /v1/blobs/{got.content_id} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    status, headers, _ = await _head_only(reader)
    assert status == 200
    await until(lambda: metric(server, "mint_http_in_flight") == 0, "the send given up")
    received = await _drain(reader)
    writer.close()
    assert received < int(headers["content-length"])
    async with http.get(f"{server.url}/healthz") as r:
        assert r.status == 200


async def test_the_decode_budget_admits_bytes_in_order_and_one_request_alone() -> None:
    from mint_store.service.slots import ByteBudget

    budget = ByteBudget(100)
    order: list[str] = []
    first_in, release_first = asyncio.Event(), asyncio.Event()

    async def take(name: str, n: int, hold: asyncio.Event | None = None) -> None:
        async with budget.hold(n):
            order.append(name)
            if name == "a":
                first_in.set()
            if hold is not None:
                await hold.wait()

    a = asyncio.create_task(take("a", 60, release_first))
    await first_in.wait()
    b = asyncio.create_task(take("b", 60))  # does not fit beside a
    c = asyncio.create_task(take("c", 10))  # would fit, but waits its turn behind b
    await until(lambda: len(budget._queue) == 2, "b and c queued")
    assert order == ["a"] and budget.used == 60
    release_first.set()
    await asyncio.gather(a, b, c)
    assert order == ["a", "b", "c"] and budget.used == 0
    async with budget.hold(10**9):  # over the capacity: admitted alone
        assert budget.used == 10**9


async def test_a_caller_over_its_share_of_the_byte_budget_does_not_hold_up_the_others() -> None:
    from mint_store.service.slots import ByteBudget

    budget = ByteBudget(100, share=50)
    order: list[str] = []
    release = {k: asyncio.Event() for k in ("a1", "a2", "b")}

    async def take(name: str, owner: str, n: int) -> None:
        async with budget.hold(n, owner):
            order.append(name)
            await release[name].wait()

    a1 = asyncio.create_task(take("a1", "a", 60))  # alone: over its share is fine
    await until(lambda: order == ["a1"], "a1 admitted")
    a2 = asyncio.create_task(take("a2", "a", 50))  # does not fit beside a1: first in line
    await until(lambda: budget.waiting == 1, "a2 queued")
    b = asyncio.create_task(take("b", "b", 20))  # fits; a, over its share, does not make b wait
    await until(lambda: order == ["a1", "b"], "b admitted past a's second request")
    assert budget.waiting == 1 and budget.held("a") == 60 and budget.held("b") == 20
    release["a1"].set()
    await until(lambda: order == ["a1", "b", "a2"], "a2 admitted once a1 let go")
    for e in release.values():
        e.set()
    await asyncio.gather(a1, a2, b)
    assert budget.used == 0 and budget.held("a") == budget.held("b") == 0
    # even alone, a caller past its share leaves a share free: another's request always fits
    async with budget.hold(40, "a"):
        more = asyncio.create_task(take("a3", "a", 30))  # 70 held by a: over its share and 100 - 50
        await until(lambda: budget.waiting == 1, "a's third request waits though nobody else does")
        release["c"] = asyncio.Event()
        c = asyncio.create_task(take("c", "c", 50))
        await until(lambda: order[-1] == "c", "c admitted in the share left free")
        assert not more.done() and budget.used == 90
        release["c"].set()
        await c
    release["a3"] = asyncio.Event()
    release["a3"].set()
    await more
    assert budget.used == 0


async def test_a_callers_small_requests_never_pass_its_own_large_one() -> None:
    """Past its share, a caller's large request waits for room; its later small requests (each
    within the share) were admitted past it, and with steady reading it never got in."""
    from mint_store.service.slots import ByteBudget

    budget = ByteBudget(100, share=25)
    order: list[str] = []
    gates = {k: asyncio.Event() for k in ("small-1", "large", "small-2")}

    async def take(name: str, n: int) -> None:
        async with budget.hold(n, "a"):
            order.append(name)
            await gates[name].wait()

    first = asyncio.create_task(take("small-1", 10))
    await until(lambda: order == ["small-1"], "the first small request holds")
    large = asyncio.create_task(take("large", 80))  # 10 + 80 past the share, 90 > 100 - 25: waits
    await until(lambda: budget.waiting == 1, "the large request waits")
    later = asyncio.create_task(take("small-2", 10))  # within the share, but behind its own large one
    await until(lambda: budget.waiting == 2, "the later small request queued")
    assert order == ["small-1"]
    gates["small-1"].set()
    await until(lambda: order == ["small-1", "large"], "the large one first once there is room")
    gates["large"].set()
    gates["small-2"].set()
    await asyncio.gather(first, large, later)
    assert order == ["small-1", "large", "small-2"] and budget.used == 0


def _holder(budget: Any, order: list[str], release: asyncio.Event) -> Any:
    """``take(name, owner, n)``: hold ``n`` bytes of ``budget`` for ``owner``, note ``name`` once
    admitted, let go when ``release`` is set."""

    async def take(name: str, owner: str, n: int) -> None:
        async with budget.hold(n, owner):
            order.append(name)
            await release.wait()

    return take


async def test_a_request_over_all_but_a_share_leaves_the_others_a_share() -> None:
    """An owner's first request was always in its share: a whole-adapter export of nearly all of
    read_memory, read slowly for days, shut every other tenant's multi-range and export answers
    out. Such a request is admitted alone, and while it is held the others still get a share."""
    from mint_store.service.slots import ByteBudget

    budget = ByteBudget(1024, share=256)
    release = asyncio.Event()
    order: list[str] = []
    take = _holder(budget, order, release)

    tasks = [asyncio.create_task(take("a", "a", 1000))]
    await until(lambda: order == ["a"], "the large one admitted into the empty budget")
    tasks += [asyncio.create_task(take("b1", "b", 24)), asyncio.create_task(take("b2", "b", 100))]
    await until(lambda: order == ["a", "b1", "b2"], "b's requests within a share admitted beside it")
    tasks.append(asyncio.create_task(take("b3", "b", 256)))  # past b's share: waits
    tasks.append(asyncio.create_task(take("c", "c", 8)))  # not held up behind b's
    await until(lambda: order[-1] == "c", "c admitted")
    assert "b3" not in order and budget.used == 1132
    tasks.append(asyncio.create_task(take("d", "d", 1000)))  # another large one waits for an empty budget
    tasks.append(asyncio.create_task(take("e", "e", 300)))  # over a share: cannot fit beside a, waits ...
    tasks.append(asyncio.create_task(take("f", "f", 8)))  # ... without holding up a small one behind it
    await until(lambda: order[-1] == "f", "f admitted past e")
    assert budget.waiting == 3 and not {"b3", "d", "e"} & set(order)
    release.set()
    await asyncio.gather(*tasks)
    assert budget.used == 0 and set(order) == {"a", "b1", "b2", "b3", "c", "d", "e", "f"}


async def test_a_waiting_request_over_all_but_a_share_holds_up_nobody() -> None:
    """A slow reader holds what its share rules allow; an oversize request cannot be admitted
    beside it however long others wait, so waiting it must not hold up another caller's request
    of up to a share (made next in line, it did)."""
    from mint_store.service.slots import ByteBudget

    budget = ByteBudget(100, share=25)
    release = asyncio.Event()
    order: list[str] = []
    take = _holder(budget, order, release)

    tasks = [asyncio.create_task(take(f"t{i}", "t", 25)) for i in range(3)]  # a slow reader's 75
    await until(lambda: len(order) == 3, "t's three answers admitted")
    tasks.append(asyncio.create_task(take("u", "u", 80)))  # an export over all but a share: waits
    await until(lambda: budget.waiting == 1, "u waits")
    tasks.append(asyncio.create_task(take("v", "v", 10)))  # another caller's first request
    await until(lambda: order[-1] == "v", "v admitted while u waits")
    release.set()
    await asyncio.gather(*tasks)
    assert budget.used == 0 and order[-1] == "u"


async def test_uploads_over_the_decode_budget_are_decoded_one_at_a_time(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession,
    peft_files: dict[str, bytes],
) -> None:
    server = await make_server(local_target, upload_memory=1)  # every upload is over it: one at a time
    results = await asyncio.gather(*(publish(http, server, peft_files, name=f"n{i}") for i in range(6)))
    assert sorted(r["version"] for r in results) == [1] * 6
    assert server.app[STATE].decode_budget.used == 0


async def _drain(reader: asyncio.StreamReader) -> int:
    """Bytes the server still sent before it closed the connection (a reset counts as closed)."""
    got = 0
    async with asyncio.timeout(LIVENESS):
        try:
            while chunk := await reader.read(2**20):
                got += len(chunk)
        except ConnectionResetError:
            pass
    return got
