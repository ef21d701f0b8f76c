"""A writer's lease taken over between its renewal's write and the read-back of that write.

The renewal's compare-and-swap succeeded, then another writer's did, before the read-back: the
lease is lost. The writer must say so at once (``lost``), not only once its local deadline
passes; otherwise its renew thread stopped silently and anything waiting on ``lost`` waited
out its whole bound (tests/test_writer_exclusive.py::test_fenced_writer_refuses_commits took
its 120 s bound when the race fell that way).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mint_store.errors import WriterFenced
from mint_store.storage.local import LocalStorage
from mint_store.write.lease import LEASE_KEY, WriterLease


class ThiefAfterWrite(LocalStorage):
    """The real LocalStorage; once armed, the next lease write is followed by a thief's take-over
    (its own compare-and-swap, as another writer's renewal or acquisition would do)."""

    armed = False

    def replace_if(self, key: str, data: Any, token: str) -> None:
        super().replace_if(key, data, token)
        if key == LEASE_KEY and self.armed:
            self.armed = False
            raw, now = self.get_with_token(LEASE_KEY)
            rec = json.loads(raw)
            super().replace_if(LEASE_KEY, json.dumps(rec | {"epoch": rec["epoch"] + 1,
                                                            "holder": {"id": "thief"}}).encode(), now)


def test_a_lease_taken_right_after_a_renewal_fences_the_writer_at_once(tmp_path: Path) -> None:
    storage = ThiefAfterWrite(tmp_path / "store")
    lease = WriterLease(storage, ttl_s=60.0, renew_s=30.0)  # its thread stays out of the way: renew() by hand
    lease.acquire()
    try:
        lease.renew()  # a plain renewal holds on
        assert lease.lost is None
        storage.armed = True
        with pytest.raises(WriterFenced, match="lost the lease"):
            lease.renew()
        assert lease.lost is not None and "lost the lease" in lease.lost
        with pytest.raises(WriterFenced, match="lost the lease"):
            lease.check()  # at once: its local deadline is nearly a minute away
        assert json.loads(storage.get(LEASE_KEY))["holder"] == {"id": "thief"}  # the thief's lease stands
    finally:
        lease.release()
    assert json.loads(storage.get(LEASE_KEY))["holder"] == {"id": "thief"}  # and closing leaves it alone
