"""The open shard files the service sends rows from (local storage's descriptor cache, which the
store's own reads use too): one an answer still reads is never closed under it.

A slow download sends a row from a cached shard file across many awaits; more than the
cache's capacity of other shards opened meanwhile evicted that file. Closed then, its
descriptor number went to the next file opened, and the download went on with that file's
bytes (another shard, maybe another tenant's) under the first row's ETag."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mint_store.storage import LocalStorage


def _shards(tmp_path: Path, n: int, capacity: int) -> tuple[LocalStorage, list[str]]:
    files = LocalStorage(tmp_path / "store", max_open_files=capacity)
    keys = []
    for i in range(n):
        files.put(f"shard{i}", bytes([i]) * 64)
        keys.append(f"shard{i}")
    return files, keys


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_a_held_file_outlives_its_eviction_and_closes_at_its_last_release(tmp_path: Path) -> None:
    files, (a, b, c, d) = _shards(tmp_path, 4, capacity=2)
    slow = files.hold(a)  # a download in progress
    fd = slow.fd
    for p in (b, c):  # other answers, each done at once: a is evicted meanwhile
        files.release(files.hold(p))
    assert not _closed(fd) and os.pread(fd, 4, 0) == b"\0" * 4
    other = files.hold(d)  # would have taken a's descriptor number had a been closed
    assert other.fd != fd and os.pread(fd, 4, 0) == b"\0" * 4
    files.release(slow)
    assert _closed(fd)
    again = files.hold(a)  # evicted and closed: opened afresh
    assert again is not slow and os.pread(again.fd, 1, 0) == b"\0"
    files.release(again)
    files.release(other)


def test_a_file_held_twice_closes_after_both_and_close_waits_for_holders(tmp_path: Path) -> None:
    files, (a, b) = _shards(tmp_path, 2, capacity=1)
    first, second = files.hold(a), files.hold(a)
    assert first is second
    files.release(files.hold(b))  # evicts a: two answers still read it
    files.release(first)
    assert not _closed(second.fd)
    files.release(second)
    assert _closed(second.fd)
    held = files.hold(b)
    files.close()  # the service stops while an answer still sends from b
    assert not _closed(held.fd)
    files.release(held)
    assert _closed(held.fd)


def test_the_cache_drops_the_least_recently_used_descriptor(tmp_path: Path) -> None:
    storage, keys = _shards(tmp_path, 3, capacity=2)
    for k in (keys[0], keys[1], keys[0]):  # keys[0] read last
        storage.read_range(k, 0, 1)
    storage.read_range(keys[2], 0, 1)
    assert list(storage._fds) == [keys[0], keys[2]]  # keys[1], not the hot keys[0], went


def test_a_read_after_close_is_refused_and_opens_nothing(tmp_path: Path) -> None:
    from mint_store.errors import StoreClosed

    storage, keys = _shards(tmp_path, 2, capacity=8)
    storage.read_range(keys[0], 0, 1)
    storage.close()
    with pytest.raises(StoreClosed):
        storage.read_range(keys[1], 0, 1)
    assert not storage._fds  # (a read racing close() left descriptors nothing would close)


def test_a_child_forked_while_another_thread_held_the_cache_lock_still_reads(tmp_path: Path) -> None:
    """A lock held by another thread at fork() stays held in the child for good: its first read
    waited forever. The child's storages get fresh locks."""
    import signal
    import threading

    storage, keys = _shards(tmp_path, 1, capacity=8)
    held, done = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with storage._fd_lock:
            held.set()
            done.wait(30)

    t = threading.Thread(target=hold_the_lock)
    t.start()
    held.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 if the read returns, killed by the alarm if it hangs
        signal.alarm(20)
        try:
            ok = storage.read_range(keys[0], 0, 1) == b"\0"
        except BaseException:
            os._exit(2)
        os._exit(0 if ok else 3)
    done.set()
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
