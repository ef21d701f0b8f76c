"""Compaction never copies a damaged row; fsck names each kind of damage it finds (local and S3)."""

from __future__ import annotations

import numpy as np
import pytest

from mint_store.errors import DamagedAdapter, IntegrityError, StaleLocation
from mint_store.index.commit_log import log_key
from mint_store.maintenance.compaction import CompactionPolicy, compact
from mint_store.maintenance.fsck import fsck
from tests.support.factories import corrupt_byte, random_adapter
from tests.support.targets import StoreTarget


def truncate(storage, key: str, size: int) -> None:
    """Cut a stored object short: in place on disk, or by overwriting the S3 object."""
    path = storage.local_path(key)
    if path is not None:
        with open(path, "r+b") as f:
            f.truncate(size)
        return
    storage.put(key, storage.get(key)[:size])


def four_shards(store) -> dict[str, str]:
    """a0..a3 in four commits (four small shards of one layout); a0 deleted. Returns ref -> content id."""
    for i in range(4):
        store.publish("acme", f"a{i}", random_adapter(i))
    store.delete("acme/a0")
    return {f"acme/a{i}": store.resolve(f"acme/a{i}").content_id for i in range(1, 4)}


@pytest.mark.parametrize("damage", ["flipped byte", "shard missing"])
def test_compaction_refuses_to_copy_a_damaged_row(target: StoreTarget, damage: str) -> None:
    with target.open() as store:
        cids = four_shards(store)
        bad = store.resolve("acme/a1")
        if damage == "flipped byte":
            corrupt_byte(store.storage, bad.shard_key, bad.offset + 3)
        else:
            store.storage.delete(bad.shard_key)
        with pytest.raises(IntegrityError if damage == "flipped byte" else StaleLocation):
            store.read("acme/a1")  # never the wrong bytes: bytes that fail their content id, or none
        report = compact(store, CompactionPolicy())
        assert report.damaged == [cids["acme/a1"]]
        assert (report.rows_moved, report.rows_dropped) == (2, 1)
        # the damaged row stays where it was, its shard kept; proven unusable, it is quarantined
        assert bad.shard_key not in report.shards_retired and len(report.shards_retired) == 3
        moved = {store.resolve(r).shard_key for r in ("acme/a2", "acme/a3")}
        assert len(moved) == 1 and bad.shard_key not in moved
        for i in (2, 3):
            np.testing.assert_array_equal(store.read(f"acme/a{i}")[1], random_adapter(i).to_row()[1])
        with pytest.raises(DamagedAdapter):
            store.resolve("acme/a1")
        store.sweep(grace_s=0)
        found = fsck(store)
        assert found.clean and found.damaged == []
        assert [(d["content_id"], d["adapters"], d["shard"]) for d in found.held] == [
            (cids["acme/a1"], ["acme/a1@1"], bad.shard_key)]


def test_fsck_finds_a_missing_and_a_short_shard(target: StoreTarget) -> None:
    with target.open() as store:
        cids = four_shards(store)
        gone, short = store.resolve("acme/a1"), store.resolve("acme/a2")
        assert gone.shard_key != short.shard_key
        store.storage.delete(gone.shard_key)
        truncate(store.storage, short.shard_key, short.offset + short.length - 1)
        report = fsck(store)
        found = sorted((d["content_id"], d["shard"], d["reason"]) for d in report.damaged)
        assert found == sorted([
            (cids["acme/a1"], gone.shard_key, "shard missing"),
            (cids["acme/a2"], short.shard_key, "shard shorter than the recorded location"),
        ])
        assert not report.clean and report.orphans == [] and report.log_problems == []
        repaired = fsck(store, repair=True)  # quarantined: their refs refuse, never serve short bytes
        assert sorted(repaired.quarantined) == sorted([cids["acme/a1"], cids["acme/a2"]])
        for ref in ("acme/a1", "acme/a2"):
            with pytest.raises(DamagedAdapter):
                store.read(ref)
        np.testing.assert_array_equal(store.read("acme/a3")[1], random_adapter(3).to_row()[1])


def test_fsck_finds_log_objects_missing(target: StoreTarget) -> None:
    with target.open() as store:
        for i in range(3):
            store.publish("acme", f"a{i}", random_adapter(i))
        assert fsck(store).clean
        store.storage.delete(log_key(2))
        report = fsck(store)
        assert report.log_problems == ["log objects missing: seqs [2]"]
        assert not report.clean and report.damaged == [] and report.orphans == []
        store.storage.delete(log_key(3))  # the tail is gone: what is left is contiguous, the index ahead of it
        assert fsck(store).log_problems == ["the index is at seq 3, the log at 1"]


@pytest.mark.parametrize("quarantined", [True, False])
def test_compaction_settles_around_a_row_it_cannot_move(target: StoreTarget, quarantined: bool) -> None:
    """A shard kept for a row that cannot be moved (quarantined, or unreadable and not yet) is not
    a candidate again: counted as small, it paired with the shard the good rows had just moved into,
    and every pass (every minute, automatically) rewrote those rows and logged a compaction."""
    with target.open() as store:
        cids = four_shards(store)
        bad = store.resolve("acme/a1")
        corrupt_byte(store.storage, bad.shard_key, bad.offset + 3)
        if quarantined:
            assert fsck(store, repair=True).quarantined == [cids["acme/a1"]]
        first = compact(store, CompactionPolicy())
        assert first.rows_moved == 2
        settled = store.last_seq
        for _ in range(3):
            again = compact(store, CompactionPolicy())
            assert (again.rows_moved, again.shards_retired) == (0, [])
        assert store.last_seq == settled  # nothing more committed
        for i in (2, 3):
            np.testing.assert_array_equal(store.read(f"acme/a{i}")[1], random_adapter(i).to_row()[1])


def test_reindex_rebuilds_a_store_whose_lost_shard_fsck_quarantined(local_target: StoreTarget) -> None:
    """fsck --repair quarantines the rows of a lost shard; reindex (the documented rebuild of a
    damaged index) refused such a store until the versions were deleted and compacted away."""
    from mint_store.maintenance.reindex import rebuild_index
    from mint_store.storage import open_storage

    with local_target.open() as store:
        cids = four_shards(store)
        gone = store.resolve("acme/a1")
        store.storage.delete(gone.shard_key)
        assert fsck(store, repair=True).quarantined == [cids["acme/a1"]]
    rebuild_index(open_storage(local_target.url), local_target.index_dir)
    with local_target.open() as store:
        with pytest.raises(DamagedAdapter):
            store.read("acme/a1")
        np.testing.assert_array_equal(store.read("acme/a2")[1], random_adapter(2).to_row()[1])
