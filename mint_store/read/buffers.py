"""The destination of a row read: one check shared by the store and the clients."""

from __future__ import annotations

from typing import Any

import numpy as np


def row_buffer(length: int, out: Any = None) -> tuple[Any, memoryview]:
    """``out`` (or a new uint8 array) and a writable byte view of exactly ``length`` bytes of it.

    Parameters
    ----------
    length
        Bytes of the row to read.
    out
        Any writable, C-contiguous buffer of at least ``length`` bytes, or None for a new
        ``numpy.uint8`` array of ``length``.

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
        out = np.empty(length, dtype=np.uint8)
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
