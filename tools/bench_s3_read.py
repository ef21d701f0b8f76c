#!/usr/bin/env python3
"""S3 read benchmark (not a test): a large row as parallel ranged GETs vs one GET, and vs the
raw bandwidth the same s3fs client gets from the same server (moto on 127.0.0.1).

    python tools/bench_s3_read.py                 # a 64 MiB row, 9 rounds
    python tools/bench_s3_read.py --quick         # a 16 MiB row, 3 rounds (the suite's run)

See tools/bench/s3_read_bench.py for what each mode measures.
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401  (puts the repository root on sys.path: tools.bench imports)

from tools.bench.s3_read_bench import S3ReadConfig, report, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row-mib", type=int, help="row size in MiB (default 64; --quick: 16)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 9; --quick: 3)")
    p.add_argument("--quick", action="store_true", help="a smaller row and fewer rounds")
    p.add_argument("--server", choices=("process", "thread"), default="process",
                   help="moto in its own process (default) or a thread of this one")
    p.add_argument("--out", default="docs/results/s3_read.json")
    a = p.parse_args()
    cfg = S3ReadConfig(row_mib=a.row_mib or (16 if a.quick else 64), rounds=a.rounds or (3 if a.quick else 9),
                       server=a.server, out=a.out)
    report(run(cfg))


if __name__ == "__main__":
    main()
