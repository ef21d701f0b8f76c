"""The streamer against a real local store: tiers and metrics, shared reads, LRU by bytes,
back pressure through the pool, cancellation, and failures that leave nothing behind."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from engine_client import MintClient
from engine_client.errors import IntegrityError
from engine_client.stream.host_pool import HostPool
from engine_client.stream.streamer import Streamer, StreamerConfig
from mint_store import Location
from tests.support.engine import publish_random
from tests.support.targets import StoreTarget

N = 12


@pytest.fixture
def published(local_target: StoreTarget) -> dict[str, np.ndarray]:
    """``t/a{i}`` -> its row bytes."""
    return publish_random(local_target, N)


async def _settle(pool: HostPool, streamer: Streamer) -> None:
    """Wait (bounded) until reads abandoned by a cancellation have returned their buffers."""
    for _ in range(1000):
        if pool.live == len(streamer.cache_keys()):
            return
        await asyncio.sleep(0.01)


async def test_rows_land_verified_and_tiers_are_counted(client: MintClient, published: dict[str, np.ndarray]) -> None:
    pool = HostPool(1 << 20)
    s = Streamer(client, pool)
    refs = list(published)
    watched = time.perf_counter()
    locs = await s.prefetch(refs)
    assert [loc.content_id for loc in locs] == [(await client.resolve(r)).content_id for r in refs]
    snap = s.metrics.snapshot()
    row_bytes = len(published[refs[0]])
    assert snap.tiers["storage"].count == N and snap.tiers["storage"].bytes == N * row_bytes
    assert snap.tiers["host"].count == 0
    assert sorted(s.cache_keys()) == sorted(loc.content_id for loc in locs)  # reads finish in any order
    assert pool.live == N  # rows stay cached, nothing else holds a buffer

    for ref, loc in zip(refs, locs, strict=True):
        with await s.fetch(loc) as lease:
            assert lease.tensor.data_ptr() >= pool.tensor.data_ptr()  # in the pool, not a copy
            assert np.array_equal(lease.tensor.numpy(), published[ref])
    snap = s.metrics.snapshot()
    assert snap.tiers["host"].count == N and snap.tiers["storage"].count == N
    assert snap.hit_rate("host") == 0.5
    watched = time.perf_counter() - watched
    st = snap.tiers["storage"]  # each read's latency, in seconds, lies within the time this test watched
    assert 0 < st.p50_s <= st.p90_s <= st.p99_s <= watched and 0 < st.mean_s <= watched
    assert "storage" in snap.table()


async def test_concurrent_fetches_of_one_row_share_one_read(client: MintClient,
                                                            published: dict[str, np.ndarray]) -> None:
    s = Streamer(client, HostPool(1 << 20))
    loc = await client.resolve("t/a3")
    leases = await asyncio.gather(*(s.fetch(loc) for _ in range(8)))
    assert s.metrics.count("storage") == 1
    assert len({lease.tensor.data_ptr() for lease in leases}) == 1
    for lease in leases:
        lease.release()


async def test_host_cache_is_lru_by_bytes(client: MintClient, published: dict[str, np.ndarray]) -> None:
    pool = HostPool(1 << 20)
    row = pool.footprint(len(published["t/a0"]))
    s = Streamer(client, pool, config=StreamerConfig(cache_bytes=3 * row))
    locs = [(await s.prefetch([f"t/a{i}"]))[0] for i in range(3)]  # one by one: a known LRU order
    (await s.fetch(locs[0])).release()  # a0 is now the most recent
    await s.prefetch(["t/a3"])
    assert s.cache_keys() == [locs[2].content_id, locs[0].content_id, (await client.resolve("t/a3")).content_id]
    assert s.cached_bytes == 3 * row and pool.live == 3
    # a held row is never evicted, even over the budget
    held = await s.fetch(locs[2])
    await s.prefetch(["t/a4", "t/a5"])
    assert s.cached(locs[2].content_id)
    held.release()
    await s.prefetch(["t/a6"])
    assert not s.cached(locs[2].content_id) and s.cached_bytes == 3 * row


async def test_a_zero_cache_budget_keeps_no_row_once_released(client: MintClient,
                                                               published: dict[str, np.ndarray]) -> None:
    pool = HostPool(1 << 20)
    s = Streamer(client, pool, config=StreamerConfig(cache_bytes=0))  # 0 is no cache, not "all of it"
    loc = (await s.prefetch(["t/a0"]))[0]
    got = await s.fetch(loc)
    assert got.tensor.numpy().tobytes() == published["t/a0"].tobytes()  # there while held
    got.release()
    assert s.cache_keys() == [] and s.cached_bytes == 0 and pool.live == 0


async def test_a_full_pool_applies_back_pressure(client: MintClient, published: dict[str, np.ndarray]) -> None:
    pool = HostPool(1)  # rounded up to one page...
    row = pool.footprint(len(published["t/a0"]))
    pool = HostPool(2 * row)  # ... this one holds exactly two rows
    s = Streamer(client, pool)
    locs = [await client.resolve(f"t/a{i}") for i in range(3)]
    a, b = await s.fetch(locs[0]), await s.fetch(locs[1])
    third = asyncio.ensure_future(s.fetch(locs[2]))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not third.done()  # both rows are held: nothing to evict
    b.release()  # now evictable: the pool reclaims it for the third row
    c = await third
    assert not s.cached(locs[1].content_id) and s.cached(locs[0].content_id)
    assert np.array_equal(c.tensor.numpy(), published["t/a2"])
    a.release()
    c.release()


async def test_cancelling_a_prefetch_stops_it_and_leaks_nothing(client: MintClient,
                                                               published: dict[str, np.ndarray]) -> None:
    pool = HostPool(1 << 20)
    s = Streamer(client, pool, config=StreamerConfig(concurrency=1))
    locs = [await client.resolve(r) for r in published]
    task = asyncio.ensure_future(s.prefetch(locs))
    while s.metrics.count("storage") < 1:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _settle(pool, s)
    assert s.metrics.count("storage") < N
    assert pool.live == len(s.cache_keys())  # every buffer belongs to a cached row
    # the streamer still works, and rows it read before the cancel are cached
    assert (await s.prefetch(locs)) == locs
    assert len(s.cache_keys()) == N


async def test_a_cancelled_caller_does_not_cancel_a_read_another_one_waits_for(
    client: MintClient, published: dict[str, np.ndarray]
) -> None:
    s = Streamer(client, HostPool(1 << 20))
    loc = await client.resolve("t/a0")
    first = asyncio.ensure_future(s.fetch(loc))
    second = asyncio.ensure_future(s.fetch(loc))
    await asyncio.sleep(0)
    first.cancel()
    lease = await second
    assert np.array_equal(lease.tensor.numpy(), published["t/a0"])
    lease.release()
    assert first.cancelled()


async def test_a_fetch_right_after_the_last_waiter_gave_up_reads_the_row_itself(
    client: MintClient, published: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last waiter's cancel stops the read, but the dying load stayed findable until its task
    ended: a fetch in that window joined it and failed as cancelled, never cancelled itself (the
    engine's retry after a compaction moved a row failed so: "the row stream ended")."""
    s = Streamer(client, HostPool(1 << 20))
    loc = await client.resolve("t/a0")
    gate = asyncio.Event()
    real = client.read_row

    async def slow(*args, **kwargs):  # the real read, once the test lets it go
        await gate.wait()
        return await real(*args, **kwargs)

    monkeypatch.setattr(client, "read_row", slow)
    first = asyncio.ensure_future(s.fetch(loc))
    await asyncio.sleep(0.05)  # its read is in flight
    first.cancel()
    second = asyncio.ensure_future(s.fetch(loc))  # before the cancelled read has ended
    await asyncio.sleep(0.05)
    gate.set()
    lease = await second
    assert np.array_equal(lease.tensor.numpy(), published["t/a0"])
    lease.release()
    assert first.cancelled()


