"""Training LoRA policies on a tensor-parallel base (a model loaded with transformers' ``tp_plan``).

Design: every rank keeps the *full* A and B of every policy (the same init, the same
optimizer, so they stay identical), but computes each sharded linear with its slice, the
way the base computes with its weight shard:

* column-parallel ``M`` (output shard ``[s, e)``): the hook sees the whole (replicated)
  input and this rank's output shard, and adds ``x A^T B[s:e]^T``. The input goes through
  transformers' ``_AllReduceBackward`` first, so the LoRA's part of the input gradient (a
  partial sum over the output shards) is summed over ranks like the base's own.
* row-parallel ``M`` (input shard ``[s, e)``): the hook sees this rank's input shard and the
  reduced output; it adds ``all_reduce((x_shard A[:, s:e]^T) B^T)`` (transformers'
  ``_AllReduceForward``: a sum forward, identity backward, as every rank gets the same
  output gradient). That is one collective per row-parallel LoRA layer more than
  inference, where the delta rides the base's all-reduce.
* anything else (unsharded, or ``colwise_gather_output`` like ``lm_head``) runs whole.

Gradients: after backward a rank holds, for a sharded module, the gradient of its own
slice (B rows of a column-parallel, A columns of a row-parallel; zero elsewhere) plus a
partial sum of the replicated factor's. :func:`sum_sharded_grads` all-reduces them (one
collective per stack) before the optimizer step, so every rank steps on the exact full
gradient and the policies stay identical. Fused experts that the plan leaves whole (transformers'
``tp_plan`` no longer shards them) train whole on every rank, like any unsharded module. Fused
experts run tensor-parallel (the deprecated ``moe_tp_experts``) or expert-parallel (``ep_plan``)
and other sharded styles are refused (:func:`check_trainable`); the rest of the policy's targets
on such a base train.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engine.lora_layers import LinearLoRA, tokens_per_sequence
from ..engine.targets import Target
from ..errors import TrainerError
from ..kernels.ops import add_lora
from ..tp.sharding import LinearShard, TPModel


class TPLinearLoRA(LinearLoRA):
    """Forward hook of one linear of a tensor-parallel base, for full (unsliced) trainer factors."""

    def __init__(self, module: nn.Linear, shard: LinearShard | None, group: Any) -> None:
        super().__init__(module)
        self.shard = shard
        self.group = group

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        from transformers.distributed.parallel_utils import _AllReduceBackward, _AllReduceForward

        from ..engine.lora_layers import current_batch

        ctx = current_batch()
        if ctx is None:
            return None
        live = [(e, ctx.layouts[e.layout_id]) for e in self.entries if e.layout_id in ctx.layouts]
        if not live:
            return None
        x = args[0] if args else kwargs["input"]
        b_n = ctx.batch_size
        per = tokens_per_sequence(x.numel() // x.shape[-1], ctx)
        style = None if self.shard is None else self.shard.style
        if style == "colwise":  # the input gradient of the LoRA path is partial: sum it like the base's
            x = _AllReduceBackward.apply(x, self.group)
        x3 = x.reshape(b_n, per, x.shape[-1])
        y = out.reshape(b_n, per, out.shape[-1])
        if style == "rowwise":
            y_lora = torch.zeros_like(y)
        for e, lb in live:
            a, b = e.a, e.b
            if self.shard is not None:
                ((s, t),) = self.shard.pieces
                a, b = (a, b[:, s:t]) if style == "colwise" else (a[..., s:t], b)
            target = y_lora if style == "rowwise" else y
            target = add_lora(target, x3, a, b, e.scaling, lb.active_slots, lb.seqs(b_n), progression=lb.progression,
                              distinct=True)
            if style == "rowwise":
                y_lora = target
            else:
                y = target
        if style == "rowwise":  # this rank's partial delta, summed over ranks
            y = y + _AllReduceForward.apply(y_lora.contiguous(), self.group)
        return y.view(out.shape)


def check_trainable(tpm: TPModel, targets: list[Target]) -> None:
    """Raise :class:`TrainerError` for a target a trainer cannot follow on this tensor-parallel base."""
    for t in targets:
        how = tpm.unsupported.get(t.module) or tpm.untrainable.get(t.module)
        if t.kind == "experts" and t.module in tpm.ep:
            # the engine's masked all-reduce path is inference only, and transformers' training
            # path (an all-to-all of the routed tokens) carries tokens away from their sequence,
            # whose policy picks the LoRA: nothing here could give each pair its policy
            raise TrainerError(
                f"module {t.name!r} is expert-parallel (transformers' ep_plan: each rank holds some experts); "
                "MultiLoRATrainer trains no experts of an expert-parallel base: leave the experts out of the "
                "policy (attention and dense targets train), or load the base without ep_size (tensor-parallel "
                "only: the experts are replicated and train)"
            )
        if t.kind == "experts" and (t.module in tpm.experts or how is not None):
            how = how or "moe_tp_experts"
        if how is not None:
            raise TrainerError(
                f"module {t.name!r} is tensor-parallel as {how}; MultiLoRATrainer trains on colwise, rowwise and "
                "unsharded linears and replicated experts of a tensor-parallel base (not on fused experts run "
                "tensor-parallel): leave it out of the policy, or load the base without tp_plan"
            )
        sh = tpm.shards.get(t.module)
        if sh is not None and len(sh.pieces) != 1:
            raise TrainerError(f"module {t.name!r} is sharded in {len(sh.pieces)} pieces; the trainer takes one")


def sum_sharded_grads(params: list[tuple[str, nn.Parameter]], targets: dict[str, Target], tpm: TPModel) -> None:
    """Sum over the TP group the gradients of the factors of sharded modules (one all-reduce).

    Modules that run whole have the full gradient on every rank already and are left alone.
    """
    grads = []
    for name, p in params:
        module = targets[name.rpartition(".")[0]].module
        if p.grad is not None and module in tpm.shards:
            grads.append(p.grad)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tpm.group)
    at = 0
    for g in grads:
        g.copy_(flat[at : at + g.numel()].view_as(g))
        at += g.numel()
