"""Row serving sends only bytes it has verified, from the pack the index names (security review,
finding 1).

A real writer store and a real replica server on loopback over one local store; the replica's
follower applies log objects planted as the writer writes them (the next seq). An event whose
key falls outside the writer's grammar is reported and not applied, so the row is still served
from its real place; one whose key is well formed but points at another row's bytes, or past
the end of the shard, is applied, and serving then answers ``integrity_error`` with none of
those bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mint_store.results import Location
from mint_store.service.state import STATE
from mint_store.store import Store
from tests.support.factories import random_adapter
from tests.support.service import RunningServer, ServerFactory, auth, store_of
from tests.support.targets import StoreTarget
from tests.test_planted_keys import QUIET, _move_to, _plant

DEADLINE_S = 60.0


async def _until(probe: Callable[[], Any], what: str) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S  # only there to fail a hung test
    while loop.time() < end:
        if got := probe():
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def _replica(make_server: ServerFactory, target: StoreTarget, tmp_path: Path, tokens_file: str) -> RunningServer:
    return await make_server(dataclasses.replace(target, index_dir=str(tmp_path / "replica-index")),
                             readonly=True, tokens_file=tokens_file, store_options={"follow_interval_s": 0.01})


def _row(store: Store, loc: Location) -> bytes:
    return bytes(store.storage.read_range(loc.shard_key, loc.offset, loc.length))


async def test_a_replica_server_never_serves_the_token_file(make_server: ServerFactory, local_target: StoreTarget,
                                                            tmp_path: Path, tokens_file: str) -> None:
    """The report: the token file planted as acme's row. The replica's follower reports the
    event, the row is served from its real place (its bytes), beta gets none of it."""
    loop = asyncio.get_running_loop()
    with local_target.open(**QUIET) as writer:
        await loop.run_in_executor(None, writer.publish, "acme", "a", random_adapter(1))
        loc = writer.resolve("acme/a@1")
        want = _row(writer, loc)
        replica = await _replica(make_server, local_target, tmp_path, tokens_file)
        r = store_of(replica)
        _plant(writer.storage, writer.last_seq, **_move_to(loc, tokens_file))
        await _until(lambda: r.replica_stats.failures >= 1, "the replica to report the planted event")
        assert "InvalidKey" in (r.replica_stats.last_error or "")
        secret = Path(tokens_file).read_bytes()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{replica.url}/v1/blobs/{loc.content_id}", headers=auth("acme")) as resp:
                assert resp.status == 200 and await resp.read() == want
            async with http.get(f"{replica.url}/v1/blobs/{loc.content_id}", headers=auth("beta")) as resp:
                body = await resp.read()
                assert resp.status == 404 and secret not in body


@pytest.mark.parametrize("where", ["another row's bytes", "past the shard's end"])
@pytest.mark.parametrize("ranges", [None, "bytes=0-15", "bytes=0-3,8-11"])
async def test_a_planted_location_is_refused_with_no_body_bytes(make_server: ServerFactory, local_target: StoreTarget,
                                                                tmp_path: Path, tokens_file: str, where: str,
                                                                ranges: str | None) -> None:
    loop = asyncio.get_running_loop()
    with local_target.open(**QUIET) as writer:
        await loop.run_in_executor(None, writer.publish, "acme", "a", random_adapter(1))
        await loop.run_in_executor(None, writer.publish, "beta", "b", random_adapter(2))
        loc, other = writer.resolve("acme/a@1"), writer.resolve("beta/b@1")
        assert loc.layout_id == other.layout_id
        theirs = _row(writer, other)
        replica = await _replica(make_server, local_target, tmp_path, tokens_file)
        r = store_of(replica)
        offset = other.offset if where == "another row's bytes" else other.offset + 64 * loc.length
        _plant(writer.storage, writer.last_seq, **_move_to(loc, other.shard_key, offset))
        await _until(lambda: r.last_seq == writer.last_seq + 1, "the replica to apply the planted event")
        assert r.resolve("acme/a@1").offset == offset  # well formed: applied, so serving must check
        headers = auth("acme") | ({"Range": ranges} if ranges else {})
        async with (aiohttp.ClientSession() as http,
                    http.get(f"{replica.url}/v1/blobs/{loc.content_id}", headers=headers) as resp):
            body = await resp.read()
            assert resp.status == 500, (resp.status, len(body))
            assert (await _json(body))["error"] == "integrity_error"
            assert theirs[:4] not in body


async def _json(body: bytes) -> dict[str, Any]:
    import json

    return dict(json.loads(body))


async def test_a_row_this_server_wrote_is_known_verified_until_its_file_is_another(
        server: RunningServer, tmp_path: Path) -> None:
    """A row published through this server is not hashed again for its first answer: its content
    id was computed from the bytes the writer wrote (LocalRowCheck.seed). That trust is bound to
    the file as written: a shard replaced since (another inode) is hashed at its first answer and
    refused, none of its bytes sent."""
    loop = asyncio.get_running_loop()
    store = store_of(server)
    rows = server.app[STATE].rows
    for name, seed in (("a", 1), ("b", 2)):
        await loop.run_in_executor(None, store.publish, "acme", name, random_adapter(seed))
    a, b = store.resolve("acme/a@1"), store.resolve("acme/b@1")
    assert a.shard_key != b.shard_key or a.offset != b.offset
    want = _row(store, a)
    for loc in (a, b):  # known before any answer asked for it
        fd = os.open(store.storage.local_path(loc.shard_key) or "", os.O_RDONLY)
        try:
            assert rows.check.known(fd, loc)
        finally:
            os.close(fd)
    # b's shard replaced by a copy with one byte of b's row changed: a new file, not the one written
    path = Path(store.storage.local_path(b.shard_key) or "")
    data = bytearray(path.read_bytes())
    data[b.offset + b.length // 2] ^= 0xFF
    (tmp_path / "shard").write_bytes(data)
    os.replace(tmp_path / "shard", path)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/v1/blobs/{a.content_id}") as resp:
            assert resp.status == 200 and await resp.read() == want  # (hashed now if it shares b's shard)
        async with http.get(f"{server.url}/v1/blobs/{b.content_id}") as resp:
            body = await resp.read()
            assert resp.status == 500 and (await _json(body))["error"] == "integrity_error"
            assert bytes(data[b.offset : b.offset + 16]) not in body
