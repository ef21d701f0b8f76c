"""Which device pools an engine keeps: one per layout, under an optional byte budget.

Every rank and every set of target modules is its own layout, so an engine serving a
varied catalog would otherwise grow one ``slots x row`` pool per layout it ever saw. With
``device_bytes`` set, a new pool that does not fit pushes out idle pools, least recently
used first. A pool is idle when no slot of it is pinned and no batch, pin or prefetch is
between resolving its refs and pinning its slots (see ``use``/``done``); a busy pool is
never dropped, so a batch in flight never loses its slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from ..errors import DeviceBudgetExceeded
from .device_pool import DevicePool


class PoolBudget:
    """Layout ids with a device pool, least recently used first, and how many users each has.

    Not thread-safe: the engine calls it under its own lock.
    """

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"device_bytes must be >= 1 (or None for no limit), got {limit}")
        self.limit = limit
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._users: dict[str, int] = {}

    def use(self, layout_id: str) -> None:
        if self.limit is None:  # nothing is ever dropped: no need to count (switches stay cheap)
            return
        self._users[layout_id] = self._users.get(layout_id, 0) + 1
        self._lru[layout_id] = None
        self._lru.move_to_end(layout_id)

    def done(self, layout_id: str) -> None:
        if self.limit is None:
            return
        n = self._users.get(layout_id, 0)
        if n <= 0:
            raise RuntimeError(f"layout {layout_id} is not in use")
        if n == 1:
            del self._users[layout_id]
        else:
            self._users[layout_id] = n - 1

    def users(self, layout_id: str) -> int:
        return self._users.get(layout_id, 0)

    def forget(self, layout_id: str) -> None:
        self._lru.pop(layout_id, None)

    def forget_all(self) -> None:
        """Every pool is gone (the engine detached). Uses stay counted: the batches and
        prefetches holding them still give them back, and until then they protect any pool
        made again for the same layout."""
        self._lru.clear()

    def to_drop(self, pools: Mapping[str, DevicePool], new: list[str], need: int) -> list[str]:
        """Idle pools to drop, oldest first, so that new pools for ``new`` (``need`` bytes in
        all) fit; raises, choosing nothing, when they cannot."""
        if self.limit is None:
            return []
        what = f"the device pool{'s' if len(new) > 1 else ''} of layout{'s' if len(new) > 1 else ''} {', '.join(new)}"
        if need > self.limit:
            raise DeviceBudgetExceeded(
                f"{what} need{'s' if len(new) == 1 else ''} {need:,} B (slots x row bytes), more than the engine's "
                f"device_bytes={self.limit:,}; raise device_bytes or lower slots"
            )
        used = sum(p.nbytes for p in pools.values())
        drop: list[str] = []
        for old in self._lru:
            if used + need <= self.limit:
                break
            pool = pools.get(old)
            if pool is None or old in new or self._users.get(old) or pool.pinned_slots:
                continue
            drop.append(old)
            used -= pool.nbytes
        if used + need > self.limit:
            kept = len(pools) - len(drop)
            raise DeviceBudgetExceeded(
                f"{what} need{'s' if len(new) == 1 else ''} {need:,} B but the pools of {kept} layouts hold "
                f"{used:,} B of the engine's device_bytes={self.limit:,} and are in use (pinned slots, a running "
                "batch or prefetch); unpin adapters, wait for the batch, or raise device_bytes"
            )
        return drop