async def test_a_row_failing_verification_is_not_cached(client: MintClient, published: dict[str, np.ndarray]) -> None:
    pool = HostPool(1 << 20)
    s = Streamer(client, pool)
    loc = await client.resolve("t/a0")
    bad = dataclasses.replace(loc, content_id="0" * 32)
    with pytest.raises(IntegrityError):
        await s.fetch(bad)
    assert pool.live == 0 and not s.cached(bad.content_id)
    assert s.metrics.snapshot().errors == 1
    # a failure among many cancels the rest and surfaces
    with pytest.raises(IntegrityError):
        await s.prefetch([loc, bad, *[await client.resolve(f"t/a{i}") for i in range(1, 4)]])
    await _settle(pool, s)
    assert pool.live == len(s.cache_keys())


async def test_stream_hands_over_each_row_as_it_lands(client: MintClient, published: dict[str, np.ndarray]) -> None:
    pool = HostPool(1 << 20)
    s = Streamer(client, pool, config=StreamerConfig(concurrency=3))
    locs: list[Location] = [await client.resolve(r) for r in published]
    got: list[object] = []
    await s.stream(locs, got.append)
    assert sorted(lease.loc.content_id for lease in got) == sorted(loc.content_id for loc in locs)  # type: ignore[attr-defined]
    for lease in got:
        lease.release()  # type: ignore[attr-defined]
