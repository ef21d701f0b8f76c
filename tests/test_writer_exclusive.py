"""One writer per store, whatever its index directory; no object a commit names is overwritten.

Each writable open takes ``writer.lease`` in the store itself (local directory, S3 on moto,
fsspec memory://); commits write ``log/<seq>.json`` and shard objects create-only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from mint_store.errors import (
    AdapterNotFound,
    CommitConflict,
    ObjectChanged,
    StoreUnavailable,
    WriterFenced,
    WriterLocked,
)
from mint_store.index.commit_log import log_key
from mint_store.storage import open_storage
from mint_store.store import Store
from mint_store.write.lease import LEASE_KEY
from tests.support.factories import random_adapter
from tests.support.targets import StoreTarget

DEADLINE_S = 120.0  # a bound for waits on another process, never a pass/fail threshold


def _other_index(target: StoreTarget, tmp_path: Path) -> str:
    return str(tmp_path / f"other-index-{uuid.uuid4().hex[:6]}")


def test_second_writer_with_another_index_dir_is_refused(target: StoreTarget, tmp_path: Path) -> None:
    with target.open() as first:
        first.publish("acme", "a", random_adapter(1))
        with pytest.raises(WriterLocked, match=rf"pid {os.getpid()}") as info:
            Store.open(target.url, index_dir=_other_index(target, tmp_path), storage_options=target.storage_options)
        assert "read-only" in str(info.value)  # the message says what to do
        # the refused open changed nothing: the first writer still commits
        assert first.publish("acme", "a", random_adapter(2)).version == 2
    # closing released the lease: the next writer (any index) opens at once and replays the log
    with Store.open(target.url, index_dir=_other_index(target, tmp_path),
                    storage_options=target.storage_options) as second:
        assert second.resolve("acme/a").content_id == second.resolve("acme/a@2").content_id
        assert second.publish("acme", "a", random_adapter(3)).version == 3


def test_memory_urls_with_and_without_slash_are_one_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINT_INDEX_ROOT", str(tmp_path / "indexes"))
    url = f"memory://mint-{uuid.uuid4().hex[:8]}/p"
    with Store.open(url) as first:
        first.publish("acme", "a", random_adapter(1))
        with pytest.raises(WriterLocked):
            Store.open(url + "/", index_dir=str(tmp_path / "other"))
        with pytest.raises(WriterLocked):
            Store.open(url + "/")


def test_conditional_writes_hold_across_storage_objects_and_a_filesystem_without_them_takes_no_writer(
        tmp_path: Path) -> None:
    """memory://'s create-only write is atomic for every storage object in the process (each had
    its own lock: two writers' objects could both create one log seq). A filesystem with no
    conditional writes (fsspec's local:// here, as gs:// or sftp://) cannot fence a writer: a
    writable open is refused."""
    from mint_store.errors import ObjectExists, ReadOnlyStore

    url = f"memory://mint-{uuid.uuid4().hex[:8]}/p"
    a, b = open_storage(url), open_storage(url)
    assert a._cas() is b._cas()
    a.put_if_absent("log/1", b"x")
    with pytest.raises(ObjectExists):
        b.put_if_absent("log/1", b"y")
    assert b.get("log/1") == b"x"

    other = f"local://{tmp_path / 'store'}"
    with pytest.raises(ReadOnlyStore, match="no conditional writes"):
        Store.open(other, index_dir=str(tmp_path / "index"))
    assert not (tmp_path / "store" / LEASE_KEY).exists()  # refused before any lease was written


@pytest.mark.s3
def test_an_object_store_that_ignores_conditional_writes_takes_no_writer(
        s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """S3-compatible services may ignore If-None-Match / If-Match: create-only and compare-and-
    swap then overwrite, and two writers both "create" one log seq (the first's acknowledged
    commit silently replaced). A writer checks both on a scratch object before it opens. Here
    moto stands for such a service: the conditions are dropped before the request is sent."""
    import s3fs

    from mint_store.errors import ReadOnlyStore
    from tests.support.targets import make_bucket, s3_options

    url = f"s3://{make_bucket(s3_endpoint)}/mint"
    with Store.open(url, index_dir=str(tmp_path / "ok"), storage_options=s3_options(s3_endpoint)) as store:
        store.publish("acme", "a", random_adapter(1))  # moto honours them: a writer opens
        assert not [k for k in store.storage.list("") if k.startswith("probes/")]  # its scratch object is gone
    real = s3fs.S3FileSystem._pipe_file

    async def careless(self: Any, path: str, data: Any, mode: str = "overwrite", **kwargs: Any) -> Any:
        kwargs.pop("IfMatch", None)
        return await real(self, path, data, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", careless)
    with pytest.raises(ReadOnlyStore, match="ignores conditional writes"):
        Store.open(url, index_dir=str(tmp_path / "other"), storage_options=s3_options(s3_endpoint))


def test_existing_log_object_fails_the_commit_and_is_not_overwritten(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        # another writer's commit 2, already in the store (one in flight when it lost the lease)
        theirs = {"seq": 2, "kind": "base", "time": time.time(), "base": "other-writer", "shapes": {}}
        planted = json.dumps(theirs).encode()
        store.storage.put(log_key(2), planted)
        with pytest.raises(CommitConflict, match=r"log/0+2\.json already exists.*send it again"):
            store.publish("acme", "b", random_adapter(2))
        assert store.storage.get(log_key(2)) == planted
        with pytest.raises(AdapterNotFound):
            store.resolve("acme/b")  # not acknowledged, not visible
        assert store.base("other-writer") == {}  # their commit is applied, as every replica applies it
        assert store.publish("acme", "c", random_adapter(3)).seq == 3  # and this writer goes on
    with target.open() as store:  # reopening replays the same log; nothing of ours leaked
        assert store.base("other-writer") == {}
        with pytest.raises(AdapterNotFound):
            store.resolve("acme/b")
        assert store.publish("acme", "b", random_adapter(2)).version == 1


def test_an_existing_shard_object_is_not_overwritten_and_the_commit_goes_past_it(target: StoreTarget) -> None:
    """A shard name already taken while this writer holds the lease: never overwritten; an
    orphan (of the writer before, paused past its lease), so the commit is planned past it."""
    from mint_store.maintenance.fsck import fsck

    with target.open() as store:
        first = store.publish("acme", "a", random_adapter(1))
        loc = store.resolve("acme/a")
        next_shard = loc.shard_key.replace("/rows/c/0/", "/rows/c/1/")
        store.storage.put(next_shard, b"another writer's rows")
        store.publish("acme", "b", random_adapter(2))
        assert store.resolve("acme/b").shard_key not in (next_shard, loc.shard_key)
        assert store.storage.get(next_shard) == b"another writer's rows"
        assert store.read("acme/a")[0].content_id == first.content_id
        assert store.read("acme/b")[1].tobytes() == random_adapter(2).to_row()[1].tobytes()
        assert next_shard in fsck(store).orphans


# -- a writer that dies, and one that stalls past its lease -------------------------------

_HOLDER = textwrap.dedent(
    """
    import sys
    from tests.support.factories import random_adapter
    from mint_store.errors import MintError
    from mint_store.store import Store

    url, index, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    store = Store.open(url, index_dir=index, lease_ttl_s=ttl, lease_renew_s=ttl / 5)
    store.publish("acme", "a", random_adapter(1))
    print("READY", store._lease.epoch, flush=True)
    sys.stdin.readline()
    try:
        store.publish("acme", "zombie", random_adapter(9))
        print("COMMITTED", flush=True)
    except MintError as e:
        print("REFUSED", e.code, flush=True)
    """
)


def _start_holder(url: str, index: str, *, ttl_s: float) -> tuple[subprocess.Popen[str], int]:
    root = str(Path(__file__).resolve().parents[1])  # the repository: tests.support imports
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, url, index, str(ttl_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == ["READY"], line
    return proc, int(line[1])


def _open_when_free(url: str, index: str, **options: Any) -> Store:
    """Open as writer, retrying while the lease is held (the holder stopped renewing)."""
    stop = time.monotonic() + DEADLINE_S
    while True:
        try:
            return Store.open(url, index_dir=index, **options)
        except WriterLocked:
            if time.monotonic() > stop:
                raise
            time.sleep(0.1)


def _lease(store_url: str) -> dict[str, Any]:
    return json.loads(open_storage(store_url).get(LEASE_KEY))


def _take_lease(store: Store, **fields: Any) -> None:
    """Another holder takes ``store``'s lease (epoch + 1, ``fields`` set in the record); returns once
    the store's renew thread has found it taken."""
    storage = store.storage
    while True:  # the renew thread may change the lease between our read and our CAS
        raw, token = storage.get_with_token(LEASE_KEY)
        rec = json.loads(raw)
        try:
            storage.replace_if(LEASE_KEY, json.dumps(rec | {"epoch": rec["epoch"] + 1, "holder": {"id": "thief"}}
                                                     | fields).encode(), token)
            break
        except ObjectChanged:
            continue
    stop = time.monotonic() + DEADLINE_S
    while store._lease is not None and store._lease.lost is None and time.monotonic() < stop:
        time.sleep(0.02)


def test_lease_of_a_killed_writer_is_taken_over(local_target: StoreTarget, tmp_path: Path) -> None:
    # a long TTL: a dead holder on this host is taken over at once, not when it expires
    proc, epoch = _start_holder(local_target.url, local_target.index_dir, ttl_s=3600.0)
    try:
        with pytest.raises(WriterLocked, match=f"pid {proc.pid}"):
            Store.open(local_target.url, index_dir=str(tmp_path / "mine"))
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE_S)
    finally:
        proc.kill()
    # the process is gone: its lease is taken over (at once on this host), with a new epoch
    with _open_when_free(local_target.url, str(tmp_path / "mine")) as store:
        assert _lease(local_target.url)["epoch"] == epoch + 1
        assert store.read("acme/a")[1].tobytes() == random_adapter(1).to_row()[1].tobytes()
        assert store.publish("acme", "b", random_adapter(2)).seq == 2


