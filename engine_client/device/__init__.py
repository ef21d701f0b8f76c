"""Adapters on the device: one ``[slots, S]`` byte tensor per layout, the pools an engine keeps
under a byte budget, and the pool set with its pins and batch indices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mint_store._lazy import lazy_exports

if TYPE_CHECKING:
    from .device_pool import DevicePool
    from .pool_budget import PoolBudget
    from .pool_set import PoolSet

_EXPORTS = {
    "DevicePool": ".device_pool",
    "PoolBudget": ".pool_budget",
    "PoolSet": ".pool_set",
}

__all__ = [
    "DevicePool",
    "PoolBudget",
    "PoolSet",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
