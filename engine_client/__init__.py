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
Import-light: no transformers or aiohttp here. The clients and the engine side
(``LoRAEngine``, the pools, the streamer, training; they need torch) load on first use
of their names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mint_store._lazy import lazy_exports

from . import errors

if TYPE_CHECKING:
    from .client.mint_client import ClientConfig, EventBatch, MintClient, SyncMintClient
    from .device.device_pool import DevicePool
    from .engine.lora_engine import EngineConfig, LoRAEngine
    from .engine.metrics import Metrics
    from .stream.host_pool import HostPool
    from .stream.streamer import Streamer, StreamerConfig
    from .train import GRPO, GRPOConfig, LoraSpec, MultiLoRATrainer, OptimConfig, TrainerConfig

_LAZY = {
    # the clients load on first use too: the HTTP transport brings aiohttp, and a caller
    # that only decodes errors (engine_client.errors) should not pay for it
    "MintClient": ".client.mint_client",
    "SyncMintClient": ".client.mint_client",
    "ClientConfig": ".client.mint_client",
    "EventBatch": ".client.mint_client",
    "LoRAEngine": ".engine.lora_engine",
    "EngineConfig": ".engine.lora_engine",
    "HostPool": ".stream.host_pool",
    "Streamer": ".stream.streamer",
    "StreamerConfig": ".stream.streamer",
    "DevicePool": ".device.device_pool",
    "Metrics": ".engine.metrics",
    # training (the train subpackage): many LoRA policies on one frozen base, GRPO and SFT steps
    "MultiLoRATrainer": ".train",
    "TrainerConfig": ".train",
    "LoraSpec": ".train",
    "OptimConfig": ".train",
    "GRPO": ".train",
    "GRPOConfig": ".train",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


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
