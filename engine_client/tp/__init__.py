"""Adapters on a sharded base: tensor parallel (transformers' ``tp_plan``) and expert parallel
(``ep_plan``); each rank reads and verifies only its slice; batches decided on rank 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mint_store._lazy import lazy_exports

if TYPE_CHECKING:
    from .batch import prepare_batch
    from .ep import EPExperts, ep_experts
    from .reads import SliceReader
    from .sharding import SlicedPool, TPModel, tp_model

_EXPORTS = {
    "EPExperts": ".ep",
    "SliceReader": ".reads",
    "SlicedPool": ".sharding",
    "TPModel": ".sharding",
    "ep_experts": ".ep",
    "prepare_batch": ".batch",
    "tp_model": ".sharding",
}

__all__ = [
    "EPExperts",
    "SliceReader",
    "SlicedPool",
    "TPModel",
    "ep_experts",
    "prepare_batch",
    "tp_model",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
