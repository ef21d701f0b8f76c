"""The read path: refs resolved in the index, rows read in one pass into a checked destination
buffer and verified against their content id as they land (vectored where ranges are asked for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .buffers import empty_row, row_buffer
    from .store_reads import StoreReads
    from .verified import ReadConfig, RowCheck, configure, hash_fd, read_fd, read_verified
    from .vread import read_ranges_into, read_row_ranges

_EXPORTS = {
    "ReadConfig": ".verified",
    "RowCheck": ".verified",
    "hash_fd": ".verified",
    "read_fd": ".verified",
    "StoreReads": ".store_reads",
    "configure": ".verified",
    "read_verified": ".verified",
    "read_ranges_into": ".vread",
    "read_row_ranges": ".vread",
    "empty_row": ".buffers",
    "row_buffer": ".buffers",
}

__all__ = [
    "ReadConfig",
    "RowCheck",
    "StoreReads",
    "configure",
    "empty_row",
    "hash_fd",
    "read_fd",
    "read_ranges_into",
    "read_row_ranges",
    "read_verified",
    "row_buffer",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