def test_lease_of_a_writer_elsewhere_is_taken_over_only_after_expiry(target: StoreTarget) -> None:
    storage = open_storage(target.url, storage_options=target.storage_options)
    holder = {"id": "x", "host": "another-machine", "pid": 1, "url": None}

    def lease() -> dict[str, Any]:
        return json.loads(storage.get(LEASE_KEY))

    def record(expires: float) -> bytes:
        return json.dumps({"format": 1, "epoch": 41, "expires": expires, "released": False,
                           "holder": holder}).encode()

    storage.put_if_absent(LEASE_KEY, record(time.time() + 3600))  # renewed by a live writer elsewhere
    with pytest.raises(WriterLocked, match="another-machine") as info:
        target.open()
    assert info.value.holder["host"] == "another-machine" and lease()["epoch"] == 41
    # that writer stopped renewing: once its expiry has passed, the lease is taken over
    storage.replace_if(LEASE_KEY, record(time.time() - 1), storage.get_with_token(LEASE_KEY)[1])
    with target.open():
        assert lease()["epoch"] == 42 and lease()["holder"]["pid"] == os.getpid()
    assert lease()["released"] is True  # closing released it: the next open is immediate
    with target.open():
        assert lease()["epoch"] == 43


def test_a_dead_pid_on_this_host_name_in_another_pid_namespace_is_not_taken_for_a_dead_writer(
        local_target: StoreTarget) -> None:
    """Containers with the host's network share its host name, not its pids: a live writer
    there whose pid is missing here kept its lease only until a standby here looked. Only a
    holder of this boot and pid namespace is checked by pid; others wait for the expiry."""
    import socket

    from mint_store.write.lease import _namespace

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = int(done.stdout)  # a pid that has exited
    storage = open_storage(local_target.url)
    here = _namespace()
    assert here["boot"] and here["pidns"]
    holder = {"id": "x", "host": socket.gethostname(), "pid": dead, "url": None, **here, "pidns": "4026531000"}
    record = {"format": 1, "epoch": 7, "expires": time.time() + 3600, "released": False, "holder": holder}
    storage.put_if_absent(LEASE_KEY, json.dumps(record).encode())
    with pytest.raises(WriterLocked, match=f"pid {dead}"):
        local_target.open()
    # the same holder in this namespace: its pid is gone here, so it is gone; taken at once
    token = storage.get_with_token(LEASE_KEY)[1]
    storage.replace_if(LEASE_KEY, json.dumps(record | {"holder": holder | here}).encode(), token)
    with local_target.open():
        assert json.loads(storage.get(LEASE_KEY))["epoch"] == 8


