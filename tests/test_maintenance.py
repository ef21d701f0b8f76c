"""Compaction, sweep, fsck and repair on a live store (local and S3)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mint_store.errors import DamagedAdapter, IntegrityError, StaleLocation
from mint_store.maintenance.compaction import CompactionPolicy, compact, plan
from mint_store.maintenance.fsck import fsck
from mint_store.maintenance.stats import store_stats
from tests.support.factories import corrupt_byte, random_adapter
from tests.support.targets import StoreTarget


def rows_of(store, refs):
    return {ref: store.read(ref)[1].tobytes() for ref in refs}


def test_compaction_merges_sparse_and_small_shards(target: StoreTarget) -> None:
    with target.open() as store:
        for i in range(6):  # six commits: six small shards of one layout
            with store.held_commits():
                futs = [store.publish_async("acme", f"a{i}-{j}", random_adapter(10 * i + j)) for j in range(3)]
            [f.result() for f in futs]
        for i in range(3):
            store.delete(f"acme/a{i}-0")
        live = [v.ref for v in store.iter_versions() if not v.deleted]
        before = rows_of(store, live)
        cids = {ref: store.resolve(ref).content_id for ref in live}
        old_locs = {ref: store.resolve(ref) for ref in live}
        assert store_stats(store)["shards"] == 6
        report = compact(store, CompactionPolicy())
        assert report.shards_before == 6 and report.shards_after == 1
        assert report.rows_moved == 15 and report.rows_dropped == 3 and len(report.shards_retired) == 6
        assert rows_of(store, live) == before
        assert {ref: store.resolve(ref).content_id for ref in live} == cids  # content ids never change
        # an engine holding an old location still reads valid bytes until the sweep
        for ref, loc in old_locs.items():
            assert store.read_row(loc).tobytes() == before[ref]
        assert store.sweep(grace_s=3600) == []  # within the grace period nothing goes
        swept = store.sweep(grace_s=0)
        assert sorted(swept) == sorted(report.shards_retired)
        ref, loc = next(iter(old_locs.items()))
        with pytest.raises(StaleLocation):
            store.read_row(loc)
        assert store.read(ref)[1].tobytes() == before[ref]  # re-resolving finds the new shard
        assert fsck(store).clean
        assert plan(store, CompactionPolicy()) == []  # nothing left to do


def test_compaction_while_publishing_and_reading(target: StoreTarget) -> None:
    with target.open() as store:
        for i in range(8):
            store.publish("acme", f"seed{i}", random_adapter(i))
        stop = threading.Event()
        errors: list[BaseException] = []
        published: list = []

        def publisher() -> None:
            i = 100
            while i < 140 and (i < 103 or not stop.is_set()):  # a few publishes, whatever the timing
                try:
                    published.append(store.publish("acme", f"live{i % 5}", random_adapter(i)))
                except BaseException as e:  # reported below: a failed publish fails the test
                    errors.append(e)
                i += 1

        def reader() -> None:
            while not stop.is_set():
                for j in range(8):
                    try:
                        _, row = store.read(f"acme/seed{j}")
                        if not np.array_equal(row, random_adapter(j).to_row()[1]):
                            errors.append(AssertionError(f"wrong bytes for seed{j}"))
                    except BaseException as e:  # reported below
                        errors.append(e)

        threads = [threading.Thread(target=publisher), threading.Thread(target=reader)]
        for t in threads:
            t.start()
        reports = [compact(store, CompactionPolicy(min_small_shards=2)) for _ in range(3)]
        stop.set()
        for t in threads:
            t.join()
        assert not errors
        assert len(published) >= 3
        assert sum(r.rows_moved for r in reports) > 0
        versions = {}
        for r in published:
            versions.setdefault(r.name, []).append(r.version)
        for name, vs in versions.items():
            assert sorted(vs) == list(range(1, len(vs) + 1))  # no lost or duplicated version
            for v in vs:
                store.read(f"acme/{name}@{v}")
        assert fsck(store).clean


def test_fsck_finds_and_repairs_damage_and_orphans(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish("acme", "good", random_adapter(1))
        store.publish("acme", "bad", random_adapter(2))
        store.publish("beta", "also-bad", random_adapter(2))  # same bytes, another tenant
        assert fsck(store).clean
        loc = store.resolve("acme/bad")
        corrupt_byte(store.storage, loc.shard_key, loc.offset + 3)
        store.storage.put("packs/junk/rows/c/0/0", b"orphan")
        report = fsck(store)
        assert not report.clean
        assert [d["adapters"] for d in report.damaged] == [["acme/bad@1", "beta/also-bad@1"]]
        assert report.damaged[0]["reason"] == "bytes do not match the content id"
        assert report.orphans == ["packs/junk/rows/c/0/0"]
        repaired = fsck(store, repair=True)
        assert repaired.quarantined == [loc.content_id] and repaired.removed == ["packs/junk/rows/c/0/0"]
        with pytest.raises(DamagedAdapter):
            store.read("acme/bad")
        store.read("acme/good")
        assert repaired.clean and [d["adapters"] for d in repaired.held] == [["acme/bad@1", "beta/also-bad@1"]]
        after = fsck(store)  # the same answer without --repair: held, not damaged (repair cannot help)
        assert after.clean and after.orphans == [] and after.damaged == []
        assert [d["content_id"] for d in after.held] == [loc.content_id]
        # publishing the same bytes again heals every version that holds them
        store.publish("acme", "fix", random_adapter(2))
        _, row = store.read("beta/also-bad")
        np.testing.assert_array_equal(row, random_adapter(2).to_row()[1])
        assert fsck(store).clean


def test_repair_quarantines_only_rows_still_damaged_where_they_are_now(local_target: StoreTarget) -> None:
    """fsck's scan reads every row from one snapshot, which can take hours; a compaction
    meanwhile moves rows and sweeps their old shards, so the scan may read a live row as gone.
    Repair's quarantine reads each row again where the index places it now."""
    with local_target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        store.publish("acme", "b", random_adapter(2))
        store.publish("acme", "c", random_adapter(3))
        store.delete("acme/a")
        moved = store.resolve("acme/b")
        assert compact(store, CompactionPolicy()).rows_moved >= 1  # small shards merged: b moves
        assert moved.shard_key in store.sweep(grace_s=0)  # and its old shard goes
        assert store.resolve("acme/b").shard_key != moved.shard_key
        assert not store.storage.exists(moved.shard_key)  # where an earlier scan read b: gone
        bad = store.resolve("acme/c")
        corrupt_byte(store.storage, bad.shard_key, bad.offset + 3)
        assert store.quarantine([moved.content_id, bad.content_id], recheck=True) == [bad.content_id]
        store.read("acme/b")  # intact where it is: not marked
        with pytest.raises(DamagedAdapter):
            store.read("acme/c")
        assert store.quarantine([moved.content_id]) == [moved.content_id]  # an operator's own call: as asked
        with pytest.raises(DamagedAdapter):
            store.read("acme/b")


