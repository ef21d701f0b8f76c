"""Content ids: xxh3-128 of (layout_id, row bytes)."""

from __future__ import annotations

from typing import Any

import xxhash

# hasher states that have already absorbed a layout id: a copy + one update per row
_PREFIXES: dict[str, Any] = {}


def content_hasher(layout_id: str) -> Any:
    """A streaming xxh3-128 that has absorbed ``layout_id``: ``update`` it with a row's bytes in
    order (in chunks as they land) and its ``hexdigest()`` is the row's content id."""
    base = _PREFIXES.get(layout_id)
    if base is None:
        if len(_PREFIXES) > 4096:
            _PREFIXES.clear()
        base = _PREFIXES[layout_id] = xxhash.xxh3_128(layout_id.encode())
    return base.copy()


def content_id(layout_id: str, row: Any) -> str:
    """``row`` is any C-contiguous buffer (bytes, memoryview, numpy array)."""
    h = content_hasher(layout_id)
    h.update(row)
    return str(h.hexdigest())
