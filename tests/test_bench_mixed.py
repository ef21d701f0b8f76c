"""bench_batch --part peer past the N where PEFT runs, and its rows as bench_all's measures (issue 15)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.mixed_measures import mixed_measures

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_peer_bench_skips_peft_above_its_max_n_with_an_estimate_and_feeds_the_suite(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, "tools/bench_batch.py", "--part", "peer", "--peer-counts", "2,4", "--peer-max-n", "2",
           "--peer-shapes", "prefill,decode", "--peer-families", "dense", "--peer-hidden", "64", "--peer-layers", "1",
           "--peer-intermediate", "96",
           "--peer-tokens", "8", "--vocab", "64", "--repeat", "1", "--threads", "1", "--device", "cpu",
           # a budget never reached: the round count is the cap, twice that in decode
           "--peer-budget", "1000", "--peer-max-rounds", "2",
           "--out", str(out)]  # with --part peer, --out names the peer results (as bench_all passes it)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())["results"]
    rows = {(r["n"], r["shape"]): r for r in res["rows"]}
    assert set(rows) == {(n, s) for n in (2, 4) for s in ("prefill", "decode")}
    for (_, shape), row in rows.items():
        assert row["rounds"] == (4 if shape == "decode" else 2)
        check_paired_fields(row, layers=1)
    for shape in ("prefill", "decode"):
        measured, skipped = rows[2, shape], rows[4, shape]
        assert measured["peft_overhead_s"] is not None and measured["max_logit_diff"] < 1e-4
        assert skipped["peft_overhead_s"] is None and skipped["peft_s"] is None and skipped["max_logit_diff"] is None
        # PEFT's loop is linear in N: twice the adapters, twice the overhead of N=2
        assert skipped["peft_estimate_s"] == measured["peft_overhead_s"] * 2
    assert done.stdout.count("PEFT skipped (would take ~") == 4  # each row live, then in the table
    keys = {m.key for m in mixed_measures(res, "cmd")}
    assert keys == {f"mixed.{s}.n{n}.{m}" for n in (2, 4) for s in ("prefill", "decode")
                    for m in ("vs_floor", "lora_ops_vs_floor")} | {
        f"mixed.{s}.n2.vs_peft" for s in ("prefill", "decode")}


@pytest.mark.slow
def test_peer_bench_runs_moe_bases_with_lora_on_the_experts_checked_against_peft(tmp_path: Path) -> None:
    """MoE rows: PEFT has no mixed batch on expert parameters, so none is timed (and none claimed);
    the engine's logits equal PEFT's with each checked sequence's adapter alone."""
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, "tools/bench_batch.py", "--part", "peer", "--peer-counts", "3", "--peer-shapes", "prefill",
           "--peer-families", "moe", "--peer-hidden", "64", "--peer-layers", "1", "--peer-moe-intermediate", "32",
           "--peer-experts", "4", "--peer-tokens", "8", "--vocab", "64", "--repeat", "2", "--threads", "1",
           "--peer-budget", "0", "--device", "cpu", "--out", str(out)]  # no budget: --repeat rounds exactly
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())["results"]
    [row] = res["rows"]
    assert (row["family"], row["n"], row["shape"]) == ("moe", 3, "prefill")
    assert row["max_logit_diff"] < 1e-4 and row["peft_overhead_s"] is None and "ParamWrapper" in row["peft_skipped"]
    assert row["rounds"] == 2
    check_paired_fields(row, layers=1)
    # the floor's bytes: q, v, o, and the routed share of the 4 experts x (gate_up 64->64 + down 32->64)
    assert 0.5 <= row["routed_fraction"] <= 1  # 8 tokens top-2 of 4: at least 2 experts per sequence
    per_seq = 3 * (64 + 64) + row["routed_fraction"] * 4 * ((64 + 64) + (32 + 64))
    assert row["adapter_bytes"] == int(3 * 8 * per_seq * 4)
    assert {m.key for m in mixed_measures(res, "cmd")} == {"mixed.moe.prefill.n3.vs_floor",
                                                            "mixed.moe.prefill.n3.lora_ops_vs_floor"}


