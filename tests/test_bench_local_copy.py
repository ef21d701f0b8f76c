"""tools/bench_local_copy.py at a small size: the service runs in its own process, every way of
reading the row ran (each read checked against the content id by its reader), and the suite
turns its JSON into measures. No figure is judged here (no timing asserts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.bench.suite import benches, run_tool


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux's")
def test_bench_local_copy_small_run_parses_into_the_suites_measures(tmp_path: Path) -> None:
    bench = next(b for b in benches(True) if b.name == "local-copy")
    assert bench.tool == "bench_local_copy.py"
    run = run_tool("local-copy", bench.tool, ["--ranks", "16", "--reads", "2"], tmp_path, timeout=600)
    r = run.results
    got = r["ranks"]["16"]
    assert r["reads"] == 2 and got["row_bytes"] == 9306560  # (bench_vllm.py's r16 row)
    for way in ("socket_kept", "socket_file", "http", "limit"):
        assert got[f"{way}_ms"] > 0
    assert got["socket_kept_vs_limit"] == got["socket_kept_ms"] / got["limit_ms"]
    measures = {m.key: m for m in bench.measures(r, run.command_text)}
    assert set(measures) == {"local_copy.r16.vs_limit", "local_copy.r16.vs_http"}
    assert measures["local_copy.r16.vs_http"].ratio == got["socket_kept_ms"] / got["http_ms"]
    assert not measures["local_copy.r16.vs_limit"].higher_is_better
