"""Where objects live: a local directory (default) or any fsspec URL (``s3://`` via s3fs).

Small and synchronous on purpose: the store calls it from its writer thread and from read
paths that must cost one system call (``os.preadv``) or one ranged GET per row.
"""

from __future__ import annotations

import builtins
import fcntl
import hashlib
import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Any

import fsspec
import zarr.storage

from .errors import BlobNotFound, ObjectChanged, ObjectExists
from .retry import RetryPolicy, call_with_retry, retried

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
    def put_if_absent(self, key: str, data: Any) -> None:
        """Like :meth:`put`, but create-only: raise ObjectExists (and change nothing) when
        ``key`` exists. Every object a commit names is written this way."""

    def create(self, key: str, data: Any) -> None:
        """:meth:`put_if_absent`, retried on transient errors (``retry``).

        A retry that finds ``key`` holding exactly ``data`` is the earlier attempt's write,
        which landed though its answer was lost (a reset after the upload): done. Anything
        else there is another writer's object: ObjectExists, nothing changed.
        """
        attempts = 0

        def once() -> None:
            nonlocal attempts
            attempts += 1
            try:
                self.put_if_absent(key, data)
            except ObjectExists:
                if attempts > 1 and self.get(key) == _joined(data):
                    return
                raise

        call_with_retry(self.retry, once)

    @abstractmethod
    def get_with_token(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and a token that changes whenever the object does."""

    @abstractmethod
    def replace_if(self, key: str, data: Any, token: str) -> None:
        """Overwrite ``key`` only if it still has ``token`` (compare-and-swap); raise
        ObjectChanged otherwise. Used for the writer lease only."""

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
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.root.parent)  # a new store's own entry survives power loss too
        # directories whose entries this process made durable in their parents
        self._durable_dirs: set[Path] = {self.root}
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
        data = self.get(key)
        return data, hashlib.sha256(data).hexdigest()

    def replace_if(self, key: str, data: Any, token: str) -> None:
        # the compare and the rename run under an flock that every CAS of this key takes;
        # the kernel drops it when its holder dies, so a killed process never wedges it
        path = self._path(key)
        self._ensure_dir(path.parent)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = self.get_with_token(key)[1]
            except BlobNotFound:
                current = None
            if current != token:
                raise ObjectChanged(f"object {key!r} changed since it was read; not overwritten")
            self.put(key, data)
        finally:
            os.close(fd)  # releases the flock

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
            dirs.add(path.parent)
        for d in sorted(dirs, key=lambda d: -len(d.parts)):
            fsync_dir(d)  # the files' own entries
            self._ensure_dir(d)  # and directories zarr created, in their parents

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
        self._s3 = hasattr(self.fs, "_call_s3")
        # other filesystems (memory://) are one process: a lock makes check-then-write atomic
        self._cas_lock = threading.Lock()

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    def zarr_store(self) -> Any:
        return zarr.storage.FsspecStore.from_url(self.url, storage_options=self._opts)

    def put(self, key: str, data: Any) -> None:
        self.fs.pipe_file(self._path(key), _joined(data))

    def put_if_absent(self, key: str, data: Any) -> None:
        # S3: PutObject with If-None-Match: * (s3fs's mode="create"); a 412 is FileExistsError
        try:
            if self._s3:
                self.fs.pipe_file(self._path(key), _joined(data), mode="create")
                return
            with self._cas_lock:
                if self.exists(key):
                    raise FileExistsError(key)
                self.put(key, data)
        except FileExistsError:
            raise ObjectExists(f"object {key!r} already exists in {self.url}; not overwritten") from None

    def get_with_token(self, key: str) -> tuple[bytes, str]:
        if not self._s3:
            data = self.get(key)
            return data, hashlib.sha256(data).hexdigest()
        from fsspec.asyn import sync

        bucket, name, _ = self.fs.split_path(self._path(key))

        async def fetch() -> tuple[bytes, str]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=name)
            return bytes(await resp["Body"].read()), str(resp["ETag"])

        try:
            return sync(self.fs.loop, fetch)
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def replace_if(self, key: str, data: Any, token: str) -> None:
        if not self._s3:
            with self._cas_lock:
                try:
                    current: str | None = self.get_with_token(key)[1]
                except BlobNotFound:
                    current = None
                if current != token:
                    raise ObjectChanged(f"object {key!r} changed since it was read; not overwritten")
                self.put(key, data)
            return
        try:  # PutObject with If-Match: the ETag we read
            self.fs.pipe_file(self._path(key), _joined(data), IfMatch=token)
        except (OSError, FileNotFoundError) as e:
            if _precondition_failed(e):
                raise ObjectChanged(f"object {key!r} changed since it was read; not overwritten") from None
            raise

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


def _joined(data: Any) -> bytes:
    parts = data if isinstance(data, list) else [data]
    return b"".join(memoryview(p).cast("B") for p in parts)


def _precondition_failed(e: BaseException) -> bool:
    """Whether an s3fs error is S3's 412 PreconditionFailed (or 404 on If-Match of a gone key)."""
    cause = e.__cause__ or e.__context__
    resp = getattr(cause, "response", None)
    if isinstance(resp, dict):
        code = str(resp.get("Error", {}).get("Code", ""))
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in ("PreconditionFailed", "NoSuchKey", "412") or status in (404, 412)
    return isinstance(e, FileNotFoundError) or "pre-condition" in str(e).lower()


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
