"""A commit the previous writer had in flight when it lost its lease lands after the new
writer's take-over replay (create-only log: it owns that seq). The new writer must apply it,
fail only its own colliding commit (nothing of it was logged), and keep accepting writes --
never stop as if it were the fenced one, and never answer its caller with the other commit."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest

from mint_store import CommitConflict, Store
from mint_store.config import StoreConfig
from mint_store.errors import AdapterNotFound
from mint_store.index.commit_log import CommitLog
from mint_store.storage import LocalStorage
from mint_store.storage.retry import RetryPolicy
from tests.support.factories import random_adapter


def _late_tag_commit(store: Store) -> Any:
    """Publish t/a, then log the previous writer's late commit after it (the zombie's: planned on
    the state at that seq, with the previous epoch): it tags t/a@1 "zombie". Returns the publish."""
    first = store.publish("t", "a", random_adapter(1, rank=2))
    lease = store._writer.lease if store._writer is not None else None
    assert lease is not None
    late = {"seq": first.seq + 1, "time": time.time(), "kind": "tag", "tenant": "t", "name": "a",
            "version": first.version, "tag": "zombie", "epoch": lease.epoch - 1}
    CommitLog(store.storage).write(late)
    return first


def test_a_late_commit_of_the_previous_writer_is_applied_and_the_writer_goes_on(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "store"), index_dir=str(tmp_path / "index")) as store:
        first = _late_tag_commit(store)
        with pytest.raises(CommitConflict, match="send it again"):
            store.publish("t", "b", random_adapter(2, rank=2))
        assert store.resolve("t/a:zombie").content_id == first.content_id  # applied, as replicas do
        assert store.health()["writable"]
        again = store.publish("t", "b", random_adapter(2, rank=2))  # the writer goes on
        assert again.seq == first.seq + 2 and again.version == 1
        assert store.resolve("t/b").content_id == again.content_id
    with Store.open(str(tmp_path / "store"), index_dir=str(tmp_path / "index2"), readonly=True) as replica:
        assert replica.resolve("t/a:zombie").content_id == first.content_id
        assert replica.resolve("t/b").content_id == again.content_id


class LateCommitThenReset(LocalStorage):
    """The real LocalStorage. Armed: our next log object finds the previous writer's late commit
    landing at its seq first, and our own create then fails with a reset (not ObjectExists)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.late: dict | None = None

    def put_if_absent(self, key: str, data: Any) -> None:
        late, self.late = (self.late, None) if key.startswith("log/") else (None, self.late)
        if late is not None:
            CommitLog(LocalStorage(self.root)).write(late | {"seq": int(key[4:-5])})
            raise OSError(errno.ECONNRESET, os.strerror(errno.ECONNRESET), key)
        super().put_if_absent(key, data)


def test_a_commit_that_fails_while_the_previous_writers_lands_at_its_seq_is_not_answered_as_ours(
        tmp_path: Path) -> None:
    """Recovery replays the other commit at our seq; that seq being in the index does not make
    our commit durable. Answered as committed, the caller would hold a version whose row is the
    other writer's (or nothing)."""
    storage = LateCommitThenReset(tmp_path / "store")
    config = StoreConfig(retry=RetryPolicy(attempts=1, base_s=0.001, max_s=0.01))
    with Store(storage, config, str(tmp_path / "index")) as store:
        first = store.publish("t", "a", random_adapter(1, rank=2))
        lease = store._writer.lease if store._writer is not None else None
        assert lease is not None
        storage.late = {"time": time.time(), "kind": "tag", "tenant": "t", "name": "a",
                        "version": first.version, "tag": "zombie", "epoch": lease.epoch - 1}
        with pytest.raises(CommitConflict, match=r"another writer's commit .* send it again"):
            store.publish("t", "b", random_adapter(2, rank=2))
        assert store.resolve("t/a:zombie").content_id == first.content_id  # theirs, applied
        with pytest.raises(AdapterNotFound):
            store.resolve("t/b")  # ours: not committed, and not claimed
        again = store.publish("t", "b", random_adapter(2, rank=2))
        assert again.seq == first.seq + 2 and store.resolve("t/b").content_id == again.content_id


