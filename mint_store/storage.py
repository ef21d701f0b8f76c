"""Where objects live: a local directory (default) or any fsspec URL (``s3://`` via s3fs).

Small and synchronous on purpose: the store calls it from its writer thread and from read
paths that must cost one system call (``os.preadv``) or one ranged GET per row.
"""

from __future__ import annotations

import builtins
import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Any

import fsspec
import zarr.storage

from .errors import BlobNotFound
from .retry import RetryPolicy, retried

_FORK_GENERATION = 0


def _after_fork() -> None:
    global _FORK_GENERATION
    _FORK_GENERATION += 1


os.register_at_fork(after_in_child=_after_fork)

class Storage(ABC):
    url: str
    # set by the store from StoreConfig.retry; every method named in RETRIED goes through it
    retry: RetryPolicy = RetryPolicy()
    RETRIED: tuple[str, ...] = ("put", "get", "exists", "size", "read_into", "delete", "list", "make_durable")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.RETRIED:
            fn = cls.__dict__.get(name)
            if callable(fn) and not getattr(fn, "__mint_retried__", False):
                setattr(cls, name, retried(fn))

    @abstractmethod
    def zarr_store(self) -> Any:
        """The zarr Store over the same root (used to write and cross-check packs)."""

    @abstractmethod
    def put(self, key: str, data: Any) -> None:
        """Write one object durably and atomically (all or nothing).

        ``data`` is a bytes-like object or a list of them (written back to back).
        """

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes at ``offset`` of object ``key`` in one read call."""

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(key, offset, memoryview(buf))
        return bytes(buf)

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def list(self, prefix: str) -> builtins.list[str]:
        """Keys under ``prefix`` (recursive), sorted."""

    def make_durable(self, keys: builtins.list[str]) -> None:  # noqa: B027 - object stores need nothing
        """Make objects written through the zarr store durable (fsync locally)."""

    def local_path(self, key: str) -> str | None:
        """A filesystem path for ``key`` when the bytes are local (lets the service sendfile)."""
        return None

    def close(self) -> None:  # noqa: B027
        pass


class LocalStorage(Storage):
    """A directory. Writes go through temp file + fsync + rename + fsync(dir)."""

    # reads (preadv) are the hot path and the kernel call is already retried on EINTR (PEP 475)
    RETRIED = ("put", "get", "delete", "list", "make_durable")

    def __init__(self, root: str | os.PathLike[str], *, max_open_files: int | None = None) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._fd_lock = threading.Lock()
        # a million adapters are ~1,000 shards: the descriptor cache must hold them all, or
        # random reads turn into open() + close() each
        self._max_fds = max_open_files or _fd_budget()
        self._gen = _FORK_GENERATION

    def _path(self, key: str) -> Path:
        return self.root / key

    def zarr_store(self) -> Any:
        return zarr.storage.LocalStore(str(self.root))

    def put(self, key: str, data: Any) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            write_synced(tmp, data if isinstance(data, list) else [data])
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a failed write (ENOSPC) must not leave its bytes behind
            raise
        fsync_dir(path.parent)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def _fd(self, key: str) -> int:
        # the hit path takes no lock: a dict lookup is atomic, and eviction is not LRU-exact
        fd = self._fds.get(key)
        if fd is not None and self._gen == _FORK_GENERATION:
            return fd
        with self._fd_lock:
            if self._gen != _FORK_GENERATION:  # descriptors of the parent are not ours to manage
                self._fds = OrderedDict()
                self._gen = _FORK_GENERATION
            fd = self._fds.get(key)
            if fd is not None:
                return fd
            try:
                fd = os.open(self._path(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise BlobNotFound(f"object {key!r} not found in {self.url}") from None
            self._fds[key] = fd
            while len(self._fds) > self._max_fds:
                _, old = self._fds.popitem(last=False)
                os.close(old)
            return fd

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        fd = self._fds.get(key)
        if fd is None or self._gen != _FORK_GENERATION:
            fd = self._fd(key)
        want = len(buf)
        got = os.preadv(fd, [buf], offset)
        while got < want:  # short reads are legal; the first call is the one that counts
            n = os.preadv(fd, [buf[got:]], offset + got)
            if n == 0:
                raise BlobNotFound(f"object {key!r} is shorter than {offset + want} bytes")
            got += n

    def delete(self, key: str) -> None:
        with self._fd_lock:
            fd = self._fds.pop(key, None)
            if fd is not None:
                os.close(fd)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return
        fsync_dir(self._path(key).parent)

    def list(self, prefix: str) -> builtins.list[str]:
        base = self._path(prefix)
        if not base.exists():
            return []
        out = [str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file()]
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
            # new directories must be durable in their parents too
            p = path.parent
            while p != self.root and p not in dirs:
                dirs.add(p)
                p = p.parent
            dirs.add(self.root)
        for d in sorted(dirs, key=lambda d: -len(d.parts)):
            fsync_dir(d)

    def local_path(self, key: str) -> str | None:
        return str(self._path(key))

    def close(self) -> None:
        with self._fd_lock:
            if self._gen == _FORK_GENERATION:
                for fd in self._fds.values():
                    os.close(fd)
            self._fds.clear()


class FsspecStorage(Storage):
    """Any fsspec filesystem; s3fs for ``s3://``. A completed PUT is durable."""

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        opts = dict(storage_options or {})
        protocol = url.split("://", 1)[0]
        if protocol == "s3":
            # listings must never come from a stale cache: replay probes for new log objects
            opts.setdefault("use_listings_cache", False)
        self._opts = opts
        self.fs, self._root = fsspec.core.url_to_fs(self.url, **opts)
        self._root = self._root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    def zarr_store(self) -> Any:
        return zarr.storage.FsspecStore.from_url(self.url, storage_options=self._opts)

    def put(self, key: str, data: Any) -> None:
        parts = data if isinstance(data, list) else [data]
        self.fs.pipe_file(self._path(key), b"".join(memoryview(p).cast("B") for p in parts))

    def get(self, key: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._path(key)))
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def exists(self, key: str) -> bool:
        try:
            self.fs.info(self._path(key))
            return True
        except FileNotFoundError:
            return False

    def size(self, key: str) -> int:
        try:
            return int(self.fs.size(self._path(key)))
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        try:
            data = self.fs.cat_file(self._path(key), start=offset, end=offset + len(buf))
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None
        if len(data) != len(buf):
            raise BlobNotFound(f"object {key!r} is shorter than {offset + len(buf)} bytes")
        buf[:] = data

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def list(self, prefix: str) -> builtins.list[str]:
        try:
            found = self.fs.find(self._path(prefix))
        except FileNotFoundError:
            return []
        n = len(self._root) + 1
        return sorted(p[n:] for p in found)


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


def fsync_dir(path: Path) -> None:
    """Make renames and creations in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_storage(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Storage:
    """A directory path, ``file://`` URL, or any fsspec URL (``s3://bucket/prefix``)."""
    text = os.fspath(url)
    if text.startswith("file://"):
        return LocalStorage(text[len("file://") :])
    if "://" not in text:
        return LocalStorage(text)
    return FsspecStorage(text, storage_options=storage_options)
