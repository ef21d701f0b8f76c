"""Host buffers for the rows read into vLLM, reused once vLLM drops every tensor of a row.

A fresh buffer costs a page fault per 4 KiB page on its first touch, and on a virtual machine
that fault is the expensive part of a cold load: measured on the 2-core VM of
``tools/bench_vllm.py``, a fresh 37 MB buffer took 14-25 ms to fault in, the verified read of
the row into a buffer already touched 3.7 ms. glibc keeps no freed block above 32 MiB for
reuse (its mmap threshold stops there), so without this a vLLM worker paid those faults on
every cold load of a large adapter. vLLM's own directory load pays none: safetensors maps the
file, whose pages are already in the page cache.

:class:`RowBuffers` hands out a buffer of a row's size (rounded up to 2 MiB, so rows of one
shape share buffers) as a uint8 tensor; when the last tensor that shares its memory is freed
(vLLM evicted the adapter from its CPU cache), the buffer goes back to a free list that keeps
at most ``keep_bytes``. A pinned buffer (a GPU worker) comes from torch's own caching host
allocator, which already reuses pinned blocks; a small row from torch's allocator, which
reuses them too.

A free list alone does not help the cold loads that matter most: new adapters arriving while
vLLM's CPU cache still holds every earlier row, so nothing has come back. So the pool keeps a
*spare* of each size class it hands out: when a ``take`` leaves none of that size free, a
thread at the lowest priority (nice 19) maps the next buffer and faults in its pages, off the
load's path (on the VM above, ~0.7 ms per MB of row: 27-33 ms of a 37 MB row's cold load).
The next row of that size is read into memory already touched; the first of a size still
faults. Spares are free buffers like any other: within ``keep_bytes``, the least recently
freed size going first (``keep_bytes=0`` turns both off). Measured by
``tools/bench_row_buffers.py``.

A spare is made once no read into one of these buffers is under way (:meth:`RowBuffers.reading`):
faulting in a buffer is memory-bound, as the row's copy into another one is, on CPUs the
service shares, and the next load is what the spare is for, not this one.

Buffers the MinT service on this machine copies rows into (:meth:`RowBuffers.take_shared`) are
memfd mappings, pooled apart from the rest, which are anonymous memory (a fresh shmem page
cost about 7% more to fault in here). A pooled one's size is sealed, so the service keeps its
own mapping of it and copies the next row into that: a ``pread``, not shmem's slower write path.
A shared spare is shown to the service as soon as it is made (``on_spare``:
:meth:`.direct.DirectLoader` sends it over the socket), so the first row copied into it is a
``pread`` into a mapping too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator

import numpy as np
import torch

from .background import NiceWorker

MIN_POOLED = 1 << 20  # smaller rows: torch.empty (the allocator's free lists reuse those)
GRAIN = 2 << 20  # sizes rounded up to this: rows of one shape take each other's buffers
READ_WAIT_S = 2.0  # longest a spare waits for the reads under way (then it is made anyway)

log = logging.getLogger("vllm.plugins.mint_lora_resolver.buffers")


class RowBuffers:
    """A free list of host buffers by size; ``take`` a row's buffer, it comes back by itself."""

    def __init__(self, keep_bytes: int, *, spares: bool = True) -> None:
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
        self.keep_bytes = keep_bytes
        self._spares_on = spares  # (off: only what comes back is reused; tools/bench_row_buffers.py)
        self._lock = threading.RLock()  # (a finalizer can run inside take, on a GC in this thread)
        # (size, shared) -> buffers; the oldest freed first. Shared ones are memfds (take_shared), the
        # rest anonymous memory: a fresh page of shmem costs more to fault in than an anonymous one
        self._free: OrderedDict[_Key, list[_Mem]] = OrderedDict()
        self._free_bytes = 0
        self.fresh = 0  # buffers mapped on a take's path (tests and logs)
        self.reused = 0  # takes served from the free list (a spare included)
        self.spares = 0  # buffers mapped and faulted in ahead, by the spare thread
        self._pending: set[_Key] = set()  # kinds the spare thread is preparing
        self._settled = threading.Condition(self._lock)
        self._spare_thread = NiceWorker("mint-vllm-row-spares")
        self._pid = os.getpid()  # the process whose asks these are (a forked child starts its own)
        self._reading = 0  # reads into buffers of this pool under way (reading): spares wait for them
        # (fd, size) of each shared spare once it is faulted in, on the spare thread, before any take
        # can have it: the loader shows it to the service on this machine (it maps it then)
        self.on_spare: Callable[[int, int], None] | None = None

    def take(self, nbytes: int, *, pin: bool = False) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (``[S]``), writable, 64-byte aligned or better.

        Its memory returns to this pool when the tensor and every view of it are gone.
        """
        if pin or nbytes < MIN_POOLED or self.keep_bytes == 0:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return self._take(nbytes, False)[0]

    def take_shared(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """As :meth:`take`, in memory another process can be handed: ``(tensor, fd)``, the fd a
        memfd whose first ``nbytes`` the tensor maps (valid while the tensor lives; the pool's
        to close). The MinT service on this machine copies rows into it
        (:mod:`..client.local_rows`). OSError where there is no memfd (not Linux)."""
        if not hasattr(os, "memfd_create"):
            raise OSError("no memfd on this system: rows are read over HTTP")
        if nbytes < MIN_POOLED or self.keep_bytes == 0:  # not pooled: its own, closed with the tensor
            mem = _Mem(nbytes, shared=True, reused=False)
            arr = np.frombuffer(mem.mm, dtype=np.uint8, count=nbytes)  # [S]
            weakref.finalize(arr, mem.close)
            return torch.from_numpy(arr), mem.fd
        return self._take(nbytes, True)

    def _take(self, nbytes: int, shared: bool) -> tuple[torch.Tensor, int]:
        key = (-(-nbytes // GRAIN) * GRAIN, shared)
        mem = None
        with self._lock:
            free = self._free.get(key)
            if free:
                mem = free.pop()
                if not free:  # (no empty lists: the eviction loop takes the oldest kind's first)
                    del self._free[key]
                self._free_bytes -= key[0]
                self.reused += 1
            else:
                self.fresh += 1
            self._want_spare(key)
        if mem is None:
            mem = _Mem(*key)  # faulted in by the read that fills it
        arr = np.frombuffer(mem.mm, dtype=np.uint8, count=nbytes)  # [S]
        weakref.finalize(arr, self._give_back, mem, key)  # torch.from_numpy keeps arr alive
        return torch.from_numpy(arr), mem.fd

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """While this holds, a row is being read into a buffer of this pool: no spare is made."""
        with self._lock:
            self._reading += 1
        try:
            yield
        finally:
            with self._settled:
                self._reading -= 1
                self._settled.notify_all()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until the spares asked for are ready (the chores' thread before a warm marker,
        :meth:`.DirectLoader.mark_warm`; tests and benchmarks; a load never waits); False on timeout."""
        with self._settled:
            return self._settled.wait_for(lambda: not self._pending, timeout)

    def _want_spare(self, key: _Key) -> None:
        """Under the lock, after a take of ``key``'s kind: ask for a spare if none of it is free."""
        if self._pid != os.getpid():  # a forked child: none of the parent's asks are its own
            self._pid = os.getpid()
            self._pending.clear()
        if not self._spares_on or self._free.get(key) or key in self._pending or key[0] > self.keep_bytes:
            return
        self._pending.add(key)
        self._spare_thread.submit(functools.partial(self._make_spare, key))

    def _make_spare(self, key: _Key) -> None:
        """On the spare thread (nice 19): a buffer of ``key``'s kind, faulted in, onto the free list."""
        with self._settled:  # (after the reads under way: they are memory-bound too)
            self._settled.wait_for(lambda: self._reading == 0, READ_WAIT_S)
        mem: _Mem | None = None
        try:
            mem = _Mem(*key)
            np.frombuffer(mem.mm, dtype=np.uint8)[::mmap.PAGESIZE] = 0  # one write a page: each faulted in now
        except (OSError, ValueError):  # (out of memory now: the next take maps its own)
            mem = None
        show = self.on_spare
        if mem is not None and mem.fd >= 0 and show is not None:
            try:
                show(mem.fd, key[0])
            except Exception as e:  # (a spare the service did not map is copied into through its fd)
                log.debug("spare buffer not shown to the service: %s", e)
        with self._settled:
            self._pending.discard(key)
            if mem is not None:
                self.spares += 1
                self._keep(mem, key)
            self._settled.notify_all()

    def _give_back(self, mem: _Mem, key: _Key) -> None:
        with self._lock:
            self._keep(mem, key)

    def _keep(self, mem: _Mem, key: _Key) -> None:
        """Under the lock: ``mem`` onto the free list, within ``keep_bytes``."""
        if key[0] > self.keep_bytes:
            mem.close()
            return
        self._free.setdefault(key, []).append(mem)
        self._free.move_to_end(key)
        self._free_bytes += key[0]
        while self._free_bytes > self.keep_bytes:  # the least recently freed kind goes first
            old, bufs = next(iter(self._free.items()))
            bufs.pop(0).close()
            self._free_bytes -= old[0]
            if not bufs:
                del self._free[old]

    @property
    def free_bytes(self) -> int:
        return self._free_bytes


_Key = tuple[int, bool]  # (size, shared): a kind of buffer in the pool


class _Mem:
    """``size`` bytes mapped, not yet faulted in, page-aligned: anonymous memory, or (``shared``)
    a memfd's, handed to the MinT service on this machine by its descriptor ``fd``."""

    __slots__ = ("fd", "mm")

    def __init__(self, size: int, shared: bool = False, reused: bool = True) -> None:
        self.fd = -1
        if shared:
            self.fd = os.memfd_create("mint-row", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(self.fd, size)
                if reused:
                    # its size fixed for good: the service then keeps a mapping of it and copies
                    # the next row into that (mint_store.service.copy_targets), which it does only
                    # for memory that cannot shrink under the mapping. (Not for a buffer used once:
                    # the kept mapping would hold its memory after it was freed)
                    fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                self.mm = mmap.mmap(self.fd, size)
            except BaseException:
                os.close(self.fd)
                raise
        else:
            self.mm = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.mm.madvise(mmap.MADV_HUGEPAGE)  # (where THP is on for madvised memory: 512x fewer faults)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # (the mapping stays valid without it)
            self.fd = -1
        try:
            self.mm.close()
        except BufferError:  # a dying array still exports it: unmapped once it is dropped
            pass