def test_removing_orphans_first_takes_the_next_seq_so_a_paused_writers_commit_is_refused(tmp_path: Path) -> None:
    """The previous writer wrote its shards, passed its lease check and paused before its log
    object; fsck --repair (holding the lease now) finds the shards orphans. Deleting them while
    that seq is free would let the paused writer commit rows that are gone, and acknowledge it."""
    from mint_store.maintenance.fsck import fsck

    with Store.open(str(tmp_path / "store"), index_dir=str(tmp_path / "index")) as store:
        first = store.publish("t", "a", random_adapter(1, rank=2))
        lease = store._writer.lease if store._writer is not None else None
        assert lease is not None
        shard = "packs/paused/rows/c/0/0"  # what the paused writer wrote before its commit
        store.storage.put(shard, b"rows of a commit not logged yet")
        assert store.remove_orphans([shard]) == [shard] and not store.storage.exists(shard)
        paused = {"seq": first.seq + 1, "time": time.time(), "kind": "tag", "tenant": "t", "name": "a",
                  "version": first.version, "tag": "late", "epoch": lease.epoch - 1}
        with pytest.raises(CommitConflict):
            CommitLog(store.storage).write(paused)  # its log object: that seq is taken
        assert store.last_seq == first.seq + 1 and fsck(store).clean
        assert store.remove_orphans([]) == [] and store.last_seq == first.seq + 1  # nothing to do: no event


def test_an_orphan_shard_of_the_previous_writer_is_planned_past_and_the_writer_goes_on(tmp_path: Path) -> None:
    """The writer before this one, paused past its lease, resized a pack and wrote its next shard
    before its commit was fenced: an orphan no commit names. This writer's next shard of that
    layout took the same name: ShardTaken stopped the writer for good (every write StoreClosed)
    while its lease thread kept the store from any standby. Now it plans again past it."""
    import numpy as np

    from mint_store.format.packs import Pack, geometry_for
    from mint_store.maintenance.fsck import fsck

    with Store.open(tmp_path / "store", index_dir=str(tmp_path / "index")) as store:
        store.publish("acme", "a", random_adapter(1))
        layout = random_adapter(2).layout
        assert random_adapter(1).layout.layout_id == layout.layout_id
        with store.index_snapshot() as t:
            rec = t.get("layouts", layout.layout_id.encode())
        geometry = type(geometry_for(layout.row_nbytes))(layout.row_nbytes, rec["rows_per_shard"], rec["chunk_cols"])
        theirs = Pack.open_or_create(store.storage, store.storage.zarr_store(), layout, geometry)  # a fresh view
        start = theirs.next_free_row(0)
        # two shards of theirs: our own resize (to one shard past ours) then hides the second one's
        # row count from the stored shape, so only looking for taken names gets past both
        placed = theirs.write_rows(start, np.zeros((geometry.rows_per_shard + 1, layout.row_nbytes), np.uint8))
        orphans = sorted({p.shard_key for p in placed})
        assert len(orphans) == 2
        got = store.publish("acme", "b", random_adapter(2))  # the same layout: its next shard is the orphan's name
        assert store.resolve("acme/b").shard_key not in orphans and got.version == 1
        assert store.publish("acme", "c", random_adapter(3)).version == 1  # the writer goes on
        np.testing.assert_array_equal(store.read("acme/b")[1], random_adapter(2).to_row()[1])
        assert set(orphans) <= set(fsck(store).orphans)


def test_a_late_commit_landing_while_the_writer_is_idle_is_applied_without_waiting_for_a_write(
        tmp_path: Path) -> None:
    """The previous writer passed its lease check, paused, then logged its commit at the next free
    seq after the take-over (and answered it): replicas served it while this writer, idle,
    answered AdapterNotFound for it until its next commit found the seq taken."""
    from mint_store.errors import TagNotFound

    with Store.open(str(tmp_path / "store"), index_dir=str(tmp_path / "index"), lease_ttl_s=2.0,
                    lease_renew_s=0.1) as store:
        first = _late_tag_commit(store)
        for _ in range(600):  # bounded wait for the idle writer's next look (every lease_renew_s)
            try:
                assert store.resolve("t/a:zombie").content_id == first.content_id
                break
            except TagNotFound:
                time.sleep(0.05)
        else:
            raise AssertionError("the late commit was never applied by the idle writer")
        assert store.publish("t", "b", random_adapter(2, rank=2)).seq == first.seq + 2  # no conflict: caught up
