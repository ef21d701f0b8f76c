"""A pool of host staging buffers: one big allocation, carved into row buffers and reused.

With CUDA the pool is one pinned (page-locked) allocation made once, so every row read
into it can be copied to the device with ``non_blocking=True``; pinning per tensor or per
row would cost a syscall and a page-table walk per switch. Without CUDA it is ordinary
anonymous memory from ``mmap`` (page-aligned, committed lazily by the kernel).

Buffers are extents of that allocation (first fit, neighbours coalesced on release),
each starting at a multiple of ``alignment``. ``await pool.acquire(n)`` waits while no
extent of ``n`` bytes is free (back pressure); a *reclaimer* (the streamer's host cache)
is asked first to give back buffers it can spare.

Thread safety: acquire is called on one event loop; release may come from any thread
(the engine releases after a device copy) and wakes waiters through their loop.
"""

from __future__ import annotations

import asyncio
import bisect
import mmap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import HostPoolTooSmall

PAGE = mmap.PAGESIZE


class HostBuffer:
    """One extent of the pool. ``tensor`` is a uint8 ``[nbytes]`` view; ``array`` the same
    memory as numpy (what the client reads into). Release exactly once."""

    __slots__ = ("_pool", "array", "fence", "nbytes", "offset", "tensor")

    def __init__(self, pool: HostPool, offset: int, nbytes: int) -> None:
        self._pool: HostPool | None = pool
        self.offset = offset
        self.nbytes = nbytes
        self.tensor = pool.tensor[offset : offset + nbytes]  # [nbytes] uint8, a view
        self.array: np.ndarray = self.tensor.numpy()
        # a CUDA event after which no queued copy reads this memory any more
        self.fence: Any = None

    @property
    def released(self) -> bool:
        return self._pool is None

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            raise RuntimeError("host buffer released twice")
        pool._free(self)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self.release()


class HostPool:
    """``HostPool(capacity_bytes, *, pin=None, alignment=4096)``.

    ``pin=None`` pins when CUDA is available. ``capacity`` is rounded up to whole pages.
    """

    def __init__(self, capacity: int, *, pin: bool | None = None, alignment: int = PAGE) -> None:
        if capacity < 1:
            raise ValueError("host pool capacity must be at least one byte")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError("alignment must be a power of two")
        self.alignment = alignment
        self.capacity = (capacity + PAGE - 1) // PAGE * PAGE
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self._mmap: mmap.mmap | None = None
        if self.pinned:
            # one cudaHostAlloc for the whole pool: page-aligned, page-locked
            self.tensor = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
        else:
            self._mmap = mmap.mmap(-1, self.capacity)
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)  # [capacity], page-aligned
        self._lock = threading.Lock()
        self._starts: list[int] = [0]  # free extents, sorted by start
        self._sizes: list[int] = [self.capacity]
        self._used = 0
        self._live = 0
        self._fenced: list[HostBuffer] = []  # released, but a device copy may still read them
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.reclaimer: Callable[[int], bool] | None = None

    # -- accounting -------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes held by live buffers (alignment padding included)."""
        return self._used

    @property
    def live(self) -> int:
        """Number of buffers handed out and not yet released."""
        return self._live

    @property
    def free(self) -> int:
        return self.capacity - self._used

    def footprint(self, nbytes: int) -> int:
        """Bytes an ``nbytes`` buffer takes from the pool."""
        return (max(nbytes, 1) + self.alignment - 1) // self.alignment * self.alignment

    # -- acquire / release ---------------------------------------------------------------------

    def try_acquire(self, nbytes: int) -> HostBuffer | None:
        """A buffer of ``nbytes`` now, or None when no free extent is large enough."""
        size = self._check(nbytes)
        with self._lock:
            self._retire_fences(block=False)
            off = self._take(size)
            if off is None and self._fenced:
                self._retire_fences(block=True)  # a copy finishes in microseconds: wait for it
                off = self._take(size)
        if off is None:
            return None
        return HostBuffer(self, off, nbytes)

    async def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of ``nbytes``; waits (back pressure) until one is free."""
        self._check(nbytes)
        while True:
            buf = self.try_acquire(nbytes)
            if buf is not None:
                return buf
            if self.reclaimer is not None and self.reclaimer(self.footprint(nbytes)):
                continue
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            with self._lock:
                self._waiters.append((loop, fut))
                # a release between try_acquire and here would not have seen this waiter
                if self._largest() >= self.footprint(nbytes):
                    self._waiters.remove((loop, fut))
                    continue
            try:
                await fut
            finally:
                with self._lock:
                    if (loop, fut) in self._waiters:
                        self._waiters.remove((loop, fut))

    def _check(self, nbytes: int) -> int:
        size = self.footprint(nbytes)
        if size > self.capacity:
            raise HostPoolTooSmall(
                f"a row of {nbytes} bytes does not fit in a host pool of {self.capacity} bytes; "
                "make the pool larger"
            )
        return size

    def _take(self, size: int) -> int | None:
        for i, have in enumerate(self._sizes):
            if have >= size:
                off = self._starts[i]
                if have == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self._used += size
                self._live += 1
                return off
        return None

    def _largest(self) -> int:
        return max(self._sizes, default=0)

    def _free(self, buf: HostBuffer) -> None:
        with self._lock:
            self._live -= 1
            if buf.fence is not None and not buf.fence.query():
                self._fenced.append(buf)  # the extent returns once the copy reading it is done
                return
            self._give_back(buf)
        self.wake()

    def wake(self) -> None:
        """Let waiting acquires try again (their reclaimer may now have something to give)."""
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_wake, fut)

    def _give_back(self, buf: HostBuffer) -> None:
        size = self.footprint(buf.nbytes)
        off = buf.offset
        i = bisect.bisect_left(self._starts, off)
        # coalesce with the free neighbours so big rows still find room after small ones
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == off:
            i -= 1
            self._sizes[i] += size
        else:
            self._starts.insert(i, off)
            self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:
            self._sizes[i] += self._sizes[i + 1]
            del self._starts[i + 1], self._sizes[i + 1]
        self._used -= size

    def _retire_fences(self, *, block: bool) -> None:
        keep: list[HostBuffer] = []
        for buf in self._fenced:
            if block:
                buf.fence.synchronize()
            if block or buf.fence.query():
                self._give_back(buf)
            else:
                keep.append(buf)
        self._fenced = keep


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
