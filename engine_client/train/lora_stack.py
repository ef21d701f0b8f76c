"""Trainable LoRA stacks: a trainer's policies as float parameters that the engine's kernels read.

A serving engine keeps adapters in a ``[slots, S]`` byte pool (one copy per switch, but
not differentiable). A trainer keeps the policies of one layout as ``nn.Parameter`` stacks
over its policies instead, one pair per module::

    a        [N, r, in]       dense nn.Linear, and M.weight (2-d target_parameters; [1, r, in] in the store)
    b        [N, out, r]
    a        [N, E, r, in]    fused experts (gate_up_proj / up_proj / down_proj)
    b        [N, E, out, r]
    scaling  [N, n_modules]   float32, not trained

and registers them with the very wrappers the engine uses
(:class:`~engine_client.engine.lora_layers.LinearLoRA`,
:class:`~engine_client.engine.lora_layers.ExpertsLoRA`) as one more layout: an
:class:`~engine_client.engine.lora_layers.Entry` whose layout id is the stack's. The
:class:`~engine_client.engine.lora_layers.BatchContext` of a batch routes each sequence to its
policy's row of the stack; BGMV/SGMV gather rows by index, so autograd delivers each token's
gradient to exactly its own policy's row (masked tokens contribute exact zeros). No change to the
wrappers or kernels is needed, and a mixed batch of policies runs through the same calls as a mixed
batch of served adapters.

Only leaf parameters go into entries: a view made once (``a[:, 0]``) would carry an
autograd node that the first backward frees, so the 2-d ``M.weight`` form is kept in
kernel shape ``[N, r, in]`` and reshaped only at import and export.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mint_store.format.adapter import Adapter, LoraModule
from mint_store.format.layout import natural_key

from ..engine.lora_layers import Entry, ExpertsLoRA, LinearLoRA
from ..engine.targets import Target, model_targets
from ..errors import LayoutMismatch, TrainerError
from ..tp.sharding import TPModel
from .tp_train import TPLinearLoRA

Factors = dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module -> (A, B, scaling), kernel shapes


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSpec:
    """A policy started from scratch, initialised as PEFT does.

    ``target_modules``: nn.Linear names, matched like PEFT (the full path, or its tail after a
    dot: ``"q_proj"``), or ``"all-linear"`` (every nn.Linear but the output embedding).
    ``target_parameters``: fused-experts parameters (``"mlp.experts.gate_up_proj"``) or 2-d
    weights (``"self_attn.q_proj.weight"``), matched the same way. Scaling ``lora_alpha / r``
    (``/ sqrt(r)`` with rsLoRA). A: kaiming-uniform (a = sqrt(5), PEFT's default, i.e.
    U(-1/sqrt(in), 1/sqrt(in))); B: zeros, or normal with ``init_b_std`` (a non-zero start).
    ``seed`` makes the init reproducible.
    """

    r: int = 8
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")  # or "all-linear"
    target_parameters: tuple[str, ...] = ()
    use_rslora: bool = False
    seed: int = 0
    init_b_std: float = 0.0

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError("r must be >= 1")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise TypeError("target_modules is a tuple of names (or the string 'all-linear')")
        if not self.target_modules and not self.target_parameters:
            raise ValueError("give target_modules and/or target_parameters")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def resolve_targets(spec: LoraSpec, model: nn.Module, targets: dict[str, Target]) -> list[Target]:
    """The model targets ``spec`` names, in canonical order; every name must match something."""
    chosen: dict[str, Target] = {}

    def match(key: str, kinds: tuple[str, ...]) -> list[Target]:
        return [t for n, t in targets.items() if t.kind in kinds and (n == key or n.endswith("." + key))]

    if spec.target_modules == "all-linear":
        getter = getattr(model, "get_output_embeddings", None)
        out_emb = getter() if callable(getter) else None
        for t in targets.values():
            if t.kind == "linear" and model.get_submodule(t.module) is not out_emb:
                chosen[t.name] = t
    else:
        for key in spec.target_modules:
            hits = match(key, ("linear",))
            if not hits:
                raise LayoutMismatch(f"target_modules entry {key!r} matches no nn.Linear of the model")
            chosen.update((t.name, t) for t in hits)
    for key in spec.target_parameters:
        hits = match(key, ("experts", "linear_param"))
        if not hits:
            raise LayoutMismatch(f"target_parameters entry {key!r} matches no fused-experts parameter or 2-d weight")
        chosen.update((t.name, t) for t in hits)
    return sorted(chosen.values(), key=lambda t: natural_key(t.name))


def init_factors(spec: LoraSpec, targets: Sequence[Target]) -> Factors:
    """Float32 ``{name: (A, B, scaling)}`` in kernel shapes (no policy dimension)."""
    gen = torch.Generator().manual_seed(spec.seed)
    out = {}
    for t in targets:
        lead = (t.experts,) if t.kind == "experts" and t.experts is not None else ()
        bound = 1.0 / math.sqrt(t.in_features)  # kaiming_uniform_(a=sqrt(5)) over fan_in = in
        a = torch.empty(*lead, spec.r, t.in_features).uniform_(-bound, bound, generator=gen)
        b = torch.zeros(*lead, t.out_features, spec.r)
        if spec.init_b_std:
            b.normal_(0.0, spec.init_b_std, generator=gen)
        out[t.name] = (a, b, spec.scaling)
    return out


def adapter_factors(adapter: Adapter, targets: dict[str, Target]) -> Factors:
    """An adapter's modules in kernel shapes (``M.weight``: ``[1, r, in]`` -> ``[r, in]``)."""
    out = {}
    for m in adapter.modules:
        t = targets.get(m.name)
        if t is None:
            raise LayoutMismatch(f"module {m.name!r} of the adapter is not in the model")
        a, b = (m.a[0], m.b[0]) if t.kind == "linear_param" else (m.a, m.b)
        out[m.name] = (a, b, m.scaling)
    return out


