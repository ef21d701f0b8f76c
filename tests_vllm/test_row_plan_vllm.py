"""The LoRAModel a layout's plan builds (engine_client/vllm_plugin/row_plan.py) is the one vLLM's own
from_lora_tensors builds of the same tensors: names, ranks, alphas, scalings, the tensors
themselves (views of the row). No engine needed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

import torch
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.model_executor.models.utils import WeightsMapper

from engine_client.vllm_plugin.hooks import _check_modules
from engine_client.vllm_plugin.row_plan import RowPlan
from mint_store import make_adapter

EXPECTED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _row(scaling: float = 2.0) -> tuple[RowPlan, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    mods = {}
    for layer in range(2):
        for m, (n_in, n_out) in {"q_proj": (64, 64), "v_proj": (64, 16), "down_proj": (96, 64)}.items():
            part = "mlp" if m == "down_proj" else "self_attn"
            mods[f"model.layers.{layer}.{part}.{m}"] = (torch.randn(8, n_in, generator=gen).to(torch.bfloat16),
                                                        torch.randn(n_out, 8, generator=gen).to(torch.bfloat16),
                                                        scaling)
    layout, row = make_adapter(mods, base="tiny").to_row()
    return RowPlan(layout), torch.from_numpy(row.copy())


@pytest.mark.parametrize("mapper", [None, WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."})])
def test_the_plans_lora_model_is_vllms_own(mapper: WeightsMapper | None) -> None:
    plan, row = _row()
    scalings = plan.scalings(row)
    config = plan.config(row, scalings)
    assert config is not None
    helper = PEFTHelper.from_dict(dict(config))
    args = {"peft_helper": helper, "device": "cpu", "dtype": torch.bfloat16, "weights_mapper": mapper,
            "skip_prefixes": None}

    def check(keys: object) -> None:
        _check_modules(keys, EXPECTED, helper, "row", args)  # type: ignore[arg-type]

    got = plan.model(LoRAModel, row, scalings, lora_model_id=7, expected=EXPECTED, check=check, **args)
    want = LoRAModel.from_lora_tensors(lora_model_id=7, tensors=plan.tensors(row), **args)
    assert (got.id, got.rank, list(got.loras), got.modules_to_save) == (want.id, want.rank, list(want.loras), {})
    assert all(n.startswith("language_model." if mapper else "model.") for n in got.loras)
    for name, w in want.loras.items():
        g = got.loras[name]
        assert (g.module_name, g.rank, g.lora_alpha, g.scaling) == (w.module_name, w.rank, w.lora_alpha, w.scaling)
        assert g.scaling == 2.0
        for a, b in ((g.lora_a, w.lora_a), (g.lora_b, w.lora_b)):
            assert torch.equal(a, b) and a.data_ptr() == b.data_ptr()  # the same views of the row: no copy
    # another load of the layout (vLLM makes a new mapper each time): the module table is reused
    again = WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."}) if mapper else None
    plan.model(LoRAModel, row, scalings, lora_model_id=8, expected=EXPECTED, check=check, **args | {
        "weights_mapper": again})
    assert len(plan._models) == 1


def test_a_module_the_model_cannot_take_is_refused_as_vllm_refuses_it() -> None:
    plan, row = _row()
    scalings = plan.scalings(row)
    helper = PEFTHelper.from_dict(dict(plan.config(row, scalings) or {}))
    expected = EXPECTED - {"down_proj"}
    args = {"peft_helper": helper, "device": "cpu", "dtype": torch.bfloat16, "weights_mapper": None,
            "skip_prefixes": None}
    for _ in range(2):  # a refusal is not remembered as a pass
        with pytest.raises(ValueError, match="expected target modules"):
            plan.model(LoRAModel, row, scalings, lora_model_id=9, expected=expected, **args,
                       check=lambda keys: _check_modules(keys, expected, helper, "row", args))
    assert not plan._models


def test_a_row_the_cache_writer_reads_is_never_written_by_vllm_and_gives_vllms_own_weights() -> None:
    """A row read over the network is written to the local row cache from the buffer vLLM's views
    point into (direct.py): vLLM, which scales B in place, must get B scaled in memory of its own,
    bit for bit what its own ``optimize`` makes, and the row must stay as it was read."""
    plan, row = _row(scaling=0.37)  # (not a power of two: the product rounds)
    before = row.clone()
    scalings = plan.scalings(row)
    helper = PEFTHelper.from_dict(dict(plan.config(row, scalings) or {}))
    args = {"peft_helper": helper, "device": "cpu", "dtype": torch.bfloat16, "weights_mapper": None,
            "skip_prefixes": None}
    taken: list[int] = []

    def fold(n: int) -> torch.Tensor:
        taken.append(n)
        return torch.empty(n, dtype=torch.uint8)

    got = plan.model(LoRAModel, row, scalings, lora_model_id=7, expected=EXPECTED, fold=fold,
                     check=lambda keys: _check_modules(keys, EXPECTED, helper, "row", args), **args)
    want = LoRAModel.from_lora_tensors(lora_model_id=7, tensors=plan.tensors(row.clone()), **args)
    assert taken == [plan.fold_nbytes]  # one buffer for every B
    lo, hi = row.data_ptr(), row.data_ptr() + row.numel()
    for name, w in want.loras.items():
        g = got.loras[name]
        assert g.scaling == 1 and w.scaling == pytest.approx(0.37)
        assert lo <= g.lora_a.data_ptr() < hi  # A: still a view of the row
        assert not lo <= g.lora_b.data_ptr() < hi  # B: its own memory
        w.optimize(), g.optimize()  # what vLLM does next (add_adapter): g's is a no-op
        assert torch.equal(g.lora_a, w.lora_a) and torch.equal(g.lora_b, w.lora_b)
        assert g.lora_b.view(torch.int16).equal(w.lora_b.view(torch.int16))  # bit for bit
    assert torch.equal(row, before)


def test_the_general_way_copies_a_shared_rows_b_and_leaves_a_a_view() -> None:
    from engine_client.vllm_plugin.direct import _Row

    plan, row = _row()
    shared = _Row({}, row, plan, plan.scalings(row), shared=True).tensors
    alone = _Row({}, row, plan, plan.scalings(row)).tensors
    lo, hi = row.data_ptr(), row.data_ptr() + row.numel()
    for key, t in shared.items():
        assert torch.equal(t, alone[key])
        assert (lo <= t.data_ptr() < hi) == (".lora_A." in key), key
        assert lo <= alone[key].data_ptr() < hi
