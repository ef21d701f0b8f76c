"""The switch path that skips the I/O loop: a local store resolved and read in the caller's
thread (``MintClient.direct``, ``Streamer.fetch_now``), with the same verification, tiers,
host cache and deduplication as the loop's path. Correctness only; timing lives in
``tools/bench_swap.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_client import MintClient
from engine_client.errors import IntegrityError
from engine_client.stream.host_pool import HostPool
from engine_client.stream.streamer import Streamer, StreamerConfig
from tests.support.engine import open_engine, publish_dirs, publish_random
from tests.support.factories import random_adapter
from tests.support.hf_models import ATTN, build_model, load_peft, logits, make_peft_dir, sample_ids
from tests.support.targets import StoreTarget

N = 6


@pytest.fixture
def published(local_target: StoreTarget) -> dict[str, np.ndarray]:
    """``t/a{i}`` -> its row bytes."""
    return publish_random(local_target, N)


async def test_direct_access_is_offered_once_the_store_is_open(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish("t", "a0", random_adapter(0))
    async with MintClient(target.url, index_dir=target.index_dir, storage_options=target.storage_options) as c:
        assert c.direct() is None and c.direct(read=True) is None  # not opened yet: never blocks to open
        loc = await c.resolve("t/a0")
        store = c.direct()
        assert store is not None
        got = store.resolve_many(["t/a0", "t/nope"])
        assert got[0] == loc and isinstance(got[1], Exception)
        # resolves are local everywhere (LMDB); row reads only when the rows are local files
        assert (c.direct(read=True) is store) == (target.kind == "local")


async def test_fetch_now_reads_in_this_thread_into_the_pool_then_hits_the_host_cache(
    client: MintClient, published: dict[str, np.ndarray]
) -> None:
    pool = HostPool(1 << 20)
    s = Streamer(client, pool)
    loc = await client.resolve("t/a1")  # (opens the store)
    lease = await asyncio.to_thread(s.fetch_now, loc)  # another thread than the loop's
    assert lease is not None
    assert lease.tensor.data_ptr() >= pool.tensor.data_ptr()  # in the pool, not a copy
    assert np.array_equal(lease.tensor.numpy(), published["t/a1"])
    assert s.metrics.count("storage") == 1 and s.cached(loc.content_id)
    lease.release()
    again = s.fetch_now(loc)
    assert again is not None and s.metrics.count("host") == 1 and s.metrics.count("storage") == 1
    again.release()
    assert pool.live == 1  # the cached row, nothing else


async def test_fetch_now_declines_what_the_loop_should_do(client: MintClient, local_target: StoreTarget,
                                                          published: dict[str, np.ndarray]) -> None:
    s = Streamer(client, HostPool(1 << 20), config=StreamerConfig(direct_read_bytes=0))
    async with MintClient(local_target.url, index_dir=local_target.index_dir) as fresh:
        loc = await client.resolve("t/a0")
        unopened = Streamer(fresh, HostPool(1 << 20))
        assert unopened.fetch_now(loc) is None  # its client has no open store yet
    assert s.fetch_now(loc) is None  # over direct_read_bytes ...
    lease = s.fetch_now(loc, alone=True)  # ... unless it is the only row the caller waits for
    assert lease is not None and np.array_equal(lease.tensor.numpy(), published["t/a0"])
    lease.release()
    assert s.metrics.count("storage") == 1


async def test_fetch_now_never_waits_for_room_but_reclaims_what_nobody_holds(
    client: MintClient, published: dict[str, np.ndarray]
) -> None:
    row = HostPool(1).footprint(len(published["t/a0"]))
    pool = HostPool(2 * row)  # exactly two rows
    s = Streamer(client, pool)
    locs = [await client.resolve(f"t/a{i}") for i in range(3)]
    a, b = s.fetch_now(locs[0]), s.fetch_now(locs[1])
    assert a is not None and b is not None
    assert s.fetch_now(locs[2]) is None  # both held: the loop's fetch would wait, this declines
    assert pool.live == 2 and not s.cached(locs[2].content_id)
    b.release()
    c = s.fetch_now(locs[2])  # b's row is evicted for it
    assert c is not None and np.array_equal(c.tensor.numpy(), published["t/a2"])
    assert not s.cached(locs[1].content_id) and s.cached(locs[0].content_id)
    a.release()
    c.release()


async def test_a_direct_read_failing_verification_leaves_nothing_behind(
    client: MintClient, published: dict[str, np.ndarray]
) -> None:
    pool = HostPool(1 << 20)
    s = Streamer(client, pool)
    bad = dataclasses.replace(await client.resolve("t/a0"), content_id="0" * 32)
    with pytest.raises(IntegrityError):
        s.fetch_now(bad)
    assert pool.live == 0 and not s.cached(bad.content_id) and s.metrics.snapshot().errors == 1


class _GatedStore:
    """The client's store, but ``read_row`` waits for ``go`` after signalling ``entered``."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.entered = threading.Event()
        self.go = threading.Event()

    def read_row(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.go.wait(10)
        return self.store.read_row(*args, **kwargs)


@pytest.mark.parametrize("loop_lands_first", [True, False])
async def test_a_direct_read_racing_a_load_on_the_loop_shares_one_entry(
    client: MintClient, published: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch, loop_lands_first: bool
) -> None:
    pool = HostPool(1 << 20)
    s = Streamer(client, pool)
    loc = await client.resolve("t/a2")
    gated = _GatedStore(client.direct(read=True))
    monkeypatch.setattr(client, "direct", lambda *, read=False: gated)
    direct = asyncio.ensure_future(asyncio.to_thread(s.fetch_now, loc))
    await asyncio.to_thread(gated.entered.wait, 10)  # past its check for a running load: both read
    if loop_lands_first:
        on_loop = await s.fetch(loc)
        gated.go.set()
    else:
        real = client.read_row
        loop_entered, loop_go = asyncio.Event(), asyncio.Event()

        async def late_read(*args: Any, **kwargs: Any) -> Any:
            loop_entered.set()
            await loop_go.wait()
            return await real(*args, **kwargs)

        monkeypatch.setattr(client, "read_row", late_read)
        pending = asyncio.ensure_future(s.fetch(loc))
        await loop_entered.wait()  # the loop's load is under way before the direct read lands
        gated.go.set()
        first = await direct
        assert first is not None and s.cached(loc.content_id)
        loop_go.set()
        on_loop = await pending
    got = await direct
    assert got is not None
    assert got.tensor.data_ptr() == on_loop.tensor.data_ptr()  # one entry, one buffer
    assert np.array_equal(got.tensor.numpy(), published["t/a2"])
    assert s.metrics.count("storage") == 2  # both read; the second gave its buffer back
    got.release()
    on_loop.release()
    assert s.cache_keys() == [loc.content_id] and pool.live == 1
    s.clear()
    assert pool.live == 0 and s.cached_bytes == 0


# -- the engine --------------------------------------------------------------------------------


def test_an_engine_switches_on_a_local_store_without_its_io_loop(local_target: StoreTarget, tmp_path: Path) -> None:
    ids = sample_ids(batch=2, seq=5, seed=3)
    dirs = {f"v{i}": make_peft_dir(tmp_path / f"v{i}", "llama", seed=0, r=2, lora_alpha=4 + i,
                                   target_modules=ATTN) for i in range(4)}
    publish_dirs(local_target, dirs)
    want = {name: logits(load_peft(d, "llama"), ids) for name, d in dirs.items()}
    with open_engine(build_model("llama"), local_target, slots=1) as engine, torch.no_grad():
        first = engine.forward(ids, adapters=["t/v0", None]).logits  # opens the store (through the loop)
        assert (first[0] - want["v0"][0]).abs().max() <= 1e-5

        def no_loop(*args: Any) -> Any:
            for a in args:
                if asyncio.iscoroutine(a):
                    a.close()
            raise AssertionError("the switch went through the I/O loop")

        with pytest.MonkeyPatch.context() as m:  # restored before the engine closes, even on a failure
            m.setattr(engine._io, "run", no_loop)
            m.setattr(engine._io, "submit", no_loop)
            for name in ("v1", "v2"):  # never seen: resolve, read, verify, copy, all in this thread
                before = engine.metrics.count("storage")
                out = engine.forward(ids, adapters=[None, f"t/{name}"]).logits
                assert engine.metrics.count("storage") == before + 1
                assert (out[1] - want[name][1]).abs().max() <= 1e-5
            # on the CPU a slot is host memory: the rows went straight into it, with no second
            # copy in the host cache, so v1, evicted from the one slot, is read again (one pass)
            assert engine.streamer.cache_keys() == []
            before = engine.metrics.count("storage")
            out = engine.forward(ids, adapters=["t/v1", None]).logits
            assert engine.metrics.count("storage") == before + 1 and engine.metrics.count("host") == 0
            assert (out[0] - want["v1"][0]).abs().max() <= 1e-5

    # two cold rows over direct_read_bytes, with the slots not on the CPU's plain rows (as on a
    # device): the loop reads them into the host cache concurrently, same result
    with open_engine(build_model("llama"), local_target, slots=2) as engine, torch.no_grad():
        engine.streamer.config = dataclasses.replace(engine.streamer.config, direct_read_bytes=0)
        engine.forward(ids, adapters=["t/v2", None])  # alone: read directly even so
        assert engine.metrics.count("storage") == 1
        for pool in engine.pools.values():
            pool.host_rows = None  # (what a CUDA pool is: no slot a read could land in)
        submitted: list[object] = []
        real_submit = engine._io.submit

        def counting(coro: Any) -> Any:
            submitted.append(coro)
            return real_submit(coro)

        engine._io.submit = counting  # type: ignore[method-assign]
        out = engine.forward(ids, adapters=["t/v3", "t/v0"]).logits
        assert engine.metrics.count("storage") == 3 and len(submitted) == 1  # one stream of both rows
        assert (out[0] - want["v3"][0]).abs().max() <= 1e-5 and (out[1] - want["v0"][1]).abs().max() <= 1e-5


def test_a_damaged_row_read_straight_into_a_cpu_slot_fails_and_frees_the_slot(local_target: StoreTarget,
                                                                              tmp_path: Path) -> None:
    """On the CPU a cold row lands in its slot as it is read; a row that fails its content id
    raises and leaves no slot claiming it, and the next good row takes the slot."""
    ids = sample_ids(batch=2, seq=5, seed=3)
    dirs = {name: make_peft_dir(tmp_path / name, "llama", seed=0, r=2, lora_alpha=4 + i, target_modules=ATTN)
            for i, name in enumerate(("good", "bad"))}
    publish_dirs(local_target, dirs)
    want = logits(load_peft(dirs["good"], "llama"), ids)
    with local_target.open() as store:
        bad = store.resolve("t/bad")
        path = store.storage.local_path(bad.shard_key)
    assert path is not None
    with open(path, "r+b") as f:  # one flipped byte in the middle of the row, in place
        f.seek(bad.offset + bad.length // 2)
        byte = f.read(1)
        f.seek(bad.offset + bad.length // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    with open_engine(build_model("llama"), local_target, slots=1) as engine, torch.no_grad():
        with pytest.raises(IntegrityError):
            engine.forward(ids, adapters=["t/bad", None])
        (pool,) = engine.pools.values()
        assert pool.resident() == [] and pool.available() == 1 and engine.metrics.snapshot().errors == 1
        out = engine.forward(ids, adapters=["t/good", None]).logits
        assert (out[0] - want[0]).abs().max() <= 1e-5 and engine.streamer.cache_keys() == []
