"""The engine around the math: layout checks, slots, prefetch, pinning, hot swap through the
change feed, and the import surface."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_client.errors import AdapterNotFound, BatchMismatch, DeviceBudgetExceeded, LayoutMismatch, OutOfSlots
from mint_store import Location
from tests.support.engine import TENANT, open_engine, publish_dirs
from tests.support.factories import random_adapter
from tests.support.hf_models import ATTN, MLP, MOE_PARAMS, build_model, load_peft, logits, make_peft_dir, sample_ids
from tests.support.targets import StoreTarget

IDS = sample_ids(batch=3, seq=5, seed=5)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ops")
    return {
        "v1": make_peft_dir(tmp / "v1", "llama", r=4, lora_alpha=8, target_modules=ATTN),
        "v2": make_peft_dir(tmp / "v2", "llama", r=4, lora_alpha=2, target_modules=ATTN),  # same layout, other values
        "mlp": make_peft_dir(tmp / "mlp", "llama", r=1, lora_alpha=2, target_modules=MLP),
        "r2": make_peft_dir(tmp / "r2", "llama", r=2, lora_alpha=2, target_modules=ATTN),  # a third layout
        "mlp2": make_peft_dir(tmp / "mlp2", "llama", r=2, lora_alpha=2, target_modules=MLP),  # and a fourth
        "moe": make_peft_dir(tmp / "moe", "qwen3_moe", r=2, target_modules=["q_proj"], target_parameters=MOE_PARAMS),
    }


@pytest.fixture(scope="module")
def want(dirs: dict[str, Path]) -> dict[str, torch.Tensor]:
    out = {name: logits(load_peft(dirs[name], "llama"), IDS) for name in ("v1", "v2", "mlp", "r2")}
    out["base"] = logits(build_model("llama"), IDS)
    return out


def _publish_rows(target: StoreTarget, dirs: dict[str, Path], *names: str) -> list[Location]:
    """Publish ``dirs[name]`` as ``t/<name>``; their locations (row bytes, layout, content id)."""
    publish_dirs(target, {n: dirs[n] for n in names})
    with target.open() as store:
        return [store.resolve(f"{TENANT}/{n}") for n in names]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max().item() <= 1e-5)


def test_a_layout_that_does_not_fit_is_refused_naming_the_first_mismatch(
    local_target: StoreTarget, dirs: dict[str, Path], want: dict[str, torch.Tensor]
) -> None:
    publish_dirs(local_target, {"ok": dirs["v1"], "moe": dirs["moe"]})
    with local_target.open() as store:
        # q_proj fits llama (32 -> 32) but k_proj does not (llama: 32 -> 16 with 2 kv heads)
        store.publish(TENANT, "shapes", random_adapter(0, rank=2, base="unspecified"))
    with open_engine(build_model("llama"), local_target) as engine:
        with pytest.raises(LayoutMismatch, match=r"'t/shapes'.*'model\.layers\.0\.self_attn\.k_proj'.*\(32, 32, None\)"
                                                 r".*\(32, 16, None\)"):
            engine.forward(IDS, adapters=["t/ok", "t/shapes", None])
        with pytest.raises(LayoutMismatch, match=r"'t/moe'.*'model\.layers\.0\.mlp\.experts\.down_proj' is not in the"):
            engine.forward(IDS, adapters=[None, None, "t/moe"])
        # nothing stayed pinned or half-loaded: the engine goes on serving
        with torch.no_grad():
            out = engine.forward(IDS, adapters=["t/ok", None, "t/ok"]).logits
        assert _close(out[0], want["v1"][0]) and _close(out[1], want["base"][1]) and _close(out[2], want["v1"][2])
        assert all(p.available() == p.slots for p in engine.pools.values())  # no pin left behind


def test_a_base_of_another_name_is_refused(local_target: StoreTarget, dirs: dict[str, Path]) -> None:
    with local_target.open() as store:
        from mint_store.peft.directory import load_peft_dir

        store.publish(TENANT, "other", load_peft_dir(dirs["v1"], base="qwen3-4b"))
    with open_engine(build_model("llama"), local_target, base="tiny-llama") as engine, \
            pytest.raises(LayoutMismatch, match="published for base 'qwen3-4b'"):
        engine.forward(IDS, adapters=["t/other", None, None])


def test_more_distinct_adapters_than_slots_is_a_clear_error(local_target: StoreTarget, dirs: dict[str, Path],
                                                           want: dict[str, torch.Tensor]) -> None:
    publish_dirs(local_target, {"v1": dirs["v1"], "v2": dirs["v2"], "mlp": dirs["mlp"]})
    with open_engine(build_model("llama"), local_target, slots=1) as engine:
        with pytest.raises(OutOfSlots, match=r"needs 2 distinct adapters of layout .* has 1 slots"):
            engine.forward(IDS, adapters=["t/v1", "t/v2", None])
        # other layouts have their own pools: v1 and mlp together fit in one slot each
        with torch.no_grad():
            out = engine.forward(IDS, adapters=["t/v1", "t/mlp", "t/v1"]).logits
        assert _close(out[0], want["v1"][0]) and _close(out[1], want["mlp"][1])
        # a pinned adapter holds its slot: v2 has nowhere to go until it is unpinned
        engine.pin("t/v1")
        with pytest.raises(OutOfSlots, match="pinned"):
            engine.forward(IDS, adapters=["t/v2", None, None])
        engine.unpin("t/v1")
        with torch.no_grad():
            out = engine.forward(IDS, adapters=["t/v2", None, None]).logits
        assert _close(out[0], want["v2"][0])
        with pytest.raises(BatchMismatch, match="2 adapters for a batch of 3"):
            engine.forward(IDS, adapters=["t/v2", None])
        with pytest.raises(AdapterNotFound):
            engine.forward(IDS, adapters=["t/nope", None, None])


def test_device_bytes_bounds_the_pools_of_all_layouts(local_target: StoreTarget, dirs: dict[str, Path],
                                                    want: dict[str, torch.Tensor]) -> None:
    attn, mlp = (loc.length for loc in _publish_rows(local_target, dirs, "v1", "mlp"))  # row bytes of the layouts
    slots = 2
    budget = slots * max(attn, mlp) + slots * min(attn, mlp) - 1  # one pool fits, never both
    with open_engine(build_model("llama"), local_target, slots=slots, device_bytes=budget) as engine, \
            torch.no_grad():
        out = engine.forward(IDS, adapters=["t/v1", None, "t/v1"]).logits
        assert _close(out[0], want["v1"][0]) and _close(out[1], want["base"][1])
        (attn_lid,) = engine.pools
        # mlp's pool does not fit beside attn's: the idle attn pool goes, mlp runs right
        out = engine.forward(IDS, adapters=[None, "t/mlp", None]).logits
        assert _close(out[1], want["mlp"][1]) and _close(out[0], want["base"][0])
        assert attn_lid not in engine.pools and len(engine.pools) == 1
        assert sum(p.nbytes for p in engine.pools.values()) <= budget
        # one batch with both layouts cannot fit: refused, and the engine serves on unchanged
        resident = engine.resident()
        with pytest.raises(DeviceBudgetExceeded, match="in use"):
            engine.forward(IDS, adapters=["t/v1", "t/mlp", None])
        assert engine.resident() == resident
        # a pinned adapter keeps its pool: the other layout has nowhere to go
        engine.pin("t/mlp")
        with pytest.raises(DeviceBudgetExceeded, match="in use"):
            engine.forward(IDS, adapters=["t/v1", None, None])
        assert engine.resident() == resident
        engine.unpin("t/mlp")
        before = engine.metrics.snapshot().tiers
        out = engine.forward(IDS, adapters=["t/v1", None, None]).logits
        assert _close(out[0], want["v1"][0]) and attn_lid in engine.pools and len(engine.pools) == 1
        after = engine.metrics.snapshot().tiers
        # its slots went with the dropped pool: the row came up again from the host cache or storage
        assert after["device"].count == before["device"].count
        assert after["host"].count + after["storage"].count == before["host"].count + before["storage"].count + 1
        assert all(p.available() == p.slots for p in engine.pools.values())  # no pin left behind
    tight = slots * min(attn, mlp) - 1  # neither layout's pool fits
    with open_engine(build_model("llama"), local_target, slots=slots, device_bytes=tight) as small:
        with pytest.raises(DeviceBudgetExceeded, match="raise device_bytes or lower slots"):
            small.forward(IDS, adapters=["t/v1", None, None])
        assert not small.pools


def test_device_bytes_drops_the_least_recently_used_idle_pool_and_plans_new_pools_together(
    local_target: StoreTarget, dirs: dict[str, Path], want: dict[str, torch.Tensor]
) -> None:
    rows = dict(zip(("v1", "mlp", "r2"), _publish_rows(local_target, dirs, "v1", "mlp", "r2"), strict=True))
    total = sum(loc.length for loc in rows.values())
    with open_engine(build_model("llama"), local_target, slots=1, device_bytes=total - 1) as engine, \
            torch.no_grad():  # any two pools fit, never all three
        for name in ("v1", "mlp", "v1", "r2"):  # v1 is used again after mlp: mlp is the oldest
            out = engine.forward(IDS, adapters=[f"t/{name}", None, None]).logits
            assert _close(out[0], want[name][0])
        assert set(engine.pools) == {rows["v1"].layout_id, rows["r2"].layout_id}
        assert engine.resident()[rows["r2"].layout_id] == [rows["r2"].content_id]
    # two new layouts that fit the budget but not beside a pinned pool: refused before the idle
    # pool is dropped (made one at a time, the first would have pushed it out for nothing)
    (rows["mlp2"],) = _publish_rows(local_target, dirs, "mlp2")
    pinned, idle, a, b = (rows[n].length for n in ("r2", "mlp2", "v1", "mlp"))
    budget = pinned + a + b - 1
    assert pinned + idle <= budget and a + b <= budget  # the sizes this case needs
    with open_engine(build_model("llama"), local_target, slots=1, device_bytes=budget) as engine, \
            torch.no_grad():
        engine.pin("t/r2")
        engine.forward(IDS, adapters=["t/mlp2", None, None])
        resident = engine.resident()
        assert len(resident) == 2
        with pytest.raises(DeviceBudgetExceeded, match="in use"):
            engine.forward(IDS, adapters=["t/v1", "t/mlp", None])
        assert engine.resident() == resident
        engine.unpin("t/r2")


def test_a_batch_between_resolve_and_upload_keeps_its_pool_from_other_threads(
    local_target: StoreTarget, dirs: dict[str, Path], want: dict[str, torch.Tensor]
) -> None:
    v1, mlp = _publish_rows(local_target, dirs, "v1", "mlp")
    with open_engine(build_model("llama"), local_target, slots=1, device_bytes=max(v1.length, mlp.length)) as engine:
        fetch, seen = engine.streamer.lease_cached, []  # (the upload's first step, on every path)

        def fetch_and_meanwhile_pin(loc, **kw):  # the batch has its pool but no pinned slot yet
            if not seen:
                try:
                    engine.pin("t/mlp")  # as another thread would; it would need v1's pool dropped
                except DeviceBudgetExceeded as e:
                    seen.append(e)
            return fetch(loc, **kw)

        with pytest.MonkeyPatch.context() as m, torch.no_grad():  # restored even when an assert fails
            m.setattr(engine.streamer, "lease_cached", fetch_and_meanwhile_pin)
            out = engine.forward(IDS, adapters=["t/v1", None, None]).logits
        assert len(seen) == 1 and "in use" in str(seen[0])
        assert _close(out[0], want["v1"][0]) and set(engine.pools) == {v1.layout_id}
        engine.pin("t/mlp")  # the batch is over: v1's pool is idle and goes
        assert engine.resident() == {mlp.layout_id: [mlp.content_id]}
        engine.unpin("t/mlp")


def test_detach_during_a_batch_or_a_host_only_prefetch_leaves_the_accounting_whole(
    local_target: StoreTarget, dirs: dict[str, Path]
) -> None:
    import asyncio

    v1, mlp = _publish_rows(local_target, dirs, "v1", "mlp")
    with open_engine(build_model("llama"), local_target, slots=1, device_bytes=max(v1.length, mlp.length)) as engine:
        engine.forward(IDS, adapters=["t/v1", None, None])
        # warming the host cache needs no slot: no pool is made and none is pushed out
        asyncio.run(engine.prefetch(["t/mlp"], device=False))
        assert engine.resident() == {v1.layout_id: [v1.content_id]} and engine.streamer.cached(mlp.content_id)
        with engine.batch(["t/v1", None, None]):
            engine.detach()  # the batch still gives back its pins and its layout on the way out
        assert not engine.pools


async def test_prefetch_makes_the_next_batch_all_device_hits(local_target: StoreTarget, dirs: dict[str, Path],
                                                            want: dict[str, torch.Tensor]) -> None:
    publish_dirs(local_target, {"v1": dirs["v1"], "v2": dirs["v2"], "mlp": dirs["mlp"]})
    with open_engine(build_model("llama"), local_target, slots=2) as engine:
        locs = await engine.prefetch(["t/v1", "t/v2", "t/mlp"])
        assert len({loc.layout_id for loc in locs}) == 2
        assert sorted(c for cids in engine.resident().values() for c in cids) == sorted(loc.content_id for loc in locs)
        before = engine.metrics.snapshot()
        assert before.tiers["storage"].count == 3
        with torch.no_grad():
            out = engine.forward(IDS, adapters=["t/v2", "t/mlp", "t/v1"]).logits
        after = engine.metrics.snapshot()
        assert after.tiers["device"].count == 3 and after.tiers["storage"].count == 3
        assert _close(out[0], want["v2"][0]) and _close(out[1], want["mlp"][1]) and _close(out[2], want["v1"][2])
        # a host-only prefetch warms the host cache and leaves the slots alone
        engine.streamer.clear()
        await engine.prefetch(["t/v1"], device=False)
        assert engine.streamer.cached(locs[0].content_id)


def test_without_the_feed_a_moved_tag_is_seen_at_the_next_batch(local_target: StoreTarget, dirs: dict[str, Path],
                                                                 want: dict[str, torch.Tensor]) -> None:
    publish_dirs(local_target, {"chat": dirs["v1"]}, tag="prod")
    with open_engine(build_model("llama"), local_target) as engine, torch.no_grad():
        assert _close(engine.forward(IDS, adapters=["t/chat:prod"] * 3).logits[1], want["v1"][1])
        engine.call(engine.client.publish(TENANT, "chat", dirs["v2"], tag="prod"))
        assert _close(engine.forward(IDS, adapters=["t/chat:prod"] * 3).logits[1], want["v2"][1])


def test_hot_swap_through_the_change_feed(local_target: StoreTarget, dirs: dict[str, Path],
                                          want: dict[str, torch.Tensor]) -> None:
    first = publish_dirs(local_target, {"chat": dirs["v1"]}, tag="prod")["chat"]
    with open_engine(build_model("llama"), local_target, follow=True, follow_wait=0.5) as engine, torch.no_grad():
        refs = ["t/chat:prod", None, "t/chat"]
        out = engine.forward(IDS, adapters=refs).logits
        assert _close(out[0], want["v1"][0]) and _close(out[2], want["v1"][2])
        with engine.batch(refs):  # a batch in flight when the tag moves ...
            second = engine.call(engine.client.publish(TENANT, "chat", dirs["v2"], tag="prod"))
            engine.sync_events()
            # ... the new row is already in the host cache, but this batch finishes on the old one
            assert engine.streamer.cached(second.content_id)
            out = engine.model(IDS).logits
            assert _close(out[0], want["v1"][0]) and _close(out[2], want["v1"][2])
        storage_reads = engine.metrics.count("storage")
        out = engine.forward(IDS, adapters=refs).logits  # the next batch runs the new version
        assert _close(out[0], want["v2"][0]) and _close(out[1], want["base"][1]) and _close(out[2], want["v2"][2])
        assert engine.swaps == 2  # ":prod" and latest
        assert engine.metrics.count("storage") == storage_reads  # the swap cost one device copy, no read
        pool = next(iter(engine.pools.values()))
        assert set(pool.resident()) == {first.content_id, second.content_id}
        # rolling the tag back swaps back, again between batches
        engine.call(engine.client.tag(f"{TENANT}/chat@1", "prod"))
        engine.sync_events()
        out = engine.forward(IDS, adapters=refs).logits
        assert _close(out[0], want["v1"][0]) and _close(out[2], want["v2"][2])


def test_detach_restores_the_model(local_target: StoreTarget, dirs: dict[str, Path],
                                   want: dict[str, torch.Tensor]) -> None:
    publish_dirs(local_target, {"v1": dirs["v1"]})
    model = build_model("llama")
    engine = open_engine(model, local_target)
    with torch.no_grad():
        engine.forward(IDS, adapters=["t/v1"] * 3)
    engine.close()
    assert not any(m._forward_hooks for m in model.modules())
    assert torch.equal(logits(model, IDS), want["base"])


def test_importing_the_client_does_not_import_transformers_or_torch() -> None:
    code = (
        "import sys, engine_client\n"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules\n"
        "from engine_client import LoRAEngine, MintClient\n"
        "assert 'transformers' not in sys.modules, 'LoRAEngine must not import transformers'\n"
        "assert LoRAEngine.__module__ == 'engine_client.engine.lora_engine'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


async def test_prefetch_under_device_bytes_never_pushes_out_a_running_batch(
    local_target: StoreTarget, dirs: dict[str, Path], want: dict[str, torch.Tensor]
) -> None:
    v1, mlp = _publish_rows(local_target, dirs, "v1", "mlp")
    with open_engine(build_model("llama"), local_target, slots=1, device_bytes=max(v1.length, mlp.length)) as engine:
        with engine.batch(["t/v1", None, None]), torch.no_grad():
            with pytest.raises(DeviceBudgetExceeded):
                await engine.prefetch(["t/mlp"])
            out = engine.model(input_ids=IDS).logits  # the batch still has its slots
        assert _close(out[0], want["v1"][0])
        assert len(engine.pools) == 1
        await engine.prefetch(["t/mlp"])  # the batch is over: v1's idle pool makes room
        assert engine.resident() == {mlp.layout_id: [mlp.content_id]}
        before = engine.metrics.snapshot().tiers["device"].count
        with torch.no_grad():
            out = engine.forward(IDS, adapters=[None, "t/mlp", None]).logits
        assert _close(out[1], want["mlp"][1]) and engine.metrics.snapshot().tiers["device"].count == before + 1


def test_closing_the_engine_retires_every_pool(local_target: StoreTarget, dirs: dict[str, Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing (or detaching) lets the pools' memory go: uploads still in flight on the side stream
    must land first (retire), as when the budget drops one pool (on CUDA a pending copy landed in
    the next owner of the freed block)."""
    from engine_client.device.device_pool import DevicePool

    publish_dirs(local_target, {"v1": dirs["v1"], "mlp": dirs["mlp"]})
    retired: list[str] = []
    real = DevicePool.retire
    monkeypatch.setattr(DevicePool, "retire", lambda self: (retired.append(self.layout.layout_id), real(self))[1])
    with open_engine(build_model("llama"), local_target) as engine, torch.no_grad():
        engine.forward(IDS, adapters=["t/v1", "t/mlp", None])
        layouts = sorted(engine.pools)
        assert len(layouts) == 2 and not retired
    assert sorted(retired) == layouts
