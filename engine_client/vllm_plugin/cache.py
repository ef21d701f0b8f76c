"""The on-disk cache of PEFT directories vLLM loads, keyed by content id.

Layout under the cache directory::

    entries/<content_id>/   adapter_config.json + adapter_model.safetensors (complete, never modified),
                            and .mint-digests.json: their seal (:mod:`.seal`)
    tmp/                    materialisations in progress, and evicted entries being deleted
    leases/<pid>-<hex>      per cache instance: the content ids it holds (one per line)
    .lock                   flock: shared to look up or add an entry, exclusive to evict
    .mint-key               the key entries are sealed with (0600)

- **Private**: the directory is this user's alone (created 0700; one another user could
  change is refused, with the fix: :mod:`.cache_root`), and an entry is served only under a
  seal made with its key (:mod:`.seal`): an entry planted in it, digests file and all, is not.

- **Identical content is materialised once**: the key is the content id. Within a process
  one thread materialises a given content id while the others wait for it; two processes
  racing both write, the first rename wins and the other discards its copy.
- **Atomic**: files are written and fsynced in ``tmp/``, checked, and the directory is
  renamed into ``entries/``. A crash leaves at most a ``tmp/`` directory (swept after
  ``tmp_grace_s``), never an entry vLLM could load half of.
- **Checked on every hit**: the seal (keyed; the files' stat and xxh3, taken when they were
  written from the row checked against its content id) is checked before a path is returned;
  an entry that does not match (planted, bit rot, a stray write) is never served: the row's
  files are made again, and the entry sealed anew if it holds exactly them, else replaced.
- **LRU by bytes**: an entry's last use is its directory's mtime (set on every hit); after
  adding an entry, least recently used ones go until the total is within ``max_bytes``.
  The entry of the current call is never evicted.
- **Leases**: vLLM remembers the path a resolver returned and reloads the adapter from it
  whenever its own in-memory LoRA cache dropped it, so deleting a returned directory
  would make a later request fail. With ``hold=True`` an instance holds every entry it
  returned until :meth:`release` (the server forgot every name of it), :meth:`close` or its
  process exits (the lease file is flock-ed by its owner, so a dead owner's leases lapse by
  themselves); held entries are never evicted,
  even when they alone exceed the limit (a warning says so). With ``hold=False`` only the
  current call's entry is protected: plain LRU. Safe for several processes on one host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from mint_store.format.names import check_content_id
from mint_store.storage import fsync_dir, write_synced

from .cache_root import load_key, prepare_root, private_dir
from .seal import DIGESTS, FORMAT, is_sealed, seal

__all__ = ["DIGESTS", "FORMAT", "AdapterCache", "CachedAdapter", "EntryStat"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CachedAdapter:
    content_id: str
    path: Path
    nbytes: int
    created: bool  # this call materialised it


@dataclass(frozen=True, slots=True)
class EntryStat:
    content_id: str
    nbytes: int
    last_used: float


class AdapterCache:
    """Thread-safe; one instance per process is the usual use (each instance holds its own leases)."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, *, hold: bool = True,
                 tmp_grace_s: float = 3600.0, logger: logging.Logger | None = None) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.root = prepare_root(root)  # raises UnsafeCacheDir, naming the fix
        self.max_bytes = max_bytes
        self.hold = hold
        self.tmp_grace_s = tmp_grace_s
        self.log = logger or log
        self.entries_dir = self.root / "entries"
        self.tmp_dir = self.root / "tmp"
        self.leases_dir = self.root / "leases"
        for d in (self.entries_dir, self.tmp_dir, self.leases_dir):
            private_dir(d)
        self._key = load_key(self.root)  # in memory from here on
        self._lock_path = self.root / ".lock"
        self._mutex = threading.Lock()
        self._flights: dict[str, tuple[threading.Lock, int]] = {}
        self._leases: Counter[str] = Counter()
        self._lease_fd: int | None = None
        self._lease_size = 0
        self._lease_name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._closed = False

    # -- public ----------------------------------------------------------------------------

    def get(self, content_id: str, produce: Callable[[], Mapping[str, bytes]]) -> CachedAdapter:
        """The entry of ``content_id``; on a miss ``produce()`` gives its files (name -> bytes)."""
        check_content_id(content_id)
        with self._flight(content_id):
            with self._global(exclusive=False):
                added = self._lease(content_id)
                path = self.entries_dir / content_id
                hit = path.is_dir()
                if hit:
                    os.utime(path)
            files: Mapping[str, bytes] | None = None
            release = not self.hold  # without hold, the lease lasts this call only
            try:
                if hit and not is_sealed(path, content_id, self._key):
                    files = produce()  # the checked row's files: what the entry must hold
                    hit = self._mend(content_id, files)
                if hit:
                    return CachedAdapter(content_id, path, _dir_bytes(path), False)
                created = self._add(content_id, produce() if files is None else files)
                self.evict(protect=(content_id,))
                return CachedAdapter(content_id, path, _dir_bytes(path), created)
            except BaseException:
                release = release or added  # hold nothing that was never returned
                raise
            finally:
                if release:
                    self._unlease(content_id)

    def entries(self) -> list[EntryStat]:
        out = []
        for name in os.listdir(self.entries_dir):
            path = self.entries_dir / name
            try:
                out.append(EntryStat(name, _dir_bytes(path), path.stat().st_mtime))
            except FileNotFoundError:  # evicted meanwhile
                continue
        return out

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries())

    def held(self) -> set[str]:
        """Content ids this instance holds (leases)."""
        with self._mutex:
            return set(self._leases)

    def evict(self, protect: tuple[str, ...] = ()) -> list[str]:
        """Remove least recently used unheld entries until the total fits; returns their ids."""
        trash: list[Path] = []
        with self._global(exclusive=True):
            held = self._live_leases() | set(protect)
            stats = sorted(self.entries(), key=lambda e: (e.last_used, e.content_id))
            total = sum(e.nbytes for e in stats)
            evicted = []
            for e in stats:
                if total <= self.max_bytes:
                    break
                if e.content_id in held:
                    continue
                dest = self.tmp_dir / f"evict.{e.content_id}.{uuid.uuid4().hex[:8]}"
                os.rename(self.entries_dir / e.content_id, dest)
                trash.append(dest)
                evicted.append(e.content_id)
                total -= e.nbytes
            trash.extend(self._stale_tmp())
        for d in trash:
            shutil.rmtree(d, ignore_errors=True)
        if total > self.max_bytes:
            self.log.warning("MinT vLLM cache %s holds %d bytes, over its limit of %d: the rest is in use "
                        "by live vLLM processes (MINT_VLLM_CACHE_HOLD=1)", self.root, total, self.max_bytes)
        return evicted

    def close(self) -> None:
        """Release this instance's leases (its entries become evictable)."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._leases.clear()
            if self._lease_fd is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.leases_dir / self._lease_name)
                os.close(self._lease_fd)
                self._lease_fd = None

    # -- materialisation -------------------------------------------------------------------

    def _add(self, content_id: str, files: Mapping[str, bytes]) -> bool:
        tmp = self.tmp_dir / f"{content_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for name, data in files.items():
                if "/" in name or name.startswith("."):
                    raise ValueError(f"bad file name {name!r}")
                write_synced(tmp / name, [data])
            if not seal(tmp, content_id, self._key, files):  # read back: complete, or nothing is renamed
                raise OSError(f"{tmp} does not hold what was written to it")
            with self._global(exclusive=False):
                dest = self.entries_dir / content_id
                try:
                    os.rename(tmp, dest)
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    created = False  # another process won the race; same content by construction
                else:
                    created = True
                    fsync_dir(self.entries_dir)
                os.utime(dest)
            return created
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _mend(self, content_id: str, files: Mapping[str, bytes]) -> bool:
        """An entry that failed its seal: True if it is sound after all (checked again under the
        exclusive lock: another process may have replaced it; or it holds exactly ``files``, the
        checked row's, as an entry of an older version or of an older export that gave the same
        bytes does: it is sealed as it is), else it is moved out and deleted (False: the caller
        makes it again). Never served unsealed: its bytes are compared with the row's."""
        path = self.entries_dir / content_id
        dest = self.tmp_dir / f"evict.{content_id}.{uuid.uuid4().hex[:8]}"
        with self._global(exclusive=True):
            if is_sealed(path, content_id, self._key):
                return True
            try:
                if seal(path, content_id, self._key, files):  # already what the row gives
                    return True
            except OSError:  # (the digests file could not be written: another user's directory)
                pass
            self.log.warning("MinT vLLM cache entry %s is not as this cache sealed it (changed on disk, or not "
                             "written by this cache): it is replaced", path)
            try:
                os.rename(path, dest)
            except FileNotFoundError:  # gone meanwhile
                return False
        shutil.rmtree(dest, ignore_errors=True)
        return False

    def _stale_tmp(self) -> list[Path]:
        now = time.time()
        out = []
        for name in os.listdir(self.tmp_dir):
            path = self.tmp_dir / name
            try:
                old = now - path.stat().st_mtime > self.tmp_grace_s
            except FileNotFoundError:
                continue
            if name.startswith("evict.") or old:
                out.append(path)
        return out

    # -- locks and leases ------------------------------------------------------------------

    @contextlib.contextmanager
    def _global(self, *, exclusive: bool) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _flight(self, content_id: str) -> Iterator[None]:
        with self._mutex:
            lock, users = self._flights.get(content_id, (threading.Lock(), 0))
            self._flights[content_id] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._mutex:
                lock, users = self._flights[content_id]
                if users == 1:
                    del self._flights[content_id]
                else:
                    self._flights[content_id] = (lock, users - 1)

    def _lease(self, content_id: str) -> bool:
        """Hold ``content_id`` (call under the shared global lock). True if newly held."""
        with self._mutex:
            if self._closed:
                raise RuntimeError("the adapter cache is closed")
            self._leases[content_id] += 1
            if self._leases[content_id] > 1:
                return False
            self._write_leases(added=content_id)
            return True

    def release(self, content_id: str) -> None:
        """Hold ``content_id`` no more, however many calls returned it: the server that used its
        directory forgot every name that named it (LRU may evict it from now on)."""
        with self._global(exclusive=False), self._mutex:
            if self._leases.pop(content_id, 0) and not self._closed:
                self._write_leases()

    def _unlease(self, content_id: str) -> None:
        with self._global(exclusive=False), self._mutex:
            if self._leases[content_id] <= 1:
                self._leases.pop(content_id, None)
                if not self._closed:
                    self._write_leases()
            else:
                self._leases[content_id] -= 1

    def _write_leases(self, added: str | None = None) -> None:
        """Publish the held set (under the shared global lock, so an evictor never reads half of it)."""
        if self._lease_fd is None:
            fd = os.open(self.leases_dir / self._lease_name, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for life: a dead owner's leases lapse
            self._lease_fd, self._lease_size = fd, 0
        if added is not None:  # the common case (hold=True only ever adds): append one line
            line = f"{added}\n".encode()
            os.pwrite(self._lease_fd, line, self._lease_size)
            self._lease_size += len(line)
            return
        data = "".join(f"{c}\n" for c in self._leases).encode()
        os.ftruncate(self._lease_fd, 0)
        os.pwrite(self._lease_fd, data, 0)
        self._lease_size = len(data)

    def _live_leases(self) -> set[str]:
        """Every content id a live instance holds; removes dead owners' files (under the exclusive lock)."""
        with self._mutex:
            held = set(self._leases)
        for name in os.listdir(self.leases_dir):
            if name == self._lease_name:
                continue
            path = self.leases_dir / name
            try:
                f = open(path, "rb")  # noqa: SIM115 -- closed below, after the flock test
            except FileNotFoundError:
                continue
            with f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # its owner is alive
                    held.update(f.read().decode().split())
                else:
                    os.unlink(path)
        return held


def _dir_bytes(path: Path) -> int:
    """An entry's adapter files (its digests file, a few hundred bytes, not counted)."""
    return sum(f.stat().st_size for f in path.iterdir() if f.name != DIGESTS)
