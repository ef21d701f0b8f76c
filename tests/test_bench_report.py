"""tools/bench_all.py writes a report, plots and comparable JSON from real tool runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_all_quick_catalog_run_writes_report_plots_and_compare(tmp_path: Path) -> None:
    out, report = tmp_path / "b.json", tmp_path / "B.md"
    cmd = [sys.executable, "tools/bench_all.py", "--quick", "--only", "catalog", "--no-profile", "--readme", "",
           "--plots", str(tmp_path / "plots"),
           "--out", str(out), "--report", str(report)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert [p["n"] for p in doc["catalog"]] == [1000, 3000]
    assert all(p["resolve_p50_us"] > 0 and p["read_us"] > 0 and p["raw_read_us"] > 0 for p in doc["catalog"])
    text = report.read_text()
    assert "catalog 1,000: `python tools/bench_store.py --n 1000" in text and "](" in text
    plot = tmp_path / "plots" / "catalog.png"
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rerun = [*cmd[:-4], "--out", str(tmp_path / "c.json"), "--report", str(tmp_path / "C.md"), "--compare", str(out)]
    again = subprocess.run(rerun, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "compared with" in again.stdout


def test_compare_reports_faster_and_slower() -> None:
    from mint_store.bench.benchmarks_md import compare

    def doc(**values: float) -> dict:
        return {"measures": {k: {"title": k, "ours": v, "unit": "us", "higher_is_better": k != "lat"}
                             for k, v in values.items()}}

    lines = compare(doc(lat=8.0, tput=200.0, same=1.0, new=3.0), doc(lat=10.0, tput=250.0, same=1.01, old=2.0))
    assert lines[0].startswith("better") and "lat" in lines[0]  # lower latency is better
    assert lines[1].startswith("worse") and "tput" in lines[1]
    assert lines[2].startswith("same") and lines[3].startswith("new") and lines[4].startswith("gone")
