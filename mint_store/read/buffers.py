"""The destination of a row read: one check shared by the store and the clients, and the
allocation of a new one.

A new destination starts on a page (64 bytes for a row under ``PAGE_ALIGNED_FROM``). Why: the
kernel's copy of a ``pread`` or a socket's ``recv`` (``rep movsb``) runs several times slower
when the destination lies 1 to 31 bytes past the source modulo 4 KiB (measured on the AMD EPYC
VM of ``tools/bench_vllm.py``: a 37 MB row at a page-aligned shard offset read in 15-18 ms into
a buffer at 16 bytes past a page, as a large ``numpy.empty`` is, and in 5-8 ms into one that
starts on a page). Rows lie at 64-byte aligned offsets of their shards (:mod:`mint_store.format.layout`),
so a destination on a page (or on 64 bytes) is never 1 to 31 bytes past its source.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PAGE = 4096
PAGE_ALIGNED_FROM = 64 * 1024  # rows this large start on a page (the padding is noise beside them)
ALIGN = 64  # smaller rows: the row layout's own alignment (a cache line)


def empty_row(length: int) -> np.ndarray:
    """A new uint8 array of ``length`` bytes (``[length]``) for a row to be read into: its first
    byte on a page, or on 64 bytes for a row under ``PAGE_ALIGNED_FROM`` (see the module's note).

    Its memory is a slice of a slightly larger array, which it keeps alive (``.base``).
    """
    if length < 0:
        raise ValueError(f"a row has no negative length, got {length}")
    align = PAGE if length >= PAGE_ALIGNED_FROM else ALIGN
    raw = np.empty(length + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + length]


def row_buffer(length: int, out: Any = None) -> tuple[Any, memoryview]:
    """``out`` (or a new uint8 array) and a writable byte view of exactly ``length`` bytes of it.

    Parameters
    ----------
    length
        Bytes of the row to read.
    out
        Any writable, C-contiguous buffer of at least ``length`` bytes, or None for a new
        ``numpy.uint8`` array of ``length`` (:func:`empty_row`).

    Returns
    -------
    tuple
        ``(out, view)``: the buffer to hand back to the caller and the view to read into.

    Raises
    ------
    ValueError
        ``out`` is read-only, not C-contiguous, or smaller than the row.
    """
    if out is None:
        out = empty_row(length)
    view = memoryview(out)
    if view.readonly:
        raise ValueError("the destination buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("the destination buffer is not C-contiguous (one block of memory)")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if len(view) < length:
        raise ValueError(f"buffer of {len(view)} bytes is smaller than the row ({length})")
    return out, view[:length]
