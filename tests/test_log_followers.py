"""Replicas survive stray objects in ``log/`` and gaps in the log, and say when they are not
following (security review, finding 2).

Real stores on a local directory and on moto's S3 (ThreadedMotoServer on loopback), a real
writer and real read-only stores; each poll is a ``refresh()`` (no follower thread), so the
number of polls a gap is waited on is exact, never a matter of time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mint_store.errors import IntegrityError, LogGap
from mint_store.fleet.replica import catch_up
from mint_store.fleet.replica_stats import FAILURES_DEGRADED, GAP_POLLS, ReplicaStats
from mint_store.index.checkpoint import manifest_key
from mint_store.index.commit_log import CommitLog, log_key, seq_of_key
from mint_store.index.log_listing import LogListing, list_log_after
from mint_store.storage import open_storage
from mint_store.store import Store
from tests.support.factories import random_adapter
from tests.support.targets import StoreTarget
from tests.test_replicas import replica_of, same_view

# no checkpoint but the ones a test writes: a background one could cover a gap by chance
QUIET = {"checkpoint_every": 10**6, "checkpoint_interval_s": 10**6}
STRAYS = ["log/backup-1.json", "log/00000000000000000001.json.bak", "log/old/00000000000000000001.json",
          "log/0000000000000000000².json"]


def _writer(target: StoreTarget) -> Store:
    return target.open(**QUIET)


def _replica(target: StoreTarget, tmp_path: Path, name: str = "r") -> Store:
    return replica_of(target, str(tmp_path / name), follow_interval_s=0)


def test_the_writer_grammar_is_the_only_log_key() -> None:
    assert seq_of_key(log_key(7)) == 7
    for key in [*STRAYS, "log/00000000000000000000.json", "log/7.json", "log/.00000000000000000001.json.x.tmp",
                "checkpoints/00000000000000000001.json", f"{log_key(1)}x"]:
        assert seq_of_key(key) is None, key


def test_a_stray_object_in_the_log_is_skipped_and_counted(target: StoreTarget, tmp_path: Path) -> None:
    with _writer(target) as writer:
        writer.publish("acme", "a", random_adapter(1))
        with _replica(target, tmp_path) as replica:
            for key in STRAYS:
                writer.storage.create(key, b'{"seq": 1}')
            writer.publish("acme", "b", random_adapter(2))
            assert replica.refresh() == 1
            for _ in range(3):  # a stray that sorts after the head comes back in every listing
                assert replica.refresh() == 0
            stats = replica.replica_stats
            assert stats.foreign_log_objects == len(STRAYS)  # a local store's listing names log/old once
            assert stats.reason is None and stats.reloads == 0 and stats.last_error is None
            same_view(writer, replica)
            writer.tag("acme/a@1", "prod")  # still following
            assert replica.refresh() == 1
            same_view(writer, replica)
        # a new replica builds its index past them too
        with _replica(target, tmp_path, "fresh") as fresh:
            same_view(writer, fresh)
            assert fresh.replica_stats.foreign_log_objects == len(STRAYS)  # a local store's listing names log/old once
            assert fresh.health()["replica"]["following"] is True
        assert sorted(CommitLog(writer.storage).all_seqs()) == [1, 2, 3]  # fsck's and reindex's listing


def test_an_s3_listing_walks_past_pages_of_foreign_keys(target: StoreTarget) -> None:
    """Foreign keys between two seqs fill whole pages (S3: the listing pages on past them; a local
    store lists the directory whole): the next seq is found behind them."""
    storage = open_storage(target.url, storage_options=target.storage_options)
    try:
        storage.create(log_key(1), b"{}")
        storage.create(log_key(2), b"{}")
        for i in range(5):
            storage.create(f"{log_key(1)}.bak{i}", b"{}")
            storage.create(f"log/zz-{i}.json", b"{}")
        got = list_log_after(storage, 1, limit=2)
        assert got.seqs == [2]
        assert set(got.foreign) >= {f"{log_key(1)}.bak{i}" for i in range(5)}
        assert list_log_after(storage, 2, limit=2).seqs == []  # only foreign keys after the head
    finally:
        storage.close()


def test_a_gap_is_waited_on_then_reported_and_heals(target: StoreTarget, tmp_path: Path) -> None:
    with _writer(target) as writer:
        writer.publish("acme", "a", random_adapter(1))
        writer.publish("acme", "b", random_adapter(2))
        with _replica(target, tmp_path) as replica:
            writer.tag("acme/a@1", "x")
            writer.tag("acme/a@1", "y")
            held = writer.storage.get(log_key(3))
            writer.storage.delete(log_key(3))  # seq 4 is there, 3 is not
            stats = replica.replica_stats
            for poll in range(1, GAP_POLLS + 1):
                assert replica.refresh() == 0  # waited on: no error, no reload, no rewind
                assert stats.gap is not None and stats.gap["polls"] == poll and stats.reason is None
                assert replica.last_seq == 2 and stats.reloads == 0
            with pytest.raises(LogGap) as err:
                replica.refresh()
            assert err.value.after == 2 and err.value.next_seq == 4 and log_key(3) in str(err.value)
            assert stats.reason == "log_gap" and replica.health()["replica"]["following"] is False
            assert replica.last_seq == 2 and stats.reloads == 0
            writer.storage.create(log_key(3), held)  # restored: the replica goes on by itself
            assert replica.refresh() == 2
            assert stats.reason is None and stats.gap is None and stats.failures == 0
            same_view(writer, replica)


def test_a_gap_past_the_newest_checkpoint_never_reloads_it(target: StoreTarget, tmp_path: Path) -> None:
    """The newest checkpoint is older than the gap: reloading it cannot help, so it is not
    reloaded (the bug reloaded it at every poll and rewound the index each time)."""
    with _writer(target) as writer:
        writer.publish("acme", "a", random_adapter(1))
        assert writer.checkpoint() == 1
        writer.tag("acme/a@1", "x")
        with _replica(target, tmp_path) as replica:
            assert replica.last_seq == 2
            writer.tag("acme/a@1", "y")
            writer.tag("acme/a@1", "z")
            writer.storage.delete(log_key(3))
            stats = replica.replica_stats
            for _ in range(GAP_POLLS):
                replica.refresh()
                assert replica.last_seq == 2  # never rewound to the checkpoint at 1
            assert stats.reloads == 0
            with pytest.raises(LogGap):
                replica.refresh()
            covered = writer.checkpoint()  # the writer's index holds seq 3: its checkpoint covers the hole
            assert covered == 4
            replica.refresh()
            assert stats.reloads == 1 and stats.checkpoint_seq == 4 and stats.reason is None
            same_view(writer, replica)


def test_a_rejected_checkpoint_is_not_fetched_again_at_every_poll(local_target: StoreTarget,
                                                                  tmp_path: Path) -> None:
    with _writer(local_target) as writer:
        writer.publish("acme", "a", random_adapter(1))
        with _replica(local_target, tmp_path) as replica:
            writer.tag("acme/a@1", "x")
            writer.tag("acme/a@1", "y")
            bad = writer.checkpoint()
            writer.storage.put(manifest_key(bad), b"{not json")
            writer.storage.delete(log_key(2))
            for _ in range(GAP_POLLS):
                replica.refresh()
            stats = replica.replica_stats
            assert len(stats.rejected_checkpoints) == 1 and stats.reloads == 0 and replica.last_seq == 1


def test_a_gap_at_open_serves_the_prefix_before_it(target: StoreTarget, tmp_path: Path) -> None:
    with _writer(target) as writer:
        writer.publish("acme", "a", random_adapter(1))
        writer.tag("acme/a@1", "x")
        writer.tag("acme/a@1", "y")
        writer.storage.delete(log_key(2))
        with _replica(target, tmp_path) as replica:  # the bug: the open raised LogGap
            assert replica.last_seq == 1
            assert replica.version("acme/a@1").version == 1
            assert replica.replica_stats.gap is not None and replica.replica_stats.gap["after"] == 1


def test_a_lagging_listing_is_read_past_by_gets(local_target: StoreTarget, tmp_path: Path) -> None:
    """A listing that names seq 3 but not 2 (a store that lists late): a GET finds 2, nothing is a gap."""
    with _writer(local_target) as writer:
        writer.publish("acme", "a", random_adapter(1))
        with _replica(local_target, tmp_path) as replica:
            writer.tag("acme/a@1", "x")
            writer.tag("acme/a@1", "y")
            stats = ReplicaStats()
            index: Any = replica._idx()
            assert catch_up(replica.storage, index, stats, listed=(1, LogListing(seqs=[3]))) == 2
            assert stats.gap is None
            same_view(writer, replica)


def test_polls_that_keep_failing_say_not_following(local_target: StoreTarget, tmp_path: Path) -> None:
    with _writer(local_target) as writer:
        writer.publish("acme", "a", random_adapter(1))
        with _replica(local_target, tmp_path) as replica:
            writer.tag("acme/a@1", "x")
            good = writer.storage.get(log_key(2))
            writer.storage.put(log_key(2), b"{torn")
            stats = replica.replica_stats
            for n in range(1, FAILURES_DEGRADED + 1):
                assert stats.reason is None
                with pytest.raises(IntegrityError):
                    replica.refresh()
                assert stats.failures == n
            health = replica.health()["replica"]
            assert health["reason"] == "not_following" and health["since"] is not None
            writer.storage.put(log_key(2), good)
            assert replica.refresh() == 1
            assert stats.reason is None and stats.last_error is None
