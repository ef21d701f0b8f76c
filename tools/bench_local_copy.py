#!/usr/bin/env python3
"""A row read through the service's same-machine socket, against GET and the machine's limit (not a test).

    python tools/bench_local_copy.py                  # the r16 and r64 rows of tools/bench_vllm.py
    python tools/bench_local_copy.py --ranks 64 --reads 20

The service (``mint serve --local-socket``) runs in a process of its own on a local directory
store, as beside a vLLM server; the reader is a thread pinned to one CPU, as vLLM's CPU worker
is. Per rank (the adapters of ``tools/bench_vllm.py``: Llama hidden 1024, 16 layers, bf16, all
7 modules), the same row read ``--reads`` times, each read checked against the content id,
medians of:

* ``socket_kept``: through the socket into one buffer of the plugin's pool, sent again and
  again (``engine_client/vllm_plugin/buffers.py``: a sealed memfd, which the service keeps
  mapped and reads the row into: ``mint_store/service/copy_targets.py``);
* ``socket_file``: the same into an unsealed memfd, which the service writes through its file
  interface (``sendfile``) every time: what every read was before it kept mappings;
* ``http``: ``GET /v1/blobs/{id}`` over loopback into a buffer already faulted in
  (``engine_client/client/http_rows.py``);
* ``limit``: one ``pread`` of the row from its shard file by this thread (page cache warm)
  into a buffer already faulted in and placed as the row is in its page
  (:mod:`tools.bench.read_floor`), then one hash of it against the content id: what the
  socket's path does (one copy, one hash), with nothing between; the socket's path can beat it
  only by hashing a piece while the service copies the next, on the other CPU.

The first read of each way is not counted (it maps the buffer, or faults it in).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _repo  # noqa: F401  (puts the repository root on sys.path)
import numpy as np

from tools.bench.read_floor import median_ms, page_matched, preadv_all
from tools.bench.report import write_json

ROOT = Path(__file__).resolve().parents[1]


def _serve(store: str, sock: str, urls: Any) -> None:
    from mint_store.service import ServerThread, ServiceConfig

    server = ServerThread(ServiceConfig(store=store, host="127.0.0.1", port=0, auto_compact=False,
                                        local_socket=sock))
    urls.put(server.url)
    time.sleep(3600)  # (terminated by the parent)


def measure(rank: int, reads: int, root: Path, url: str, sock: Path) -> dict[str, Any]:
    from engine_client import SyncMintClient
    from engine_client.client.http_rows import HttpRowReader
    from engine_client.client.local_rows import LocalRowReader
    from engine_client.vllm_plugin.buffers import RowBuffers
    from mint_store.format.hashing import content_hasher
    from mint_store.storage import LocalStorage
    from tools.bench_vllm import random_adapter

    shape = SimpleNamespace(hidden=1024, intermediate=2816, layers=16)
    with SyncMintClient(url) as c:
        c.publish("bench", f"r{rank}", random_adapter(shape, rank, rank), tag="prod")
        loc = c.resolve(f"bench/r{rank}:prod")  # (no tokens: the admin's view, with its shard)
    cid = loc.content_id
    n = loc.length
    kept, kept_fd = RowBuffers(4 * n).take_shared(n)  # [S]
    loose_fd = os.memfd_create("bench-row")
    os.ftruncate(loose_fd, n)
    loose = np.frombuffer(mmap.mmap(loose_fd, n), dtype=np.uint8)  # [S]
    _, warm = page_matched(n, 0)  # [S] faulted in, on a page
    local, http = LocalRowReader(sock), HttpRowReader(url)
    shard = LocalStorage(str(root / "store")).local_path(loc.shard_key)
    assert shard is not None
    shard_fd = os.open(shard, os.O_RDONLY)

    _room, floor = page_matched(n, loc.offset)  # faulted in, placed as the row is in its page

    def limit() -> None:  # one pread into memory already faulted in, one hash of it, on this thread
        preadv_all(shard_fd, floor, loc.offset)
        h = content_hasher(loc.layout_id)
        h.update(floor)
        assert h.hexdigest() == cid

    out = {
        "rank": rank, "row_bytes": n,
        "socket_kept_ms": median_ms(lambda: local.read_blob(cid, lambda _: (kept.numpy(), kept_fd)), reads),
        "socket_file_ms": median_ms(lambda: local.read_blob(cid, lambda _: (loose, loose_fd)), reads),
        "http_ms": median_ms(lambda: http.read_blob(cid, lambda _: warm), reads),
        "limit_ms": median_ms(limit, reads),
    }
    local.close()
    os.close(shard_fd)
    os.close(loose_fd)
    return out | {f"{k[:-3]}_vs_limit": out[k] / out["limit_ms"] for k in ("socket_kept_ms", "socket_file_ms",
                                                                            "http_ms")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--reads", type=int, default=15)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "local_copy.json")
    a = p.parse_args(argv)
    results: dict[str, Any] = {"reads": a.reads, "cpus": os.cpu_count(), "ranks": {}}
    with tempfile.TemporaryDirectory(prefix="mint-bench-local-copy-") as tmp:
        root = Path(tmp)
        sock = root / "mint.sock"
        ctx = mp.get_context("spawn")
        urls = ctx.Queue()
        server = ctx.Process(target=_serve, args=(str(root / "store"), str(sock), urls), daemon=True)
        server.start()
        try:
            url = urls.get(timeout=120)
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # (as vLLM's CPU worker: one CPU)
            for r in (int(x) for x in a.ranks.split(",")):
                got = results["ranks"][str(r)] = measure(r, a.reads, root, url, sock)
                print(f"r{r} row {got['row_bytes'] / 1e6:.1f} MB: socket, buffer kept mapped "
                      f"{got['socket_kept_ms']:.2f} ms "
                      f"({got['socket_kept_vs_limit']:.2f}x the limit); socket, file interface "
                      f"{got['socket_file_ms']:.2f} ms ({got['socket_file_vs_limit']:.2f}x); GET over loopback "
                      f"{got['http_ms']:.2f} ms ({got['http_vs_limit']:.2f}x); limit (pread + hash) "
                      f"{got['limit_ms']:.2f} ms")
        finally:
            server.terminate()
            server.join(10)
    write_json(a.out, "local_copy", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
