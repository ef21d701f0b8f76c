"""S3 read benchmark: one large row read by ``Store.read_row`` as parallel ranged GETs, against
the same read as one GET, and against the raw bandwidth of the same s3fs client from the same
server (moto's S3 server on 127.0.0.1).

Modes, interleaved within each round (their order rotates from round to round), best and
median over the rounds:

* ``parallel``: ``store.read_row(loc, buf)`` verified (xxh3-128), the default read options
  (``read_part_bytes`` 8 MiB, ``read_concurrency`` 16): concurrent ranged GETs, each part
  copied into its slice of ``buf``;
* ``one_get``: the same on a store opened with ``read_concurrency=1``: one GET of the row;
* ``raw_parallel``: ``fs.cat_ranges`` on the parallel store's own s3fs instance, for the same
  bytes with the same part split and concurrency: no MinT code, no copy into a buffer, no hash;
* ``raw_one_get``: ``fs.cat_file`` of the same byte range, one GET (context for ``one_get``).

The server runs in its own process (``python -m moto.server``) so it does not share the
client's GIL; ``--server thread`` (or a server process that fails to start) uses moto's
ThreadedMotoServer in this process, and the results say which. moto reads the whole object
for every GET, ranged or not, before it slices the range: each ranged GET costs its server
a copy of the whole object, which no real S3 does. The figures are of loopback on this
machine, client and server sharing its cores.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from mint_store.format.layout import Layout, build_layout, encode_rows
from mint_store.storage.remote import FsspecStorage, read_parts

from .report import print_table, write_json

MiB = 2**20
MODES = ("parallel", "one_get", "raw_parallel", "raw_one_get")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True, slots=True, kw_only=True)
class S3ReadConfig:
    row_mib: int = 64
    rounds: int = 9
    server: str = "process"  # or "thread"
    hidden: int = 4096
    rank: int = 64  # with hidden 4096 in bfloat16: 1 MiB per module (A and B)
    out: str = "docs/results/s3_read.json"

    def __post_init__(self) -> None:
        if self.row_mib < 1 or self.rounds < 1:
            raise ValueError("row_mib and rounds must be at least 1")
        if self.server not in ("process", "thread"):
            raise ValueError(f"server must be 'process' or 'thread', not {self.server!r}")


def big_layout(cfg: S3ReadConfig) -> Layout:
    """``row_mib`` modules of 1 MiB each (q/k/v/o of successive layers), bfloat16."""
    h, r = cfg.hidden, cfg.rank
    shapes: list[tuple[str, tuple[int, ...], str]] = []
    for i in range(cfg.row_mib):
        mod = f"model.layers.{i // 4}.self_attn.{('q', 'k', 'v', 'o')[i % 4]}_proj"
        shapes += [(f"{mod}.lora_A", (r, h), "bfloat16"), (f"{mod}.lora_B", (h, r), "bfloat16")]
    shapes.append(("scaling", (cfg.row_mib,), "float32"))
    return build_layout("s3-read-bench", shapes)


class MotoServer:
    """moto's S3 server on 127.0.0.1: a process of its own, or a thread of this one."""

    def __init__(self, kind: str) -> None:
        self.kind, self.note = kind, ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: Any = None
        if kind == "process":
            try:
                self._start_process()
                return
            except (OSError, RuntimeError) as e:
                self.note = f"the server process did not start ({e}); fell back to a thread"
        self._start_thread()

    def _start_process(self) -> None:
        with socket.socket() as s:  # a free port (moto's CLI does not report one it picked)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env=os.environ | CREDENTIALS)
        self.endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"exited with {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    self.kind = "process"
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("not listening after 30 s")

    def _start_thread(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
        self._thread = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._thread.start()
        host, port = self._thread.get_host_and_port()
        self.endpoint, self.kind = f"http://{host}:{port}", "thread"

    def describe(self) -> str:
        what = ("python -m moto.server, a process of its own (its own GIL)" if self.kind == "process"
                else "moto ThreadedMotoServer in the benchmark's process (it shares the client's GIL)")
        return f"{what}; {self.note}" if self.note else what

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.stop()


def server_probe(fs: Any, path: str, offset: int, small: str, nbytes: int = 64 * 2**10) -> dict[str, Any]:
    """What one GET costs the server beyond its bytes: a ``nbytes`` range of the row's object
    against the same range of an object of ``nbytes`` (best of 7 each). On moto the difference
    is its read of the whole object, paid by every ranged GET; S3 pays nothing of the kind."""
    fs.pipe_file(small, bytes(nbytes))

    def best(fn: Callable[[], Any]) -> float:
        fn()
        out = []
        for _ in range(7):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return min(out) * 1e3

    big_ms = best(lambda: fs.cat_file(path, start=offset, end=offset + nbytes))
    small_ms = best(lambda: fs.cat_file(small, start=0, end=nbytes))
    return {"range_bytes": nbytes, "range_of_row_object_ms": big_ms, "range_of_small_object_ms": small_ms,
            "per_get_cost_of_the_object_size_ms": big_ms - small_ms}


def _stats(seconds: list[float], nbytes: int) -> dict[str, Any]:
    best, med = min(seconds), statistics.median(seconds)
    return {"seconds": [round(s, 6) for s in seconds], "best_s": best, "median_s": med,
            "best_mbps": nbytes / best / 1e6, "median_mbps": nbytes / med / 1e6}


def _ratio(r: dict[str, Any], ours: str, theirs: str) -> dict[str, float]:
    """Throughput of ``ours`` over that of ``theirs`` (their time over ours), best and median."""
    return {"best": r[theirs]["best_s"] / r[ours]["best_s"], "median": r[theirs]["median_s"] / r[ours]["median_s"]}


def run(cfg: S3ReadConfig) -> dict[str, Any]:
    import boto3

    from mint_store.format.hashing import content_id
    from mint_store.store import Store

    for k, v in CREDENTIALS.items():
        os.environ.setdefault(k, v)
    server = MotoServer(cfg.server)
    root = tempfile.mkdtemp(prefix="mint-bench-s3read-")
    stores: list[Any] = []
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/mint"
        opts = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                "client_kwargs": {"endpoint_url": server.endpoint, "region_name": "us-east-1"}}
        layout = big_layout(cfg)
        g = torch.Generator().manual_seed(0)
        stacked = {t.name: (torch.randn((1, *t.shape), generator=g) * 0.01).to(torch.bfloat16)
                   for t in layout.tensors if t.name != "scaling"}
        stacked["scaling"] = torch.full((1, cfg.row_mib), 2.0)
        rows = encode_rows(layout, stacked, 1)
        del stacked
        with Store.open(url, index_dir=f"{root}/w", storage_options=opts) as writer:
            writer.publish_rows([("bench", "big")], layout, rows)
        expected = content_id(layout.layout_id, rows[0])
        del rows
        # two readers, no log polling or lease renewals during the clock: the default read
        # options, and one GET per read
        par = Store.open(url, index_dir=f"{root}/a", storage_options=opts, readonly=True, follow_interval_s=0)
        stores.append(par)
        one = Store.open(url, index_dir=f"{root}/b", storage_options={**opts, "read_concurrency": 1},
                         readonly=True, follow_interval_s=0)
        stores.append(one)
        loc = par.resolve("bench/big")
        assert loc.content_id == expected and one.resolve("bench/big") == loc
        storage, single = par.storage, one.storage
        assert isinstance(storage, FsspecStorage) and isinstance(single, FsspecStorage)
        assert single.read_concurrency == 1 and storage.read_concurrency > 1
        n = loc.length
        fs, path = storage.fs, storage._path(loc.shard_key)
        part, conc = storage.read_part_bytes, storage.read_concurrency
        spans = read_parts(n, part)
        starts, ends = [loc.offset + lo for lo, _ in spans], [loc.offset + hi for _, hi in spans]
        buf_a, buf_b = np.empty(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)

        def raw_parallel() -> None:
            got = fs.cat_ranges([path] * len(spans), starts, ends, batch_size=conc, on_error="raise")
            assert sum(map(len, got)) == n

        def raw_one_get() -> None:
            assert len(fs.cat_file(path, start=loc.offset, end=loc.offset + n)) == n

        reads: dict[str, Callable[[], Any]] = {
            "parallel": lambda: par.read_row(loc, buf_a), "one_get": lambda: one.read_row(loc, buf_b),
            "raw_parallel": raw_parallel, "raw_one_get": raw_one_get}
        for fn in reads.values():  # warm: connections opened, the server's object touched
            fn()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for rnd in range(cfg.rounds):
            for m in MODES[rnd % len(MODES):] + MODES[: rnd % len(MODES)]:
                t = time.perf_counter()
                reads[m]()
                times[m].append(time.perf_counter() - t)
        assert content_id(loc.layout_id, buf_a) == content_id(loc.layout_id, buf_b) == expected
        probe = server_probe(fs, path, loc.offset, f"{bucket}/probe/small")
        results: dict[str, Any] = {
            "config": asdict(cfg), "row_nbytes": n, "server": server.kind, "server_detail": server.describe(),
            "read_part_bytes": part, "read_concurrency": conc, "gets_per_parallel_read": len(spans),
            "parallel_threshold_bytes": 2 * part, "cpus": os.cpu_count(),
            "note": "MB/s are 10^6 bytes per second; moto reads the whole object for every ranged GET",
        }
        results |= {m: _stats(times[m], n) for m in MODES}
        results["server_probe"] = probe
        results["ratio"] = {"parallel_vs_one_get": _ratio(results, "parallel", "one_get"),
                            "parallel_vs_raw": _ratio(results, "parallel", "raw_parallel"),
                            "one_get_vs_raw_one_get": _ratio(results, "one_get", "raw_one_get")}
    finally:
        for s in stores:
            s.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    write_json(cfg.out, "s3read", results)
    return results


def report(r: dict[str, Any]) -> None:
    n = r["row_nbytes"]
    rows = [(f"{m} ({'read_row, verified' if not m.startswith('raw') else 's3fs only'})",
             f"best {r[m]['best_mbps']:8.1f} MB/s   median {r[m]['median_mbps']:8.1f} MB/s")
            for m in MODES]
    for k, v in r["ratio"].items():
        rows.append((k, f"best {v['best']:.2f}x   median {v['median']:.2f}x"))
    p = r["server_probe"]
    kib = p["range_bytes"] // 1024
    rows.append(("server cost of one GET (object size)",
                 f"{p['per_get_cost_of_the_object_size_ms']:.1f} ms: a {kib} KiB range of the row's object "
                 f"{p['range_of_row_object_ms']:.1f} ms, of a {kib} KiB object {p['range_of_small_object_ms']:.1f} ms"))
    rows.append(("server", r["server_detail"]))
    print_table(f"S3 read of one {n / MiB:.1f} MiB row, {r['gets_per_parallel_read']} GETs of "
                f"<= {r['read_part_bytes'] / MiB:g} MiB, {r['read_concurrency']} at once "
                f"({r['config']['rounds']} rounds)", rows)

