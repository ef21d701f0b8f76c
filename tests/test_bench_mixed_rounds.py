"""The mixed bench's paired rounds, its LoRA-ops profile and the suite's verdicts on them (issue 15).

The overhead of a variant is the median of within-round differences to the base; the suite
gives a ratio only to a resolved one and calls the rest "within noise (< X ms)"."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine_client.engine import lora_layers
from engine_client.kernels import ops as kernels
from tools.bench import mixed_rounds
from tools.bench.mixed_measures import mixed_measures
from tools.bench.mixed_rounds import kernel_ranges, lora_time, overhead_fields, ratios, time_rounds, timing_fields


def test_rounds_run_every_variant_back_to_back_in_an_order_that_rotates() -> None:
    calls: list[str] = []
    variants = {k: (lambda k=k, **kw: calls.append(k)) for k in ("base", "engine", "peft")}
    times = time_rounds(variants, {}, decode=False, repeat=3, max_rounds=15, budget_s=0.0, device="cpu")
    assert calls == ["base", "engine", "peft", "engine", "peft", "base", "peft", "base", "engine"]
    assert {k: len(v) for k, v in times.items()} == {"base": 3, "engine": 3, "peft": 3}
    # a budget never reached: rounds up to the cap (twice it in decode), never under --repeat
    calls.clear()
    time_rounds(variants, {}, decode=False, repeat=1, max_rounds=4, budget_s=1e9, device="cpu")
    assert len(calls) == 3 * 4
    assert mixed_rounds.round_limits(20, 15, decode=False) == (20, 20)
    assert mixed_rounds.round_limits(3, 15, decode=True) == (3, 30)


def test_overhead_is_the_median_of_paired_differences_not_a_difference_of_bests() -> None:
    # the base drifts from 100 to 140 ms over the run; the engine is always 10 ms above it in its round
    base = [0.100, 0.120, 0.140, 0.110, 0.130]
    times = {"base": base, "engine": [b + 0.010 for b in base]}
    row = timing_fields(times)
    assert row["engine_overhead_s"] == pytest.approx(0.010)
    assert row["engine_overhead_range_s"] == pytest.approx([0.010, 0.010])
    assert row["base_s"] == pytest.approx(0.120) and row["base_spread_s"] == pytest.approx(0.020)
    # 10 ms is under the base's own 20 ms spread: not resolved, however steady the differences
    assert row["engine_resolved"] is False and row["engine_noise_bound_s"] == pytest.approx(0.020)
    steady = timing_fields({"base": [0.100] * 5, "engine": [0.110, 0.111, 0.109, 0.110, 0.112]})
    assert steady["engine_resolved"] is True and steady["engine_overhead_s"] == pytest.approx(0.010)


def test_differences_that_straddle_zero_are_within_noise_bounded_by_their_upper_quartile() -> None:
    f = overhead_fields({"base": [0.5] * 5, "engine": [0.45, 0.48, 0.51, 0.53, 0.56]}, "engine")
    assert f["engine_overhead_s"] == pytest.approx(0.01)
    assert f["engine_overhead_iqr_s"] == pytest.approx([-0.02, 0.03])
    assert f["engine_resolved"] is False and f["engine_noise_bound_s"] == pytest.approx(0.03)


def test_peft_over_engine_is_a_ratio_of_resolved_overheads_else_a_lower_bound() -> None:
    row = {"engine_overhead_s": 0.004, "engine_resolved": False, "engine_noise_bound_s": 0.02,
           "peft_overhead_s": 0.2, "peft_resolved": True, "floor_s": 0.01, "lora_ops_s": 0.005}
    got = ratios(row)
    assert got["peft_over_engine"] is None and got["peft_over_engine_at_least"] == pytest.approx(10)
    assert got["lora_ops_over_floor"] == pytest.approx(0.5)
    got = ratios(row | {"engine_resolved": True})
    assert got["peft_over_engine"] == pytest.approx(50) and got["peft_over_engine_at_least"] is None


def _linear_lora_args() -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    a, b = torch.randn(5, 8, 64, generator=g), torch.randn(5, 96, 8, generator=g)
    return x, w, None, a, b, torch.ones(5), torch.tensor([1, 2, 3, 4])


def test_lora_ops_are_the_kernel_ops_less_the_base_matmul_fused_into_linear_lora() -> None:
    args = _linear_lora_args()
    original = kernels.linear_lora
    experts = lora_layers.add_expert_lora
    with kernel_ranges():
        assert lora_layers.linear_lora is not original  # the engine's binding is wrapped
        assert lora_layers.add_expert_lora is not experts  # and the experts' LoRA kernel's
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = lora_layers.linear_lora(*args)
    assert lora_layers.linear_lora is original and kernels.linear_lora is original  # unwrapped again after
    assert lora_layers.add_expert_lora is experts
    torch.testing.assert_close(got, kernels.linear_lora(*args))  # the wrapper changes no number
    events = prof.events()
    found, host, calls = lora_time(events, "cpu")
    ops = sum(t for _, t in found)
    assert calls == 1 and host > 0 and not {"aten::addmm_", "aten::linear", "aten::mm"} & {name for name, _ in found}

    def under_range(e: Any) -> bool:
        while e.cpu_parent is not None:
            e = e.cpu_parent
            if e.name == "mint.lora.linear_lora":
                return True
        return False

    inside = [e for e in events if under_range(e) and not e.name.startswith("mint.lora.")]
    # the base matmul: F.linear before the C kernels, the GEMM accumulating into the delta with the torch ops
    x, w, _, a, b, scaling, _ = args
    c_kernels = kernels.fast_kernels(x, x, w, a, b, scaling) is not None  # as linear_lora asks
    base = [e for e in inside if e.name == ("aten::linear" if c_kernels else "aten::addmm_")]
    lora = "mint::cpu_shrink_expand" if c_kernels else "aten::bmm"
    assert len(base) == 1 and any(e.name == lora for e in inside)
    # everything under the range but the base's addmm_ (which has no timed children of its own)
    want = sum(e.self_cpu_time_total for e in inside if e not in base and not _below(e, base[0])) / 1e6
    assert ops == pytest.approx(want) and ops > 0


def _below(e: Any, top: Any) -> bool:
    while e.cpu_parent is not None:
        e = e.cpu_parent
        if e is top:
            return True
    return False


def _row(**kw: Any) -> dict[str, Any]:
    row = {"family": "dense", "n": 256, "shape": "prefill", "floor_s": 0.010, "bound_by": "compute",
           "engine_overhead_s": 0.004, "engine_resolved": False, "engine_noise_bound_s": 0.025,
           "engine_over_floor": 0.4, "peft_overhead_s": 0.5, "peft_resolved": True, "peft_over_engine": None,
           "peft_over_engine_at_least": 20.0, "lora_ops_s": 0.012, "lora_ops_over_floor": 1.2}
    return row | kw


def _measures(*rows: dict[str, Any]) -> dict[str, Any]:
    res = {"config": {"hidden": 64, "layers": 1, "rank": 8, "tokens": 8, "experts": 4}, "torch_threads": 1,
           "rows": list(rows)}
    return {m.key: m for m in mixed_measures(res, "cmd")}


def test_suite_reports_an_unresolved_overhead_as_within_noise_with_a_verdict_only_from_its_bound() -> None:
    m = _measures(_row())
    floor = m["mixed.prefill.n256.vs_floor"]
    assert "within noise (< 25 ms)" in floor.title and floor.ratio is None and floor.ours == pytest.approx(25)
    assert floor.met is True  # its upper bound, 25 ms, is under 3x the 10 ms floor
    peft = m["mixed.prefill.n256.vs_peft"]
    assert peft.ratio is None and "PEFT/engine >= 20.00x" in peft.title and peft.met is True  # target >= 5x
    ops = m["mixed.prefill.n256.lora_ops_vs_floor"]
    assert ops.ours == pytest.approx(12) and ops.ratio == pytest.approx(1.2) and ops.met is None
    loose = _measures(_row(engine_noise_bound_s=0.2, peft_over_engine_at_least=2.5))
    assert loose["mixed.prefill.n256.vs_floor"].met is None  # 200 ms bound: neither met nor missed
    assert loose["mixed.prefill.n256.vs_peft"].met is None


def test_the_medians_interval_comes_from_order_statistics_with_binomial_coverage() -> None:
    median_interval = mixed_rounds.median_interval
    assert median_interval([0.1, 0.2, 0.3, 0.4, 0.5]) is None  # [min, max] of 5 covers 93.75% < 95%
    six = [6.0, 1.0, 5.0, 2.0, 4.0, 3.0]
    assert median_interval(six) == [1.0, 6.0]  # 6 values: [min, max], 96.9%
    assert median_interval(six, level=0.5) == [2.0, 5.0]  # the 2nd smallest and largest cover 78% of 6
    # 15 values: k = 4 (1 - 2 P(B <= 3) = 96.5%; k = 5 would cover 88.2%): the 4th smallest, 4th largest
    assert median_interval([float(i) for i in range(15)]) == [3.0, 11.0]
    # 30 values: k = 10 (95.7%), an interval that narrows with rounds where the quartiles would not
    assert median_interval([float(i) for i in range(30)]) == [9.0, 20.0]
    row = timing_fields({"base": [1.0] * 6, "engine": [1.0 + d for d in six]})
    assert row["engine_overhead_ci95_s"] == pytest.approx([1.0, 6.0])
    # a results row written before the intervals gets them from its stored rounds, and its ratios with them
    old = {k: v for k, v in _row().items() if "ci95" not in k} | {
        "rounds_s": {"base": [1.0] * 6, "engine": [1.0 + d / 1000 for d in six], "peft": [1.5] * 6}}
    got = mixed_rounds.with_intervals(old)
    assert got["engine_overhead_ci95_s"] == pytest.approx([0.001, 0.006]) and got["peft_overhead_ci95_s"] == [0.5, 0.5]
    assert got["peft_over_engine_at_least"] == pytest.approx(0.5 / 0.006)
    assert mixed_rounds.with_intervals(_row()) == _row()  # no rounds stored: as it is


def test_a_within_noise_overhead_is_decided_by_its_medians_interval_where_it_lies_on_one_side() -> None:
    # within noise (bound 200 ms) but the interval is wholly under 3x the 10 ms floor: met
    m = _measures(_row(engine_noise_bound_s=0.2, engine_overhead_ci95_s=[0.001, 0.025],
                       peft_overhead_ci95_s=[0.4, 0.6]))
    floor = m["mixed.prefill.n256.vs_floor"]
    assert floor.met is True and "95% interval [1, 25] ms" in floor.title and floor.ratio is None
    above = _measures(_row(engine_noise_bound_s=0.2, engine_overhead_ci95_s=[0.031, 0.09]))
    assert above["mixed.prefill.n256.vs_floor"].met is False  # wholly above 30 ms
    across = _measures(_row(engine_overhead_ci95_s=[0.01, 0.05]))
    assert across["mixed.prefill.n256.vs_floor"].met is None  # across the target: no verdict, bound or not
    # PEFT/engine's lower bound: PEFT's interval low over the engine's interval high
    got = ratios(_row(engine_overhead_ci95_s=[0.001, 0.025], peft_overhead_ci95_s=[0.4, 0.6]))
    assert got["peft_over_engine_at_least"] == pytest.approx(16)
    assert ratios(_row(engine_overhead_ci95_s=[-0.01, 0.0], peft_overhead_ci95_s=[0.4, 0.6]))[
        "peft_over_engine_at_least"] is None  # an interval reaching 0: no ratio bounds it
    assert ratios(_row())["peft_over_engine_at_least"] == pytest.approx(20)  # no intervals: PEFT over the bound


def test_suite_gives_a_resolved_overhead_its_ratios() -> None:
    m = _measures(_row(engine_overhead_s=0.05, engine_resolved=True, engine_over_floor=5.0, peft_over_engine=10.0,
                       peft_over_engine_at_least=None))
    floor, peft = m["mixed.prefill.n256.vs_floor"], m["mixed.prefill.n256.vs_peft"]
    assert "noise" not in floor.title and floor.ratio == 5.0 and floor.met is False and floor.ours == pytest.approx(50)
    assert peft.ratio == 10.0 and peft.met is True


def test_the_c_kernels_count_as_lora_ops_inside_the_grouped_range() -> None:
    """The experts' grouped path calls GroupedKernels.add_grouped directly: it gets a range, and
    the ctypes calls inside (no aten op of their own) count through their mint::cpu_* marks."""
    from engine_client.kernels import cpu as cpu_kernels
    from engine_client.kernels.groups import GroupedKernels, Groups

    try:
        cpu_kernels.compiler()
    except cpu_kernels.BuildError:
        pytest.skip("no C compiler: the CPU kernels are not built (apt-get install -y gcc)")
    gk = cpu_kernels.kernels()
    assert gk is not None
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 48, generator=g)
    a, b, sc = torch.randn(3, 4, 32, generator=g), torch.randn(3, 48, 4, generator=g), torch.ones(3)
    groups = Groups(torch.tensor([0, 2]), 32, rows=torch.tensor([0, 32]))
    original = GroupedKernels.add_grouped
    with kernel_ranges():
        assert GroupedKernels.add_grouped is not original
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            gk.add_grouped(y, x, a, b, sc, groups)
    assert GroupedKernels.add_grouped is original
    found, _, calls = lora_time(prof.events(), "cpu")
    names = [name for name, _ in found]
    assert calls == 1 and "mint::cpu_shrink_expand" in names  # SHRINK and EXPAND in one C call
    assert sum(t for _, t in found) > 0


def test_rounds_are_timed_in_thread_cpu_time_on_one_cpu_thread_else_wall_clock() -> None:
    """One torch thread: this thread's CPU clock (what the variant computed, not the time other
    processes held the core); more threads, or CUDA: the wall clock."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert mixed_rounds.clock("cpu") == ("thread CPU time", time.thread_time)
        assert mixed_rounds.clock("cuda") == ("wall clock", time.perf_counter)
        torch.set_num_threads(2)
        assert mixed_rounds.clock("cpu") == ("wall clock", time.perf_counter)
    finally:
        torch.set_num_threads(before)


def test_an_overhead_below_the_lora_ops_alone_is_judged_on_the_ops() -> None:
    """In an MoE batch the engine runs its own expert kernels, faster than the base model's: the
    overhead (engine minus base) then hides LoRA cost, and met the floor target while the LoRA
    ops alone missed it. Where the ops cost more than the overhead, they are what is judged."""
    moe = dict(family="moe", engine_resolved=True, engine_overhead_s=0.0974, engine_over_floor=1.66,
               floor_s=0.0585, lora_ops_s=0.2283, lora_ops_over_floor=3.9, peft_overhead_s=None)
    floor = _measures(_row(**moe))["mixed.moe.prefill.n256.vs_floor"]
    assert floor.met is False and "judged on the ops" in floor.title and "3.90x the floor" in floor.title
    within = _measures(_row(**(moe | {"lora_ops_s": 0.15})))["mixed.moe.prefill.n256.vs_floor"]  # 2.56x: met
    assert within.met is True and "judged on the ops" not in within.title
