"""Rows on their way to the device: bounded concurrent prefetch into a pinned host pool,
a local disk row cache, and the engine's I/O event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mint_store._lazy import lazy_exports

if TYPE_CHECKING:
    from .host_pool import HostBuffer, HostPool
    from .io_loop import IOThread
    from .row_cache import RowCache
    from .streamer import Streamer, StreamerConfig

_EXPORTS = {
    "HostBuffer": ".host_pool",
    "HostPool": ".host_pool",
    "IOThread": ".io_loop",
    "RowCache": ".row_cache",
    "Streamer": ".streamer",
    "StreamerConfig": ".streamer",
}

__all__ = [
    "HostBuffer",
    "HostPool",
    "IOThread",
    "RowCache",
    "Streamer",
    "StreamerConfig",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
