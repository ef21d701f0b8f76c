"""Engine-side access to MinT Store: the public API of ``engine_client``.

* clients: :class:`MintClient` (async; ``MintClient(url)`` picks HTTP or a store opened
  directly), :class:`SyncMintClient` (blocking), :class:`ClientConfig`, :class:`EventBatch`;
* serving: :class:`LoRAEngine` (many adapters in one batch of a transformers model) and
  its parts (:class:`EngineConfig`, :class:`HostPool`, :class:`DevicePool`,
  :class:`Streamer`, :class:`Metrics`);
* training (:mod:`engine_client.train`): :class:`MultiLoRATrainer`, :class:`GRPO` and
  their options;
* :mod:`engine_client.errors`: every typed error (the store's, the wire's, the engine's).

Import what is listed in ``__all__`` from here; other modules are internal and may move.
Import-light: no transformers here, and the engine side (``LoRAEngine``, the pools, the
streamer, training; they need torch) loads on first use of its names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .client import ClientConfig, EventBatch, MintClient, SyncMintClient

if TYPE_CHECKING:
    from .device_pool import DevicePool
    from .engine import EngineConfig, LoRAEngine
    from .host_pool import HostPool
    from .metrics import Metrics
    from .streamer import Streamer, StreamerConfig
    from .train import GRPO, GRPOConfig, LoraSpec, MultiLoRATrainer, OptimConfig, TrainerConfig

_LAZY = {
    "LoRAEngine": "engine",
    "EngineConfig": "engine",
    "HostPool": "host_pool",
    "Streamer": "streamer",
    "StreamerConfig": "streamer",
    "DevicePool": "device_pool",
    "Metrics": "metrics",
    # training (the train subpackage): many LoRA policies on one frozen base, GRPO and SFT steps
    "MultiLoRATrainer": "train",
    "TrainerConfig": "train",
    "LoraSpec": "train",
    "OptimConfig": "train",
    "GRPO": "train",
    "GRPOConfig": "train",
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
    "errors",
]
