"""The pinned host pool (extents, reuse, back pressure) and the device slot pool (views, one copy, LRU)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_client.device.device_pool import DevicePool
from engine_client.errors import HostPoolTooSmall, OutOfSlots
from engine_client.stream.host_pool import PAGE, HostPool
from mint_store.format.layout import decode_row
from tests.support.factories import random_adapter

# -- host pool ---------------------------------------------------------------------------------


def test_one_page_aligned_allocation_carved_into_aligned_buffers() -> None:
    pool = HostPool(10 * PAGE + 1)
    assert pool.capacity == 11 * PAGE
    assert pool.pinned is torch.cuda.is_available()
    assert pool.tensor.data_ptr() % PAGE == 0
    bufs = [pool.try_acquire(n) for n in (1, PAGE, PAGE + 1, 100)]
    assert all(b is not None for b in bufs)
    base, end = pool.tensor.data_ptr(), pool.tensor.data_ptr() + pool.capacity
    for b in bufs:
        assert b is not None
        assert b.tensor.data_ptr() % PAGE == 0
        assert base <= b.tensor.data_ptr() and b.tensor.data_ptr() + b.nbytes <= end  # a view, not a copy
        assert b.array.ctypes.data == b.tensor.data_ptr()
    assert pool.used == 5 * PAGE and pool.live == 4
    for b in bufs:
        assert b is not None
        b.release()
    assert pool.used == 0 and pool.live == 0


def test_released_extents_coalesce_and_are_reused() -> None:
    pool = HostPool(4 * PAGE)
    a, b, c, d = (pool.try_acquire(PAGE) for _ in range(4))
    assert None not in (a, b, c, d) and pool.try_acquire(1) is None
    assert a is not None and b is not None and c is not None and d is not None
    first = a.tensor.data_ptr()
    b.release()
    a.release()  # a and b are neighbours: one extent of two pages
    two = pool.try_acquire(2 * PAGE)
    assert two is not None and two.tensor.data_ptr() == first
    with pytest.raises(RuntimeError, match="twice"):
        a.release()
    with c, d, two:
        pass
    assert pool.used == 0
    assert pool.try_acquire(4 * PAGE) is not None


def test_a_row_larger_than_the_pool_is_refused() -> None:
    pool = HostPool(PAGE)
    with pytest.raises(HostPoolTooSmall, match="make the pool larger"):
        pool.try_acquire(PAGE + 1)


async def test_acquire_waits_for_a_release_when_full() -> None:
    pool = HostPool(2 * PAGE)
    a = await pool.acquire(PAGE)
    b = await pool.acquire(PAGE)
    waiting = asyncio.ensure_future(pool.acquire(PAGE))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not waiting.done()  # back pressure: nothing free
    b.release()
    c = await waiting
    assert c.tensor.data_ptr() == b.tensor.data_ptr()
    # a release from another thread (the engine releases after its device copy) wakes a waiter too
    waiting = asyncio.ensure_future(pool.acquire(PAGE))
    await asyncio.sleep(0)
    assert not waiting.done()
    t = threading.Thread(target=a.release)
    t.start()
    d = await waiting
    t.join()
    c.release()
    d.release()
    assert pool.used == 0


async def test_acquire_asks_the_reclaimer_before_waiting() -> None:
    pool = HostPool(PAGE)
    held = [await pool.acquire(PAGE)]
    asked: list[int] = []

    def reclaim(nbytes: int) -> bool:
        asked.append(nbytes)
        if held:
            held.pop().release()
            return True
        return False

    pool.reclaimer = reclaim
    buf = await pool.acquire(10)
    assert asked == [PAGE] and pool.live == 1
    buf.release()


# -- device pool -----------------------------------------------------------------------------


def _pool(slots: int = 3, **kw: object) -> tuple[DevicePool, list]:
    adapters = [random_adapter(i, rank=2, experts=4, **kw) for i in range(5)]
    layout = adapters[0].layout
    assert all(a.layout == layout for a in adapters)
    return DevicePool(layout, slots, "cpu"), adapters


def test_module_stacks_are_strided_views_into_the_one_pool_tensor() -> None:
    pool, _ = _pool()
    data = pool.data
    assert data.shape == (3, pool.layout.row_nbytes) and data.dtype == torch.uint8
    lo, hi = data.data_ptr(), data.data_ptr() + data.numel()
    for m in pool.layout.modules:
        v = pool.modules[m.name]
        lead = (3,) if m.experts is None else (3, m.experts)
        assert v.a.shape == (*lead, m.rank, m.in_features)
        assert v.b.shape == (*lead, m.out_features, m.rank)
        assert v.scaling.shape == (3,)
        for t in (v.a, v.b, v.scaling):
            assert t.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            assert lo <= t.data_ptr() < hi
            # slot s of every view starts inside row s of the pool
            assert t.stride(0) * t.element_size() == pool.layout.row_nbytes


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_load_is_one_copy_and_the_views_see_the_adapter() -> None:
    pool, adapters = _pool()
    layout, row = adapters[1].to_row()
    row_t = torch.from_numpy(row)
    slot = pool.assign("c1")
    with _CountOps() as counted:
        pool.load(slot, row_t)
    assert [op for op in counted.ops if "copy" in op] == ["aten.copy_.default"]
    assert len([op for op in counted.ops if "view" not in op and "slice" not in op and "select" not in op]) == 1
    want = decode_row(layout, row)
    for m in layout.modules:
        v = pool.modules[m.name]
        assert torch.equal(v.a[slot], want[m.a.name])
        assert torch.equal(v.b[slot], want[m.b.name])
        assert v.scaling[slot].item() == want["scaling"][m.index].item()
    assert pool.loads == 1
    with pytest.raises(ValueError, match="uint8"):
        pool.load(slot, row_t[:-64])


def test_lru_eviction_pins_and_out_of_slots() -> None:
    pool, _ = _pool(slots=2)
    a = pool.assign("a")
    b = pool.assign("b")
    assert (a, b) == (0, 1) and pool.resident() == ["a", "b"]
    pool.touch(a)  # b is now the least recently used
    c = pool.assign("c")
    assert c == b and "b" not in pool and pool.resident() == ["a", "c"]
    pool.pin(a)
    d = pool.assign("d")  # c goes: a is pinned even though it is older
    assert d == c and pool.resident() == ["a", "d"]
    pool.pin(d)
    assert pool.available() == 0
    with pytest.raises(OutOfSlots, match="all 2 device slots"):
        pool.assign("e")
    pool.unpin(d)
    pool.unpin(a)
    with pytest.raises(RuntimeError, match="not pinned"):
        pool.unpin(a)
    pool.evict("a")
    assert pool.slot_of("a") is None and pool.available() == 2
    assert pool.assign("e") == a


def test_available_counts_free_and_unpinned_slots_through_pins_and_evictions() -> None:
    pool, _ = _pool(slots=4)
    with pytest.raises(RuntimeError, match="assign"):
        pool.pin(0)  # nothing in slot 0 yet: a pin there would be counted and never released
    slots = [pool.assign(c) for c in "abc"]
    assert pool.available() == 4  # one free, three evictable
    pool.pin(slots[0])
    pool.pin(slots[0])  # two batches share the adapter: still one slot taken
    pool.pin(slots[1])
    assert pool.available() == 2
    pool.unpin(slots[0])
    assert pool.available() == 2
    pool.unpin(slots[0])
    assert pool.available() == 3
    with pytest.raises(RuntimeError, match="pinned"):
        pool.evict("b")
    pool.evict("a")
    assert pool.available() == 3 and pool.assign("d") == slots[0]  # the freed slot is handed out first
    pool.unpin(slots[1])
    assert pool.available() == 4


def test_pool_budget_drops_idle_pools_oldest_first_and_never_one_in_use() -> None:
    from engine_client.device.pool_budget import PoolBudget
    from engine_client.errors import DeviceBudgetExceeded

    pools = {k: DevicePool(random_adapter(0, rank=r).layout, 2, "cpu") for k, r in (("a", 1), ("b", 2), ("c", 3))}
    size = {k: p.nbytes for k, p in pools.items()}
    budget = PoolBudget(size["a"] + size["b"] + size["c"] - 1)
    for k in ("a", "b", "c", "a"):  # a is used again last: b is the oldest
        budget.use(k)
    for k in ("a", "a", "b"):  # nobody uses a or b now; c is still in use
        budget.done(k)
    new = size["a"] // 2  # room for it takes dropping any one pool
    assert budget.to_drop(pools, ["d"], new) == ["b"]  # the oldest idle pool, and only as much as needed
    budget.use("b")  # in use again: protected, though it has no pinned slot
    assert budget.to_drop(pools, ["d"], new) == ["a"]
    pools["a"].pin(pools["a"].assign("x"))  # a pinned slot protects a pool too
    with pytest.raises(DeviceBudgetExceeded, match="in use"):
        budget.to_drop(pools, ["d"], new)
    with pytest.raises(DeviceBudgetExceeded, match="raise device_bytes or lower slots"):
        budget.to_drop(pools, ["d", "e"], budget.limit + 1)
    with pytest.raises(RuntimeError, match="not in use"):
        budget.done("a")
    assert PoolBudget(None).to_drop(pools, ["d"], 10**15) == []  # no limit: nothing ever goes
