"""Engine-side access to MinT Store: ``MintClient`` (async), ``SyncMintClient`` and ``LoRAEngine``.

Import-light: no transformers here, and the engine side (``LoRAEngine``, the pools, the
streamer; they need torch) loads on first use of its names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .client import ClientConfig, EventBatch, MintClient, SyncMintClient

if TYPE_CHECKING:
    from .device_pool import DevicePool
    from .engine import EngineConfig, LoRAEngine
    from .host_pool import HostPool
    from .metrics import Metrics
    from .streamer import Streamer, StreamerConfig

_LAZY = {
    "LoRAEngine": "engine",
    "EngineConfig": "engine",
    "HostPool": "host_pool",
    "Streamer": "streamer",
    "StreamerConfig": "streamer",
    "DevicePool": "device_pool",
    "Metrics": "metrics",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'engine_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ClientConfig",
    "DevicePool",
    "EngineConfig",
    "EventBatch",
    "HostPool",
    "LoRAEngine",
    "Metrics",
    "MintClient",
    "Streamer",
    "StreamerConfig",
    "SyncMintClient",
]
