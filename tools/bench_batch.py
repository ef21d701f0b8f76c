#!/usr/bin/env python3
"""Multi-adapter batching benchmark (not a test).

0. (``--part peer``) Mixed batches of N = 1..1,000 sequences, each with its own adapter,
   against the base alone and PEFT's mixed batch (``adapter_names=``) on the same inputs,
   in prefill, ragged prefill and decode; the LoRA overhead of each (the median of paired,
   interleaved rounds, with its spread) and the LoRA ops' own time (a profiled forward) beside
   a roofline floor measured on this machine in the same run (``tools/bench/mixed_bench.py``).
1. One batch whose sequences use 1, 8, 64 and 1,000 distinct adapters, against running the
   same sequences one adapter at a time (one forward per adapter, same engine, adapters
   already in device slots for both).
2. A sweep of switches drawn (Zipf) from a large catalog through a small slot pool: the
   latency of preparing a one-adapter batch (resolve, host/storage fetch, one device copy),
   by the tier that served it.

Logic: ``tools/bench/batch_bench.py``.

    python tools/bench_batch.py                      # all parts, defaults below
    python tools/bench_batch.py --part peer --peer-counts 1,8,64,256,1000 --peer-max-n 256
    python tools/bench_batch.py --switches 10000 --catalog 2000 --seqs 256   # quicker
    # re-measure the noisiest rows with more rounds, in place (tools/bench/mixed_update.py)
    python tools/bench_batch.py --part peer --peer-counts 256 --peer-shapes prefill,ragged \
        --peer-families dense --threads 1 --peer-budget 120 --peer-max-rounds 40 --peer-update docs/results/mixed.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import _repo  # noqa: F401  (puts the repository root on sys.path: tools.bench imports)
import torch

from tools.bench import mixed_bench, mixed_run, mixed_update
from tools.bench.batch_bench import BatchBenchConfig, report, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seqs", type=int, default=1000, help="sequences in the batch")
    p.add_argument("--seq", type=int, default=4, help="tokens per sequence")
    p.add_argument("--distinct", default="1,8,64,1000")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per variant (--part peer: rounds at least)")
    p.add_argument("--catalog", type=int, default=10_000)
    p.add_argument("--switches", type=int, default=100_000)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--host-rows", type=int, default=1024, help="host cache size, in rows")
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default 0: torch's default, "
                   "every core; 1: the work saved alone)")
    p.add_argument("--out", default=None, help="results of the self part (default docs/results/batch.json); with "
                   "--part peer, of the peer part unless --peer-out is given")
    p.add_argument("--part", choices=("all", "peer", "self"), default="all",
                   help="peer: against the base and PEFT; self: batched vs one at a time and the switch sweep")
    p.add_argument("--peer-counts", default="1,8,64,256,1000", help="sequences (= distinct adapters) per batch")
    p.add_argument("--peer-shapes", default="prefill,ragged,decode")
    p.add_argument("--peer-tokens", type=int, default=32, help="tokens per sequence (the KV cache length in decode)")
    p.add_argument("--peer-hidden", type=int, default=512)
    p.add_argument("--peer-layers", type=int, default=6)
    p.add_argument("--peer-intermediate", type=int, default=1408)
    p.add_argument("--peer-max-n", type=int, default=256, help="run PEFT only up to this N (above: an estimate "
                   "from the largest N measured, its loop being linear in N)")
    p.add_argument("--peer-families", default="dense,moe", help="dense (Llama) and/or moe (Qwen3-MoE, LoRA on the "
                   "experts too)")
    p.add_argument("--peer-experts", type=int, default=8)
    p.add_argument("--peer-moe-intermediate", type=int, default=256)
    p.add_argument("--peer-budget", type=float, default=2.0, help="more paired rounds until every variant has run "
                   "this many seconds per N and shape (at least --repeat rounds, at most --peer-max-rounds)")
    p.add_argument("--peer-max-rounds", type=int, default=15, help="paired rounds at most (decode: twice)")
    p.add_argument("--peer-out", default=None, help="results of the peer part (default docs/results/mixed.json)")
    p.add_argument("--peer-update", metavar="FILE", help="put the rows measured in place of FILE's rows of the same "
                   "family, shape and N, keeping its others (its settings must match this run's); the run's own "
                   "results are written only where --peer-out names")
    a = p.parse_args()
    # the peer part's file: --peer-out; with --out, that file (--part peer) or one beside it
    # (--part all: never the repository's docs/results/mixed.json behind the caller's back)
    if a.peer_out:
        peer_out = a.peer_out
    elif a.out:
        peer_out = a.out if a.part == "peer" else str(Path(a.out).with_suffix("")) + ".mixed.json"
    else:
        peer_out = "docs/results/mixed.json"
    if a.peer_update:
        peer_out = a.peer_out
    a.out = a.out or "docs/results/batch.json"
    if a.part in ("all", "peer"):
        try:
            peer = mixed_bench.MixedBenchConfig(
                hidden=a.peer_hidden, layers=a.peer_layers, intermediate=a.peer_intermediate, vocab=a.vocab,
                rank=a.rank, tokens=a.peer_tokens, counts=tuple(int(x) for x in a.peer_counts.split(",")),
                shapes=tuple(a.peer_shapes.split(",")), repeat=a.repeat, budget_s=a.peer_budget,
                max_rounds=a.peer_max_rounds, peft_max_n=a.peer_max_n,
                families=tuple(a.peer_families.split(",")), experts=a.peer_experts,
                moe_intermediate=a.peer_moe_intermediate, threads=a.threads,
                device=a.device, out=peer_out)
            update = mixed_update.load(a.peer_update) if a.peer_update else None
            if update is not None:  # refused before an hour of runs, not after
                mixed_update.check_settings(update, mixed_bench.settings(peer))
                mixed_update.check_threads(update, a.threads or torch.get_num_threads())
        except ValueError as e:
            p.error(str(e))
        results = mixed_run.run(peer)
        mixed_bench.report(results)
        if peer.out:
            print(f"\nwrote {peer.out}")
        if update is not None:
            command = shlex.join(["python", "tools/bench_batch.py", *sys.argv[1:]])
            mixed_update.write(a.peer_update, mixed_update.merge(update, results, command=command))
            print(f"\nput {len(results['rows'])} rows into {a.peer_update}")
        if a.part == "peer":
            return
    try:
        cfg = BatchBenchConfig(
            hidden=a.hidden, layers=a.layers, vocab=a.vocab, rank=a.rank, seqs=a.seqs, seq=a.seq,
            distinct=tuple(int(x) for x in a.distinct.split(",")), repeat=a.repeat, catalog=a.catalog,
            switches=a.switches, slots=a.slots, host_rows=a.host_rows, zipf=a.zipf, device=a.device,
            threads=a.threads, out=a.out,
        )
    except ValueError as e:  # a bad flag: usage and exit 2, as argparse does for its own checks
        p.error(str(e))
    report(run(cfg))
    print(f"\nwrote {cfg.out}")


if __name__ == "__main__":
    main()
