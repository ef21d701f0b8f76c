"""Storage faults: transient errors are retried, a failed commit fails only its own publishes,
and the writer recovers in place (no reopen) once the storage takes writes again."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from mint_store.config import StoreConfig
from mint_store.errors import AdapterNotFound, CommitInDoubt, ObjectExists, StoreUnavailable
from mint_store.storage import LocalStorage
from mint_store.storage.retry import RetryPolicy, is_transient
from mint_store.store import Store
from tests.support.factories import random_adapter

FAST = RetryPolicy(attempts=4, base_s=0.001, max_s=0.01)


class FaultyStorage(LocalStorage):
    """The real LocalStorage; a write of a matching key raises the queued errnos first.

    ``broken`` set: every put raises ENOSPC (a full disk) until it is cleared.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        # (key prefix, errno (0: ObjectExists, as the S3 client's own retry of a PUT that landed
        # gets), raise after writing, then break the storage)
        self.faults: list[tuple[str, int, bool, bool]] = []
        self.raised = 0
        self.broken = threading.Event()
        self.lock = threading.Lock()

    def arm(self, prefix: str, err: int, *, after_write: bool = False, then_break: bool = False) -> None:
        with self.lock:
            self.faults.append((prefix, err, after_write, then_break))

    def _write(self, key: str, data: Any, write: Any) -> None:
        if self.broken.is_set():
            self.raised += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), key)
        with self.lock:
            hit = next((f for f in self.faults if key.startswith(f[0])), None)
            if hit is not None:
                self.faults.remove(hit)
        if hit is not None and hit[2]:
            write(key, data)  # the write reached storage; the caller still sees an error
        if hit is not None:
            self.raised += 1
            if hit[3]:
                self.broken.set()  # and the storage refuses writes from now on (recovery too)
            if hit[1] == 0:
                raise ObjectExists(f"{key} exists")
            raise OSError(hit[1], os.strerror(hit[1]), key)
        write(key, data)

    # both ways an object is written: log objects and shards are create-only
    def put(self, key: str, data: Any) -> None:
        self._write(key, data, super().put)

    def put_if_absent(self, key: str, data: Any) -> None:
        self._write(key, data, super().put_if_absent)


def open_faulty(tmp_path: Path) -> tuple[Store, FaultyStorage]:
    storage = FaultyStorage(tmp_path / "store")
    return Store(storage, StoreConfig(retry=FAST), str(tmp_path / "index")), storage


def same(store: Store, ref: str, expected: Any) -> None:
    got = store.load(ref)
    assert got.layout.layout_id == expected.layout.layout_id
    assert [m.name for m in got.modules] == [m.name for m in expected.modules]
    for m0, m1 in zip(expected.modules, got.modules, strict=True):
        assert torch.equal(m0.a, m1.a) and torch.equal(m0.b, m1.b) and m0.scaling == m1.scaling, (ref, m0.name)


def test_enospc_fails_only_that_publish_and_the_next_one_succeeds(tmp_path: Path) -> None:
    store, storage = open_faulty(tmp_path)
    a, b, c = random_adapter(1), random_adapter(2), random_adapter(3)
    try:
        assert store.publish("acme", "a", a).version == 1
        storage.arm("packs/", errno.ENOSPC)
        with pytest.raises(StoreUnavailable, match="No space left"):
            store.publish("acme", "b", b)
        assert storage.raised == 1  # a full disk is not retried
        # the same store, not reopened: the writer recovered and takes the next publish
        assert store.health()["writable"] and store.health()["failures"] == 1
        assert store.publish("acme", "c", c).version == 1
        same(store, "acme/a", a)
        same(store, "acme/c", c)
        with pytest.raises(AdapterNotFound):
            store.resolve("acme/b")
        assert store.publish("acme", "b", b).version == 1  # the refused one, published again
        same(store, "acme/b", b)
    finally:
        store.close()
    with Store.open(tmp_path / "store", index_dir=str(tmp_path / "index"), readonly=True) as again:
        for ref, ad in (("acme/a", a), ("acme/b", b), ("acme/c", c)):
            same(again, ref, ad)
        assert again.last_seq == 3


def test_a_log_write_that_reached_storage_is_answered_as_committed(tmp_path: Path) -> None:
    # the log object was written but the call failed (a reset after the upload): replay finds
    # it, so the publish is durable and its caller is told so, not "failed"
    store, storage = open_faulty(tmp_path)
    a = random_adapter(1)
    try:
        storage.arm("log/", errno.EIO, after_write=True)
        result = store.publish("acme", "a", a)
        assert (result.version, result.seq, storage.raised) == (1, 1, 1)
        same(store, "acme/a", a)
        assert store.publish("acme", "b", random_adapter(2)).seq == 2  # numbered after it, not over it
    finally:
        store.close()


def test_a_transient_error_is_retried_and_the_publish_succeeds(tmp_path: Path) -> None:
    store, storage = open_faulty(tmp_path)
    a = random_adapter(1)
    try:
        storage.arm("packs/", errno.EINTR)
        storage.arm("log/", errno.EAGAIN)
        assert store.publish("acme", "a", a).version == 1
        assert storage.raised == 2
        assert store.health() == {"writable": True, "failures": 0, "recoveries": 0}
        same(store, "acme/a", a)
    finally:
        store.close()


