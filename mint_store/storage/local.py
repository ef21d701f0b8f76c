"""A local directory as storage: temp file + fsync + rename + fsync(dir), reads by ``os.preadv``."""

from __future__ import annotations

import builtins
import mmap
import os
import sys
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zarr.storage

from ..errors import BlobNotFound, ObjectExists, StoreClosed
from ..format.keys import check_relative_key
from . import local_cas
from .base import Storage
from .durable import fsync_dir

_FORK_GENERATION = 0
# how stale a cached descriptor's "is the file still linked" check may be: an fstat per read
# costs a small row's whole read, and a swept shard's bytes are still the verified row for the
# few reads inside this window (sweeps wait out a grace period far longer than this anyway)
RECHECK_S = 0.05
# mapped files at most (vm.max_map_count is 65,530 by default, shared with the rest of the process)
MAX_MAPPINGS = 4096
# the lock-free hold relies on the GIL; a free-threaded build always takes the lock
_GIL = bool(getattr(sys, "_is_gil_enabled", lambda: True)())
_INSTANCES: weakref.WeakSet[LocalStorage] = weakref.WeakSet()


def _after_fork() -> None:
    """In a forked child (one thread, before any other runs): a lock another thread of the parent
    held at the fork is held for good in the child, and its first read would wait forever."""
    global _FORK_GENERATION
    _FORK_GENERATION += 1
    for storage in list(_INSTANCES):
        storage._fd_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


@dataclass(slots=True, eq=False)
class _Fd:
    """A cached read descriptor: held by the reads in ``holders``; ``dropped`` once out of the cache."""

    fd: int
    # one entry per read holding it: list append/pop are atomic under the GIL, so a read of a
    # cached, recently checked descriptor takes no lock (``hold``); closing takes the lock
    holders: list[None] = field(default_factory=list)
    dropped: bool = False
    closed: bool = False
    checked: float = 0.0  # time.monotonic() of the last check that the file is still linked
    # the file mapped read-only (:meth:`LocalStorage.mapping`), closed with the descriptor
    mapped: mmap.mmap | None = None

    def close(self) -> None:
        self.closed = True
        if self.mapped is not None:
            self.mapped.close()  # (no read holds it: the entry has no holders)
            self.mapped = None
        os.close(self.fd)


