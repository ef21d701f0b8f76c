#!/usr/bin/env python3
"""Store benchmark (not a test): bulk publish, resolve latency, row reads vs os.pread, overhead.

    python tools/bench_store.py --n 100000
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401  (puts the repository root on sys.path: tools.bench imports)

from tools.bench.store_bench import StoreBenchConfig, report, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000, help="adapters to publish (default 100,000)")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--root", help="work directory (default: a temp dir, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the store")
    p.add_argument("--read-ranks", default="16,64", help="extra ranks for the read comparison ('' for none)")
    p.add_argument("--out", default="docs/results/store.json")
    a = p.parse_args()
    cfg = StoreBenchConfig(n=a.n, rank=a.rank, hidden=a.hidden, layers=a.layers, root=a.root, keep=a.keep,
                           out=a.out, read_ranks=tuple(int(x) for x in a.read_ranks.split(",") if x))
    report(run(cfg))


if __name__ == "__main__":
    main()
