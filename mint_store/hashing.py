"""Content ids: xxh3-128 of (layout_id, row bytes)."""

from __future__ import annotations

from typing import Any

import xxhash


def content_id(layout_id: str, row: Any) -> str:
    h = xxhash.xxh3_128()
    h.update(layout_id.encode())
    h.update(memoryview(row).cast("B") if not isinstance(row, bytes) else row)
    return h.hexdigest()
