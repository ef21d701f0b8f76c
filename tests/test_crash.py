"""Crash at every step of a commit, reopen, and check: acknowledged writes are all there
and exact; the interrupted one is either wholly visible or not at all."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mint_store.errors import CrashInjected, NotFound, VersionDeleted
from mint_store.testing.crash import CRASH_POINTS, open_crashing
from tests.support.factories import random_adapter
from tests.support.targets import StoreTarget

SHARD_POINTS = ("after_resize", "after_shards")


def crashing_store(target: StoreTarget, point: str):
    """The target's store, with a writer that stops at ``point`` of its commit order."""
    return open_crashing(target.url, {point}, index_dir=target.index_dir, storage_options=target.storage_options)


def expected_row(seed: int) -> np.ndarray:
    return random_adapter(seed).to_row()[1]


def check_consistent(store) -> None:
    """Every live version in the index is readable and matches its content id."""
    for info in store.iter_versions():
        if not info.deleted:
            loc, _ = store.read(info.ref)  # read() verifies the content id
            assert loc.content_id == info.content_id


def shard_bytes(store) -> dict[str, bytes]:
    return {k: store.storage.get(k) for k in store.storage.list("packs/") if "/c/" in k}


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_during_publish(target: StoreTarget, point: str) -> None:
    with target.open() as store:
        acked = {f"base{i}": store.publish("acme", f"base{i}", random_adapter(i)) for i in range(3)}
        seq0 = store.last_seq
    crashing = crashing_store(target, point)
    with crashing.held_commits():
        futs = [crashing.publish_async("acme", f"new{i}", random_adapter(100 + i)) for i in range(3)]
    for f in futs:
        with pytest.raises(CrashInjected):
            f.result()
    crashing.close()
    with target.open() as store:
        for name, r in acked.items():
            _, row = store.read(f"acme/{name}")
            np.testing.assert_array_equal(row, expected_row(int(name[4:])))
            assert store.resolve(f"acme/{name}").content_id == r.content_id
        visible = point in ("after_log", "after_index")
        assert store.last_seq == seq0 + (1 if visible else 0)
        for i in range(3):
            if visible:
                _, row = store.read(f"acme/new{i}")
                np.testing.assert_array_equal(row, expected_row(100 + i))
            else:
                with pytest.raises(NotFound):
                    store.resolve(f"acme/new{i}")
        check_consistent(store)
        # the store goes on: new rows land in new shards, no existing object is rewritten
        before = shard_bytes(store)
        r = store.publish("acme", "later", random_adapter(500))
        assert r.version == 1
        after = shard_bytes(store)
        assert all(after[k] == v for k, v in before.items())
        assert store.resolve("acme/later").shard_key not in before


@pytest.mark.parametrize("point", [p for p in CRASH_POINTS if p not in SHARD_POINTS])
@pytest.mark.parametrize("op", ["tag", "delete"])
def test_crash_during_tag_or_delete(target: StoreTarget, point: str, op: str) -> None:
    with target.open() as store:
        store.publish("acme", "m", random_adapter(1))
        store.publish("acme", "m", random_adapter(2), tag="prod")
    crashing = crashing_store(target, point)
    with pytest.raises(CrashInjected):
        crashing.tag("acme/m@1", "prod") if op == "tag" else crashing.delete("acme/m@2")
    crashing.close()
    with target.open() as store:
        # the log object was written before the crash: the reopened index replays it
        if op == "tag":
            assert store.resolve("acme/m:prod") == store.resolve("acme/m@1")
        else:
            with pytest.raises(VersionDeleted):
                store.resolve("acme/m@2")
            assert store.resolve("acme/m") == store.resolve("acme/m@1")
        check_consistent(store)


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from tests.support.factories import random_adapter
    from mint_store.store import Store
    store = Store.open({url!r}, index_dir={index!r})
    i = {start}
    while True:
        r = store.publish("kill", f"a{{i % 7}}", random_adapter(i))
        print(f"ACK {{r.name}} {{r.version}} {{r.content_id}} {{i}}", flush=True)
        i += 1
    """
)


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_no_acknowledged_publish(local_target: StoreTarget) -> None:
    rng = random.Random(1234)
    acked: dict[tuple[str, int], tuple[str, int]] = {}
    start = 0
    root = str(Path(__file__).resolve().parents[1])  # the repository: tests.support imports
    for _ in range(4):  # bounded: four kills at random moments
        code = CHILD.format(root=root, url=local_target.url, index=local_target.index_dir, start=start)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        wanted = rng.randint(3, 25)
        lines = 0
        assert proc.stdout is not None
        while lines < wanted and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            _, name, version, cid, seed = line.split()
            acked[(name, int(version))] = (cid, int(seed))
            start = max(start, int(seed) + 1)
            lines += 1
        time.sleep(rng.random() * 0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for line in proc.stdout:  # acks printed before the kill still count
            _, name, version, cid, seed = line.split()
            acked[(name, int(version))] = (cid, int(seed))
            start = max(start, int(seed) + 1)
        proc.stdout.close()
        assert lines > 0, "the child never acknowledged a publish"
    with local_target.open() as store:
        for (name, version), (cid, seed) in acked.items():
            loc, row = store.read(f"kill/{name}@{version}")
            assert loc.content_id == cid
            np.testing.assert_array_equal(row, expected_row(seed))
        check_consistent(store)
        for name in {n for n, _ in acked}:
            versions = [v.version for v in store.versions("kill", name)]
            assert versions == list(range(1, len(versions) + 1))


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_during_compaction(target: StoreTarget, point: str) -> None:
    from mint_store.maintenance.compaction import CompactionPolicy, compact, count_shards
    from mint_store.maintenance.fsck import fsck

    with target.open() as store:
        for i in range(4):
            store.publish("acme", f"a{i}", random_adapter(i))
        store.delete("acme/a0")
    crashing = crashing_store(target, point)
    with pytest.raises(CrashInjected):
        compact(crashing, CompactionPolicy())
    crashing.close()
    with target.open() as store:
        for i in range(1, 4):
            _, row = store.read(f"acme/a{i}")
            np.testing.assert_array_equal(row, expected_row(i))
        check_consistent(store)
        report = fsck(store, repair=True)  # shards written before the crash are orphans: removed
        assert not report.damaged and not report.log_problems
        assert fsck(store).clean
        logged = point in ("after_log", "after_index")  # the move's log entry was durable
        assert count_shards(store) == (1 if logged else 4)
        done = compact(store, CompactionPolicy())  # and compaction completes on the reopened store
        assert fsck(store).clean
        assert done.shards_after == 1
        # a logged move is replayed, not redone; a lost one is done now, a0's row dropped
        assert (done.rows_moved, done.rows_dropped) == ((0, 0) if logged else (3, 1))
