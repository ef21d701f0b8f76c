"""A layout's plan (engine_client/vllm_plugin/row_plan.py): the same tensors and config as the
general way (an Adapter rebuilt from the row, PEFT names), as views of the row, worked out once.

vLLM's half (the LoRAModel it builds against vLLM's own from_lora_tensors) runs in vLLM's
environment: tests_vllm/test_offline.py."""

from __future__ import annotations

import torch

from engine_client.vllm_plugin.resolver import for_vllm
from engine_client.vllm_plugin.row_plan import RowPlan
from mint_store import make_adapter
from mint_store.format.adapter import Adapter
from mint_store.peft.directory import peft_state_dict, synthesize_config


def _adapter(scalings: list[float], dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Adapter:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (64, 64), "k_proj": (64, 16), "down_proj": (96, 64)}
    mods = {}
    for i, (m, (n_in, n_out)) in enumerate(shapes.items()):
        r = 4 + 4 * i  # mixed ranks: one config says them all
        mods[f"model.layers.0.self_attn.{m}"] = (torch.randn(r, n_in, generator=gen).to(dtype),
                                                 torch.randn(n_out, r, generator=gen).to(dtype), scalings[i])
    return make_adapter(mods, base="tiny")


def _row(adapter: Adapter) -> tuple[RowPlan, torch.Tensor]:
    layout, row = adapter.to_row()
    return RowPlan(layout), torch.from_numpy(row.copy())


def test_a_plan_gives_the_general_ways_tensors_as_views_of_the_row() -> None:
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        adapter = _adapter([2.0, 2.0, 2.0], dtype)
        plan, row = _row(adapter)
        want = {k: v.clone() for k, v in peft_state_dict(for_vllm(Adapter.from_row(plan.layout, row))).items()}
        got = plan.tensors(row)
        assert list(got) == list(want) == list(plan.keys)
        lo, hi = row.data_ptr(), row.data_ptr() + row.numel()
        for k, t in got.items():
            assert t.dtype == want[k].dtype and t.shape == want[k].shape and torch.equal(t, want[k])
            assert t.is_contiguous() and lo <= t.data_ptr() < hi  # a view of the row, no copy
        row[plan.layout.tensors[0].offset] ^= 0xFF  # the view sees the row's bytes
        assert not torch.equal(plan.tensors(row)[plan.keys[0]], want[plan.keys[0]])


def test_configs_are_the_general_ways_and_mixed_scalings_get_none() -> None:
    plan, row = _row(_adapter([2.0, 2.0, 2.0]))
    s = plan.scalings(row)
    assert s == (2.0, 2.0, 2.0)
    assert plan.config(row, s) == synthesize_config(Adapter.from_row(plan.layout, row))
    assert plan.config(row, s) is plan.config(row, s)  # worked out once
    other = _adapter([0.5, 0.5, 0.5], seed=1)  # the same layout, another scaling: its own config
    row2 = torch.from_numpy(other.to_row()[1].copy())
    assert other.layout.layout_id == plan.layout.layout_id
    c2 = plan.config(row2, plan.scalings(row2))
    assert c2 == synthesize_config(other) and c2 != plan.config(row, s)
    # modules that scale differently: vLLM takes one scaling, for_vllm folds them (copies): no plan
    mixed = _adapter([2.0, 1.0, 0.5], seed=2)
    row3 = torch.from_numpy(mixed.to_row()[1].copy())
    assert plan.config(row3, plan.scalings(row3)) is None


def test_fused_experts_are_not_planned() -> None:
    gen = torch.Generator().manual_seed(0)
    moe = make_adapter({"model.layers.0.mlp.experts.gate_up_proj": (
        torch.randn(4, 2, 32, generator=gen), torch.randn(4, 64, 2, generator=gen), 1.0)}, base="tiny")
    assert not RowPlan(moe.layout).dense
    assert RowPlan(_adapter([1.0, 1.0, 1.0]).layout).dense


def test_a_row_that_starts_inside_a_larger_buffer_gives_its_own_bytes() -> None:
    adapter = _adapter([2.0, 2.0, 2.0])
    plan, row = _row(adapter)
    big = torch.zeros(row.numel() + 192, dtype=torch.uint8)
    big[128 : 128 + row.numel()] = row
    inner = big[128 : 128 + row.numel()]  # a slice: its storage starts 128 bytes earlier
    want, got = plan.tensors(row), plan.tensors(inner)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(big.data_ptr() + 128 <= t.data_ptr() < big.data_ptr() + 128 + row.numel() for t in got.values())
