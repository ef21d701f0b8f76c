"""tools/bench_replicas.py at a tiny size: every part runs, and the suite turns its JSON into measures.

No figure is judged here (no timing asserts): the test shows the tool's three parts run against
real servers and stores, and that bench_all knows the benchmark and parses every key it writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench.failover_bench import MODES
from tools.bench.suite import benches, run_tool

TINY = ["--replicas", "1", "--publishes", "4", "--sizes", "300", "--batch", "100", "--tail", "3",
        "--failover-trials", "1", "--failover-backend", "local", "--lease-ttl", "1", "--lease-renew", "0.2"]


@pytest.mark.slow
def test_bench_replicas_tiny_run_parses_into_the_suites_measures(tmp_path: Path) -> None:
    bench = next(b for b in benches(True) if b.name == "replicas")
    assert bench.tool == "bench_replicas.py" and "--failover-trials" in bench.full
    run = run_tool("replicas", bench.tool, TINY, tmp_path, timeout=600)
    r = run.results
    assert [row["replicas"] for row in r["lag"]] == [1]
    cold = r["cold_start"][0]
    assert cold["adapters"] == 300 and cold["commits"] == 3 + 3  # 3 batches of 100, then the tail
    assert cold["cold_full_log_objects"] == cold["commits"] > cold["cold_ckpt_log_objects"]
    assert [row["mode"] for row in r["failover"]] == list(MODES)
    for row in r["failover"]:
        assert len(row["seconds"]) == 1 and row["max_s"] == row["seconds"][0] > 0
        assert row["max_over_ttl"] == round(row["max_s"] / row["lease_ttl_s"], 3)
    measures = {m.key: m for m in bench.measures(r, run.command_text)}
    assert set(measures) == {"replicas.lag_p99_ms.r1", "replicas.cold_start_s.n300",
                             "replicas.failover_s.sigkill_same_host", "replicas.failover_s.sigstop_silent_holder"}
    honest = measures["replicas.failover_s.sigstop_silent_holder"]
    stopped = next(row for row in r["failover"] if row["mode"] == "sigstop_silent_holder")
    assert honest.target.startswith("<= 2x TTL (2 s)") and honest.met is (stopped["max_s"] <= 2.0)
    assert measures["replicas.failover_s.sigkill_same_host"].met is None  # the flattering case claims nothing
    assert measures["replicas.lag_p99_ms.r1"].met is (r["lag"][0]["lag_p99_ms"] <= 1000)
    assert measures["replicas.cold_start_s.n300"].baseline == cold["cold_full_s"]
