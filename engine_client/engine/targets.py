"""What an adapter may target in a model, and whether a layout fits it.

A model's LoRA targets, by the canonical module names of ``mint_store.peft.directory``:

* every ``nn.Linear`` ``M``: a dense module ``M`` (A ``[r, in]``, B ``[out, r]``), or the
  2-d ``target_parameters`` form ``M.weight`` (A ``[1, r, in]``, B ``[1, out, r]``);
* every fused-experts module ``X`` (transformers 5.x ``Qwen3MoeExperts``,
  ``DeepseekV3Experts``, Mixtral-style: 3-d ``gate_up_proj``/``up_proj`` and
  ``down_proj`` parameters, forward ``(hidden_states, top_k_index, top_k_weights)``):
  ``X.gate_up_proj`` / ``X.down_proj`` with A ``[E, r, in]``, B ``[E, out, r]``, where
  in/out are the per-expert matmul's features (``[E, out, in]`` storage, or ``[E, in, out]``
  when the class sets ``is_transposed``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mint_store.format.layout import Layout
from mint_store.peft.bases import EXPERT_PARAMS, is_experts

from ..errors import LayoutMismatch

__all__ = ["EXPERT_PARAMS", "Target", "check_layout", "is_experts", "model_targets"]


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # the adapter's module name
    kind: str  # "linear" | "linear_param" | "experts"
    module: str  # path of the nn.Module the engine hooks
    param: str | None  # the experts parameter (kind "experts")
    in_features: int
    out_features: int
    experts: int | None


def model_targets(model: nn.Module) -> dict[str, Target]:
    out: dict[str, Target] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            i, o = mod.in_features, mod.out_features
            out[path] = Target(path, "linear", path, None, i, o, None)
            out[f"{path}.weight"] = Target(f"{path}.weight", "linear_param", path, None, i, o, 1)
        elif is_experts(mod):
            transposed = bool(getattr(mod, "is_transposed", False))
            for p in EXPERT_PARAMS:
                w = getattr(mod, p, None)
                if isinstance(w, nn.Parameter) and w.dim() == 3:
                    e, d1, d2 = w.shape
                    i, o = (d1, d2) if transposed else (d2, d1)
                    out[f"{path}.{p}"] = Target(f"{path}.{p}", "experts", path, p, int(i), int(o), int(e))
    return out


def check_layout(layout: Layout, targets: dict[str, Target], *, what: str = "") -> None:
    """Raise :class:`LayoutMismatch` naming the first module of ``layout`` that does not fit."""
    who = what or f"layout {layout.layout_id}"
    for m in layout.modules:
        t = targets.get(m.name)
        if t is None:
            raise LayoutMismatch(
                f"{who}: module {m.name!r} is not in the model (no nn.Linear or fused experts parameter "
                "of that name)"
            )
        got = (m.in_features, m.out_features, m.experts)
        want = (t.in_features, t.out_features, t.experts)
        if got != want:
            kind = {"linear": "a dense linear", "linear_param": "a linear weight", "experts": "fused experts"}[t.kind]
            raise LayoutMismatch(
                f"{who}: module {m.name!r} has (in, out, experts) = {got} in the adapter, but the model's is "
                f"{kind} with {want}"
            )
