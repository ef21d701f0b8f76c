#!/usr/bin/env python3
"""Read-replica benchmark (not a test): replication lag and replica cold start.

    python tools/bench_replicas.py --part lag --replicas 1,3 --publishes 200
    python tools/bench_replicas.py --part cold --sizes 100000,1000000
    python tools/bench_replicas.py --part failover --failover-trials 5 --lease-ttl 10 --lease-renew 3

lag: a writer and R read-only replicas (each its own index directory and follower thread,
default poll interval) on one bucket of moto's S3 server on 127.0.0.1, in this process.
Each publish is timed from its acknowledgement to the moment each replica's index holds
its seq; publishes are spaced by a random 0-250 ms so they land at random points of the
poll cycle. p50/p99 over every (publish, replica) pair.

cold: the time a replica with no local index takes to come up, from the newest checkpoint
plus a log tail, against replaying the whole log. The store's log is synthesised cheaply:
publish events in the writer's own format (``CommitLog.write``, batches of ``--batch``
adapters per commit) naming rows that were never written -- a replica's cold start reads
only the log and the checkpoints, never the packs. The checkpoint is written by the
writer's own ``write_checkpoint`` from the folded index. ``--tail`` commits follow it.
Local directory by default; ``--s3`` runs it on moto too.
failover: a writer ``mint serve`` and a standby ``mint serve --standby`` subprocess on one
store; the writer is SIGKILLed (same host: the lease sees its pid gone, no TTL wait -- a
flattering figure) or SIGSTOPped (alive but silent: what a standby on another machine sees,
so it waits out the TTL -- the honest cross-machine figure); the time from the signal to the
first write the standby accepts. See tools/bench/failover_bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench.failover_bench import MODES, bench_failover
from tools.bench.replica_adapters import moto_bucket, s3_options
from tools.bench.replica_adapters import tiny_adapter as _tiny_adapter
from tools.bench.report import write_json


def _moto() -> tuple[Any, dict[str, Any], str]:
    server, endpoint, url = moto_bucket()
    return server, s3_options(endpoint), url


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def bench_lag(replica_counts: list[int], publishes: int, interval: float | None) -> list[dict[str, Any]]:
    from mint_store.store import Store

    logging_off()
    server, opts, url = _moto()
    root = tempfile.mkdtemp(prefix="mint-bench-lag-")
    out = []
    try:
        writer = Store.open(url, index_dir=f"{root}/w", storage_options=opts)
        writer.publish("bench", "warm", _tiny_adapter(0))
        extra = {} if interval is None else {"follow_interval_s": interval}
        for count in replica_counts:
            replicas = [Store.open(url, index_dir=f"{root}/r{count}-{i}", storage_options=opts, readonly=True, **extra)
                        for i in range(count)]
            lags: list[float] = []
            rng = random.Random(count)
            for k in range(publishes):
                time.sleep(rng.uniform(0, 0.25))
                seq = writer.publish("bench", f"a{count}-{k}", _tiny_adapter(k + 1)).seq
                acked = time.perf_counter()
                pending = set(range(count))
                while pending:
                    for i in list(pending):
                        if replicas[i].last_seq >= seq:
                            lags.append(time.perf_counter() - acked)
                            pending.discard(i)
                    time.sleep(0.0005)
            poll = replicas[0].config.follow_interval_s
            for r in replicas:
                r.close()
            row = {"replicas": count, "publishes": publishes, "poll_interval_s": poll,
                   "lag_p50_ms": round(_pct(lags, 0.5) * 1e3, 1), "lag_p99_ms": round(_pct(lags, 0.99) * 1e3, 1),
                   "lag_max_ms": round(max(lags) * 1e3, 1), "lag_mean_ms": round(statistics.mean(lags) * 1e3, 1)}
            print(json.dumps(row), flush=True)
            out.append(row)
        writer.close()
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def synth_store(storage: Any, n: int, batch: int, tail: int, index_dir: str) -> dict[str, Any]:
    """``n`` adapters in publish events of ``batch`` (log objects only), a checkpoint, then
    ``tail`` more commits of one adapter each. Returns seqs and timings."""
    from mint_store.fleet.replica import ensure_store_id
    from mint_store.index.checkpoint import write_checkpoint
    from mint_store.index.commit_log import CommitLog, apply_event
    from mint_store.index.lmdb_index import Index, index_db_path

    store_id = ensure_store_id(storage)
    layout, _ = _tiny_adapter(0).to_row()
    log = CommitLog(storage)
    seq = 0
    index = Index.acquire(index_db_path(index_dir))
    started = time.perf_counter()

    def commit(first: int, count: int) -> None:
        nonlocal seq
        seq += 1
        rows, versions = [], []
        for j in range(first, first + count):
            cid = f"{j:032x}"
            rows.append([cid, j, j % 4096 * layout.row_nbytes])
            versions.append([f"t{j % 100}", f"adapter-{j}", 1, cid, "prod", False, None])
        shard = f"packs/{layout.layout_id}/rows/c/{first // 4096}/0"
        event = {"seq": seq, "kind": "publish", "time": time.time(), "epoch": 1,
                 "layouts": [{"layout_id": layout.layout_id, "layout": layout.to_dict(), "rows_per_shard": 4096,
                              "chunk_cols": layout.row_nbytes}] if seq == 1 else [],
                 "rows": [{"layout_id": layout.layout_id, "length": layout.row_nbytes,
                           "shards": [{"key": shard, "rows": rows}]}],
                 "versions": versions}
        log.write(event)
        with index.write() as w:
            apply_event(w, event)

    for first in range(0, n, batch):
        commit(first, min(batch, n - first))
    made = time.perf_counter() - started
    started = time.perf_counter()
    covered = write_checkpoint(storage, index, store_id=store_id)
    ckpt_s = time.perf_counter() - started
    for k in range(tail):
        commit(n + k, 1)
    index.release()
    ckpt_bytes = sum(storage.size(k) for k in storage.list("checkpoints/"))
    return {"commits": seq, "checkpoint_seq": covered, "synth_s": round(made, 1),
            "checkpoint_write_s": round(ckpt_s, 2), "checkpoint_bytes": ckpt_bytes}


def bench_cold(sizes: list[int], batch: int, tail: int, s3: bool) -> list[dict[str, Any]]:
    from mint_store.storage import open_storage
    from mint_store.store import Store

    logging_off()
    out = []
    for n in sizes:
        root = tempfile.mkdtemp(prefix="mint-bench-cold-")
        server = None
        try:
            if s3:
                server, opts, url = _moto()
            else:
                opts, url = None, f"{root}/store"
            storage = open_storage(url, storage_options=opts)
            info = synth_store(storage, n, batch, tail, f"{root}/writer-index")
            row: dict[str, Any] = {"adapters": n, "backend": "s3 (moto)" if s3 else "local", "batch": batch,
                                   "tail_commits": tail, **info}
            for mode in ("checkpoint+tail", "full log replay"):
                if mode == "full log replay":  # the same store without its checkpoints
                    for k in storage.list("checkpoints/"):
                        storage.delete(k)
                started = time.perf_counter()
                r = Store.open(url, index_dir=f"{root}/{mode[:4]}", storage_options=opts, readonly=True,
                               follow_interval_s=0)
                took = time.perf_counter() - started
                stats = r.replica_stats
                assert r.last_seq == info["commits"], (r.last_seq, info)
                r.close()
                key = "cold_ckpt" if mode.startswith("check") else "cold_full"
                row[f"{key}_s"] = round(took, 2)
                row[f"{key}_log_objects"] = stats.log_objects_read
            print(json.dumps(row), flush=True)
            out.append(row)
        finally:
            if server is not None:
                server.stop()
            shutil.rmtree(root, ignore_errors=True)
    return out


def logging_off() -> None:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("lag", "cold", "failover", "all"), default="all")
    p.add_argument("--replicas", default="1,3")
    p.add_argument("--publishes", type=int, default=200)
    p.add_argument("--interval", type=float, default=None, help="follow interval (default: the store's)")
    p.add_argument("--sizes", default="100000,1000000", help="adapters for the cold start")
    p.add_argument("--batch", type=int, default=1000, help="adapters per synthesised commit")
    p.add_argument("--tail", type=int, default=100, help="commits after the checkpoint")
    p.add_argument("--s3", action="store_true", help="cold start on moto instead of a local directory")
    p.add_argument("--failover-trials", type=int, default=5, help="failovers per mode")
    p.add_argument("--failover-modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--failover-backend", choices=("s3", "local"), default="s3",
                   help="the failover's store: a moto bucket (default) or a local directory")
    p.add_argument("--lease-ttl", type=float, default=10.0, help="the servers' lease TTL for the failover (10)")
    p.add_argument("--lease-renew", type=float, default=3.0, help="the servers' lease renew interval (3)")
    p.add_argument("--out", help="write the rows as JSON here (the benchmarks' format: under 'results')")
    a = p.parse_args()
    result: dict[str, Any] = {}
    if a.part in ("lag", "all"):
        result["lag"] = bench_lag([int(x) for x in a.replicas.split(",")], a.publishes, a.interval)
    if a.part in ("cold", "all"):
        result["cold_start"] = bench_cold([int(x) for x in a.sizes.split(",")], a.batch, a.tail, a.s3)
    if a.part in ("failover", "all"):
        modes = [m for m in a.failover_modes.split(",") if m]
        if unknown := set(modes) - set(MODES):
            p.error(f"unknown failover mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
        result["failover"] = bench_failover(backend=a.failover_backend, modes=modes, trials=a.failover_trials,
                                            ttl=a.lease_ttl, renew=a.lease_renew)
    if a.out:
        write_json(a.out, "replicas", result)


if __name__ == "__main__":
    main()
