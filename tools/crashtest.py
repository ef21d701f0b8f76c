#!/usr/bin/env python3
"""Kill-safety check (not a unit test): SIGKILL a publisher storm, a compaction loop or a
reindex at random moments, reopen, fsck, and check every acknowledged publish.

    python tools/crashtest.py --mode publish --kills 30
"""

from __future__ import annotations

import argparse
import json
import tempfile

from mint_store.testing.crashtest import MODES, run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=(*MODES, "all"), default="all")
    p.add_argument("--kills", type=int, default=20, help="kills per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=300.0, help="time bound per mode")
    p.add_argument("--store", help="directory to use (default: a new temp dir per mode)")
    p.add_argument("--out", help="write the JSON report here")
    a = p.parse_args()
    reports = []
    for mode in MODES if a.mode == "all" else (a.mode,):
        store = a.store or tempfile.mkdtemp(prefix=f"mint-crash-{mode}-")
        r = run(mode, store, kills=a.kills, seed=a.seed, max_seconds=a.max_seconds)
        reports.append(r.to_dict())
        print(f"{mode:8} kills={r.kills} acknowledged={r.acknowledged} orphans_removed={r.orphans_removed} "
              f"problems={len(r.problems)} ({r.seconds:.0f} s)")
        for problem in r.problems[:20]:
            print(f"  {problem}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(reports, f, indent=2)
    return 1 if any(r["problems"] for r in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