@dataclass(frozen=True, slots=True)
class StackKey:
    """What makes policies share a stack: the same modules with the same shapes and dtype."""

    dtype: torch.dtype
    modules: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # (name, A shape, B shape)


def stack_key(factors: Factors, dtype: torch.dtype) -> StackKey:
    mods = sorted(factors.items(), key=lambda kv: natural_key(kv[0]))
    return StackKey(dtype, tuple((n, tuple(a.shape), tuple(b.shape)) for n, (a, b, _) in mods))


@dataclass(eq=False)
class PolicyStack:
    """The trainable factors of every policy of one :class:`StackKey` (rows = slots)."""

    stack_id: str
    key: StackKey
    targets: dict[str, Target]
    device: torch.device
    names: list[str] = field(default_factory=list)  # policy name per slot
    a: dict[str, nn.Parameter] = field(default_factory=dict)  # [N, (E,) r, in]
    b: dict[str, nn.Parameter] = field(default_factory=dict)  # [N, (E,) out, r]
    scaling: torch.Tensor | None = None  # [N, n_modules] float32

    @property
    def modules(self) -> list[str]:
        return [n for n, _, _ in self.key.modules]

    def __len__(self) -> int:
        return len(self.names)

    def parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``("<module>.lora_A" | "<module>.lora_B", parameter)`` in canonical order."""
        for n in self.modules:
            yield f"{n}.lora_A", self.a[n]
            yield f"{n}.lora_B", self.b[n]

    def saved(self) -> tuple[Any, ...]:
        """What :meth:`restore` puts back: the parameters as they are now (references, no copy)."""
        return dict(self.a), dict(self.b), self.scaling, list(self.names)

    def restore(self, saved: tuple[Any, ...]) -> None:
        """Undo an :meth:`append` (its policy's row, name and the grown parameters)."""
        a, b, self.scaling, self.names = saved
        self.a.clear()
        self.a.update(a)
        self.b.clear()
        self.b.update(b)

    def append(self, name: str, factors: Factors) -> int:
        """Add a policy as a new last row; returns its slot. Parameters are replaced (re-attach)."""
        dt = self.key.dtype
        grown_a: dict[str, nn.Parameter] = {}
        grown_b: dict[str, nn.Parameter] = {}
        with torch.no_grad():  # every grown tensor made before any is swapped in: a failure (out of
            for n in self.modules:  # memory) leaves the stack as it was, not half grown
                a, b, _ = factors[n]
                new_a = a.to(self.device, dt).unsqueeze(0)
                new_b = b.to(self.device, dt).unsqueeze(0)
                if n in self.a:
                    new_a = torch.cat([self.a[n].detach(), new_a])
                    new_b = torch.cat([self.b[n].detach(), new_b])
                grown_a[n] = nn.Parameter(new_a.contiguous())
                grown_b[n] = nn.Parameter(new_b.contiguous())
            row = torch.tensor([[factors[n][2] for n in self.modules]], dtype=torch.float32, device=self.device)
            scaling = row if self.scaling is None else torch.cat([self.scaling, row])
        self.a.update(grown_a)
        self.b.update(grown_b)
        self.scaling = scaling
        self.names.append(name)
        return len(self.names) - 1

    def assign(self, slot: int, factors: Factors) -> None:
        """Overwrite one policy's factors and scalings in place (resume, rollback with restore)."""
        if self.scaling is None:
            raise TrainerError("empty stack")
        with torch.no_grad():
            for j, n in enumerate(self.modules):
                a, b, s = factors[n]
                self.a[n][slot].copy_(a)
                self.b[n][slot].copy_(b)
                self.scaling[slot, j] = s

    def export(self, slot: int, base: str, peft_config: dict | None = None) -> Adapter:
        """One policy as an :class:`Adapter` (store shapes, exact copies of the parameters)."""
        if self.scaling is None:
            raise TrainerError("empty stack")
        scal = self.scaling[slot].tolist()
        mods = []
        for j, n in enumerate(self.modules):
            a = self.a[n].detach()[slot].cpu().clone()
            b = self.b[n].detach()[slot].cpu().clone()
            if self.targets[n].kind == "linear_param":
                a, b = a.unsqueeze(0), b.unsqueeze(0)
            mods.append(LoraModule(n, a, b, float(scal[j])))
        return Adapter(base, tuple(mods), peft_config)


class Wrapping:
    """The trainer's hooks on a model: the engine's wrapper classes, one per target module.

    A module already wrapped (by a :class:`~.engine.LoRAEngine` on the same model) is reused:
    its wrapper gets our entries too, and a batch only runs the entries of the layouts in its
    context, so engine batches and trainer batches alternate on one resident base. On
    :meth:`close` only our entries go, and only the wrappers we created are removed (an
    experts wrapper someone stacked on top of ours is left in place, with ours inert below).
    """

    def __init__(self, model: nn.Module, tp: TPModel | None = None) -> None:
        self.model = model
        self.targets = model_targets(model)
        self.tp = tp  # a tensor-parallel base: our own hooks that run on each linear's slice
        self._hooks: dict[str, LinearLoRA | ExpertsLoRA] = {}
        self._created: set[str] = set()

    def _hook(self, t: Target) -> LinearLoRA | ExpertsLoRA:
        hook = self._hooks.get(t.module)
        if hook is not None:
            return hook
        mod = self.model.get_submodule(t.module)
        if t.kind == "experts":
            owner = getattr(mod.forward, "__self__", None)  # an ExpertsLoRA replaced forward already
            if isinstance(owner, ExpertsLoRA):
                hook = owner
            else:
                hook = ExpertsLoRA(mod)
                self._created.add(t.module)
        elif self.tp is not None:  # an engine's hooks hold slices: never share them
            hook = TPLinearLoRA(mod, self.tp.shards.get(t.module), self.tp.group)  # type: ignore[arg-type]
            self._created.add(t.module)
        else:
            found = [h for h in mod._forward_hooks.values() if isinstance(h, LinearLoRA)]
            if found:
                hook = found[0]
            else:
                hook = LinearLoRA(mod)  # type: ignore[arg-type]  # model_targets: an nn.Linear
                self._created.add(t.module)
        self._hooks[t.module] = hook
        return hook

    def attach(self, stack: PolicyStack) -> None:
        if stack.scaling is None:
            return
        for j, n in enumerate(stack.modules):
            t = self.targets[n]
            hook = self._hook(t)
            e = Entry(stack.stack_id, stack.a[n], stack.b[n], stack.scaling[:, j])
            if isinstance(hook, ExpertsLoRA):
                if t.param is None:
                    raise LayoutMismatch(f"module {n!r} is fused experts without a parameter name")
                hook.entries.setdefault(t.param, []).append(e)
            else:
                hook.entries.append(e)

    def detach(self, stack_id: str) -> None:
        for hook in self._hooks.values():
            if isinstance(hook, ExpertsLoRA):
                for p, es in hook.entries.items():
                    hook.entries[p] = [e for e in es if e.layout_id != stack_id]
            else:
                hook.entries[:] = [e for e in hook.entries if e.layout_id != stack_id]

    def close(self, stack_ids: Sequence[str]) -> None:
        for sid in stack_ids:
            self.detach(sid)
        for path, hook in self._hooks.items():
            if path not in self._created:
                continue
            if isinstance(hook, ExpertsLoRA):
                if getattr(hook.module.forward, "__self__", None) is hook:
                    hook.remove()
            else:
                hook.remove()
        self._hooks.clear()
        self._created.clear()
