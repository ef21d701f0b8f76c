"""What :class:`~engine_client.train.trainer.MultiLoRATrainer` takes and gives: its options,
its record of each policy, and the reports of a step and of a supervised loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mint_store import PublishResult
from mint_store.format.adapter import UNSPECIFIED_BASE
from mint_store.format.names import check_name

from .lora_stack import PolicyStack
from .multi_adamw import OptimConfig

IGNORE_INDEX = -100  # label of a token without loss (transformers' convention)
_STORABLE = (torch.float32, torch.bfloat16, torch.float16)  # what an adapter row may hold


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    base: str = UNSPECIFIED_BASE  # base name stamped on published adapters
    publish_every: int | None = None  # K: publish every policy after every K-th optimizer step
    tag: str | None = "latest"  # the tag each publish moves (None: publish only)
    dtype: torch.dtype = torch.float32  # master weights (and published tensors) of every policy

    def __post_init__(self) -> None:
        if self.publish_every is not None and self.publish_every < 1:
            raise ValueError("publish_every must be >= 1 (or None)")
        check_name(self.base, "base")
        if self.tag is not None:
            check_name(self.tag, "tag")
        if self.dtype not in _STORABLE:
            raise ValueError(f"dtype must be one the store holds ({', '.join(map(str, _STORABLE))}), got {self.dtype}: "
                             "every publish would fail")


@dataclass(eq=False)
class Policy:
    """What the trainer knows of one policy (read it; change it through the trainer)."""

    name: str  # "tenant/name": its place in the store
    stack: PolicyStack
    slot: int  # its row in the stack
    optim: OptimConfig
    source: str | None = None  # the ref it was loaded from, if any
    peft_config: dict[str, Any] | None = None  # kept from a stored adapter, republished as is
    versions: list[int] = field(default_factory=list)  # versions loaded from / published to the store
    steps: int = 0  # optimizer steps taken
    # the base its publishes name: the trainer's, or (when the trainer declares none) its source's
    base: str = UNSPECIFIED_BASE

    @property
    def tenant(self) -> str:
        return self.name.partition("/")[0]

    @property
    def adapter_name(self) -> str:
        return self.name.partition("/")[2]


@dataclass(frozen=True, slots=True)
class StepReport:
    step: int  # the trainer's step count after this step
    stepped: tuple[str, ...]  # policies updated
    grad_norms: dict[str, float]  # every policy asked about: gradient norm before clipping
    published: dict[str, PublishResult]  # this step's handoff (empty unless it was due)
    publish_error: str | None = None  # the handoff was due and failed (tried again after the next step)


@dataclass(frozen=True, slots=True)
class SFTLoss:
    loss: torch.Tensor  # scalar: sum over policies of each one's token-mean cross-entropy
    per_policy: dict[str, tuple[float, int]]  # policy -> (its mean loss, its target tokens)
