"""bench_batch --part peer past the N where PEFT runs, and its rows as bench_all's measures (issue 15)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.suite import _mixed_measures

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_peer_bench_skips_peft_above_its_max_n_with_an_estimate_and_feeds_the_suite(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, "tools/bench_batch.py", "--part", "peer", "--peer-counts", "2,4", "--peer-max-n", "2",
           "--peer-shapes", "prefill,decode", "--peer-families", "dense", "--peer-hidden", "64", "--peer-layers", "1",
           "--peer-intermediate", "96",
           "--peer-tokens", "8", "--vocab", "64", "--repeat", "1", "--threads", "1", "--device", "cpu",
           "--out", str(out)]  # with --part peer, --out names the peer results (as bench_all passes it)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())["results"]
    rows = {(r["n"], r["shape"]): r for r in res["rows"]}
    assert set(rows) == {(n, s) for n in (2, 4) for s in ("prefill", "decode")}
    for shape in ("prefill", "decode"):
        measured, skipped = rows[2, shape], rows[4, shape]
        assert measured["peft_overhead_s"] is not None and measured["max_logit_diff"] < 1e-4
        assert skipped["peft_overhead_s"] is None and skipped["peft_s"] is None and skipped["max_logit_diff"] is None
        # PEFT's loop is linear in N: twice the adapters, twice the overhead of N=2
        assert skipped["peft_estimate_s"] == measured["peft_overhead_s"] * 2
    assert done.stdout.count("PEFT skipped (would take ~") == 4  # each row live, then in the table
    keys = {m.key for m in _mixed_measures(res, "cmd")}
    assert keys == {f"mixed.{s}.n{n}.vs_floor" for n in (2, 4) for s in ("prefill", "decode")} | {
        f"mixed.{s}.n2.vs_peft" for s in ("prefill", "decode")}


@pytest.mark.slow
def test_peer_bench_runs_moe_bases_with_lora_on_the_experts_checked_against_peft(tmp_path: Path) -> None:
    """MoE rows: PEFT has no mixed batch on expert parameters, so none is timed (and none claimed);
    the engine's logits equal PEFT's with each checked sequence's adapter alone."""
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, "tools/bench_batch.py", "--part", "peer", "--peer-counts", "3", "--peer-shapes", "prefill",
           "--peer-families", "moe", "--peer-hidden", "64", "--peer-layers", "1", "--peer-moe-intermediate", "32",
           "--peer-experts", "4", "--peer-tokens", "8", "--vocab", "64", "--repeat", "1", "--threads", "1",
           "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())["results"]
    [row] = res["rows"]
    assert (row["family"], row["n"], row["shape"]) == ("moe", 3, "prefill")
    assert row["max_logit_diff"] < 1e-4 and row["peft_overhead_s"] is None and "ParamWrapper" in row["peft_skipped"]
    # the floor counts every expert's factors as bytes: 4 experts x (gate_up 64->64 + down 32->64) + q, v, o
    assert row["adapter_bytes"] == 3 * 8 * (4 * ((64 + 64) + (32 + 64)) + 3 * (64 + 64)) * 4
    assert {m.key for m in _mixed_measures(res, "cmd")} == {"mixed.moe.prefill.n3.vs_floor"}
