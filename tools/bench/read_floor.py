"""The machine's own limit for reading a row: a raw ``preadv`` of its bytes, no hash, into a
destination faulted in and placed as the row is in its page, where the kernel's copy runs at its
fastest (1 to 31 bytes further past the source modulo 4 KiB slows it several-fold on AMD Zen:
``mint_store/read/buffers.py``). Used by ``tools/bench_vllm.py`` (via ``vllm_load``) and
``tools/bench_row_alignment.py`` and ``tools/bench_local_copy.py``.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def page_matched(length: int, offset: int) -> tuple[mmap.mmap, memoryview]:
    """A mapping, faulted in, and a view of ``length`` bytes of it that lies as far past a page
    as file offset ``offset`` does. Release the view before closing the mapping."""
    room = mmap.mmap(-1, length + mmap.PAGESIZE)
    room.write(b"\1" * len(room))  # (every page touched: no fault is timed)
    start = offset % mmap.PAGESIZE
    return room, memoryview(room)[start : start + length]


def preadv_all(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``fd`` at ``offset``: ``os.preadv`` until done (a short read is legal)."""
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], offset + got)
        if k == 0:
            raise EOFError(f"the file ended {len(view) - got} bytes before the row's end")
        got += k


def median_ms(read: Callable[[], Any], n: int) -> float:
    """The median of ``n`` calls of ``read``, in ms, after one not counted (the page cache, the
    reader's threads, a destination's first faults or mapping warm)."""
    read()
    took = []
    for _ in range(n):
        t = time.perf_counter()
        read()
        took.append(time.perf_counter() - t)
    return statistics.median(took) * 1e3
