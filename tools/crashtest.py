#!/usr/bin/env python3
"""Kill-safety check (not a unit test): SIGKILL a publisher storm, a compaction loop or a
reindex at random moments, reopen, fsck, and check every acknowledged publish.

    python tools/crashtest.py --mode publish --kills 30

``--mode fleet``: writer + standby + 2 replicas (``mint serve`` processes) on one moto S3
bucket; SIGKILL/SIGSTOP the writer or the standby during a publish storm over HTTP, then
check every acknowledged publish on every surviving process, and fsck the store
(mint_store/testing/fleet.py). ``all`` does not include it.

    python tools/crashtest.py --mode fleet --kills 6
"""

from __future__ import annotations

import argparse
import json
import tempfile

from mint_store.testing.crashtest import MODES, run
from mint_store.testing.fleet import run_fleet


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=(*MODES, "fleet", "all"), default="all")
    p.add_argument("--kills", type=int, default=20, help="kills per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=300.0, help="time bound per mode")
    p.add_argument("--store", help="directory to use (default: a new temp dir per mode; fleet: its work dir)")
    p.add_argument("--lease-ttl", type=float, default=2.0, help="fleet: the writer lease TTL (s)")
    p.add_argument("--lease-renew", type=float, default=0.3, help="fleet: the lease renew interval (s)")
    p.add_argument("--out", help="write the JSON report here")
    a = p.parse_args()
    reports = []
    if a.mode == "fleet":
        fr = run_fleet(a.store, kills=a.kills, seed=a.seed, max_seconds=a.max_seconds, ttl_s=a.lease_ttl,
                       renew_s=a.lease_renew)
        reports.append(fr.to_dict())
        print(f"fleet    events={fr.kills} (SIGKILL {fr.sigkills}, SIGSTOP {fr.sigstops}) takeovers={fr.takeovers} "
              f"fenced={fr.fenced_relaunched} acknowledged={fr.acknowledged} processes_checked={fr.processes_checked} "
              f"orphans_removed={fr.orphans_removed} problems={len(fr.problems)} ({fr.seconds:.0f} s)")
        for line in fr.events + fr.problems[:20]:
            print(f"  {line}")
    for mode in MODES if a.mode == "all" else () if a.mode == "fleet" else (a.mode,):
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
