"""CUDA-only paths: the pinned host pool and its fences, uploads on the pool's side stream
(non-blocking, waited for by the compute stream), mark_used ordering an upload after the last
read of a slot, retire() before a pool is let go, and the engine end to end on the device.

Each ordering test holds a stream busy with ``torch.cuda._sleep`` so that the work queued
behind it is certainly still pending when the next step is queued: without the ordering under
test, the result would be wrong, not merely slow. Run with ``pytest -m cuda`` on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_client.device.device_pool import DevicePool
from engine_client.stream.host_pool import PAGE, HostPool
from tests.support.engine import open_engine, publish_dirs
from tests.support.factories import random_adapter
from tests.support.hf_models import ATTN, MLP, build_model, load_peft, logits, make_peft_dir, sample_ids
from tests.support.targets import StoreTarget

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory, streams)"),
]

CYCLES = 200_000_000  # ~0.1 s of GPU clock: far longer than the Python between two queued steps
DEV = torch.device("cuda:0")


def rows(n: int) -> tuple[DevicePool, list[torch.Tensor]]:
    adapters = [random_adapter(i, rank=2) for i in range(n)]
    layout = adapters[0].layout
    return DevicePool(layout, 2, DEV), [torch.from_numpy(a.to_row()[1].copy()) for a in adapters]


def pinned_copy(host: HostPool, row: torch.Tensor) -> torch.Tensor:
    buf = host.try_acquire(row.numel())
    assert buf is not None
    buf.tensor.copy_(row)
    return buf.tensor


def test_the_host_pool_is_one_pinned_page_aligned_allocation() -> None:
    pool = HostPool(1 << 20)
    assert pool.pinned and pool.tensor.is_pinned()
    a, b = pool.try_acquire(1000), pool.try_acquire(5000)
    assert a is not None and b is not None
    for buf in (a, b):
        assert buf.tensor.is_pinned() and buf.tensor.data_ptr() % PAGE == 0
        assert buf.tensor.untyped_storage().data_ptr() == pool.tensor.untyped_storage().data_ptr()
    assert not HostPool(1 << 20, pin=False).tensor.is_pinned()


def test_a_released_buffer_is_reused_only_after_the_copy_reading_it() -> None:
    pool = HostPool(PAGE)
    buf = pool.try_acquire(PAGE)
    assert buf is not None
    buf.tensor.fill_(7)
    dst = torch.empty(PAGE, dtype=torch.uint8, device=DEV)
    side = torch.cuda.Stream(DEV)
    with torch.cuda.stream(side):
        torch.cuda._sleep(CYCLES)
        dst.copy_(buf.tensor, non_blocking=True)  # a DMA from pinned memory, queued behind the sleep
        fence = torch.cuda.Event()
        fence.record(side)
    buf.fence = fence
    buf.release()
    assert not fence.query() and pool.used == PAGE  # fenced: the extent is not free yet
    again = pool.try_acquire(PAGE)  # waits for the fence rather than hand out memory a copy still reads
    assert again is not None and fence.query()
    again.tensor.fill_(9)
    torch.cuda.synchronize()
    assert bool((dst == 7).all())  # the copy saw the old bytes, not the new owner's


def test_an_upload_is_non_blocking_on_the_side_stream_and_waited_for() -> None:
    pool, (row,) = rows(1)
    host = HostPool(1 << 20)
    src = pinned_copy(host, row)
    slot = pool.assign("c0")
    assert pool._stream is not None and pool._stream != torch.cuda.current_stream(DEV)
    with torch.cuda.stream(pool._stream):
        torch.cuda._sleep(CYCLES)  # the side stream is busy: the copy below stays queued
    done = pool.load(slot, src)
    assert done is not None and not done.query()  # load() returned before the copy ran
    pool.wait_ready([slot])
    got = pool.data[slot].clone()  # compute-stream work after wait_ready sees the upload
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), row)


def test_an_upload_waits_for_the_last_batch_that_read_the_slot() -> None:
    pool, (old, new) = rows(2)
    host = HostPool(1 << 20)
    slot = pool.assign("c0")
    pool.load(slot, pinned_copy(host, old))
    pool.wait_ready([slot])
    torch.cuda.synchronize()
    torch.cuda._sleep(CYCLES)  # the compute stream is busy: the read below stays queued
    seen = pool.data[slot].clone()  # a batch reading the slot
    pool.mark_used([slot])
    pool.evict("c0")
    assert pool.assign("c1") == slot
    pool.load(slot, pinned_copy(host, new))  # must not overwrite what that batch reads
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), old) and torch.equal(pool.data[slot].cpu(), new)


def test_retire_makes_later_compute_work_wait_for_uploads_in_flight() -> None:
    pool, (row,) = rows(1)
    host = HostPool(1 << 20)
    slot = pool.assign("c0")
    with torch.cuda.stream(pool._stream):
        torch.cuda._sleep(CYCLES)
    pool.load(slot, pinned_copy(host, row))  # still queued on the side stream
    pool.retire()
    after = pool.data[slot].clone()  # what the next owner of freed memory would run: after the copy
    torch.cuda.synchronize()
    assert torch.equal(after.cpu(), row)


def test_the_engine_on_the_device_equals_peft_through_churn_and_dropped_pools(local_target: StoreTarget,
                                                                              tmp_path: Path) -> None:
    ids = sample_ids(batch=3, seq=5, seed=7)
    dirs = {
        "v1": make_peft_dir(tmp_path / "v1", "llama", r=4, lora_alpha=8, target_modules=ATTN),
        "v2": make_peft_dir(tmp_path / "v2", "llama", r=4, lora_alpha=2, target_modules=ATTN),
        "mlp": make_peft_dir(tmp_path / "mlp", "llama", r=1, lora_alpha=2, target_modules=MLP),
    }
    published = publish_dirs(local_target, dirs)
    want = {n: logits(load_peft(d, "llama"), ids) for n, d in dirs.items()}
    one_pool = max(p.nbytes for p in published.values())  # room for one slot of one layout at a time
    with open_engine(build_model("llama").to(DEV), local_target, slots=1, device_bytes=one_pool) as engine, \
            torch.no_grad():
        assert engine.host_pool.pinned and engine.device.type == "cuda"
        for _ in range(3):
            for name in ("v1", "mlp", "v2"):  # each switch evicts a slot or drops (retires) a pool
                out = engine.forward(ids.to(DEV), adapters=[f"t/{name}", None, f"t/{name}"]).logits.cpu()
                for i in (0, 2):
                    torch.testing.assert_close(out[i], want[name][i], rtol=1e-4, atol=1e-4)
        assert len(engine.pools) == 1
