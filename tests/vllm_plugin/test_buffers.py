"""The vLLM worker's row buffers: reused once every tensor of a row is gone, never before."""

from __future__ import annotations

import gc
import multiprocessing
from typing import Any

import pytest
import torch

from engine_client.vllm_plugin.buffers import GRAIN, MIN_POOLED, RowBuffers
from engine_client.vllm_plugin.config import PluginConfig

ROW = 5 * GRAIN // 2 + 123  # rounds up to 3 grains


def test_a_buffer_comes_back_when_its_last_view_is_gone() -> None:
    pool = RowBuffers(1 << 30)
    buf = pool.take(ROW)
    assert buf.dtype == torch.uint8 and buf.shape == (ROW,) and buf.data_ptr() % 4096 == 0
    buf.fill_(7)
    ptr = buf.data_ptr()
    view = buf[GRAIN : 2 * GRAIN].view(torch.bfloat16)  # what vLLM keeps: views of the row
    del buf
    gc.collect()
    assert pool.settle(timeout=60)
    assert pool.free_bytes == 3 * GRAIN  # the spare only: the view still uses the row
    other = pool.take(ROW)  # (the spare)
    assert other.data_ptr() != ptr and (view.view(torch.uint8) == 7).all()
    assert pool.settle(timeout=60) and pool.free_bytes == 3 * GRAIN  # (the next spare)
    del view
    gc.collect()
    assert pool.free_bytes == 2 * 3 * GRAIN
    again = pool.take(ROW - 1000)  # another row of the same size class: the last one freed
    assert again.data_ptr() == ptr and pool.reused == 2 and pool.fresh == 1
    assert pool.settle(timeout=60) and pool.free_bytes == 3 * GRAIN
    del other, again


def test_free_buffers_are_bounded_and_small_or_pinned_rows_are_not_pooled() -> None:
    pool = RowBuffers(4 * GRAIN)
    bufs = [pool.take(ROW) for _ in range(3)]  # 3 x 3 grains (spares among them, or not yet)
    assert pool.settle(timeout=60)
    del bufs
    gc.collect()
    assert pool.free_bytes == 3 * GRAIN  # one kept, the others closed: within 4 grains
    assert pool.fresh + pool.reused == 3
    fresh = pool.fresh
    small = pool.take(MIN_POOLED - 1)
    assert small.shape == (MIN_POOLED - 1,) and pool.fresh == fresh  # not pooled: torch's allocator
    off = RowBuffers(0)
    off.take(ROW)
    assert off.fresh == 0 and off.free_bytes == 0
    with pytest.raises(ValueError, match="keep_bytes"):
        RowBuffers(-1)


def test_the_buffer_budget_comes_from_the_environment() -> None:
    env = {"MINT_STORE": "/tmp/store"}
    config = PluginConfig.from_env(env)
    assert config is not None and config.buffer_bytes == 1 << 30
    config = PluginConfig.from_env(env | {"MINT_VLLM_BUFFER_BYTES": "0"})
    assert config is not None and config.buffer_bytes == 0
    with pytest.raises(ValueError, match="MINT_VLLM_BUFFER_BYTES"):
        PluginConfig.from_env(env | {"MINT_VLLM_BUFFER_BYTES": "lots"})
    with pytest.raises(ValueError, match="MINT_VLLM_BUFFER_BYTES"):
        PluginConfig.from_env(env | {"MINT_VLLM_BUFFER_BYTES": "-1"})


def test_a_spare_of_each_size_is_faulted_in_ahead_so_the_next_row_needs_no_fresh_memory() -> None:
    pool = RowBuffers(1 << 30)
    first = pool.take(ROW)  # nothing free: mapped on the take's path, and a spare asked for
    assert pool.settle(timeout=60)
    assert pool.fresh == 1 and pool.spares == 1 and pool.free_bytes == 3 * GRAIN
    second = pool.take(ROW)  # while `first` is still held (vLLM's CPU cache keeps its rows)
    assert pool.reused == 1 and pool.fresh == 1 and second.data_ptr() != first.data_ptr()
    assert (second == 0).all()  # fresh anonymous memory: the spare thread wrote nothing else into it
    assert pool.settle(timeout=60) and pool.spares == 2 and pool.free_bytes == 3 * GRAIN
    other = pool.take(MIN_POOLED)  # another size class: its own spare
    assert pool.settle(timeout=60) and pool.spares == 3 and pool.free_bytes == 3 * GRAIN + GRAIN
    del first, second, other
    gc.collect()
    assert pool.free_bytes == 2 * 3 * GRAIN + 2 * GRAIN + 3 * GRAIN  # what came back, and the spares


