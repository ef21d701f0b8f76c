"""Bounded concurrent prefetch of rows into the pinned host pool, with an LRU host cache.

    streamer = Streamer(client, HostPool(1 << 30))
    locs = await streamer.prefetch(["acme/chat:prod", "acme/code@3"])   # warm the host cache
    lease = await streamer.fetch(locs[0])     # a verified row in a pool buffer, held
    slot_tensor.copy_(lease.tensor)           # ... the one device copy
    lease.release()                           # evictable again

Each storage read is one ``client.read_row`` straight into a pool buffer (no staging
copy) and is verified against the content id by the client. The host cache is keyed by
content id (a new version never serves stale bytes; identical rows are fetched once),
bounded in bytes, and evicts least recently used rows that nobody holds. Concurrent
fetches of one content id share one read. A cancelled caller stops the reads only it was
waiting for; a read already running in a thread finishes into its buffer before the
buffer is reused.

Threads: the async methods run on one event loop. The host cache itself is guarded by a
lock, so :meth:`Streamer.lease_cached` (a host hit without a trip through the loop),
:meth:`Streamer.fetch_now` (the same, or a direct read from a local store) and
``RowLease.release`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mint_store import Location
from mint_store.errors import MintError

from ..engine.metrics import Metrics
from .host_pool import HostBuffer, HostPool
from .row_cache import RowCache


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamerConfig:
    concurrency: int = 16  # storage reads in flight at once
    cache_bytes: int | None = None  # host cache budget; None: the whole pool
    verify: bool = True  # check every row read against its content id
    # rows up to this size are read in the caller's thread when the client offers direct
    # reads (a local store): the hop to the loop and an executor costs more than such a read
    direct_read_bytes: int = 16 * 2**20
    # a local disk cache of rows (stream/row_cache.py) under the host cache, shared by the engines
    # of a node; None: every host miss is a storage read. Direct reads of a local store
    # (fetch_now) skip it: those rows are local files already
    row_cache_dir: str | None = None
    row_cache_bytes: int = 16 * 2**30

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.cache_bytes is not None and self.cache_bytes < 0:
            raise ValueError("cache_bytes must be >= 0")
        if self.direct_read_bytes < 0:
            raise ValueError("direct_read_bytes must be >= 0")
        if self.row_cache_bytes < 0:
            raise ValueError("row_cache_bytes must be >= 0")


class _Entry:
    __slots__ = ("buf", "leases", "loc")

    def __init__(self, loc: Location, buf: HostBuffer) -> None:
        self.loc = loc
        self.buf = buf
        self.leases = 1  # the loader's, handed over to the first caller


class RowLease:
    """A verified row held in the host cache: not evicted, its buffer not reused, until released.

    ``tensor`` is the row as a uint8 ``[length]`` view of pinned pool memory.
    """

    __slots__ = ("_entry", "_streamer", "loc")

    def __init__(self, streamer: Streamer, entry: _Entry) -> None:
        self._streamer: Streamer | None = streamer
        self._entry = entry
        self.loc = entry.loc

    @property
    def tensor(self) -> torch.Tensor:
        return self._entry.buf.tensor[: self.loc.length]

    def release(self, fence: Any = None) -> None:
        """Give the row back; ``fence`` (a CUDA event) marks when the last copy from it ends."""
        s, self._streamer = self._streamer, None
        if s is None:
            raise RuntimeError("row lease released twice")
        s._unlease(self._entry, fence)

    def __enter__(self) -> RowLease:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._streamer is not None:
            self.release()


class _Load:
    __slots__ = ("done", "task", "waiters")

    def __init__(self, task: asyncio.Task[_Entry]) -> None:
        self.task = task
        self.waiters = 0
        self.done = False


class Streamer:
    def __init__(
        self, client: Any, pool: HostPool, *, config: StreamerConfig | None = None, metrics: Metrics | None = None
    ) -> None:
        self.client = client
        self.pool = pool
        self.config = config or StreamerConfig()
        self.metrics = metrics or Metrics()
        budget = self.config.cache_bytes
        self.cache_budget = pool.capacity if budget is None else min(budget, pool.capacity)  # 0: no cache
        self._cache: OrderedDict[str, _Entry] = OrderedDict()  # content id -> row, LRU first
        self._cached_bytes = 0
        self._loads: dict[str, _Load] = {}
        self._lock = threading.Lock()  # the cache: entries, their leases, the byte count
        self._sem: asyncio.Semaphore | None = None
        pool.reclaimer = self._reclaim
        self.row_cache = (RowCache(self.config.row_cache_dir, self.config.row_cache_bytes)
                          if self.config.row_cache_dir else None)

    # -- queries -----------------------------------------------------------------------------

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def cached(self, content_id: str) -> bool:
        return content_id in self._cache

    def cache_keys(self) -> list[str]:
        """Content ids in the host cache, least recently used first."""
        with self._lock:
            return list(self._cache)

    def lease_cached(self, loc: Location) -> RowLease | None:
        """The row of ``loc`` if the host cache has it (any thread; no I/O), else None."""
        t0 = time.perf_counter()
        with self._lock:
            entry = self._cache.get(loc.content_id)
            if entry is None:
                return None
            self._cache.move_to_end(loc.content_id)
            entry.leases += 1
        self.metrics.record("host", loc.length, time.perf_counter() - t0)
        return RowLease(self, entry)

    def fetch_now(self, loc: Location, *, alone: bool = False) -> RowLease | None:
        """The row of ``loc`` without a trip through the event loop (any thread), or None.

        A host hit, or one verified read in this thread when the client reads directly (a
        local store), the row is at most ``direct_read_bytes`` or ``alone`` (the only row
        the caller waits for: no other read could overlap it), no load of it is running on
        the loop, and the pool has room now. None means: use :meth:`fetch`, which waits for
        room and bounds concurrency.
        """
        lease = self.lease_cached(loc)
        if lease is not None or not (alone or loc.length <= self.config.direct_read_bytes):
            return lease
        store = self.client.direct(read=True)
        if store is None or loc.content_id in self._loads:  # (a racing load is deduplicated in _insert)
            return None
        t0 = time.perf_counter()
        buf = self.pool.try_acquire(loc.length)
        while buf is None and self.pool.reclaimer is not None and self.pool.reclaimer(self.pool.footprint(loc.length)):
            buf = self.pool.try_acquire(loc.length)
        if buf is None:
            return None
        try:
            store.read_row(loc, buf.array, verify=self.config.verify)
        except BaseException:
            buf.release()
            self.metrics.error()
            raise
        entry = self._insert(loc, buf)
        self.metrics.record("storage", loc.length, time.perf_counter() - t0)
        return RowLease(self, entry)

    # -- fetching ---------------------------------------------------------------------------

    async def resolve(self, refs: Sequence[str]) -> list[Location]:
        """Refs -> locations in one batched call; raises the first failure."""
        out = await self.client.resolve_many(list(refs))
        for got in out:
            if isinstance(got, MintError):
                raise got
        return out

    async def fetch(self, loc: Location) -> RowLease:
        """The row of ``loc``, held: from the host cache, or one verified read into the pool."""
        self._bind()
        lease = self.lease_cached(loc)
        if lease is not None:
            return lease
        load = self._loads.get(loc.content_id)
        if load is None:
            load = _Load(asyncio.ensure_future(self._read(loc)))
            self._loads[loc.content_id] = load
            load.task.add_done_callback(functools.partial(self._finished, loc.content_id, load))
        load.waiters += 1
        retry = False
        try:
            entry = await asyncio.shield(load.task)
            with self._lock:
                entry.leases += 1
            return RowLease(self, entry)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and not task.cancelling():  # the read was stopped, not this caller
                retry = True
            else:
                if load.waiters == 1 and not load.task.done():
                    load.task.cancel()  # nobody else wants this row: stop its read
                    if self._loads.get(loc.content_id) is load:  # a fetch from now on starts its own
                        del self._loads[loc.content_id]
                raise
        finally:
            load.waiters -= 1
            self._finish(loc.content_id, load)
        assert retry
        if self._loads.get(loc.content_id) is load:  # (its other waiters must not join it again either)
            del self._loads[loc.content_id]
        return await self.fetch(loc)

    async def prefetch(self, refs: Sequence[str | Location]) -> list[Location]:
        """Bring the rows of ``refs`` into the host cache (reads bounded by ``concurrency``).

        Rows are not held afterwards, so a prefetch larger than the cache keeps only the
        most recent rows. Cancelling it stops the reads that have not started.
        """
        names = [r for r in refs if not isinstance(r, Location)]
        resolved = iter(await self.resolve(names)) if names else iter(())
        locs = [r if isinstance(r, Location) else next(resolved) for r in refs]
        unique = list({loc.content_id: loc for loc in locs}.values())

        async def one(loc: Location) -> None:
            (await self.fetch(loc)).release()

        await _all_or_cancel([one(loc) for loc in unique])
        return locs

    async def stream(self, locs: Sequence[Location], sink: Callable[[RowLease | BaseException], None]) -> None:
        """Fetch every row (bounded concurrency) and hand each lease to ``sink`` as it lands.

        The consumer releases the leases, so a batch larger than the pool streams through
        it instead of needing all rows at once. A failure goes to ``sink`` too.
        """

        async def one(loc: Location) -> None:
            try:
                lease = await self.fetch(loc)
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                sink(e)
                raise
            sink(lease)

        await _all_or_cancel([one(loc) for loc in locs])

    # -- internals ----------------------------------------------------------------------------

    def _bind(self) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.concurrency)

    async def _read(self, loc: Location) -> _Entry:
        sem = self._sem
        if sem is None:
            raise RuntimeError("Streamer._read before _bind")
        t0 = time.perf_counter()
        async with sem:
            buf = await self.pool.acquire(loc.length)
            read = asyncio.ensure_future(
                self.client.read_row(loc, buf.array, verify=self.config.verify) if self.row_cache is None
                else self.row_cache.read_through(self.client, loc, buf.array, verify=self.config.verify))
            try:
                await asyncio.shield(read)
            except asyncio.CancelledError:
                # the read runs in a thread and is still writing into buf: free it afterwards
                read.add_done_callback(functools.partial(_release_after, buf))
                self.metrics.cancelled()
                raise
            except BaseException:
                buf.release()
                self.metrics.error()
                raise
        entry = self._insert(loc, buf)
        self.metrics.record("storage", loc.length, time.perf_counter() - t0)
        return entry

    def _insert(self, loc: Location, buf: HostBuffer) -> _Entry:
        """Cache a freshly read row; returns its entry with one lease for the reader.

        A direct read (:meth:`fetch_now`) and a load on the loop may read the same row at
        once: the second to land gives its buffer back and shares the first one's entry.
        """
        with self._lock:
            entry = self._cache.get(loc.content_id)
            if entry is None:
                entry = self._cache[loc.content_id] = _Entry(loc, buf)
                self._cached_bytes += self.pool.footprint(buf.nbytes)
                self._trim()
                return entry
            self._cache.move_to_end(loc.content_id)
            entry.leases += 1
        buf.release()
        return entry

    def _finished(self, content_id: str, load: _Load, _task: object) -> None:
        self._finish(content_id, load)

    def _finish(self, content_id: str, load: _Load) -> None:
        """Once the read is over and no caller waits, drop the loader's own lease."""
        if load.done or load.waiters or not load.task.done():
            return
        load.done = True
        if self._loads.get(content_id) is load:
            del self._loads[content_id]
        if load.task.cancelled() or load.task.exception() is not None:
            return
        self._unlease(load.task.result(), None)

    def _unlease(self, entry: _Entry, fence: Any) -> None:
        with self._lock:
            if fence is not None:
                entry.buf.fence = fence
            entry.leases -= 1
            if entry.leases:
                return
            self._trim()
        self.pool.wake()  # a fetch waiting for memory may evict this row now

    def _evict(self, content_id: str) -> None:  # under self._lock
        entry = self._cache.pop(content_id)
        self._cached_bytes -= self.pool.footprint(entry.buf.nbytes)
        entry.buf.release()

    def _trim(self) -> None:  # under self._lock
        if self._cached_bytes <= self.cache_budget:
            return
        for cid in [c for c, e in self._cache.items() if e.leases == 0]:
            if self._cached_bytes <= self.cache_budget:
                break
            self._evict(cid)

    def _reclaim(self, nbytes: int) -> bool:
        """The pool is short of ``nbytes``: evict the least recently used row nobody holds."""
        with self._lock:
            for cid, entry in self._cache.items():
                if entry.leases == 0:
                    self._evict(cid)
                    return True
        return False

    def clear(self) -> None:
        """Evict every row nobody holds."""
        with self._lock:
            for cid in [c for c, e in self._cache.items() if e.leases == 0]:
                self._evict(cid)


