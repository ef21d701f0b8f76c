#!/usr/bin/env python3
"""HTTP load benchmark (not a test): N concurrent clients on loopback fetching rows and
publishing, with latency percentiles; ``--nginx`` also serves the same shard bytes with
nginx and prints our throughput as a ratio of nginx's.

    python tools/load_http.py --clients 64 --duration 10 --nginx

``--memory`` instead measures the server's peak RSS under ``--concurrent`` maximum-size
uploads, then as many PEFT exports, against a stated bound (tools/bench/http_memory.py):

    python tools/load_http.py --memory --concurrent 4 --size-mib 64
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401  (puts the repository root on sys.path: tools.bench imports)

from tools.bench.http_bench import HttpBenchConfig, report, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64, help="concurrent connections (default 64)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per phase (default 10)")
    p.add_argument("--adapters", type=int, default=256, help="distinct adapters to fetch from")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--publishers", type=int, default=4, help="clients that upload in the mixed phase")
    p.add_argument("--workers", type=int, default=8, help="the service's executor threads")
    p.add_argument("--nginx", action="store_true", help="also run nginx on the same bytes (Debian package nginx)")
    p.add_argument("--root", help="work directory (default: a temp dir, removed after)")
    p.add_argument("--out", help="JSON results (default docs/results/http.json; --memory: http_memory.json)")
    p.add_argument("--memory", action="store_true", help="peak RSS under concurrent max-size uploads and exports")
    p.add_argument("--concurrent", type=int, default=4, help="--memory: requests at once (default 4)")
    p.add_argument("--size-mib", type=int, default=64, help="--memory: MiB of weights per upload (default 64)")
    p.add_argument("--upload-slots", type=int, default=16, help="--memory: the service's upload_slots")
    p.add_argument("--upload-memory-mib", type=int, default=1024, help="--memory: the service's upload_memory")
    a = p.parse_args()
    if a.memory:
        from tools.bench import http_memory

        mcfg = http_memory.MemoryCheckConfig(concurrent=a.concurrent, size_mib=a.size_mib,
                                             upload_slots=a.upload_slots, upload_memory_mib=a.upload_memory_mib,
                                             out=a.out or "docs/results/http_memory.json")
        http_memory.report(http_memory.run(mcfg), mcfg.out)
        return
    cfg = HttpBenchConfig(clients=a.clients, duration=a.duration, adapters=a.adapters, rank=a.rank,
                          hidden=a.hidden, layers=a.layers, publishers=a.publishers, workers=a.workers,
                          nginx=a.nginx, root=a.root, out=a.out or "docs/results/http.json")
    report(run(cfg), cfg.out)


if __name__ == "__main__":
    main()
