"""Kill-safety check: SIGKILL a writing process at random moments, reopen, verify.

A child process runs a publisher storm, compactions with publishes, or reindexes; the
parent kills it at a random moment, reopens the store (which replays the log), runs fsck
with repair, and checks that every publish acknowledged before the kill is readable with
exact bytes and that nothing unacknowledged is half-visible (every version the index
shows reads back verified). Bounded in kills and time; loopback/local only.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODES = ("publish", "compact", "reindex")


def synthetic_adapter(seed: int) -> Any:
    from ..format.adapter import make_adapter

    g = torch.Generator().manual_seed(seed)
    mods = {f"model.layers.{i}.self_attn.{m}": (torch.randn(2, 32, generator=g), torch.randn(32, 2, generator=g), 1.0)
            for i in range(2) for m in ("q_proj", "v_proj")}
    return make_adapter(mods, base="crashtest")


def child(mode: str, store_dir: str, start: int) -> None:
    """The process that gets killed. Prints ``ACK name version content_id seed`` per publish."""
    from ..errors import MintError
    from ..maintenance.compaction import CompactionPolicy, compact
    from ..maintenance.reindex import rebuild_index
    from ..storage import open_storage
    from ..store import Store

    print("READY", flush=True)  # imports done: the parent's random clock starts now
    if mode == "reindex":
        while True:
            rebuild_index(open_storage(store_dir), os.path.join(store_dir, "index"))
            print("REINDEXED", flush=True)
    with Store.open(store_dir) as store:
        i = start
        while True:
            r = store.publish("crash", f"a{i % 11}", synthetic_adapter(i))
            print(f"ACK {r.name} {r.version} {r.content_id} {i}", flush=True)
            if mode == "compact" and i % 3 == 0:
                with contextlib.suppress(MintError):  # that name may have no live version left
                    store.delete(f"crash/a{(i + 5) % 11}")
                compact(store, CompactionPolicy(min_small_shards=2))
                store.sweep(grace_s=0)
                print("COMPACTED", flush=True)
            i += 1


@dataclass(slots=True)
class CrashReport:
    mode: str
    kills: int = 0
    acknowledged: int = 0
    problems: list[str] = field(default_factory=list)
    orphans_removed: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def run(mode: str, store_dir: str | Path, *, kills: int = 20, seed: int = 0, max_seconds: float = 300.0,
        max_wait_s: float = 1.5) -> CrashReport:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    store_dir = str(store_dir)
    rng = random.Random(seed)
    report = CrashReport(mode)
    acked: dict[tuple[str, int], tuple[str, int]] = {}
    next_seed = 0
    t0 = time.monotonic()
    if mode == "reindex":  # something to rebuild
        from ..store import Store

        with Store.open(store_dir) as store:
            for i in range(40):
                r = store.publish("crash", f"a{i % 11}", synthetic_adapter(i))
                acked[(r.name, r.version)] = (r.content_id, i)
    while report.kills < kills and time.monotonic() - t0 < max_seconds:
        code = f"from mint_store.testing.crashtest import child; child({mode!r}, {store_dir!r}, {next_seed})"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        os.set_blocking(proc.stdout.fileno(), False)  # type: ignore[union-attr]
        buf = ""
        # the random moment counts from the child's READY, not from its start: a loaded machine
        # may take seconds to import torch, and a kill during imports tests nothing
        ready_by = time.monotonic() + 120
        while "READY" not in buf and time.monotonic() < ready_by and proc.poll() is None:
            buf += _drain(proc)
            time.sleep(0.01)
        deadline = time.monotonic() + rng.uniform(0.2, max_wait_s)
        while time.monotonic() < deadline and proc.poll() is None:
            buf += _drain(proc)
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        buf += _drain(proc)
        proc.stdout.close()  # type: ignore[union-attr]
        for line in buf.splitlines():
            if line.startswith("ACK "):
                _, name, version, cid, s = line.split()
                acked[(name, int(version))] = (cid, int(s))
                next_seed = max(next_seed, int(s) + 1)
        if proc.returncode not in (-signal.SIGKILL, 0):
            report.problems.append(f"kill {report.kills}: child exited with {proc.returncode} before the kill")
        report.kills += 1
        report.problems += _verify(store_dir, acked, report)
    report.acknowledged = len(acked)
    report.seconds = time.monotonic() - t0
    return report


def _drain(proc: subprocess.Popen[str]) -> str:
    try:
        return proc.stdout.read() or ""  # type: ignore[union-attr]
    except (BlockingIOError, TypeError):
        return ""


def _verify(store_dir: str, acked: dict[tuple[str, int], tuple[str, int]], report: CrashReport,
            **options: Any) -> list[str]:
    from ..errors import MintError
    from ..maintenance.fsck import fsck
    from ..store import Store

    problems: list[str] = []
    with Store.open(store_dir, **options) as store:
        for (name, version), (cid, s) in acked.items():
            try:
                info = store.version(f"crash/{name}@{version}")
                if info.content_id != cid:
                    problems.append(f"crash/{name}@{version}: content id {info.content_id}, acknowledged {cid}")
                    continue
                if info.deleted:
                    continue  # the storm deletes some versions on purpose
                _, row = store.read(f"crash/{name}@{version}")
                if not np.array_equal(row, synthetic_adapter(s).to_row()[1]):
                    problems.append(f"crash/{name}@{version}: bytes differ")
            except MintError as e:
                problems.append(f"crash/{name}@{version}: {e!r}")
        for info in store.iter_versions():  # nothing half-visible
            if not info.deleted:
                try:
                    store.read(info.ref)
                except MintError as e:
                    problems.append(f"{info.ref} is visible but unreadable: {e!r}")
        fr = fsck(store, repair=True)
        report.orphans_removed += len(fr.removed)
        problems += [f"fsck: {d}" for d in fr.damaged] + [f"fsck log: {p}" for p in fr.log_problems]
    return problems
