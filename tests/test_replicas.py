"""Read replicas (issue 14): index checkpoints, a local index built from checkpoint + log tail,
following the log, and writes to a replica answered with the writer's URL.

Every test runs real parts: LMDB, Zarr packs, a local directory or moto's S3 on loopback.
Synchronisation is by polling state with a generous deadline, never a timing assert.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mint_store.config import StoreConfig
from mint_store.errors import NotTheWriter
from mint_store.index.checkpoint import CHECKPOINT_PREFIX, list_checkpoints, manifest_key
from mint_store.index.commit_log import log_key
from mint_store.maintenance.fsck import fsck
from mint_store.storage import LocalStorage
from mint_store.store import Store
from tests.support.factories import corrupt_byte, random_adapter
from tests.support.targets import StoreTarget

DEADLINE_S = 60.0


def until(cond: Callable[[], Any], what: str) -> Any:
    """Poll ``cond`` until it is truthy (a generous deadline, only there to fail a hung test)."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def replica_of(target: StoreTarget, index_dir: str, **options: Any) -> Store:
    return Store.open(target.url, index_dir=index_dir, storage_options=target.storage_options, readonly=True,
                      **options)


def same_view(a: Store, b: Store) -> None:
    """Two stores agree on every version, tag and location (what readers can observe)."""
    assert [v.to_dict() for v in a.iter_versions()] == [v.to_dict() for v in b.iter_versions()]
    assert a.last_seq == b.last_seq
    assert a.events(0, limit=10**6) == b.events(0, limit=10**6)
    for v in a.iter_versions():
        if not v.deleted:
            assert a.resolve(v.ref) == b.resolve(v.ref)


