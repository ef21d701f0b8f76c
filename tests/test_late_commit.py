"""A commit the previous writer had in flight when it lost its lease lands after the new
writer's take-over replay (create-only log: it owns that seq). The new writer must apply it,
fail only its own colliding commit (nothing of it was logged), and keep accepting writes --
never stop as if it were the fenced one, and never answer its caller with the other commit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mint_store import CommitConflict, Store
from mint_store.log import CommitLog
from tests.support.factories import random_adapter


def test_a_late_commit_of_the_previous_writer_is_applied_and_the_writer_goes_on(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "store"), index_dir=str(tmp_path / "index")) as store:
        first = store.publish("t", "a", random_adapter(1, rank=2))
        lease = store._writer.lease if store._writer is not None else None
        assert lease is not None
        # the zombie's commit: planned on the state at first.seq, with the previous epoch
        late = {"seq": first.seq + 1, "time": time.time(), "kind": "tag", "tenant": "t", "name": "a",
                "version": first.version, "tag": "zombie", "epoch": lease.epoch - 1}
        CommitLog(store.storage).write(late)
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
