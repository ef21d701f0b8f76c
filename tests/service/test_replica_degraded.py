"""``mint serve --replica`` says ``degraded`` while it is not following the log (security review,
finding 2): a stray object in ``log/`` changes nothing, a gap turns ``/healthz`` into 503
``degraded`` with a fixed reason code once it outlasts the wait, and it heals by itself.

A real writer and a real replica server on loopback over one store, the replica's follower
thread polling every 10 ms. Its index lock, held by the test for a moment, keeps the replica
from applying while the gap is made (the lock a writer sharing the index directory holds).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mint_store.index.commit_log import log_key
from mint_store.write.lock import WriterLock
from tests.support.factories import random_adapter
from tests.support.service import ServerFactory, auth, store_of
from tests.support.targets import StoreTarget

DEADLINE_S = 60.0


async def _health(http: aiohttp.ClientSession, url: str, who: str | None = None) -> tuple[int, dict[str, Any]]:
    async with http.get(f"{url}/healthz", headers=auth(who) if who else None) as r:
        return r.status, dict(await r.json())


async def _until(probe: Callable[[], Any], what: str) -> Any:
    """Await ``probe()`` until it is truthy (a generous deadline, only there to fail a hung test)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while loop.time() < end:
        if got := await probe():
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("role", ["replica", "standby"])
async def test_a_replica_skips_strays_says_degraded_on_a_gap_and_heals(
    make_server: ServerFactory, local_target: StoreTarget, tmp_path: Path, tokens_file: str, role: str
) -> None:
    writer = await make_server(local_target, tokens_file=tokens_file)
    replica_dir = str(tmp_path / "replica-index")
    replica = await make_server(dataclasses.replace(local_target, index_dir=replica_dir),
                                **{"readonly": role == "replica", "standby": role == "standby"},
                                tokens_file=tokens_file, store_options={"follow_interval_s": 0.01})
    healthy = "ok" if role == "replica" else "standby"  # a waiting standby's 200 (it serves reads too)
    extra = set() if role == "replica" else {"writer_url", "writer_epoch"}
    w, r = store_of(writer), store_of(replica)
    loop = asyncio.get_running_loop()

    async def caught_up() -> bool:
        return r.last_seq == w.last_seq

    async with aiohttp.ClientSession() as http:
        await loop.run_in_executor(None, w.publish, "acme", "a", random_adapter(1))
        w.storage.create("log/backup-1.json", b'{"seq": 2}')  # the reported stray
        await loop.run_in_executor(None, w.tag, "acme/a@1", "prod")
        await _until(caught_up, "the replica past the stray object")
        status, body = await _health(http, replica.url)
        assert status == 200 and body["status"] == healthy and set(body) == {"status", "writable"} | extra, body
        status, body = await _health(http, replica.url, "admin")
        assert status == 200 and body["replica"]["foreign_log_objects"] == 1 and body["replica"]["gap"] is None

        lock = WriterLock(replica_dir)  # the replica applies nothing while this is held
        lock.acquire()
        try:
            await loop.run_in_executor(None, w.tag, "acme/a@1", "x")
            await loop.run_in_executor(None, w.tag, "acme/a@1", "y")
            missing = log_key(w.last_seq - 1)
            held = w.storage.get(missing)
            w.storage.delete(missing)
        finally:
            lock.release()

        async def degraded() -> tuple[int, dict[str, Any]] | None:
            got = await _health(http, replica.url)
            return got if got[0] == 503 else None

        status, body = await _until(degraded, "healthz to say degraded")
        # anyone: a fixed code and when it began, nothing of the log or of the error
        assert set(body) == {"status", "writable", "reason", "since"} | extra, body
        assert body["status"] == "degraded" and body["reason"] == "log_gap" and body["writable"] is False
        status, body = await _health(http, replica.url, "admin")
        assert status == 503 and body["reason"] == "log_gap"
        assert body["replica"]["gap"]["after"] == w.last_seq - 2 and missing in body["replica"]["last_error"]
        async with http.get(f"{replica.url}/metrics", headers=auth("admin")) as resp:
            text = await resp.text()
        assert "mint_replica_following 0.0" in text and "mint_log_foreign_objects 1.0" in text
        # reads go on from the index before the gap
        async with http.get(f"{replica.url}/v1/adapters/acme/a/versions/1", headers=auth("acme")) as resp:
            assert resp.status == 200

        w.storage.create(missing, held)  # restored: following again, healthz as before

        async def healed() -> bool:
            status, body = await _health(http, replica.url)
            return status == 200 and body["status"] == healthy and "reason" not in body

        await _until(healed, "healthz to say ok again")
        await _until(caught_up, "the replica past the gap")
