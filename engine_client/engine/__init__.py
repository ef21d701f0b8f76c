"""``LoRAEngine``: many adapters in one batch of a transformers model. The LoRA layers it
attaches, what adapters may target, the ref table and hot swaps, metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mint_store._lazy import lazy_exports

if TYPE_CHECKING:
    from .base_compat import base_refusal
    from .follow import FeedFollower
    from .lora_engine import EngineConfig, LoRAEngine
    from .lora_layers import BatchContext, ExpertsLoRA, LinearLoRA
    from .metrics import Metrics, MetricsSnapshot
    from .refs import RefTable
    from .targets import Target, model_targets

_EXPORTS = {
    "BatchContext": ".lora_layers",
    "EngineConfig": ".lora_engine",
    "ExpertsLoRA": ".lora_layers",
    "FeedFollower": ".follow",
    "LinearLoRA": ".lora_layers",
    "LoRAEngine": ".lora_engine",
    "Metrics": ".metrics",
    "MetricsSnapshot": ".metrics",
    "RefTable": ".refs",
    "Target": ".targets",
    "base_refusal": ".base_compat",
    "model_targets": ".targets",
}

__all__ = [
    "BatchContext",
    "EngineConfig",
    "ExpertsLoRA",
    "FeedFollower",
    "LinearLoRA",
    "LoRAEngine",
    "Metrics",
    "MetricsSnapshot",
    "RefTable",
    "Target",
    "base_refusal",
    "model_targets",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