def test_a_stalled_writer_is_fenced_after_take_over(local_target: StoreTarget, tmp_path: Path) -> None:
    """SIGSTOP a writer past its lease; another takes over; the woken one can commit nothing."""
    proc, epoch = _start_holder(local_target.url, local_target.index_dir, ttl_s=1.0)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        store = _open_when_free(local_target.url, str(tmp_path / "mine"))
        with store:
            assert _lease(local_target.url)["epoch"] == epoch + 1
            ours = store.publish("acme", "b", random_adapter(2))
            os.kill(proc.pid, signal.SIGCONT)
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            answer = proc.stdout.readline().split()
            assert answer[:1] == ["REFUSED"] and answer[1] in ("writer_fenced", "commit_conflict"), answer
            # nothing of the zombie's is visible; everything acknowledged is, exactly
            with pytest.raises(AdapterNotFound):
                store.resolve("acme/zombie")
            assert store.read("acme/b")[0].content_id == ours.content_id
            assert store.publish("acme", "c", random_adapter(3)).seq == ours.seq + 1
            events = [json.loads(store.storage.get(log_key(s))) for s in range(1, ours.seq + 2)]
            assert [e.get("epoch") for e in events] == [epoch, epoch + 1, epoch + 1]
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(DEADLINE_S)