def test_writes_fail_fast_while_the_storage_refuses_them_then_recover(tmp_path: Path) -> None:
    store, storage = open_faulty(tmp_path)
    a = random_adapter(1)
    try:
        store.publish("acme", "a", a)
        storage.broken.set()
        with pytest.raises(StoreUnavailable):
            store.publish("acme", "b", random_adapter(2))
        health = store.health()
        assert not health["writable"] and "No space left" in health["reason"]
        with pytest.raises(StoreUnavailable, match="recovering"):  # refused at once, nothing queued
            store.tag("acme/a", "prod")
        same(store, "acme/a", a)  # reads go on
        storage.broken.clear()
        assert store._writer is not None and store._writer.health.wait_writable(60)
        assert store.tag("acme/a", "prod") == 1
        assert store.publish("acme", "c", random_adapter(3)).seq == 3
        assert store.health()["recoveries"] >= 1
    finally:
        store.close()


@pytest.mark.parametrize(("exc", "transient"), [
    (OSError(errno.EINTR, "interrupted"), True),
    (OSError(errno.EAGAIN, "again"), True),
    (OSError(errno.EBUSY, "SlowDown"), True),  # what s3fs raises for S3 503 / SlowDown
    (ConnectionResetError(errno.ECONNRESET, "reset"), True),
    (TimeoutError("timed out"), True),
    (OSError(errno.ENOSPC, "full"), False),
    (PermissionError(errno.EACCES, "denied"), False),
    (FileNotFoundError(errno.ENOENT, "gone"), False),
    (OSError(errno.EIO, "io"), False),
    (ValueError("bug"), False),
])
def test_what_counts_as_transient(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


def test_s3_client_errors_are_classified_by_code_and_status() -> None:
    from botocore.exceptions import ClientError

    def err(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert is_transient(err("SlowDown", 503)) and is_transient(err("InternalError", 500))
    assert not is_transient(err("AccessDenied", 403)) and not is_transient(err("NoSuchBucket", 404))


def test_a_create_only_write_whose_answer_was_lost_is_not_taken_for_another_writers(tmp_path: Path) -> None:
    """The log object landed but the call failed transiently (a reset after the upload): the
    retry finds its own bytes there and the commit stands; other bytes there stay a conflict."""
    store, storage = open_faulty(tmp_path)
    a, b = random_adapter(1), random_adapter(2)
    try:
        storage.arm("log/", errno.EINTR, after_write=True)
        assert store.publish("acme", "a", a).version == 1
        assert storage.raised == 1
        same(store, "acme/a@1", a)
        storage.put("log/x.json", b"theirs")
        with pytest.raises(ObjectExists):
            storage.create("log/x.json", b"ours")
        assert storage.get("log/x.json") == b"theirs"
        assert store.publish("acme", "b", b).version == 1
    finally:
        store.close()


@pytest.mark.parametrize("prefix", ["log/", "packs/"])
def test_a_create_that_meets_its_own_landed_write_on_its_first_try_stands(tmp_path: Path, prefix: str) -> None:
    """The S3 client retries a PUT by itself: its retry of a create-only PUT that landed gets
    412 on the store's first attempt. That is the store's own object: the commit stands (a log
    object answered "send it again" made a second version; a shard fenced the writer)."""
    store, storage = open_faulty(tmp_path)
    a, b = random_adapter(1), random_adapter(2)
    try:
        storage.arm(prefix, 0, after_write=True)
        result = store.publish("acme", "a", a)
        assert (result.version, result.seq, storage.raised) == (1, 1, 1)
        same(store, "acme/a", a)
        assert store.health() == {"writable": True, "failures": 0, "recoveries": 0}
        assert store.publish("acme", "b", b).seq == 2
    finally:
        store.close()


@pytest.mark.parametrize("landed", [True, False])
def test_a_log_write_that_fails_while_recovery_fails_too_is_in_doubt(tmp_path: Path, landed: bool) -> None:
    """Whether the log object landed is not known until the storage answers again: the caller
    gets CommitInDoubt (never retried by the client: sending it again could commit twice), and
    the writer applies the commit when it recovers if it had landed."""
    store, storage = open_faulty(tmp_path)
    a = random_adapter(1)
    try:
        storage.arm("log/", errno.EIO, after_write=landed, then_break=True)
        with pytest.raises(CommitInDoubt, match="whether it landed is not known"):
            store.publish("acme", "a", a)
        storage.broken.clear()
        assert store._writer is not None and store._writer.health.wait_writable(60)
        if landed:
            same(store, "acme/a", a)
        else:
            with pytest.raises(AdapterNotFound):
                store.resolve("acme/a")
    finally:
        store.close()


def test_commit_in_doubt_crosses_http_typed_and_is_never_retried() -> None:
    from mint_store.format.wire import TERMINAL_CODES, error_from_body

    err = error_from_body(503, {"error": "commit_in_doubt", "message": "m"})
    assert isinstance(err, CommitInDoubt) and isinstance(err, StoreUnavailable)
    assert "commit_in_doubt" in TERMINAL_CODES and "store_unavailable" not in TERMINAL_CODES
