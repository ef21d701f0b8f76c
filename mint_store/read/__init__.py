"""The read path: refs resolved in the index, rows read (vectored where ranges are asked for)
into a checked destination buffer and verified against their content id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .buffers import row_buffer
    from .store_reads import StoreReads
    from .vread import read_ranges_into, read_row_ranges

_EXPORTS = {
    "StoreReads": ".store_reads",
    "read_ranges_into": ".vread",
    "read_row_ranges": ".vread",
    "row_buffer": ".buffers",
}

__all__ = [
    "StoreReads",
    "read_ranges_into",
    "read_row_ranges",
    "row_buffer",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
