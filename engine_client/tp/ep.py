"""Adapters on an expert-parallel base: fused experts split by transformers' ``ep_plan``.

Loaded with ``distributed_config=DistributedConfig(tp_size=N, ep_size=N)`` (``tp_plan={}``
too: experts only), a MoE model's fused experts follow its ``ep_plan``: ``grouped_gemm``
shards ``gate_up_proj`` / ``down_proj`` on the expert dimension (``Shard(0)`` DTensors on the
EP mesh: rank ``r`` holds the contiguous experts ``[r*E/N, (r+1)*E/N)``, the module's
``num_experts`` set to that local count) and ``ep_dispatch_experts`` replaces the module's
forward with one that brings the experts their tokens through an ``EPImplementation``.

:func:`ep_experts` recognises such a module (by its DTensor placements and the forward
transformers installed, not by a version). On each rank the engine then holds, for every
adapter of those parameters, only the ``A`` and ``B`` of its own experts (a cut of the
expert dimension, :func:`engine_client.tp.sharding.slice_layout`), and :class:`EPExpertsLoRA` runs
the batch the way transformers' ``AllReduceEP`` does: every rank sees the whole batch (the
engine's batches are the same on every rank), routes to other ranks' experts are masked
(local id ``num_experts``: the grouped loop skips ids past its experts; weight 0), its own
experts run with their base weights and adapter slices, and one all-reduce over the EP
group sums the partial outputs. So the LoRA rides the experts' own collective, whichever
``ep_implementation`` the model was loaded with (an all-to-all would carry tokens away from
the sequence that picks their adapter). That needs the EP group to share the batch:
``ep_size == tp_size`` (transformers' ``shares_batch``); other layouts are refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engine.lora_layers import BatchContext, ExpertsLoRA
from ..errors import LayoutMismatch


@dataclass(frozen=True, slots=True)
class EPExperts:
    """This rank's experts ``[start, stop)`` of a fused-experts module run expert-parallel."""

    start: int
    stop: int
    total: int
    group: Any  # the EP process group


def _ep_forward_env(module: nn.Module) -> dict[str, Any]:
    """The closure of transformers' ``ep_dispatch_experts`` forward (empty if it is not one)."""
    fwd = module.__dict__.get("forward")
    hook = getattr(fwd, "__self__", None)
    if isinstance(hook, ExpertsLoRA):  # an engine's hook on it already: transformers' forward is under it
        fwd = hook._original
    if not callable(fwd):
        return {}
    try:
        return dict(inspect.getclosurevars(fwd).nonlocals)
    except (TypeError, ValueError):
        return {}


def ep_experts(mod: nn.Module, path: str) -> EPExperts | str | None:
    """This rank's experts if ``mod`` (fused experts) is split on the expert dimension by
    transformers' expert parallelism; a reason if it is sharded so but LoRA cannot follow it;
    None if it is not expert-parallel (its parameters are no ``Shard(0)`` DTensors)."""
    from torch.distributed.tensor import DTensor, Shard

    params = [p for p in mod.parameters(recurse=False) if isinstance(p, DTensor)]
    if not params or not all(tuple(p.placements) == (Shard(0),) and p.dim() == 3 for p in params):
        return None
    mesh = params[0].device_mesh
    if mesh.ndim != 1 or any(p.device_mesh != mesh for p in params):
        return f"expert-parallel experts over a {mesh.ndim}-d mesh"
    total, local = int(params[0].shape[0]), int(params[0].to_local().shape[0])
    rank, world = mesh.get_local_rank(), mesh.size()
    if total % world or local * world != total or any(int(p.to_local().shape[0]) != local for p in params):
        return f"expert-parallel experts split unevenly ({local} of {total} on rank {rank})"
    env = _ep_forward_env(mod)
    impl = env.get("implementation")
    if impl is None or not callable(impl):
        return ("expert-parallel experts whose forward is not transformers' ep_dispatch_experts forward (load the "
                "model with distributed_config=DistributedConfig(ep_size=...) and the model's ep_plan)")
    if not getattr(impl, "shares_batch", True):
        return ("expert-parallel experts whose EP group does not share the batch (ep_size > tp_size); a LoRAEngine "
                "needs ep_size == tp_size")
    if int(getattr(mod, "num_experts", local)) != local:
        return f"expert-parallel experts with num_experts {getattr(mod, 'num_experts', None)} for {local} local ones"
    return EPExperts(rank * local, (rank + 1) * local, total, mesh.get_group())


class EPExpertsLoRA(ExpertsLoRA):
    """Fused experts run expert-parallel: this rank's experts, with their slices of every adapter.

    With no adapter of these parameters in the batch the module's own (transformers') forward
    runs; otherwise the masked local loop and one all-reduce over the EP group (module docstring).
    """

    def __init__(self, path: str, module: nn.Module, experts: EPExperts) -> None:
        self._path = path
        self._ep = experts
        super().__init__(module)  # its _original is transformers' ep_forward (used with no LoRA)

    def _lora_forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      live: Any, ctx: BatchContext) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        hidden = hidden.to_local() if isinstance(hidden, DTensor) else hidden
        top_k_weights = top_k_weights.to_local() if isinstance(top_k_weights, DTensor) else top_k_weights
        ep = self._ep
        off = (top_k_index < ep.start) | (top_k_index >= ep.stop)  # another rank's experts
        local_index = torch.where(off, ep.stop - ep.start, top_k_index - ep.start)
        with local_params(self.module):
            out = super()._lora_forward(hidden, local_index, top_k_weights.masked_fill(off, 0.0), live, ctx)
        check_local(self._path, out)
        dist.all_reduce(out, group=ep.group)  # the partial outputs of every rank's experts
        return out.to(hidden.dtype)


@contextmanager
def local_params(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local shards for the block (what transformers'
    EP forward does around the experts' own forward), restored after."""
    from torch.distributed.tensor import DTensor

    originals = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    module._parameters.update({n: p.to_local() for n, p in originals.items()})  # type: ignore[misc]
    try:
        yield
    finally:
        module._parameters.update(originals)


def check_local(path: str, out: Any) -> None:
    """Refuse a DTensor or a tensor that needs a gradient: the engine's parallel paths run inference only."""
    from torch.distributed.tensor import DTensor

    if isinstance(out, DTensor) or out.requires_grad:
        raise RuntimeError(
            f"{path}: a tensor-parallel LoRAEngine runs inference only; call it under torch.no_grad() or "
            "torch.inference_mode() (transformers' TP forward keeps activations local only there)"
        )


def refuse_ep_group(ep_group: Any, tp_group: Any | None) -> None:
    """Raise :class:`LayoutMismatch` unless the EP group is the batch (TP) group: the engine runs
    one batch on every rank of it."""
    if tp_group is None:
        return
    ep_ranks, tp_ranks = dist.get_process_group_ranks(ep_group), dist.get_process_group_ranks(tp_group)
    if ep_ranks != tp_ranks:
        raise LayoutMismatch(
            f"the experts are expert-parallel over ranks {ep_ranks} but the model is tensor-parallel over {tp_ranks}; "
            "a LoRAEngine runs one batch per group: load the model with ep_size == tp_size"
        )