def test_no_spare_is_faulted_in_while_a_row_is_read_and_a_shared_one_is_shown_when_made() -> None:
    pool = RowBuffers(1 << 30)
    shown: list[tuple[int, int]] = []
    pool.on_spare = lambda fd, size: shown.append((fd, size))
    with pool.reading():
        first, fd = pool.take_shared(ROW)  # a spare asked for: made once the read is done
        assert not pool.settle(timeout=0.3) and pool.spares == 0
    assert pool.settle(timeout=60) and pool.spares == 1 and len(shown) == 1
    spare_fd, size = shown[0]
    assert size == 3 * GRAIN and spare_fd != fd
    second, second_fd = pool.take_shared(ROW)  # the spare shown: the memfd it named
    assert second_fd == spare_fd
    anonymous = pool.take(ROW)  # (not shared: nobody to show it to)
    assert pool.settle(timeout=60) and len(shown) == 2
    del first, second, anonymous


def test_spares_stay_within_the_budget_and_the_oldest_size_goes_first() -> None:
    pool = RowBuffers(3 * GRAIN)  # room for one buffer of ROW's size class
    a = pool.take(ROW)
    assert pool.settle(timeout=60) and pool.spares == 1 and pool.free_bytes == 3 * GRAIN
    b = pool.take(MIN_POOLED)  # its spare (1 grain) pushes the older size's spare out
    assert pool.settle(timeout=60) and pool.spares == 2 and pool.free_bytes == GRAIN
    c = pool.take(ROW)  # the ROW spare is gone: fresh memory again
    assert pool.fresh == 3 and pool.reused == 0
    big = RowBuffers(GRAIN)
    d = big.take(ROW)  # larger than the whole budget: never kept, so no spare either
    assert big.settle(timeout=60) and big.spares == 0 and big.free_bytes == 0
    del a, b, c, d


def _child_spares(pool: RowBuffers, nbytes: int, out: Any) -> None:
    before = pool.spares
    pool.take(nbytes)  # the size the parent's spare thread was still making at the fork
    out.put((pool.settle(timeout=30), pool.spares - before))


def test_a_forked_child_makes_its_own_spares() -> None:
    big = 128 * GRAIN  # (256 MiB: its spare takes the parent's thread a while to fault in)
    pool = RowBuffers(4 * big)
    held = pool.take(big)  # a spare asked for: the fork below comes while it is being made
    ctx = multiprocessing.get_context("fork")  # (as a process vLLM forks inherits its loader)
    out = ctx.Queue()
    child = ctx.Process(target=_child_spares, args=(pool, big, out))
    child.start()
    settled, made = out.get(timeout=120)
    child.join(timeout=60)
    # the parent's pending spare is not the child's to wait for: the child makes its own
    assert child.exitcode == 0 and settled and made >= 1
    assert pool.settle(timeout=60) and pool.spares == 1  # the parent's, made by its own thread
    del held


@pytest.mark.skipif(not hasattr(__import__("os"), "memfd_create"), reason="memfd_create is Linux's")
def test_a_shared_buffer_is_the_memfd_it_names_and_is_pooled_apart() -> None:
    import fcntl
    import os

    pool = RowBuffers(1 << 30, spares=False)
    buf, fd = pool.take_shared(ROW)
    os.pwrite(fd, b"\x05" * 100, GRAIN)  # what another process writes through the descriptor
    assert (buf[GRAIN : GRAIN + 100] == 5).all() and buf.data_ptr() % 4096 == 0
    ptr = buf.data_ptr()
    del buf
    gc.collect()
    plain = pool.take(ROW)  # anonymous memory: never a memfd given back
    assert plain.data_ptr() != ptr
    again, fd2 = pool.take_shared(ROW)
    assert again.data_ptr() == ptr and fd2 == fd and pool.reused == 1
    # a pooled one's size is sealed (the service may keep it mapped: it cannot shrink under that)
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    with pytest.raises(PermissionError):
        os.ftruncate(fd, GRAIN)
    small, small_fd = pool.take_shared(MIN_POOLED - 1)  # not pooled: a memfd of its own, used once
    os.pwrite(small_fd, b"\x09", 0)
    assert small[0] == 9 and small_fd not in (fd,)
    assert not fcntl.fcntl(small_fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK  # (nothing keeps it mapped)
    del plain, again, small