def _release_after(buf: HostBuffer, read: asyncio.Future[Any]) -> None:
    if not read.cancelled():
        read.exception()  # retrieved: a failed read nobody awaits is not an unhandled error
    buf.release()


async def _all_or_cancel(coros: list[Any]) -> None:
    """Run ``coros`` concurrently; on the first failure or on cancellation, cancel the rest
    and wait for them, so no lease or buffer is left behind. Raises the first failure."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
        raise
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
        for t in tasks:  # retrieve every exception so none is reported as unhandled
            if not t.cancelled():
                t.exception()
        raise failed.exception() or RuntimeError("a fetch failed")


def consume_in_thread(
    streamer: Streamer,
    submit: Callable[[Coroutine[Any, Any, None]], concurrent.futures.Future[None]],
    locs: Sequence[Location],
    consume: Callable[[RowLease], None],
) -> None:
    """From a thread other than the streamer's loop: fetch ``locs`` there (``submit`` runs a
    coroutine on it) and call ``consume(lease)`` here for each row as it lands; ``consume``
    releases the lease. Reads and consumption overlap, and the pool only ever holds the
    rows in between. On any failure the rest is cancelled and every lease released."""
    q: queue.SimpleQueue[RowLease | BaseException] = queue.SimpleQueue()
    gate = threading.Lock()
    aborted = False

    def sink(item: RowLease | BaseException) -> None:  # on the streamer's loop
        with gate:
            if not aborted:
                q.put(item)
                return
        if isinstance(item, RowLease):
            item.release()

    fut = submit(streamer.stream(locs, sink))
    done = 0
    try:
        while done < len(locs):
            try:
                item = q.get(timeout=0.05)
            except queue.Empty:
                if fut.done() and q.empty():  # the stream ended (cancelled?) without every row
                    fut.result()
                    raise RuntimeError("the row stream ended before every row arrived") from None
                continue
            if isinstance(item, BaseException):
                raise item
            consume(item)
            done += 1
        fut.result()
    finally:
        if done < len(locs):
            fut.cancel()
            with gate:
                aborted = True
            while not q.empty():
                item = q.get()
                if isinstance(item, RowLease):
                    item.release()
