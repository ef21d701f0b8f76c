"""A store whose writer "crashes" at named points of its commit order (for the crash tests).

The writer calls its fault hook at each point below, in this order per commit; the hook
from :func:`crash_at` raises :class:`~mint_store.errors.CrashInjected` there, which stops
the writer as a kill would (nothing after the point runs). Reopen the store to recover.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from ..config import StoreConfig, open_location
from ..errors import CrashInjected
from ..store import Store

# fault-injection points, in commit order (tests "crash" at each and reopen)
CRASH_POINTS = ("after_resize", "after_shards", "after_log", "after_index")


def crash_at(points: Iterable[str]) -> Callable[[str], None]:
    """A writer fault hook that raises CrashInjected at each of ``points``.

    Raises
    ------
    ValueError
        A point that is not one of :data:`CRASH_POINTS`.
    """
    chosen = frozenset(points)
    unknown = chosen - set(CRASH_POINTS)
    if unknown:
        raise ValueError(f"unknown crash points {sorted(unknown)}; known: {CRASH_POINTS}")

    def hook(point: str) -> None:
        if point in chosen:
            raise CrashInjected(point)

    return hook


def open_crashing(url: str | os.PathLike[str], points: Iterable[str], **options: Any) -> Store:
    """:meth:`Store.open <mint_store.store.Store.open>` with a writer that crashes at ``points``."""
    hook = crash_at(points)
    config = StoreConfig(**options)
    storage, index_dir = open_location(url, config)
    return Store(storage, config, index_dir, fault_hook=hook)