def test_fenced_writer_refuses_commits(local_target: StoreTarget) -> None:
    """In one process: the lease taken away under a writer fences its next commit."""
    with local_target.open(lease_ttl_s=1.0, lease_renew_s=0.05) as store:
        store.publish("acme", "a", random_adapter(1))
        storage = store.storage
        _take_lease(store)
        with pytest.raises(WriterFenced, match="lost the lease"):
            store.publish("acme", "b", random_adapter(2))
        assert not storage.exists(log_key(2))
        assert [k for k in storage.list("packs/") if "/rows/c/" in k] == [store.resolve("acme/a").shard_key]


def test_a_storage_outage_during_renewal_is_recovered_in_place_not_fenced(local_target: StoreTarget,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Renewals that fail on the storage for longer than the lease's margin are not a loss of the
    lease: a write meanwhile is refused as unavailable (nothing committed), and once the storage
    answers, the same writer renews and commits. Taken for a fence, the writer stopped for good
    while its renew thread went on holding the lease: no standby could ever take over."""
    with local_target.open(lease_ttl_s=1.0, lease_renew_s=0.05) as store:
        store.publish("acme", "a", random_adapter(1))
        lease = store._lease
        assert lease is not None
        real = type(store.storage).get_with_token

        def down(self: Any, key: str) -> Any:
            if key == LEASE_KEY:
                raise OSError("storage unreachable")
            return real(self, key)

        monkeypatch.setattr(type(store.storage), "get_with_token", down)
        stop = time.monotonic() + DEADLINE_S
        while time.monotonic() < lease._valid_until and time.monotonic() < stop:
            time.sleep(0.02)  # past the last successful renewal's margin
        with pytest.raises(StoreUnavailable, match="could not renew"):
            store.publish("acme", "b", random_adapter(2))
        monkeypatch.setattr(type(store.storage), "get_with_token", real)
        while not store.health()["writable"] and time.monotonic() < stop:
            time.sleep(0.02)
        assert store.publish("acme", "b", random_adapter(2)).version == 1
        assert lease.lost is None and _lease(local_target.url)["epoch"] == lease.epoch


def test_a_writer_thread_that_stops_releases_the_lease(local_target: StoreTarget, tmp_path: Path) -> None:
    """A writer thread ended by an error that is not the storage's commits nothing more: its lease
    is released at once (another writer opens now), not renewed for the life of the process."""
    class Boom(BaseException):
        pass

    def hook(point: str) -> None:
        raise Boom(point)

    store = Store.open(local_target.url, index_dir=local_target.index_dir, lease_ttl_s=3600.0)
    try:
        store.publish("acme", "a", random_adapter(1))
        store._writer.fault_hook = hook  # type: ignore[union-attr]
        with pytest.raises(Boom):
            store.publish("acme", "b", random_adapter(2))
        assert not store.health()["writable"]
        assert _lease(local_target.url)["released"]
        with Store.open(local_target.url, index_dir=str(tmp_path / "next")) as nxt:  # no WriterLocked
            assert nxt.publish("acme", "b", random_adapter(2)).version == 1
    finally:
        store.close()


def test_a_fenced_writer_keeps_its_index_moving_with_the_log(local_target: StoreTarget, tmp_path: Path) -> None:
    """After a take-over the old writer commits nothing, says so in its health, and its reads
    (and change feed) follow the new writer's commits, as a replica's would."""
    with local_target.open(lease_ttl_s=1.0, lease_renew_s=0.05) as old:
        old.publish("acme", "a", random_adapter(1))
        seen: list[int] = []
        old.add_commit_listener(seen.append)
        _take_lease(old, expires=0)  # as a standby does once the lease expired
        stop = time.monotonic() + DEADLINE_S
        while old.health()["writable"] and time.monotonic() < stop:
            time.sleep(0.02)
        assert "lost the lease" in old.health()["reason"]
        with pytest.raises(WriterFenced):
            old.publish("acme", "b", random_adapter(2))
        with Store.open(local_target.url, index_dir=str(tmp_path / "new")) as new:
            r = new.publish("acme", "c", random_adapter(3))
        while old.last_seq < r.seq and time.monotonic() < stop:
            time.sleep(0.02)
        assert old.resolve("acme/c").content_id == r.content_id and r.seq in seen


def test_a_writer_fenced_before_its_rows_land_leaves_the_array_metadata_alone(
        local_target: StoreTarget, monkeypatch: pytest.MonkeyPatch) -> None:
    """The array's metadata is rewritten without a condition: a writer that slept through a
    take-over between its commit's first lease check and its rows would size it from its stale
    shape (shrinking what the new writer grew). It checks the lease again right before."""
    from mint_store.format.packs import Pack

    with local_target.open(lease_ttl_s=1.0, lease_renew_s=0.05) as store:
        first = store.publish("acme", "a", random_adapter(1))
        storage = store.storage
        meta = [k for k in storage.list("packs/") if k.endswith("/rows/zarr.json")]
        before = {k: storage.get(k) for k in meta}
        real = Pack.write_rows

        def taken_meanwhile(self: Any, *args: Any, **kwargs: Any) -> Any:  # the writer "sleeps" here
            _take_lease(store)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Pack, "write_rows", taken_meanwhile)
        with pytest.raises(WriterFenced):
            store.publish("acme", "b", random_adapter(2))
        assert {k: storage.get(k) for k in meta} == before
        assert not storage.exists(log_key(first.seq + 1))


def test_a_lease_that_cannot_be_checked_while_handling_a_taken_shard_is_a_storage_failure(
        local_target: StoreTarget, monkeypatch: pytest.MonkeyPatch) -> None:
    """Handling a taken shard name looks at the lease; a renewal failing on the storage there raised
    out of the writer's error handler: its thread died with the batch unanswered, health still said
    writable, and the renew thread held the lease. It is a storage failure: the commit fails, the
    writer recovers in place."""
    from mint_store.errors import ShardTaken
    from mint_store.format.packs import Pack

    with local_target.open(lease_ttl_s=600.0, lease_renew_s=300.0) as store:  # no renewal meanwhile
        store.publish("acme", "a", random_adapter(1))
        lease = store._lease
        assert lease is not None
        real_write, real_renew = Pack.write_rows, type(lease).renew

        def taken(self: Any, *args: Any, **kwargs: Any) -> Any:
            lease._valid_until = 0.0  # past the margin: the next check renews

            def unreachable(_self: Any) -> None:
                raise OSError("storage unreachable")

            monkeypatch.setattr(type(lease), "renew", unreachable)
            raise ShardTaken("shard taken (test)")

        monkeypatch.setattr(Pack, "write_rows", taken)
        with pytest.raises(StoreUnavailable):
            store.publish_async("acme", "b", random_adapter(2)).result(timeout=DEADLINE_S)
        assert store._writer is not None and store._writer._thread.is_alive() and store._writer.failed is None
        monkeypatch.setattr(Pack, "write_rows", real_write)
        monkeypatch.setattr(type(lease), "renew", real_renew)
        stop = time.monotonic() + DEADLINE_S
        while not store.health()["writable"] and time.monotonic() < stop:
            time.sleep(0.02)
        assert store.publish("acme", "b", random_adapter(2)).version == 1
