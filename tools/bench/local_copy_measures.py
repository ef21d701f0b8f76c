"""The measures of tools/bench_local_copy.py (a row through the service's same-machine socket) for the suite's table."""

from __future__ import annotations

from typing import Any

from .measure import Measure


def local_copy_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    out = []
    for rank, got in r["ranks"].items():
        mb = got["row_bytes"] / 1e6
        sizes = (f"r{rank} row of {got['row_bytes']:,} B (tools/bench_vllm.py's adapters), one buffer read into "
                 f"again and again by a thread pinned to one CPU, medians of {r['reads']}; the service in its own "
                 "process")
        out += [
            Measure(key=f"local_copy.r{rank}.vs_limit",
                    title=f"{mb:.1f} MB row through the local socket (kept mapping) vs one pread + one hash",
                    ours=got["socket_kept_ms"], unit="ms", baseline=got["limit_ms"],
                    baseline_label="one pread + one hash on the reader's thread: the machine's limit",
                    ratio=got["socket_kept_vs_limit"], higher_is_better=False, command=cmd, sizes=sizes),
            Measure(key=f"local_copy.r{rank}.vs_http",
                    title=f"{mb:.1f} MB row through the local socket vs GET over loopback",
                    ours=got["socket_kept_ms"], unit="ms", baseline=got["http_ms"],
                    baseline_label="GET /v1/blobs over loopback", ratio=got["socket_kept_ms"] / got["http_ms"],
                    higher_is_better=False, command=cmd, sizes=sizes),
        ]
    return out
