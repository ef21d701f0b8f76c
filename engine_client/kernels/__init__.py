"""Batched multi-LoRA kernels (SHRINK and EXPAND over stacked adapters): torch ops, a C library
on CPU, Triton on CUDA, fused-expert LoRA, and the reference loops the tests hold them to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mint_store._lazy import lazy_exports

if TYPE_CHECKING:
    from .groups import GroupedKernels, Groups
    from .moe import Routing, add_expert_lora
    from .ops import add_lora, bgmv, sgmv
    from .reference import add_lora_reference, bgmv_reference, sgmv_reference

_EXPORTS = {
    "GroupedKernels": ".groups",
    "Groups": ".groups",
    "Routing": ".moe",
    "add_expert_lora": ".moe",
    "add_lora": ".ops",
    "add_lora_reference": ".reference",
    "bgmv": ".ops",
    "bgmv_reference": ".reference",
    "sgmv": ".ops",
    "sgmv_reference": ".reference",
}

__all__ = [
    "GroupedKernels",
    "Groups",
    "Routing",
    "add_expert_lora",
    "add_lora",
    "add_lora_reference",
    "bgmv",
    "bgmv_reference",
    "sgmv",
    "sgmv_reference",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
