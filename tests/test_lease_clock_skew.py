"""A contender whose wall clock disagrees with the holder's takes no healthy writer's lease.

The lease's ``expires`` is the holder's wall clock; a standby running 8 s ahead of a 10 s
TTL judged a renewing writer's lease expired and fenced it. Expiry is now judged by the
contender's monotonic clock alone (one version of the lease unrenewed for the TTL), so the
skew does not matter; a writer that really stops renewing is still taken over.

The standby runs as a real second process whose every ``time.time()`` runs ahead (its
monotonic clock is the machine's), on a local directory and on S3 (moto). Waits poll a state;
nothing asserts a duration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mint_store.errors import WriterFenced, WriterLocked
from mint_store.storage import open_storage
from mint_store.store import Store
from mint_store.write.lease import LEASE_KEY, WriterLease
from tests.support.factories import random_adapter
from tests.support.targets import StoreTarget

TTL_S, RENEW_S = 2.0, 0.3
SKEW_S = 8.0  # past the whole TTL: without the fix the standby's first poll took the lease
DEADLINE_S = 60.0  # a bound on a hang, never a measure of speed

_STANDBY = textwrap.dedent(
    """
    import json, sys, time
    _real = time.time
    time.time = lambda: _real() + float(sys.argv[4])  # this machine's wall clock, running ahead

    from mint_store.fleet.standby import Standby, open_standby

    url, index, options, _, ttl = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    store = open_standby(url, index_dir=index, lease_ttl_s=ttl, lease_renew_s=ttl / 5, **options)
    standby = Standby(store)
    watched = time.monotonic()
    while time.monotonic() - watched < 3 * ttl:  # three TTLs of the holder renewing
        if standby.step():
            print("TOOK", standby.writer.epoch, flush=True)
            sys.exit(0)
        time.sleep(standby.poll_s)
    print("HELD", flush=True)
    sys.stdin.readline()  # the holder stops renewing now
    while not standby.step():
        time.sleep(standby.poll_s)
    print("TOOK", standby.writer.epoch, flush=True)
    sys.stdin.readline()
    store.close()
    """
)


def _options(target: StoreTarget) -> dict[str, Any]:
    return {"storage_options": target.storage_options} if target.storage_options else {}


@pytest.fixture
def holder(target: StoreTarget) -> Iterator[Store]:
    store = target.open(lease_ttl_s=TTL_S, lease_renew_s=RENEW_S)
    store.publish("acme", "a", random_adapter(1))
    yield store
    store.close()


def _lease(target: StoreTarget) -> dict[str, Any]:
    return dict(json.loads(open_storage(target.url, storage_options=target.storage_options).get(LEASE_KEY)))


def test_a_standby_with_a_clock_running_ahead_leaves_a_renewing_writer_alone_and_takes_a_stopped_one(
        target: StoreTarget, holder: Store, tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _STANDBY, target.url, str(tmp_path / "standby-index"), json.dumps(_options(target)),
         str(SKEW_S), str(TTL_S)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().split() == ["HELD"]  # three TTLs of polls, the lease never taken
        assert holder._lease is not None and holder._lease.lost is None and _lease(target)["epoch"] == 1
        assert holder.publish("acme", "b", random_adapter(2)).seq == 2  # the writer was never fenced
        holder._lease.stop_renewing()  # now it really stops: hung, its lease left to expire
        proc.stdin.write("stopped\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split() == ["TOOK", "2"]
        assert _lease(target)["epoch"] == 2
        with pytest.raises(WriterFenced):  # the stopped writer, woken, commits nothing
            holder.publish("acme", "zombie", random_adapter(9))
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(DEADLINE_S) == 0
    finally:
        proc.kill()
        proc.wait(DEADLINE_S)


def test_an_open_with_a_clock_running_ahead_is_refused_by_a_renewing_writer_and_takes_a_stopped_ones_lease(
        target: StoreTarget, holder: Store) -> None:
    """A plain open (not a standby) on a machine whose clock runs ahead sees the live lease as
    expired: it watches it for the TTL, sees it renewed and is refused; the holder goes on."""
    ahead = lambda: time.time() + SKEW_S  # noqa: E731 - the contender's wall clock
    storage = open_storage(target.url, storage_options=target.storage_options)
    contender = WriterLease(storage, ttl_s=TTL_S, renew_s=RENEW_S, wall_clock=ahead)
    with pytest.raises(WriterLocked, match="open for writing by"):
        contender.acquire()
    assert holder._lease is not None and holder._lease.lost is None and _lease(target)["epoch"] == 1
    assert holder.publish("acme", "b", random_adapter(2)).seq == 2
    # a standby's polls (no waiting) over three TTLs: never taken
    watched = time.monotonic()
    polls = 0
    while time.monotonic() - watched < 3 * TTL_S:
        with pytest.raises(WriterLocked):
            contender.acquire(wait=False)
        polls += 1
        time.sleep(RENEW_S)
    assert polls > 1 and holder._lease.lost is None and _lease(target)["epoch"] == 1
    holder._lease.stop_renewing()
    contender.acquire()  # waits out the TTL by its own monotonic clock, then takes the lease
    try:
        assert contender.epoch == 2 and _lease(target)["epoch"] == 2
        with pytest.raises(WriterFenced):
            holder.publish("acme", "zombie", random_adapter(9))
    finally:
        contender.release()


def test_a_contender_with_a_shorter_ttl_waits_out_the_holders(target: StoreTarget) -> None:
    """The holder's TTL is in its record: a contender configured shorter waits the longer one."""
    with target.open(lease_ttl_s=30.0, lease_renew_s=10.0) as store:
        assert _lease(target)["ttl"] == 30.0
        storage = open_storage(target.url, storage_options=target.storage_options)
        contender = WriterLease(storage, ttl_s=0.5, renew_s=0.1)
        watched = time.monotonic()
        while time.monotonic() - watched < 3 * 0.5:  # three of its own TTLs, not one of the holder's
            with pytest.raises(WriterLocked):
                contender.acquire(wait=False)
            time.sleep(0.1)
        assert store._lease is not None and store._lease.lost is None
        assert store.publish("acme", "a", random_adapter(1)).seq == 1