class CountingStorage(LocalStorage):
    """A real local store that counts the objects read under each prefix."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: dict[str, int] = {}

    def get(self, key: str) -> bytes:
        top = key.split("/", 1)[0]
        self.reads[top] = self.reads.get(top, 0) + 1
        return super().get(key)


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs when the machine has one (10,000 fsynced commits in seconds)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="mint-replica-", dir="/dev/shm"))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


def test_a_replica_on_a_fresh_index_dir_sees_everything(target: StoreTarget, tmp_path: Path) -> None:
    with target.open() as writer:
        writer.publish("acme", "a", random_adapter(1), tag="prod")
        writer.publish("acme", "b", random_adapter(2))
        writer.publish("beta", "a", random_adapter(1))  # deduplicated bytes, another tenant
        writer.delete("acme/b")
        writer.tag("acme/a@1", "stable")
        with replica_of(target, str(tmp_path / "replica-index")) as replica:
            same_view(writer, replica)
            _, row = replica.read("acme/a:prod")
            assert np.array_equal(row, writer.read("acme/a@1")[1])
            assert replica.replica_stats.log_objects_read == writer.last_seq  # no checkpoint yet: the whole log


def test_a_replica_after_10000_commits_starts_from_a_checkpoint_plus_tail(fast_dir: Path) -> None:
    url, tail = str(fast_dir / "store"), 37
    with Store.open(url, index_dir=str(fast_dir / "index"), checkpoint_interval_s=3600.0) as writer:
        writer.publish("acme", "a", random_adapter(1))
        for i in range(10_000):
            writer.tag("acme/a@1", f"t{i % 50}")
        # the writer checkpoints by itself every 1000 commits: wait until it caught up with that rule
        automatic = until(lambda: (c := list_checkpoints(writer.storage)) and c[-1] > writer.last_seq - 1000 and c,
                          "the writer's checkpoints")
        covered = writer.checkpoint()  # everything so far; then a tail no checkpoint covers
        assert covered == writer.last_seq == 10_001
        for i in range(tail):
            writer.publish("acme", f"tail{i}", random_adapter(100 + i))
        assert list_checkpoints(writer.storage)[-1] == covered  # the tail triggered none
        storage = CountingStorage(url)
        replica = Store(storage, StoreConfig(readonly=True, index_dir=str(fast_dir / "r")), str(fast_dir / "r"))
        try:
            stats = replica.replica_stats
            assert stats.checkpoint_seq == covered
            assert stats.log_objects_read == tail
            assert storage.reads.get("log", 0) == tail  # only the tail was read from the log
            assert storage.reads.get("checkpoints", 0) >= 2  # its manifest and its part(s)
            same_view(writer, replica)
        finally:
            replica.close()
    # the writer checkpointed by itself every 1000 commits along the way
    assert len([s for s in automatic if s < covered]) >= 3


def test_a_follower_sees_new_publishes_tags_and_deletes(target: StoreTarget, tmp_path: Path) -> None:
    with target.open() as writer:
        writer.publish("acme", "a", random_adapter(1))
        with replica_of(target, str(tmp_path / "replica-index")) as replica:
            assert replica._follower is not None
            result = writer.publish("acme", "b", random_adapter(2), tag="prod")
            loc = until(lambda: replica.resolve_many(["acme/b:prod"])[0] if replica.last_seq >= result.seq else None,
                        "the publish on the replica")
            assert loc == writer.resolve("acme/b:prod")
            assert np.array_equal(replica.read("acme/b")[1], writer.read("acme/b")[1])
            writer.delete("acme/a")
            until(lambda: replica.version("acme/a@1").deleted, "the delete on the replica")
            same_view(writer, replica)


def test_a_compacted_log_reloads_the_replica_from_the_newest_checkpoint(local_target: StoreTarget,
                                                                        tmp_path: Path) -> None:
    with local_target.open() as writer:
        writer.publish("acme", "a", random_adapter(1))
        writer.publish("acme", "b", random_adapter(2))
        with replica_of(local_target, str(tmp_path / "r"), follow_interval_s=0) as replica:
            assert replica.last_seq == 2
            for i in range(10):
                writer.tag("acme/a@1", f"t{i}")
            covered = writer.checkpoint()
            writer.publish("acme", "c", random_adapter(3))
            for seq in range(3, covered + 1):  # the log compacted past the replica's position
                writer.storage.delete(log_key(seq))
            assert replica.refresh() == 1  # the tail after the checkpoint
            assert replica.replica_stats.reloads == 1
            assert replica.replica_stats.checkpoint_seq == covered
            same_view(writer, replica)


def test_sweep_keeps_the_newest_checkpoints_and_removes_abandoned_parts(target: StoreTarget) -> None:
    with target.open(checkpoint_keep=2) as writer:
        writer.publish("acme", "a", random_adapter(1))
        seqs = []
        for i in range(4):
            writer.tag("acme/a@1", f"t{i}")
            seqs.append(writer.checkpoint())
        abandoned = f"{CHECKPOINT_PREFIX}{seqs[0] + 0:020d}/deadbeef0000-00000.rec"  # a crashed attempt
        writer.storage.create(abandoned, b"half a checkpoint")
        assert list_checkpoints(writer.storage) == seqs
        writer.sweep(grace_s=600)
        assert list_checkpoints(writer.storage) == seqs[-2:]
        left = writer.storage.list(CHECKPOINT_PREFIX)
        assert abandoned not in left
        assert all(k.startswith(tuple(f"{CHECKPOINT_PREFIX}{s:020d}/" for s in seqs[-2:])) for k in left)
        assert fsck(writer).clean


def test_a_corrupt_checkpoint_is_rejected_for_an_older_one_then_the_whole_log(
    target: StoreTarget, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with target.open() as writer:
        writer.publish("acme", "a", random_adapter(1))
        older = writer.checkpoint()
        writer.publish("acme", "b", random_adapter(2))
        newer = writer.checkpoint()
        writer.publish("acme", "c", random_adapter(3))
        part = next(k for k in writer.storage.list(f"{CHECKPOINT_PREFIX}{newer:020d}/") if k.endswith(".rec"))
        corrupt_byte(writer.storage, part, 5)
        with caplog.at_level(logging.WARNING, logger="mint.replica"), \
                replica_of(target, str(tmp_path / "r1")) as replica:
            assert replica.replica_stats.checkpoint_seq == older
            assert replica.replica_stats.log_objects_read == writer.last_seq - older
            same_view(writer, replica)
        assert any(f"checkpoint {newer}" in r.getMessage() and "rejected" in r.getMessage()
                   and "hash" in r.getMessage() for r in caplog.records)
        report = fsck(writer)
        assert any("does not match its hash" in p for p in report.log_problems)
        # the older one's manifest damaged too: the replica replays the whole log
        raw = bytearray(writer.storage.get(manifest_key(older)))
        raw[raw.index(b'"seq":') + 6] ^= 0x01
        writer.storage.put(manifest_key(older), bytes(raw))
        with replica_of(target, str(tmp_path / "r2")) as replica:
            assert replica.replica_stats.checkpoint_seq is None
            assert replica.replica_stats.log_objects_read == writer.last_seq
            same_view(writer, replica)


def test_an_index_of_another_store_is_rebuilt_not_trusted(tmp_path: Path) -> None:
    index = str(tmp_path / "shared-index")
    with Store.open(tmp_path / "one", index_dir=str(tmp_path / "i1")) as one:
        one.publish("acme", "only-in-one", random_adapter(1))
    with Store.open(tmp_path / "two", index_dir=str(tmp_path / "i2")) as two:
        two.publish("acme", "only-in-two", random_adapter(2))
        two.publish("acme", "also-in-two", random_adapter(3))
    with Store.open(tmp_path / "one", index_dir=index, readonly=True) as r:
        assert r.names("acme") == ["only-in-one"]
    with Store.open(tmp_path / "two", index_dir=index, readonly=True) as r:  # same index dir, other store
        assert r.names("acme") == ["also-in-two", "only-in-two"]
        assert r.last_seq == 2


def test_a_readonly_client_on_a_machine_with_no_index(target: StoreTarget, tmp_path: Path) -> None:
    import asyncio

    from engine_client import MintClient

    with target.open() as writer:
        writer.publish("acme", "a", random_adapter(1), tag="prod")
        want = writer.read("acme/a:prod")[1]

    async def read() -> Any:
        async with MintClient(target.url, readonly=True, index_dir=str(tmp_path / "engine-index"),
                              storage_options=target.storage_options) as client:
            return await client.read("acme/a:prod")

    _, row = asyncio.run(read())
    assert np.array_equal(row, want)


def test_a_write_to_a_readonly_store_names_the_writer(local_target: StoreTarget, tmp_path: Path) -> None:
    with local_target.open() as writer, replica_of(local_target, str(tmp_path / "r")) as replica:
        writer.advertise("http://127.0.0.1:9/")
        with pytest.raises(NotTheWriter) as err:
            replica.publish("acme", "a", random_adapter(1))
        assert err.value.writer_url == "http://127.0.0.1:9/"
        assert err.value.code == "not_the_writer"
        writer.publish("acme", "a", random_adapter(1))  # the writer itself is unaffected


def test_store_config_refuses_bad_checkpoint_settings() -> None:
    for bad in ({"checkpoint_every": 0}, {"checkpoint_interval_s": 0}, {"checkpoint_keep": 0},
                {"follow_interval_s": -1}):
        with pytest.raises(ValueError):
            StoreConfig(**bad)
    assert dataclasses.asdict(StoreConfig())["follow_interval_s"] <= 0.25


def test_fsck_reports_a_checkpoint_that_disagrees_with_the_log(local_target: StoreTarget, tmp_path: Path) -> None:
    from mint_store.index.checkpoint import write_checkpoint
    from mint_store.index.lmdb_index import Index

    with local_target.open() as writer:
        writer.publish("acme", "a", random_adapter(1), tag="prod")
        writer.publish("acme", "b", random_adapter(2))
        assert fsck(writer).clean  # no checkpoint yet
        covered = writer.checkpoint()
        assert fsck(writer).clean  # a checkpoint equal to the log's fold
        writer.tag("acme/a@1", "next")
        # a well-formed checkpoint (hashes fine) of an index that is not the log's fold
        forged = Index.acquire(str(tmp_path / "forged"))
        try:
            with writer._idx().read() as t, forged.write() as w:
                for db in t.dbs:
                    for k, v in t.scan(db):
                        w.put(db, k, v)
                w.put("tags", b"acme/b:prod", {"version": 1, "content_id": "0" * 32})
            assert write_checkpoint(writer.storage, forged, store_id=None) == covered + 1
        finally:
            forged.release()
        problems = fsck(writer).log_problems
        assert any("disagrees with the log" in p and "'tags'" in p for p in problems), problems


def test_a_stale_local_index_catches_up_with_the_tail_only(target: StoreTarget, tmp_path: Path) -> None:
    index = str(tmp_path / "replica-index")
    with target.open() as writer:
        for i in range(3):
            writer.publish("acme", f"a{i}", random_adapter(i))
        with replica_of(target, index) as replica:
            assert replica.last_seq == 3
        for i in range(3, 5):  # while no replica runs
            writer.publish("acme", f"a{i}", random_adapter(i))
        writer.delete("acme/a0")
        with replica_of(target, index, follow_interval_s=0) as replica:  # the same machine, later
            assert replica.replica_stats.checkpoint_seq is None  # not rebuilt: its own index, brought up to date
            assert replica.replica_stats.log_objects_read == 3
            same_view(writer, replica)


def test_a_writer_on_a_fresh_machine_starts_from_the_newest_checkpoint(target: StoreTarget, tmp_path: Path) -> None:
    with target.open(checkpoint_every=10) as first:  # at close: a checkpoint once 1 commit is not covered
        for i in range(4):
            first.publish("acme", f"a{i}", random_adapter(i))
        covered = first.checkpoint()
        first.tag("acme/a1@1", "prod")
        want = [v.to_dict() for v in first.iter_versions()]
    # a standby taking over on another machine: no index there yet
    with Store.open(target.url, index_dir=str(tmp_path / "standby-index"), storage_options=target.storage_options,
                    ) as second:
        assert second.replica_stats.checkpoint_seq == covered + 1  # the first writer's checkpoint at close
        assert [v.to_dict() for v in second.iter_versions()] == want
        assert second.publish("acme", "a4", random_adapter(4)).seq == covered + 2
        assert second.resolve("acme/a1:prod") == second.resolve("acme/a1@1")
