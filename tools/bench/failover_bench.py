"""Failover time of ``mint serve --standby``: writer SIGKILL/SIGSTOP -> first accepted write on the standby.

A writer ``mint serve`` and a standby ``mint serve --standby`` (real subprocesses, each with its
own index directory as on two machines) share one store: a bucket of moto's S3 server on
127.0.0.1, or a local directory. Each trial signals the writer at a random point of its renew
cycle and times, from the signal, the first publish the standby accepts (one attempt every
``probe_s``; the refusals are 405 NotTheWriter). The standby that took over is the next trial's
writer, and a fresh standby joins.

Two ways for a writer to disappear, reported apart because they are not equally honest:

``sigkill_same_host``
    The writer process dies. The standby runs on the same host, so the lease sees that the
    holder's pid is gone and takes over without waiting out the TTL: a flattering figure,
    valid only for a writer and a standby on one machine.
``sigstop_silent_holder``
    The writer is stopped (alive, silent: no renewals). The standby cannot tell it from a
    writer on another machine that died or lost the network, so it waits for the lease to
    expire: the figure for writers and standbys on different machines. The stopped writer is
    killed after the take-over.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mint_store.testing.serve_proc import WAIT_S, ServeProcess, wait_until

MODES = ("sigkill_same_host", "sigstop_silent_holder")


def _wait_for_writer(standby: ServeProcess, writer: ServeProcess) -> None:
    """Until the standby has seen the writer's lease (so it is waiting on that writer)."""
    wait_until(lambda: standby.health().get("writer_url") == writer.url, "the standby")


def _first_accepted_write(url: str, seed: int, signalled: float, probe_s: float) -> tuple[float, int]:
    """Seconds from ``signalled`` to the first publish ``url`` accepts; and the refusals before it."""
    from engine_client import SyncMintClient
    from mint_store.errors import MintError

    from .replica_adapters import tiny_adapter

    adapter = tiny_adapter(seed)
    refused = 0
    with SyncMintClient(url, retries=0) as client:
        while True:
            try:
                client.publish("bench", f"failover-{seed}", adapter)
                return time.perf_counter() - signalled, refused
            except (MintError, OSError):  # NotTheWriter (405) until the take-over completes
                refused += 1
                if time.perf_counter() - signalled > WAIT_S:
                    raise TimeoutError("the standby never accepted a write") from None
                time.sleep(probe_s)


def bench_failover(*, backend: str, modes: list[str], trials: int, ttl: float, renew: float,
                   probe_s: float = 0.02, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per mode: failover seconds of each trial, median, max, and max / TTL."""
    import logging

    from .replica_adapters import moto_bucket

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    env = dict(os.environ)
    server = None
    with tempfile.TemporaryDirectory(prefix="mint-bench-failover-") as tmp:
        root = Path(tmp)
        if backend == "s3":
            server, endpoint, url = moto_bucket()
            env |= {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        else:
            url = str(root / "store")
        started: list[ServeProcess] = []

        def start(standby: bool) -> ServeProcess:
            started.append(ServeProcess(url, root / f"s{len(started)}", env, ttl, renew, standby=standby))
            return started[-1]

        try:
            writer = start(False)
            _first_accepted_write(writer.url, 0, time.perf_counter(), probe_s)  # the store exists
            rows: list[dict[str, Any]] = []
            for mode in modes:
                times: list[float] = []
                refusals: list[int] = []
                for trial in range(trials):
                    standby = start(True)
                    _wait_for_writer(standby, writer)
                    time.sleep(random.uniform(0, renew))  # a random point of the writer's renew cycle
                    signalled = time.perf_counter()
                    os.kill(writer.proc.pid, signal.SIGKILL if mode == "sigkill_same_host" else signal.SIGSTOP)
                    took, refused = _first_accepted_write(standby.url, len(times) + 1000 * (1 + len(rows)),
                                                          signalled, probe_s)
                    writer.stop()
                    times.append(took)
                    refusals.append(refused)
                    log(f"  failover {mode} trial {trial + 1}/{trials}: {took:.2f} s ({refused} writes refused)")
                    writer = standby
                row = {"mode": mode, "backend": "s3 (moto)" if backend == "s3" else "local", "trials": trials,
                       "lease_ttl_s": ttl, "lease_renew_s": renew, "seconds": [round(t, 3) for t in times],
                       "median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3),
                       "max_over_ttl": round(max(times) / ttl, 3), "writes_refused": refusals}
                print(json.dumps(row), flush=True)
                rows.append(row)
            return rows
        finally:
            for s in started:
                s.stop()
            if server is not None:
                server.stop()