def test_a_shard_left_empty_by_a_healing_republish_is_retired_and_swept(target: StoreTarget) -> None:
    """Publishing a quarantined row's bytes again writes them to a new shard; the old shard,
    whose only row that was, is retired by the next compaction (in its logged event) and swept
    (nothing freed it: compaction planned only shards with rows, the sweep takes retired ones,
    and fsck sees no orphan in an indexed shard)."""
    with target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        old = store.resolve("acme/a")
        corrupt_byte(store.storage, old.shard_key, old.offset + 3)
        assert fsck(store, repair=True).quarantined == [old.content_id]
        healed = store.publish("acme", "again", random_adapter(1))
        assert healed.content_id == old.content_id and store.resolve("acme/a").shard_key != old.shard_key
        store.read("acme/a")
        assert old.shard_key in compact(store, CompactionPolicy()).shards_retired
        assert old.shard_key in store.sweep(grace_s=0)
        assert not store.storage.exists(old.shard_key) and fsck(store).clean
        assert compact(store, CompactionPolicy()).shards_retired == []  # nothing left to retire


def test_fsck_reports_log_index_disagreement(local_target: StoreTarget) -> None:
    with local_target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        with store._idx().write() as w:  # an index that lies about a version
            rec = w.get("names", b"acme/a")
            rec["next"] = 99
            w.put("names", b"acme/a", rec)
        problems = fsck(store).log_problems
        assert problems and "names" in problems[0]


