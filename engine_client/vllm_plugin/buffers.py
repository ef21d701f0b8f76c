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
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

MIN_POOLED = 1 << 20  # smaller rows: torch.empty (the allocator's free lists reuse those)
GRAIN = 2 << 20  # sizes rounded up to this: rows of one shape take each other's buffers


class RowBuffers:
    """A free list of host buffers by size; ``take`` a row's buffer, it comes back by itself."""

    def __init__(self, keep_bytes: int) -> None:
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
        self.keep_bytes = keep_bytes
        self._lock = threading.RLock()  # (a finalizer can run inside take, on a GC in this thread)
        self._free: OrderedDict[int, list[mmap.mmap]] = OrderedDict()  # size -> buffers; oldest size first
        self._free_bytes = 0
        self.fresh = 0  # buffers mapped (tests and logs)
        self.reused = 0

    def take(self, nbytes: int, *, pin: bool = False) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (``[S]``), writable, 64-byte aligned or better.

        Its memory returns to this pool when the tensor and every view of it are gone.
        """
        if pin or nbytes < MIN_POOLED or self.keep_bytes == 0:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        size = -(-nbytes // GRAIN) * GRAIN
        mm = None
        with self._lock:
            free = self._free.get(size)
            if free:
                mm = free.pop()
                self._free_bytes -= size
                self.reused += 1
            else:
                self.fresh += 1
        if mm is None:
            mm = mmap.mmap(-1, size)  # page-aligned; faulted in by the read that fills it
            if hasattr(mmap, "MADV_HUGEPAGE"):
                mm.madvise(mmap.MADV_HUGEPAGE)  # (where THP is on for madvised memory: 512x fewer faults)
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)  # [S]
        weakref.finalize(arr, self._give_back, mm, size)  # torch.from_numpy keeps arr alive
        return torch.from_numpy(arr)

    def _give_back(self, mm: mmap.mmap, size: int) -> None:
        with self._lock:
            if size > self.keep_bytes:
                mm.close()
                return
            self._free.setdefault(size, []).append(mm)
            self._free.move_to_end(size)
            self._free_bytes += size
            while self._free_bytes > self.keep_bytes:  # the least recently freed size goes first
                old, bufs = next(iter(self._free.items()))
                bufs.pop(0).close()
                self._free_bytes -= old
                if not bufs:
                    del self._free[old]

    @property
    def free_bytes(self) -> int:
        return self._free_bytes
