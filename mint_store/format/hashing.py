"""Content ids: xxh3-128 of (layout_id, row bytes)."""

from __future__ import annotations

from typing import Any

import xxhash

# hasher states that have already absorbed a layout id: a copy + one update per row
_PREFIXES: dict[str, Any] = {}


def content_id(layout_id: str, row: Any) -> str:
    """``row`` is any C-contiguous buffer (bytes, memoryview, numpy array)."""
    base = _PREFIXES.get(layout_id)
    if base is None:
        if len(_PREFIXES) > 4096:
            _PREFIXES.clear()
        base = _PREFIXES[layout_id] = xxhash.xxh3_128(layout_id.encode())
    h = base.copy()
    h.update(row)
    return str(h.hexdigest())
