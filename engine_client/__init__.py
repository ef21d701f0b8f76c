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
    from .grpo import GRPO, GRPOConfig
    from .host_pool import HostPool
    from .lora_stack import LoraSpec
    from .metrics import Metrics
    from .multi_adamw import OptimConfig
    from .streamer import Streamer, StreamerConfig
    from .training import MultiLoRATrainer, TrainerConfig

_LAZY = {
    "LoRAEngine": "engine",
    "EngineConfig": "engine",
    "HostPool": "host_pool",
    "Streamer": "streamer",
    "StreamerConfig": "streamer",
    "DevicePool": "device_pool",
    "Metrics": "metrics",
    # training (training.py): many LoRA policies on one frozen base, GRPO and SFT steps
    "MultiLoRATrainer": "training",
    "TrainerConfig": "training",
    "LoraSpec": "lora_stack",
    "OptimConfig": "multi_adamw",
    "GRPO": "grpo",
    "GRPOConfig": "grpo",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'engine_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "GRPO",
    "ClientConfig",
    "DevicePool",
    "EngineConfig",
    "EventBatch",
    "GRPOConfig",
    "HostPool",
    "LoRAEngine",
    "LoraSpec",
    "Metrics",
    "MintClient",
    "MultiLoRATrainer",
    "OptimConfig",
    "Streamer",
    "StreamerConfig",
    "SyncMintClient",
    "TrainerConfig",
]
