"""tools/bench_s3_read.py at a small size: it runs against moto's server in its own process,
reads the row in parallel parts, and the suite turns its JSON into measures.

No figure is judged here (no timing asserts): only that every mode ran on the same bytes and
that bench_all knows the benchmark and parses every key it writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench.s3_read_bench import MODES
from tools.bench.suite import benches, run_tool


@pytest.mark.slow
@pytest.mark.s3
def test_bench_s3_read_small_run_parses_into_the_suites_measures(tmp_path: Path) -> None:
    bench = next(b for b in benches(True) if b.name == "s3read")
    assert bench.tool == "bench_s3_read.py" and bench.quick == ["--quick"]
    run = run_tool("s3read", bench.tool, ["--row-mib", "17", "--rounds", "2"], tmp_path, timeout=600)
    r = run.results
    assert r["server"] == "process"  # moto in its own process, not sharing the client's GIL
    assert r["row_nbytes"] > 17 * 2**20 and r["gets_per_parallel_read"] == 3  # over 2 parts of 8 MiB: 3 GETs
    for m in MODES:
        assert len(r[m]["seconds"]) == 2 and r[m]["best_s"] <= r[m]["median_s"]
    assert r["ratio"]["parallel_vs_one_get"]["best"] == r["one_get"]["best_s"] / r["parallel"]["best_s"]
    measures = {m.key: m for m in bench.measures(r, run.command_text)}
    assert set(measures) == {"s3read.parallel_vs_one_get.17mib", "s3read.parallel_vs_raw.17mib"}
    vs_raw = measures["s3read.parallel_vs_raw.17mib"]
    assert vs_raw.ratio == r["ratio"]["parallel_vs_raw"]["median"] and vs_raw.met is (vs_raw.ratio >= 0.9)
    assert measures["s3read.parallel_vs_one_get.17mib"].target == ">= 1.0x"