def test_a_layout_table_the_index_got_wrong_is_refused(local_target: StoreTarget) -> None:
    """The layout id is the table's hash: an index record holding another table (same row size,
    another base here) must not map a row's bytes onto modules."""
    with local_target.open() as store:
        loc = store.publish("acme", "a", random_adapter(1))
        with store._idx().write() as w:
            rec = w.get("layouts", loc.layout_id.encode())
            w.put("layouts", loc.layout_id.encode(), dict(rec, layout=dict(rec["layout"], base="another-base")))
        with pytest.raises(IntegrityError, match="hashes to"):
            store.layout(loc.layout_id)
        with pytest.raises(IntegrityError):
            store.load("acme/a")


def test_stats(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        store.publish("acme", "b", random_adapter(1))
        store.publish("acme", "c", random_adapter(2))
        s = store_stats(store)
        assert (s["adapters"], s["versions"], s["rows"], s["layouts"]) == (3, 3, 2, 1)
        assert s["dedup_savings_bytes"] == s["bytes_live"] // 2
        assert sum(s["live_ratio_histogram"].values()) == s["shards"]


def test_an_index_snapshot_is_one_consistent_read(target: StoreTarget) -> None:
    """What the admin tools walk: a publish committed while a snapshot is open is not in it, and
    is in the next one."""
    with target.open() as store:
        store.publish("acme", "first", random_adapter(1))
        with store.index_snapshot() as t:
            before = t.count("names")
            store.publish("acme", "second", random_adapter(2))  # committed by the writer meanwhile
            assert t.count("names") == before == 1
        with store.index_snapshot() as t:
            assert t.count("names") == 2
        assert store.index_bytes() > 0


def test_fsck_reports_and_aborts_a_multipart_upload_a_killed_writer_left(s3_endpoint: str, tmp_path) -> None:
    """An S3 object of 100 MiB or more goes up in parts; a writer killed midway leaves the parts,
    never listed as an object (and billed). fsck reports them once older than the grace period
    (younger: a live writer's) and --repair aborts them."""
    from fsspec.asyn import sync

    from tests.support.targets import make_bucket, s3_options

    bucket = make_bucket(s3_endpoint)
    target = StoreTarget("s3", f"s3://{bucket}/mint", str(tmp_path / "index"), s3_options(s3_endpoint))
    with target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        fs = store.storage.fs
        key = "mint/packs/big/rows/c/0/0"
        upload = sync(fs.loop, fs._call_s3, "create_multipart_upload", Bucket=bucket, Key=key)
        sync(fs.loop, fs._call_s3, "upload_part", Bucket=bucket, Key=key, UploadId=upload["UploadId"],
             PartNumber=1, Body=b"x" * 1024)
        other = sync(fs.loop, fs._call_s3, "create_multipart_upload", Bucket=bucket, Key="elsewhere/x")  # not ours
        foreign = sync(fs.loop, fs._call_s3, "create_multipart_upload", Bucket=bucket, Key="mint/notes.txt")
        assert ("packs/big/rows/c/0/0", upload["UploadId"]) in [u[:2] for u in store.storage.incomplete_uploads()]
        # within the grace period: taken for a live writer's (moto dates every upload 2010: a grace
        # longer than that stands in for "just begun")
        assert fsck(store, upload_grace_s=1e10).clean
        report = fsck(store)
        assert not report.clean and [u["key"] for u in report.incomplete_uploads] == ["packs/big/rows/c/0/0"]
        repaired = fsck(store, repair=True)
        assert repaired.aborted == ["packs/big/rows/c/0/0"] and repaired.clean
        assert [u[0] for u in store.storage.incomplete_uploads()] == ["notes.txt"]
        # credentials that may not list uploads: noted, and the rest of the check still runs
        def refused() -> list[tuple[str, str, float]]:
            raise PermissionError("AccessDenied: s3:ListBucketMultipartUploads")

        store.storage.incomplete_uploads = refused  # type: ignore[method-assign]
        noted = fsck(store)
        assert noted.clean and noted.rows_checked == 1 and "not checked" in noted.notes[0]
        left = sync(fs.loop, fs._call_s3, "list_multipart_uploads", Bucket=bucket)["Uploads"]
        # outside the store, or under its prefix but not a key the store writes: untouched
        assert sorted(u["UploadId"] for u in left) == sorted([other["UploadId"], foreign["UploadId"]])
