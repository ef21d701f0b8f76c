"""A local disk cache of rows between object storage and the pinned host pool.

    cache = RowCache("/var/cache/mint-rows", max_bytes=64 << 30)
    await cache.read_through(client, loc, out)    # a verified hit, or one read that fills the cache

One file per row, ``<content id>.row``: a content id names immutable bytes, so an entry is
never stale and never needs invalidating. The cache is safe to share between the engine
processes of one node:

- crash-safe: a row is written to a temp file and renamed into place, so a reader sees a
  whole file or none; and every read from the cache is checked against its content id
  (a torn or corrupted file, e.g. after a power loss, is deleted and the row refetched);
- bounded in bytes, least recently used first: a hit stamps the file's mtime (the shared
  LRU clock of every process); a process that has written past its estimate of the
  budget lists the directory and deletes the oldest files until under it;
- concurrency-safe: two processes writing one row rename identical bytes over each
  other; a file deleted under a reader stays readable through its open handle; eviction
  skips files that vanish under it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mint_store.errors import BlobNotFound, IntegrityError
from mint_store.format.names import check_content_id
from mint_store.read import read_fd
from mint_store.results import Location

SUFFIX = ".row"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 600.0  # temp files older than this belong to a writer that died


@dataclass(frozen=True, slots=True)
class RowCacheStats:
    hits: int
    misses: int
    corrupt: int  # files that failed their content id check (deleted, refetched)
    evicted: int
    writes: int


class RowCache:
    """Rows on local disk keyed by content id, at most ``max_bytes`` (LRU). Thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("row cache max_bytes must be >= 0")
        self.directory = os.fspath(directory)
        self.max_bytes = max_bytes
        os.makedirs(self.directory, exist_ok=True)
        self._lock = threading.Lock()
        self._hits = self._misses = self._corrupt = self._evicted = self._writes = 0
        self._last_stamp = 0
        self._estimate = self._total()  # bytes in the directory, as this process last knew

    def stats(self) -> RowCacheStats:
        with self._lock:
            return RowCacheStats(self._hits, self._misses, self._corrupt, self._evicted, self._writes)

    def path(self, cid: str) -> str:
        return os.path.join(self.directory, check_content_id(cid) + SUFFIX)

    # -- reads and writes ------------------------------------------------------------------

    def load(self, loc: Location, out: Any) -> bool:
        """Fill ``out`` with the row of ``loc`` from disk; False (a miss) when absent or corrupt."""
        path = self.path(loc.content_id)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # absent (or unreadable): a miss; a cache never fails a read
            return self._count(hit=False)
        try:  # the store's one-pass verified read, from offset 0 of the row's own file
            whole = os.fstat(fd).st_size == loc.length
            if whole:
                read_fd(fd, dataclasses.replace(loc, shard_key=path, offset=0), out)
        except (OSError, BlobNotFound, IntegrityError):
            whole = False
        finally:
            os.close(fd)
        if not whole:
            self._discard(path)
            with self._lock:
                self._corrupt += 1
            return self._count(hit=False)
        self._touch(path)
        return self._count(hit=True)

    def store(self, loc: Location, data: Any) -> None:
        """Write the row (already verified by the caller) into the cache, then trim to budget."""
        view = memoryview(data).cast("B")[: loc.length]

        def write(fd: int) -> None:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(view)

        self.store_filled(loc, write)

    def store_filled(self, loc: Location, fill: Callable[[int], None]) -> None:
        """As :meth:`store`, the row's bytes put into the new file by ``fill(fd)`` (the file is
        ``loc.length`` bytes long already, open for reading and writing): e.g. copied there by
        the MinT service on this machine, which checks them (:mod:`..client.local_rows`). An
        OSError costs the entry, never the read; anything else ``fill`` raises is raised, with
        nothing left behind. Every later read of the entry is checked against the content id."""
        if loc.length > self.max_bytes:
            return  # it could never stay
        path = self.path(loc.content_id)
        tmp = os.path.join(self.directory, f"{TMP_PREFIX}{loc.content_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.ftruncate(fd, loc.length)
                fill(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # atomic: readers see the whole row or no file
        except OSError:
            self._discard(tmp)  # a full disk costs the cache entry, never the read
            return
        except BaseException:
            self._discard(tmp)
            raise
        self._touch(path)
        with self._lock:
            self._writes += 1
            self._estimate += loc.length
            over = self._estimate > self.max_bytes
        if over:
            try:
                self.trim()
            except OSError:  # the next write tries again
                pass

    async def read_through(self, client: Any, loc: Location, out: Any, *, verify: bool = True) -> Any:
        """``out`` filled with the row of ``loc``: from this cache (verified), or read by
        ``client.read_row`` and then cached. File I/O runs in a thread, off the event loop."""
        if await asyncio.to_thread(self.load, loc, out):
            return out
        await client.read_row(loc, out, verify=verify)
        await asyncio.to_thread(self.store, loc, out)
        return out

    # -- eviction --------------------------------------------------------------------------

    def trim(self) -> None:
        """Delete the least recently used rows until the directory holds at most ``max_bytes``."""
        entries = []
        now = time.time()
        for e in _scan(self.directory):
            try:
                st = e.stat()
            except FileNotFoundError:
                continue  # evicted by another process as we listed
            if e.name.startswith(TMP_PREFIX):
                if now - st.st_mtime > STALE_TMP_S:
                    self._discard(e.path)
                continue
            if e.name.endswith(SUFFIX):
                entries.append((st.st_mtime_ns, e.name, st.st_size, e.path))
        total = sum(size for _, _, size, _ in entries)
        evicted = 0
        for _, _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            self._discard(path)
            total -= size
            evicted += 1
        with self._lock:
            self._estimate = total
            self._evicted += evicted

    def keys_lru_first(self) -> list[str]:
        """Content ids on disk, least recently used first (what eviction would take first)."""
        rows = [(e.stat().st_mtime_ns, e.name) for e in _scan(self.directory) if e.name.endswith(SUFFIX)
                and not e.name.startswith(TMP_PREFIX)]
        return [name[: -len(SUFFIX)] for _, name in sorted(rows)]

    # -- internals ---------------------------------------------------------------------------

    def _count(self, *, hit: bool) -> bool:
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1
        return hit

    def _touch(self, path: str) -> None:
        """Stamp the file's mtime as its last use (strictly increasing within this process)."""
        with self._lock:
            stamp = self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass  # evicted by another process meanwhile

    def _total(self) -> int:
        total = 0
        for e in _scan(self.directory):
            if e.name.endswith(SUFFIX) and not e.name.startswith(TMP_PREFIX):
                try:
                    total += e.stat().st_size
                except FileNotFoundError:
                    pass
        return total

    @staticmethod
    def _discard(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass  # gone already (another process evicted it)


def _scan(directory: str) -> list[os.DirEntry[str]]:
    with os.scandir(directory) as it:
        return [e for e in it if e.is_file(follow_symlinks=False)]
