#!/usr/bin/env python3
"""The vLLM worker's row buffers on cold loads while earlier rows are still held (not a test).

    python tools/bench_row_buffers.py --sizes 9306560,37224896

vLLM keeps the rows of the adapters in its CPU cache (``max_cpu_loras``), so while that cache
fills, nothing comes back to the pool (``engine_client/vllm_plugin/buffers.py``) and every cold
load needs a new buffer. Per size, ``--loads`` cold loads in a row, each row kept, each timed as
the plugin's direct path does it: ``RowBuffers.take`` plus the verified read of the row from a
shard file (page cache warm) into it. Medians of:

* ``no_spares``: ``RowBuffers(spares=False)``: each buffer new, its page faults paid by the read;
* ``spares``: the plugin's pool: a spare of the size faulted in ahead by a thread at nice 19,
  between loads (as between vLLM's steps); the first load of a size is not counted (no spare yet);
* ``limit``: the same read into one buffer faulted in long before (the least a load can take
  here: what no pool can beat).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import _repo  # noqa: F401  (puts the repository root on sys.path)
import numpy as np

from engine_client.vllm_plugin.buffers import RowBuffers
from mint_store.read import read_verified
from mint_store.results import Location
from mint_store.storage import LocalStorage
from tools.bench.row_sizes import run_sizes, shard_row


def _loads_ms(pool: RowBuffers, storage: LocalStorage, loc: Location, loads: int) -> list[float]:
    held = []  # (vLLM's CPU cache: every row stays)
    took = []
    for _ in range(loads):
        pool.settle(timeout=600)  # (the worker's step between two cold loads: the spare is made meanwhile)
        t = time.perf_counter()
        buf = pool.take(loc.length)  # [S]
        read_verified(storage, loc, buf.numpy())
        took.append((time.perf_counter() - t) * 1e3)
        held.append(buf)
    return took


def measure(size: int, loads: int, root: Path) -> dict[str, Any]:
    storage, loc, data = shard_row(size, root)
    budget = 2 * (loads + 1) * (size + (2 << 20))
    no_spares = _loads_ms(RowBuffers(budget, spares=False), storage, loc, loads)
    spares = _loads_ms(RowBuffers(budget), storage, loc, loads + 1)[1:]
    one = RowBuffers(budget, spares=False).take(size)  # [S]
    one.numpy()[:] = 1  # (faulted in)
    limit = []
    for _ in range(loads):
        t = time.perf_counter()
        read_verified(storage, loc, one.numpy())
        limit.append((time.perf_counter() - t) * 1e3)
    if not np.array_equal(one.numpy(), data):
        raise AssertionError("the row read back is not the row written")
    out = {"no_spares_ms": statistics.median(no_spares), "spares_ms": statistics.median(spares),
           "limit_ms": statistics.median(limit)}
    return out | {"bytes": size, "gain": out["no_spares_ms"] / out["spares_ms"],
                  "spares_vs_limit": out["spares_ms"] / out["limit_ms"]}


def _line(r: dict[str, Any]) -> str:
    return (f"{r['bytes']:>11,} B  take + verified read, every row held: no spares {r['no_spares_ms']:6.2f} ms, "
            f"spares {r['spares_ms']:6.2f} ms ({r['gain']:.2f}x faster)   into memory faulted in long before "
            f"(the limit) {r['limit_ms']:6.2f} ms: spares at {r['spares_vs_limit']:.2f}x it")


def main(argv: list[str] | None = None) -> int:
    return run_sizes(argv, __doc__, key="row_buffers", measure=measure, line=_line,
                     repeat=("--loads", 8, "cold loads per measure, every row held (the median counts)"))


if __name__ == "__main__":
    raise SystemExit(main())
