"""The vLLM worker's row buffers: reused once every tensor of a row is gone, never before."""

from __future__ import annotations

import gc

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
    assert pool.free_bytes == 0  # the view still uses it
    other = pool.take(ROW)
    assert other.data_ptr() != ptr and (view.view(torch.uint8) == 7).all()
    del view
    gc.collect()
    assert pool.free_bytes == 3 * GRAIN
    again = pool.take(ROW - 1000)  # another row of the same size class
    assert again.data_ptr() == ptr and pool.reused == 1 and pool.fresh == 2 and pool.free_bytes == 0
    del other, again


def test_free_buffers_are_bounded_and_small_or_pinned_rows_are_not_pooled() -> None:
    pool = RowBuffers(4 * GRAIN)
    bufs = [pool.take(ROW) for _ in range(3)]  # 3 x 3 grains
    del bufs
    gc.collect()
    assert pool.free_bytes == 3 * GRAIN  # one kept, two closed: within 4 grains
    small = pool.take(MIN_POOLED - 1)
    assert small.shape == (MIN_POOLED - 1,) and pool.fresh == 3 and pool.reused == 0
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
