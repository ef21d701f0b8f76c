"""Background loops outlive one failed call: the read replica's commit poller (the change
feed of a read-only server), auto-compaction, and a client's change-feed follower."""

from __future__ import annotations

import asyncio
import errno
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from mint_store.service.app import _poll_commits
from mint_store.service.config import ServiceConfig
from mint_store.service.feed import ChangeFeed
from mint_store.service.maintenance import auto_maintain
from mint_store.store import Store
from tests.support.factories import random_adapter
from tests.support.service import ServerFactory, publish, read_peft, store_of
from tests.support.targets import StoreTarget


class FlakyStore(Store):
    """A real store whose ``last_seq`` and ``sweep`` each fail once with an I/O error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed: set[str] = set()
        self.swept = threading.Event()

    def _fail_once(self, what: str) -> None:
        if what not in self.failed:
            self.failed.add(what)
            raise OSError(errno.EIO, f"injected I/O error in {what}")

    @property
    def last_seq(self) -> int:
        self._fail_once("last_seq")
        return super().last_seq

    def sweep(self, *, grace_s: float, now: float | None = None) -> list[str]:
        self._fail_once("sweep")
        out = super().sweep(grace_s=grace_s, now=now)
        self.swept.set()
        return out


def flaky(tmp_path: Path, **options: Any) -> FlakyStore:
    from mint_store.config import StoreConfig
    from mint_store.storage import open_storage

    return FlakyStore(open_storage(str(tmp_path / "store")), StoreConfig(**options), str(tmp_path / "index"))


async def test_the_commit_poller_survives_a_failed_read(tmp_path: Path) -> None:
    with Store.open(tmp_path / "store", index_dir=str(tmp_path / "index")) as writer:
        writer.publish("acme", "a", random_adapter(1))
        replica = flaky(tmp_path, readonly=True)
        executor = ThreadPoolExecutor(2)
        feed = ChangeFeed(asyncio.get_running_loop(), 0)
        task = asyncio.create_task(_poll_commits(replica, feed, executor, interval=0.01))
        try:
            await feed.wait_beyond(0, 60)
            assert feed.seq == 1 and replica.failed == {"last_seq"} and not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            replica.close()
            executor.shutdown()


async def test_a_head_reported_again_unmoved_wakes_no_long_poll() -> None:
    """A replica reports its head every 0.2 s: each report woke every parked poll (an executor
    read each, five times a second per engine) though nothing was committed."""
    feed = ChangeFeed(asyncio.get_running_loop(), 5)
    poll = asyncio.create_task(feed.wait_beyond(5, 600))
    while not feed.parked:
        await asyncio.sleep(0)
    for _ in range(3):
        feed.advance(5)
        feed.advance(4)  # (an older report is no news either)
        await asyncio.sleep(0)
    assert not poll.done() and feed.parked == 1
    feed.advance(6)
    await poll
    assert feed.seq == 6 and not feed.parked


async def test_auto_compaction_survives_a_storage_error(tmp_path: Path) -> None:
    store = flaky(tmp_path)
    executor = ThreadPoolExecutor(2)
    config = ServiceConfig(store=str(tmp_path / "store"), compact_interval_s=0.01)
    task = asyncio.create_task(auto_maintain(store, config, executor))
    try:
        got = await asyncio.get_running_loop().run_in_executor(None, store.swept.wait, 60)
        assert got and store.failed == {"sweep"} and not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        executor.shutdown()
        store.close()


async def test_background_maintenance_removes_orphan_shards(tmp_path: Path) -> None:
    """A commit that failed or was fenced after writing its shards leaves them unnamed; a store
    served without a stop (a writer and a standby) had nothing that ever removed them."""
    with Store.open(tmp_path / "store", index_dir=str(tmp_path / "index")) as store:
        store.publish("acme", "a", random_adapter(1))
        loc = store.resolve("acme/a")
        stray = loc.shard_key.rsplit("/c/", 1)[0] + "/c/77/0"
        store.storage.put(stray, b"a fenced commit's shard")
        executor = ThreadPoolExecutor(2)
        task = asyncio.create_task(auto_maintain(store, ServiceConfig(store=str(tmp_path / "store"),
                                                                      compact_interval_s=0.01), executor))
        try:
            for _ in range(3000):
                if not store.storage.exists(stray):
                    break
                await asyncio.sleep(0.01)
            assert not store.storage.exists(stray) and store.storage.exists(loc.shard_key)
            assert store.read("acme/a")[0].content_id == loc.content_id
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            executor.shutdown()


async def test_the_client_change_feed_rides_out_a_server_error(
    make_server: ServerFactory, local_target: StoreTarget, peft_dir: Path
) -> None:
    from engine_client import MintClient

    server = await make_server(local_target)
    store = store_of(server)
    real_events = store.events
    calls = 0

    def events_failing_once(after: int = 0, *, limit: int = 1000) -> list[dict[str, Any]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError(errno.EIO, "injected I/O error")  # the server answers 500 internal_error
        return real_events(after, limit=limit)

    store.events = events_failing_once  # type: ignore[method-assign]
    try:
        async with MintClient(server.url, retries=0, backoff=0.01) as client:
            feed = client.follow(0, wait=5)
            nxt = asyncio.ensure_future(feed.__anext__())
            async with aiohttp.ClientSession() as http:
                await publish(http, server, read_peft(peft_dir))
            event = await asyncio.wait_for(nxt, 60)
            assert event["seq"] == 1 and event["kind"] == "publish" and calls >= 2
            await feed.aclose()
    finally:
        store.events = real_events  # type: ignore[method-assign]
