"""Block tables (mint_store.format.blocks) live and die with their shards: written with a publish,
anchored in the commit (and so in a rebuilt index), swept with their shard after a compaction,
and orphans for fsck when their shard is gone. On a local directory and on S3 (moto)."""

from __future__ import annotations

import pytest

from mint_store.format import blocks
from mint_store.maintenance.compaction import CompactionPolicy, compact
from mint_store.maintenance.fsck import fsck
from mint_store.read.vread import row_block_digests
from tests.support.factories import random_adapter
from tests.support.targets import StoreTarget


@pytest.fixture(autouse=True)
def fine_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "MIN_ROW_BYTES", 0)  # these small rows get tables too
    monkeypatch.setattr(blocks, "MIN_BLOCK_BYTES", 1)


def test_block_tables_follow_their_shards_through_compaction_and_sweep(target: StoreTarget) -> None:
    with target.open() as store:
        for i in range(3):  # three commits: three shards, three tables
            store.publish("acme", f"a{i}", random_adapter(i))
        tables = store.storage.list("blocks/")
        assert len(tables) == 3
        loc = store.resolve("acme/a1")
        got = row_block_digests(store, loc)
        assert got is not None and got.grid == blocks.Grid(blocks.BLOCKS, 1)
        assert fsck(store).clean  # a table of a live shard is no orphan

        report = compact(store, CompactionPolicy())
        assert len(report.shards_retired) == 3
        assert row_block_digests(store, store.resolve("acme/a1")) is None  # moved rows: read whole
        assert sorted(store.sweep(grace_s=0)) == sorted(report.shards_retired)
        assert store.storage.list("blocks/") == []  # swept with their shards
        assert fsck(store).clean


def test_a_table_whose_shard_is_gone_is_an_orphan_and_repair_removes_it(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish("acme", "a", random_adapter(0))
        loc = store.resolve("acme/a")
        stray = blocks.table_key(loc.shard_key.replace("/rows/c/", "/rows/c/9"))  # no such shard
        store.storage.put(stray, b"left by a crash")
        report = fsck(store)
        assert report.orphans == [stray]
        fsck(store, repair=True)
        assert store.storage.list("blocks/") == [blocks.table_key(loc.shard_key)]
        assert fsck(store).clean


def test_a_rebuilt_index_keeps_the_anchors(local_target: StoreTarget) -> None:
    from mint_store.maintenance.reindex import rebuild_index
    from mint_store.storage import open_storage

    with local_target.open() as store:
        store.publish("acme", "a", random_adapter(0))
        loc = store.resolve("acme/a")
        before = row_block_digests(store, loc)
    rebuild_index(open_storage(local_target.url), local_target.index_dir)  # from the commit log
    with local_target.open() as store:
        assert before is not None and row_block_digests(store, store.resolve("acme/a")) == before
