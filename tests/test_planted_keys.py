"""Keys planted in the log never reach a read, a delete or a tenant (security review, finding 1).

The reported attacks, reproduced: a compact event (the next seq, written as the writer writes
it) moving a row to ``/path/of/tokens.json`` made a replica serve the token file as the
adapter's bytes, and one saying ``"time": 0, "retired": ["/any/file"]`` made ``sweep`` delete a
file outside the store. Real stores on a local directory and real replicas (serving:
tests/service/test_planted_rows.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from mint_store.errors import IntegrityError, InvalidKey
from mint_store.format.keys import check_event_keys, check_shard_key
from mint_store.index.commit_log import log_key
from mint_store.storage import Storage
from mint_store.store import Store
from tests.support.factories import random_adapter
from tests.support.targets import StoreTarget
from tests.test_replicas import replica_of

QUIET = {"checkpoint_every": 10**6, "checkpoint_interval_s": 10**6}  # the log alone is replayed
OUTSIDE = ["absolute", "dot-dot", "dot-dot inside packs/"]


def _outside_key(kind: str, store_root: str, outside: Path, layout_id: str) -> str:
    rel = os.path.relpath(outside, store_root)  # "../tokens.json"
    return {"absolute": str(outside), "dot-dot": rel, "dot-dot inside packs/": f"packs/{layout_id}/../../{rel}"}[kind]


def _plant(storage: Storage, last_seq: int, **fields: Any) -> dict[str, Any]:
    """The next log object, as CommitLog.write writes one (the writer's epoch copied)."""
    prev = json.loads(storage.get(log_key(last_seq)))
    event = {"seq": last_seq + 1, "time": time.time(), **fields}
    if "epoch" in prev:
        event["epoch"] = prev["epoch"]
    storage.create(log_key(last_seq + 1), json.dumps(event, separators=(",", ":")).encode())
    return event


def _move_to(loc: Any, key: str, offset: int = 0) -> dict[str, Any]:
    return {"kind": "compact", "layout_id": loc.layout_id, "length": loc.length,
            "moves": [[loc.content_id, loc.row, key, offset]], "drops": [], "retired": []}


@pytest.mark.parametrize("kind", OUTSIDE)
def test_a_planted_move_outside_the_store_is_not_applied(local_target: StoreTarget, tmp_path: Path,
                                                         kind: str) -> None:
    secret = tmp_path / "tokens.json"
    secret.write_bytes(b'{"tokens": [{"token": "s3cr3t"}]}' * 64)
    with local_target.open(**QUIET) as writer:
        writer.publish("acme", "a", random_adapter(1))
        loc = writer.resolve("acme/a@1")
        with replica_of(local_target, str(tmp_path / "r"), follow_interval_s=0) as replica:
            key = _outside_key(kind, local_target.url, secret, loc.layout_id)
            event = _plant(writer.storage, writer.last_seq, **_move_to(loc, key))
            with pytest.raises(InvalidKey, match="packs/<layout id>/rows/c/<n>/0"):
                check_event_keys(event)
            with pytest.raises(IntegrityError):
                replica.refresh()  # reported, nothing of it applied
            stats = replica.replica_stats
            assert stats.failures == 1 and "InvalidKey" in (stats.last_error or "")
            assert replica.last_seq == event["seq"] - 1
            assert replica.resolve("acme/a@1") == loc  # still its real location
            assert bytes(replica.storage.read_range(loc.shard_key, loc.offset, loc.length)) != secret.read_bytes()
        # a fresh replica's open (the whole log replayed) refuses it too
        with pytest.raises(IntegrityError):
            replica_of(local_target, str(tmp_path / "fresh"), follow_interval_s=0).close()
    assert secret.exists()


def _reopened(target: StoreTarget) -> Store:
    return target.open(**QUIET)


@pytest.mark.parametrize("kind", OUTSIDE)
def test_a_planted_retirement_never_deletes_a_file_outside_the_store(local_target: StoreTarget, tmp_path: Path,
                                                                     kind: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("not the store's")
    with local_target.open(**QUIET) as writer:
        writer.publish("acme", "a", random_adapter(1))
        loc = writer.resolve("acme/a@1")
        last = writer.last_seq
    key = _outside_key(kind, local_target.url, victim, loc.layout_id)
    _plant(open_local(local_target), last, kind="compact", layout_id=loc.layout_id, length=loc.length, moves=[],
           drops=[], retired=[key], time=0)
    # the writer's replay refuses it: nothing to sweep
    with pytest.raises(IntegrityError), _reopened(local_target) as again:
        again.sweep(grace_s=0)
    shutil.rmtree(local_target.index_dir)  # a fresh index: the whole log replayed, refused the same way
    with pytest.raises(IntegrityError), _reopened(local_target) as again:
        again.sweep(grace_s=0)
    assert victim.read_text() == "not the store's"


def open_local(target: StoreTarget) -> Storage:
    from mint_store.storage import open_storage

    return open_storage(target.url, storage_options=target.storage_options)


def test_a_retirement_claiming_time_zero_waits_out_the_grace_on_the_sweepers_clock(local_target: StoreTarget,
                                                                                   tmp_path: Path) -> None:
    """A real compaction, its log object replaced by one saying ``"time": 0`` (a fresh index
    replays it): the shard is retired at 0 by the event, but the sweep counts the grace period
    from the storage's time of that log object, on its own clock."""
    with local_target.open(**QUIET) as writer:
        writer.publish("acme", "a", random_adapter(1))
        old = writer.resolve("acme/a@1")
        report = writer.compact_shards(old.layout_id, [old.shard_key], [old.content_id])
        assert report["retired"] == [old.shard_key]
        seq = writer.last_seq
    storage = open_local(local_target)
    event = json.loads(storage.get(log_key(seq)))
    assert event["kind"] == "compact" and event["retired"] == [old.shard_key]
    storage.delete(log_key(seq))
    storage.create(log_key(seq), json.dumps(dict(event, time=0), separators=(",", ":")).encode())
    shutil.rmtree(local_target.index_dir)
    with _reopened(local_target) as again:
        assert again.sweep(grace_s=3600) == []  # "time": 0 + 3600 s lies long past
        assert storage.exists(old.shard_key)
        assert again.sweep(grace_s=3600, now=time.time() + 7200) == [old.shard_key]  # its clock, past the grace
        assert not storage.exists(old.shard_key)
        assert again.resolve("acme/a@1").shard_key != old.shard_key


def test_the_writer_checks_a_retired_key_again_before_a_delete() -> None:
    for key in ["/etc/passwd", "../x", "packs/0123456789abcdef0123456789abcdef/../../x", "packs/x/rows/c/0/0"]:
        with pytest.raises(InvalidKey):
            check_shard_key(key)
