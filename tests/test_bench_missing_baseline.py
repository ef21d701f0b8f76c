"""tools/bench_all.py where an optional baseline (nginx) is not installed: it is reported as
missing and every other figure of the run is still measured and written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the http piece alone: three Python processes and ~5 s of load
def test_bench_all_http_without_nginx_reports_it_missing_and_runs_the_rest(tmp_path: Path) -> None:
    out, report = tmp_path / "b.json", tmp_path / "B.md"
    cmd = [sys.executable, "tools/bench_all.py", "--quick", "--only", "http", "--no-profile", "--readme", "",
           "--plots", str(tmp_path / "plots"), "--out", str(out), "--report", str(report)]
    # an nginx that does not exist, whatever this machine has installed
    env = os.environ | {"MINT_BENCH_NGINX": str(tmp_path / "no-nginx" / "nginx")}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["missing"] == ["http: the nginx baseline (missing: nginx not installed)"]
    m = doc["measures"]["http.fetch_req_per_s"]
    assert m["ours"] > 0 and m["baseline"] is None and m["baseline_label"] == "missing: nginx not installed"
    assert m["met"] is None  # no baseline, no verdict on the ratio target
    results = doc["runs"]["http"]["results"]
    assert results["missing"] == {"nginx": "nginx not installed"} and "nginx" not in results
    assert results["fetch"]["requests"] > 0 and results["mixed"]["fetch"]["requests"] > 0  # the rest ran
    text = report.read_text()
    assert "| missing: nginx not installed |" in text
    assert "not run: http: the nginx baseline (missing: nginx not installed)" in text
    assert "not run: http: the nginx baseline (missing: nginx not installed)" in done.stdout
