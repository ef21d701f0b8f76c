#!/usr/bin/env python3
"""Concurrent multi-policy GRPO training vs the same policies one after another (not a test).

N policies (1, 2, 4, 8) on one dense and one MoE base: wall-time ratio (one by one /
concurrent) and peak resident memory of each arrangement, each measured in a fresh
process. Logic: ``tools/bench/train_bench.py``.

    python tools/bench_train.py --quick        # a few minutes on 2 cores
    python tools/bench_train.py                # more steps
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401  (puts the repository root on sys.path: tools.bench imports)

from tools.bench.report import print_table, write_json
from tools.bench.train_bench import TrainBenchConfig, config_dict, run, table_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 timed steps per policy")
    p.add_argument("--bases", default="dense,moe")
    p.add_argument("--policies", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=None, help="timed GRPO steps per policy (default 5; quick 2)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per policy per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (0: torch default)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement, best counts (default 3; "
                   "quick 1)")
    p.add_argument("--out", default="docs/results/train.json")
    a = p.parse_args()
    cfg = TrainBenchConfig(
        bases=tuple(a.bases.split(",")), policies=tuple(int(x) for x in a.policies.split(",")),
        steps=a.steps if a.steps is not None else (2 if a.quick else 5), prompts=a.prompts,
        group_size=a.group_size, new_tokens=a.new_tokens, threads=a.threads,
        repeats=a.repeats if a.repeats is not None else (1 if a.quick else 3),
    )

    def progress(r: dict) -> None:
        print(f"  {r['base']:<5} N={r['policies']} {r['arrangement']:<13} {r['wall_s']:7.2f} s  "
              f"(cpu {r['cpu_s']:7.2f} s)  peak {r['peak_rss_mib']:.0f} MiB", flush=True)

    rows = run(cfg, progress)
    print_table(f"GRPO, {cfg.steps} steps per policy, {cfg.prompts} prompts x {cfg.group_size} completions x "
                f"{cfg.new_tokens} tokens, {cfg.threads or 'default'} thread(s): wall time and ratio one-by-one / "
                "concurrent", table_rows(rows))
    print("paper (MinT, GPU): 1.77x dense, 1.45x MoE, no higher memory peak")
    path = write_json(a.out, "train", {"config": config_dict(cfg), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
