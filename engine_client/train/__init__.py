"""Training: many LoRA policies on one frozen base, trained concurrently (``engine_client.train``).

* :mod:`.trainer` -- :class:`MultiLoRATrainer`: SFT and policy-gradient steps, publish, restore;
* :mod:`.grpo` -- :class:`GRPO`: rollouts, group advantages and updates over all policies at once;
* :mod:`.lora_stack` -- the trainable stacks of every policy's A and B in the wrapped layers;
* :mod:`.multi_adamw` -- one AdamW over the stacks with per-policy state, rates and clipping.

The names are exported from :mod:`engine_client` too (``from engine_client import MultiLoRATrainer``).
"""

from __future__ import annotations

from .grpo import GRPO, GRPOConfig
from .lora_stack import LoraSpec
from .multi_adamw import OptimConfig
from .trainer import MultiLoRATrainer, TrainerConfig

__all__ = ["GRPO", "GRPOConfig", "LoraSpec", "MultiLoRATrainer", "OptimConfig", "TrainerConfig"]