class LocalStorage(Storage):
    """A directory. Writes go through temp file + fsync + rename + fsync(dir)."""

    # reads (preadv) are the hot path and the kernel call is already retried on EINTR (PEP 475)
    RETRIED = ("put", "get", "delete", "list", "make_durable")

    def __init__(self, root: str | os.PathLike[str], *, max_open_files: int | None = None) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.root.parent)  # a new store's own entry survives power loss too
        # directories whose entries this process made durable in their parents
        self._durable_dirs: set[Path] = {self.root}
        self._root_s = str(self.root)
        self.url = self.root.as_uri()
        self._fds: OrderedDict[str, _Fd] = OrderedDict()
        self._fd_lock = threading.Lock()
        # a million adapters are ~1,000 shards: the descriptor cache must hold them all, or
        # random reads turn into open() + close() each
        self._max_fds = max_open_files or _fd_budget()
        self._gen = _FORK_GENERATION
        self._closed = False
        self._mappings = 0  # descriptors' files mapped (mapping())
        _INSTANCES.add(self)

    def _path(self, key: str) -> Path:
        # every key reaches the file system through here (or read_versioned, which checks too):
        # an absolute key or a ".." would otherwise name a file outside the root (pathlib's
        # root / "/etc/x" is "/etc/x"), a second line of defence behind mint_store.format.keys
        return self.root / check_relative_key(key)

    def zarr_store(self) -> Any:
        return zarr.storage.LocalStore(str(self.root))

    def _ensure_dir(self, d: Path) -> None:
        """Create ``d`` and its missing parents, each fsynced in its parent before use.

        Once per directory per process: a directory left by a crashed process may exist
        without being durable, so "exists" alone is not enough to skip the fsync.
        """
        chain: builtins.list[Path] = []
        while d not in self._durable_dirs and d != self.root:
            chain.append(d)
            d = d.parent
        for p in reversed(chain):
            p.mkdir(exist_ok=True)
            fsync_dir(p.parent)
            self._durable_dirs.add(p)

    def _write_temp(self, path: Path, data: Any) -> Path:
        self._ensure_dir(path.parent)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            try:
                write_synced(tmp, data if isinstance(data, list) else [data])
            except FileNotFoundError:  # someone removed a directory we had made: make it again
                self._durable_dirs = {self.root}
                self._ensure_dir(path.parent)
                write_synced(tmp, data if isinstance(data, list) else [data])
        except BaseException:
            tmp.unlink(missing_ok=True)  # a failed write (ENOSPC) must not leave its bytes behind
            raise
        return tmp

    def put(self, key: str, data: Any) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)

    def put_if_absent(self, key: str, data: Any) -> None:
        # link(2) fails if the name exists: the create-only rename that rename(2) is not
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise ObjectExists(f"object {key!r} already exists in {self.url}; not overwritten") from None
        finally:
            tmp.unlink()
            fsync_dir(path.parent)

    def get_with_token(self, key: str) -> tuple[bytes, str]:
        return local_cas.get_with_token(self, key)

    def replace_if(self, key: str, data: Any, token: str) -> None:
        # no lock: the swap is a create-if-absent link of the next version (local_cas.py), so a
        # stopped or killed CASer holds nobody up
        local_cas.replace_if(self, key, data, token)

    def get(self, key: str) -> bytes:
        got = local_cas.read_versioned(self, key)  # one failing listdir for a plain key
        return got[0] if got is not None else self._get_plain(key)

    def _get_plain(self, key: str) -> bytes:
        try:
            with open(f"{self._root_s}/{key}", "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def exists(self, key: str) -> bool:
        # a CAS'd key keeps its plain file (local_cas.py): the versions are looked at only on a miss
        return self._path(key).is_file() or bool(local_cas.versions(local_cas.vdir(self, key)))

    def size(self, key: str) -> int:
        got = local_cas.read_versioned(self, key)
        if got is not None:
            return len(got[0])
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def hold(self, key: str) -> _Fd:
        """The cached descriptor of ``key``, held until :meth:`release` (opened if need be): the
        reads here, and the service's sendfile of a row, share this one cache.

        Held, an evicted or deleted entry's descriptor stays open until its last reader lets
        go: closed under a read, its number could go to the next file opened, and the read
        would go on in another shard. A cached shard the store has since unlinked (compaction's
        sweep, by this process or another) is dropped, not read: the reader gets BlobNotFound,
        and the file's disk space is not pinned by the cache. That check runs at most every
        ``RECHECK_S`` per descriptor; this process's own delete drops the entry at once.
        """
        e = self._fds.get(key)
        if _GIL and e is not None and self._gen == _FORK_GENERATION and time.monotonic() - e.checked <= RECHECK_S:
            e.holders.append(None)
            if not e.dropped:  # (a drop sets this before it looks at the holders: held, it stays open)
                try:
                    self._fds.move_to_end(key)  # least recently used goes first (atomic, as the append)
                except KeyError:  # dropped meanwhile: this read still holds it open
                    pass
                return e
            self.release(e)
        with self._fd_lock:
            if self._closed:  # (a read racing close() opened descriptors nothing would close)
                raise StoreClosed(f"storage {self.url} is closed")
            if self._gen != _FORK_GENERATION:  # the parent's descriptors: the child's copies are closed
                for inherited in self._fds.values():
                    inherited.close()
                self._mappings = 0
                self._fds = OrderedDict()
                self._gen = _FORK_GENERATION
            e = self._fds.get(key)
            if e is not None:
                now = time.monotonic()
                if now - e.checked > RECHECK_S:
                    e.checked = now
                    if os.fstat(e.fd).st_nlink == 0:
                        self._drop(key)
                        e = None
            if e is not None:
                self._fds.move_to_end(key)  # least recently used goes first, not first opened
            if e is None:
                try:
                    fd = os.open(self._path(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    raise BlobNotFound(f"object {key!r} not found in {self.url}") from None
                e = self._fds[key] = _Fd(fd, checked=time.monotonic())
                while len(self._fds) > self._max_fds:
                    self._drop(next(iter(self._fds)))
            e.holders.append(None)
            return e

    def release(self, e: _Fd) -> None:
        e.holders.pop()
        if e.dropped and not e.holders:
            with self._fd_lock:
                if not e.closed and not e.holders:
                    self._close(e)

    def _drop(self, key: str) -> None:
        """Out of the cache (under the lock); closed now, or by its last reader."""
        e = self._fds.pop(key, None)
        if e is not None:
            e.dropped = True
            if not e.holders and not e.closed:
                self._close(e)

    def _close(self, e: _Fd) -> None:
        """(under the lock, no holders)"""
        self._mappings -= e.mapped is not None
        e.close()

    def mapping(self, e: _Fd) -> mmap.mmap | None:
        """The file of a held entry mapped read-only (made on first use, kept with the
        descriptor), or None: the file is empty, or ``MAX_MAPPINGS`` are open.

        A shard is never rewritten or truncated in place (created whole by link, removed by
        unlink), so its mapping stays valid for as long as the descriptor: an unlinked file's
        pages stay until both go. A file cut short under a mapping by something else raises
        SIGBUS on the first touch past the cut; the one reader of mappings, the compiled
        ``copy_row`` (:mod:`mint_store.read.verified`), catches its own and answers as ``preadv``
        does at a file's end (``MINT_READ_MMAP=0`` reads with ``preadv`` only).
        """
        got = e.mapped
        if got is not None or self._mappings >= MAX_MAPPINGS:
            return got
        with self._fd_lock:
            if e.mapped is None and not e.closed and self._mappings < MAX_MAPPINGS:
                try:
                    e.mapped = mmap.mmap(e.fd, 0, access=mmap.ACCESS_READ)
                except (ValueError, OSError):  # (an empty file cannot be mapped)
                    return None
                self._mappings += 1
            return e.mapped

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        if offset < 0:
            raise ValueError(f"offset {offset} < 0")
        e = self.hold(key)
        try:
            want = len(buf)
            got = os.preadv(e.fd, [buf], offset)
            while got < want:  # short reads are legal; the first call is the one that counts
                n = os.preadv(e.fd, [buf[got:]], offset + got)
                if n == 0:
                    raise BlobNotFound(f"object {key!r} is shorter than {offset + want} bytes")
                got += n
        finally:
            self.release(e)

    def delete(self, key: str) -> None:
        with self._fd_lock:
            if self._gen == _FORK_GENERATION:
                self._drop(key)
        local_cas.delete(self, key)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return
        fsync_dir(self._path(key).parent)

    def list(self, prefix: str) -> builtins.list[str]:
        base = self.root / check_relative_key(prefix, prefix=True)
        if not base.exists():
            return []
        out = {str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file()}
        # a CAS'd key's versions K.v/<n> are listed as K, once
        out = {local_cas.public_key(k) or k for k in out}
        return sorted(out)  # temp files included: fsck reports what a crash left behind

    def make_durable(self, keys: builtins.list[str]) -> None:
        dirs: set[Path] = set()
        for key in keys:
            path = self._path(key)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(path.parent)
        for d in sorted(dirs, key=lambda d: -len(d.parts)):
            fsync_dir(d)  # the files' own entries
            self._ensure_dir(d)  # and directories zarr created, in their parents

    def modified(self, key: str) -> float | None:
        try:
            return self._path(key).stat().st_mtime
        except FileNotFoundError:
            return None

    def local_path(self, key: str) -> str | None:
        return str(self._path(key))

    def close(self) -> None:
        with self._fd_lock:
            self._closed = True
            if self._gen == _FORK_GENERATION:
                for key in list(self._fds):
                    self._drop(key)
            self._fds.clear()


def _fd_budget() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as servers do); use half of it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65_536
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return max(64, min(16_384, (soft if soft != resource.RLIM_INFINITY else 65_536) // 2))


def write_synced(path: Path, parts: list[Any]) -> None:
    """Create ``path`` (it must not exist) with the bytes of ``parts``, fsynced; the caller
    renames it into place and fsyncs the directory."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