@pytest.mark.slow
def test_peer_update_re_measures_the_rows_asked_for_in_place_and_refuses_other_settings(tmp_path: Path) -> None:
    """--peer-update FILE: the rows run replace FILE's rows of the same (family, shape, N), each naming
    its run; FILE's other rows stay as they were; a run on another model is refused before it starts."""
    out = tmp_path / "mixed.json"
    tiny = ["--part", "peer", "--peer-shapes", "prefill", "--peer-families", "dense", "--peer-hidden", "64",
            "--peer-layers", "1", "--peer-intermediate", "96", "--peer-tokens", "8", "--vocab", "64", "--threads", "1",
            "--device", "cpu", "--peer-budget", "0"]

    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "tools/bench_batch.py", *tiny, *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)

    done = bench("--peer-counts", "2,4", "--repeat", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    before = json.loads(out.read_text())
    assert "out" not in before["results"]["config"]  # where a run wrote its file is not one of its settings
    done = bench("--peer-counts", "4,3", "--repeat", "3", "--peer-update", str(out))
    assert done.returncode == 0, done.stderr
    after = json.loads(out.read_text())
    assert {k: v for k, v in after.items() if k != "results"} == {k: v for k, v in before.items() if k != "results"}
    old, new = before["results"]["rows"], after["results"]["rows"]
    assert [r["n"] for r in new] == [2, 4, 3]  # N=4 in its place, N=3 (not in the file) after
    assert new[0] == old[0] and "run" not in new[0]
    for row in new[1:]:
        assert row["rounds"] == 3 and len(row["rounds_s"]["base"]) == 3
        assert "--peer-update" in row["run"]["command"] and row["run"]["budget_s"] == 0
        check_paired_fields(row, layers=1)
    measures = {m.key: m for m in mixed_measures(after["results"], "cmd")}
    assert measures["mixed.prefill.n4.vs_floor"].rerun.startswith("`python tools/bench_batch.py --part peer")
    assert measures["mixed.prefill.n4.vs_floor"].sizes == measures["mixed.prefill.n2.vs_floor"].sizes
    assert measures["mixed.prefill.n2.vs_floor"].rerun == ""
    from tools.bench.benchmarks_md import write_report
    from tools.bench.suite import SuiteResult, machine, reuse

    suite = SuiteResult("full", machine())
    reuse(suite, "mixed", out)  # as bench_all --reuse mixed=FILE takes it
    report = write_report(suite.to_dict(), tmp_path / "B.md", tmp_path / "plots", json_name="b.json").read_text()
    [line] = [ln for ln in report.splitlines() if "re-measured alone" in ln]
    assert "--peer-update" in line and "prefill, 4 sequences each with its own adapter" in line
    assert "prefill, 3 sequences" in line and "prefill, 2 sequences" not in line
    # a later bench_all reuses these figures from this one's results file, saying when they were made
    results = tmp_path / "benchmarks.json"
    results.write_text(json.dumps(suite.to_dict()))
    again = SuiteResult("full", machine())
    reuse(again, "mixed", results)
    assert [m.key for m in again.measures] == [m.key for m in suite.measures]
    assert [m.ours for m in again.measures] == [m.ours for m in suite.measures]
    written, ran = json.loads(out.read_text())["time"], json.loads(out.read_text())["command"]
    assert ran.startswith("python tools/bench_batch.py --part peer ")  # the file says what produced it
    label = f"{ran} (reused: {results}, its 'mixed' run, written {written})"
    assert again.reused["mixed"] == label
    text = out.read_text()
    refused = bench("--peer-counts", "4", "--repeat", "2", "--peer-update", str(out), "--peer-layers", "2")
    assert refused.returncode == 2 and "layers 1 there, 2 here" in refused.stderr
    assert out.read_text() == text and "LoRA overhead" not in refused.stdout  # refused before running


def test_merge_keeps_the_file_whole_and_names_each_setting_that_differs() -> None:
    from tools.bench.mixed_update import SAME_SETTINGS, check_settings, merge

    config = dict.fromkeys(SAME_SETTINGS, 1) | {"budget_s": 2.0, "max_rounds": 15}
    doc = {"benchmark": "mixed", "time": "t0",
           "results": {"config": config, "torch_threads": 1, "machine": {"bandwidth_Bps": 1.0},
                       "rows": [{"family": "dense", "shape": "prefill", "n": 256, "rounds": 6},
                                {"family": "moe", "shape": "prefill", "n": 256, "rounds": 6}]}}
    new = {"config": config | {"budget_s": 120.0, "max_rounds": 40}, "torch_threads": 1, "machine": {"m": 2},
           "rows": [{"family": "dense", "shape": "prefill", "n": 256, "rounds": 34}]}
    merged = merge(doc, new, command="python tools/bench_batch.py x", written="t1")
    assert [r["rounds"] for r in doc["results"]["rows"]] == [6, 6]  # the input is not changed
    dense, moe = merged["results"]["rows"]
    assert dense["rounds"] == 34 and moe == doc["results"]["rows"][1]
    assert dense["run"] == {"command": "python tools/bench_batch.py x", "time": "t1", "budget_s": 120.0,
                            "max_rounds": 40, "machine": {"m": 2}}
    assert merged["results"]["machine"] == {"bandwidth_Bps": 1.0} and merged["time"] == "t0"
    with pytest.raises(ValueError, match=r"rank 1 there, 16 here; threads 1 there, 2 here"):
        check_settings(doc, config | {"rank": 16, "threads": 2})
    with pytest.raises(ValueError, match="torch ran 2 threads here, 1 there"):
        merge(doc, new | {"torch_threads": 2}, command="c")
    from tools.bench.mixed_update import check_threads

    check_threads(doc, 1)
    with pytest.raises(ValueError, match=r"torch would run 2 threads here, 1 there \(pass --threads 1\)"):
        check_threads(doc, 2)


def check_paired_fields(r: dict, *, layers: int) -> None:
    """A row's figures are what its raw rounds say: medians of within-round differences inside their
    spread, the verdict from those quartiles, and LoRA ops found in every wrapped layer."""
    times = r["rounds_s"]
    assert set(times) == {"base", "engine"} | ({"peft"} if r["peft_overhead_s"] is not None else set())
    assert all(len(t) == r["rounds"] for t in times.values())
    assert r["base_s"] == statistics.median(times["base"]) and r["engine_s"] == statistics.median(times["engine"])
    assert r["base_range_s"] == [min(times["base"]), max(times["base"])] and r["base_spread_s"] >= 0
    for v in times.keys() - {"base"}:
        diffs = [a - b for a, b in zip(times[v], times["base"], strict=True)]
        med, (q1, q3), (lo, hi) = r[f"{v}_overhead_s"], r[f"{v}_overhead_iqr_s"], r[f"{v}_overhead_range_s"]
        assert med == statistics.median(diffs) and (lo, hi) == (min(diffs), max(diffs))
        assert lo <= q1 <= med <= q3 <= hi
        assert r[f"{v}_resolved"] == (q1 > 0 and med > r["base_spread_s"])
        assert r[f"{v}_noise_bound_s"] == max(q3, r["base_spread_s"])
    assert r["engine_over_floor"] == r["engine_overhead_s"] / r["floor_s"]
    lo, hi = r["lora_ops_range_s"]
    assert 0 < r["lora_ops_s"] <= lo <= hi  # each op's best of the runs: at most the best run's sum
    assert r["lora_ops_over_floor"] == r["lora_ops_s"] / r["floor_s"] and r["lora_ops_op_by_op"] is True
    assert r["lora_kernel_calls"] >= 3 * layers and r["lora_runs"] >= 2  # q, v, o at least, in every layer


def test_the_moe_floor_counts_only_the_experts_the_router_sends_each_sequence_to() -> None:
    """One token per sequence routed to top-2 of 4 experts hits exactly half the (sequence, expert)
    pairs; a prompt of many tokens hits at least that many, and at most all."""
    import torch

    from tools.bench.mixed_bench import MixedBenchConfig, inputs
    from tools.bench.mixed_moe import _routed, build_moe_base

    cfg = MixedBenchConfig(hidden=64, layers=2, vocab=64, moe_intermediate=32, experts=4, top_k=2, tokens=8,
                           device="cpu")
    base = build_moe_base(cfg)
    with torch.inference_mode():
        assert _routed(base, inputs(cfg, 5, "prefill"), 5, decode=True) == 2 / 4
        prompt = _routed(base, inputs(cfg, 5, "prefill"), 5, decode=False)
    assert 2 / 4 < prompt <= 1


def test_the_unfused_bound_adds_each_modules_input_read_and_output_read_and_rewritten() -> None:
    """Dense by hand: per token and layer, q, v, o read 512 and move 2 x 512; down reads 1408 and moves
    2 x 512. MoE: an expert module's activations count once per routed expert (top_k)."""
    import torch

    from tools.bench.mixed_bench import MixedBenchConfig, floor_s
    from tools.bench.mixed_moe import moe_floor

    machine = {"bandwidth_Bps": 1e9, "matmul_flops": 1e12}
    cfg = MixedBenchConfig(hidden=512, intermediate=1408, layers=6, tokens=32, device="cpu")
    row = floor_s(cfg, 4, 32, machine)
    want = 4 * 32 * 6 * (3 * (512 + 2 * 512) + (1408 + 2 * 512)) * 4
    assert row["activation_bytes"] == want
    assert row["unfused_floor_s"] == pytest.approx((row["adapter_bytes"] + want) / 1e9)  # bytes-bound here
    assert row["unfused_floor_s"] > row["floor_s"]
    moe_cfg = MixedBenchConfig(hidden=64, moe_intermediate=32, experts=4, top_k=2, rank=2, device="cpu")
    factors = {"q": (torch.zeros(2, 64), torch.zeros(64, 2), 1.0),  # [r, in], [out, r]
               "experts.down_proj": (torch.zeros(4, 2, 32), torch.zeros(4, 64, 2), 1.0)}  # [E, r, in], [E, out, r]
    moe = moe_floor(moe_cfg, factors, 3, 5, machine)
    assert moe["activation_bytes"] == 3 * 5 * 4 * ((64 + 2 * 64) + 2 * (32 + 2 * 64))


def test_where_the_time_goes_explains_a_missed_floor_by_the_activations_traffic() -> None:
    from tools.bench.breakdown import mixed_lines

    def row(**kw: object) -> dict[str, object]:
        return {"family": "dense", "shape": "prefill", "n": 256, "engine_resolved": True, "engine_over_floor": 8.0,
                "engine_overhead_s": 0.24, "floor_s": 0.03, "lora_ops_s": 0.18, "unfused_floor_s": 0.17,
                "activation_bytes": 1_300_000_000, "adapter_bytes": 245_000_000} | kw

    def lines(*rows: dict[str, object]) -> list[str]:
        return mixed_lines({"machine": {"bandwidth_Bps": 9.5e9}, "rows": list(rows)})

    first, decode = lines(row(), row(n=8), row(engine_resolved=False), row(engine_over_floor=2.5),
                          row(shape="decode", unfused_floor_s=0.04, activation_bytes=1_000_000))
    # (N < 64, unresolved and met rows say nothing)
    assert "dense prefill, N = 256" in first and "1,300 MB of activations" in first
    assert "136.8 ms at the measured 9.5 GB/s" in first and "170.0 ms (5.7x the floor)" in first
    assert "the overhead is 1.41x of it" in first and "fused into the base GEMM" in first and "below" not in first
    assert "does not explain the gap: the LoRA ops take 180.0 ms of the overhead, and 60.0 ms is outside them" in decode
    assert "fused" not in decode
    [dense_below] = lines(row(engine_overhead_s=0.15))
    [moe_below] = lines(row(engine_overhead_s=0.15, family="moe"))
    assert "below the bound: the activations moved faster" in dense_below and "expert" not in dense_below
    assert "below the bound: the engine's expert matmuls" in moe_below
