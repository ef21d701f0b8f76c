"""Row bytes over HTTP: a single Range with sendfile for local packs, multipart ranges,
and the checks every row passes before a byte of it goes out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .checks import LocalRowCheck, check_location, verified_row
    from .multipart import parse_ranges, send_ranges
    from .serving import ByteRange, RowSender, parse_range

_EXPORTS = {
    "ByteRange": ".serving",
    "LocalRowCheck": ".checks",
    "RowSender": ".serving",
    "check_location": ".checks",
    "parse_range": ".serving",
    "parse_ranges": ".multipart",
    "send_ranges": ".multipart",
    "verified_row": ".checks",
}

__all__ = [
    "ByteRange",
    "LocalRowCheck",
    "RowSender",
    "check_location",
    "parse_range",
    "parse_ranges",
    "send_ranges",
    "verified_row",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
