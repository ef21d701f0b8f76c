#!/usr/bin/env python3
"""Run every benchmark in tools/ at sizes that fit this machine and write BENCHMARKS.md,
docs/results/benchmarks.json and PNG plots (docs/results/plots/).

    python tools/bench_all.py            # the full run (the 10^6 catalog included; ~20-30 min)
    python tools/bench_all.py --quick    # a smoke run (a few minutes)
    python tools/bench_all.py --compare docs/results/benchmarks.json --quick --out /tmp/new.json
    python tools/bench_all.py --render docs/results/benchmarks.json   # report and plots again, no runs
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import _repo  # noqa: F401  (puts the repository root on sys.path: tools.bench imports)

from tools.bench.benchmarks_md import compare, load, update_readme, write_report
from tools.bench.suite import ROOT, add_profiles, remeasure, run_suite


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--only",
                   help="comma-separated: store,store-1m,http,batch,mixed,moe_pack,swap,train,replicas,vllm,"
                   "s3read,catalog")
    p.add_argument("--out", default="docs/results/benchmarks.json")
    p.add_argument("--report", default="BENCHMARKS.md")
    p.add_argument("--plots", default="docs/results/plots", help="directory for the PNG plots")
    p.add_argument("--compare", help="an older results JSON: print what got faster or slower")
    p.add_argument("--no-profile", action="store_true", help="skip profiling benchmarks that miss a target")
    p.add_argument("--readme", default="README.md", help="whose headline table to regenerate ('' for none)")
    p.add_argument("--reuse", action="append", default=[], metavar="NAME=JSON",
                   help="take NAME's figures from a JSON its tool wrote earlier, or from an earlier results file "
                   "of this program (marked 'reused' in the report)")
    p.add_argument("--render", metavar="JSON", help="run nothing: rewrite the report, plots and README headline "
                   "from a results JSON an earlier run wrote")
    a = p.parse_args()
    if a.render:
        return render(a)
    reused = {k: Path(v) for k, v in (item.split("=", 1) for item in a.reuse)}
    old = load(a.compare) if a.compare else None  # read now: --out may be the same file
    suite = run_suite(quick=a.quick, only=set(a.only.split(",")) if a.only else None, reused=reused)
    if not a.no_profile:
        add_profiles(suite, quick=a.quick)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = suite.to_dict()
    out.write_text(json.dumps(doc, indent=1))
    write_outputs(doc, a, out)
    for m in doc["measures"].values():
        flag = {True: "met", False: "NOT MET", None: ""}[m["met"]]
        ratio = f" ({m['ratio']:.2f}x)" if m["ratio"] is not None else ""
        print(f"  {m['title']}: {m['ours']:.4g} {m['unit']}{ratio} {flag}")
    for miss in doc["missing"]:
        print(f"  not run: {miss.splitlines()[0]}")
    if old is not None:
        print("\ncompared with", a.compare)
        for line in compare(doc, old):
            print(" ", line)
    return 0


def write_outputs(doc: dict, a: argparse.Namespace, results: Path) -> None:
    report = Path(a.report)
    write_report(doc, report, ROOT / a.plots, json_name=os.path.relpath(results, report.parent))
    if a.readme and update_readme(doc, Path(a.readme), os.path.relpath(report, Path(a.readme).parent)):
        print(f"updated the headline table in {a.readme}")
    print(f"wrote {report} from {results}")


def render(a: argparse.Namespace) -> int:
    results = Path(a.render)
    doc = remeasure(load(results))  # targets and verdicts as the measure functions now say
    results.write_text(json.dumps(doc, indent=1))
    write_outputs(doc, a, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
