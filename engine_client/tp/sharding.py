"""Adapters on a tensor-parallel base: a model sharded by transformers' ``tp_plan``.

Under ``torchrun``, ``AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=N))``
(``tp_plan="auto"`` in older transformers) gives
linears whose weights are DTensors (``Shard(0)`` for a column-parallel linear, ``Shard(1)``
for a row-parallel one) and whose ``forward`` transformers replaced with its TP forward
(inputs -> local matmul -> output collective). :class:`LoRAEngine` detects that
(:func:`tp_model`) and then, on each rank:

* holds only its slice of every adapter (:func:`slice_layout`, :class:`SlicedPool`):
  column-parallel ``M``: the rows of ``B`` of its output shard (``A`` whole); row-parallel
  ``M``: the columns of ``A`` of its input shard (``B`` whole); anything else whole;
* adds the delta where the base layer's own collective carries it, so there is no extra
  collective per LoRA layer. Column-parallel: a forward hook sees the whole (replicated)
  input and the local output shard (the inference path keeps it local), and adds
  ``x A^T B_shard^T``. Row-parallel: :class:`RowwiseLoRA` runs transformers' TP forward
  itself and adds the partial ``(x_shard A_shard^T) B^T`` to the local partial output
  *before* its all-reduce; summed over ranks that is ``x A^T B^T``, scaled once;
* runs every batch on the adapters rank 0 decided (:func:`engine_client.tp.batch.prepare_batch`): rank 0 applies
  staged hot swaps, resolves, and broadcasts the refs and their exact versions; after
  loading, ranks exchange their status, and a failure on any rank fails the batch on all
  of them with one :class:`~engine_client.errors.TPBatchFailed`.

A rank reads only its slice of a row, verified, from the first load on: the blocks of the
row that hold its slice, with one vectored read, each checked against the block digests
the writer recorded at publish; later loads read exactly the slice and check it against
the slice's own digest (:mod:`engine_client.tp.reads`). A row published without block
digests is read whole the first time and verified against its content id.

Fused experts: transformers' ``tp_plan`` leaves them replicated (their adapters run whole on
every rank); its ``ep_plan`` splits them by expert (:mod:`engine_client.tp.ep`: each rank holds
its experts' ``A`` and ``B``); a ``tp_plan`` that names the deprecated ``moe_tp_experts``
(``gate_up_proj`` packed colwise, ``down_proj`` rowwise; removal announced for transformers
5.28, and ``tests/engine/test_tp.py`` fails once it is gone) holds, per expert, the rows of
``B`` of this rank's gate rows and up rows and the columns of ``A`` of its down inputs;
:class:`TPExpertsLoRA` runs the grouped LoRA loop inside transformers' TP steps, before the
experts' all-reduce.

Inference only: the TP path needs ``torch.no_grad()`` / ``inference_mode`` (the forward
raises otherwise). Other sharded styles are refused with a :class:`LayoutMismatch`.
``pin`` and ``prefetch`` act on each rank alone (no agreement): call them with the same
refs on every rank; batches always agree, whatever each rank holds.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mint_store.format.blocks import Block, Grid, merged
from mint_store.format.layout import DTYPES, Layout, build_layout

from ..device.device_pool import DevicePool
from ..engine.lora_layers import BatchContext, ExpertsLoRA, LinearLoRA, current_batch
from ..engine.targets import Target, is_experts
from ..errors import LayoutMismatch
from .ep import EPExperts, EPExpertsLoRA, ep_experts, refuse_ep_group
from .ep import check_local as _check_local
from .reads import Cut, SliceReader, blocks_needed, runs_of, slice_digest

# the plan styles whose linear a LoRA hook sees with its whole input and whole output
_WHOLE_STYLES = ("colwise_gather_output", "replicated_with_grad_allreduce")


@dataclass(frozen=True, slots=True)
class LinearShard:
    """This rank's shard of a linear (or of a fused-experts parameter): the ``[start, stop)``
    pieces of its outputs (colwise) or inputs (rowwise); two pieces for a packed gate/up."""

    style: str  # "colwise" | "rowwise" | "experts" (expert-parallel: the pieces are experts)
    pieces: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.pieces)


@dataclass(frozen=True, slots=True)
class TPModel:
    rank: int  # in the TP group
    world: int
    group: Any  # the TP process group (the model's own mesh)
    src: int  # global rank of the group's rank 0 (it decides batches)
    shards: dict[str, LinearShard]  # linear's path, or experts' "path.param" -> this rank's shard
    experts: frozenset[str]  # paths of fused-experts modules run tensor-parallel (their own hook)
    unsupported: dict[str, str]  # module path -> how it is sharded (LoRA cannot run there)
    # module path -> the plan style of an unsharded linear whose output transformers transforms
    # for the backward (MLA's kv_a_proj: an all-reduce of part of its gradient, applied before
    # the LoRA hook adds its delta): served whole, but its LoRA would train on partial gradients
    untrainable: dict[str, str] = field(default_factory=dict)
    # fused-experts path -> this rank's experts, where transformers' ep_plan splits them (engine_client.tp.ep)
    ep: dict[str, EPExperts] = field(default_factory=dict)


def _plan_style(plan: dict[str, str], path: str) -> str | None:
    parts = path.split(".")
    for pattern, style in plan.items():
        p = pattern.split(".")
        if len(p) == len(parts) and all(a in ("*", b) for a, b in zip(p, parts, strict=True)):
            return style
    return None


def tp_model(model: nn.Module) -> TPModel | None:
    """The sharding of ``model`` if transformers loaded it tensor- or expert-parallel, else None."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ep: dict[str, EPExperts] = {}
    unsupported: dict[str, str] = {}
    for path, mod in model.named_modules():
        got_ep = ep_experts(mod, path) if is_experts(mod) else None
        if isinstance(got_ep, EPExperts):
            ep[path] = got_ep
        elif got_ep is not None:
            unsupported[path] = got_ep
    in_ep = {id(p) for path in ep for p in model.get_submodule(path).parameters(recurse=False)}
    first = next((p for p in model.parameters() if isinstance(p, DTensor) and id(p) not in in_ep), None)
    if first is None and not ep:
        return None
    if first is None:  # experts only (tp_plan={}): the EP group runs the batches
        e0 = next(iter(ep.values()))
        group = e0.group
        return TPModel(dist.get_group_rank(group, dist.get_rank()), dist.get_world_size(group), group,
                       dist.get_global_rank(group, 0), _ep_shards(model, ep), frozenset(), unsupported, {}, ep)
    mesh = first.device_mesh
    if mesh.ndim != 1:
        raise LayoutMismatch(f"the model is sharded over a {mesh.ndim}-d device mesh; LoRAEngine supports a "
                             "1-d TP mesh")
    plan = dict(getattr(model, "tp_plan", None) or {})
    rank, world = mesh.get_local_rank(), mesh.size()
    for e in ep.values():
        refuse_ep_group(e.group, mesh.get_group())
    shards: dict[str, LinearShard] = _ep_shards(model, ep)
    untrainable: dict[str, str] = {}
    experts: set[str] = set()
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            sharded = any(isinstance(p, DTensor) for p in mod.parameters(recurse=False))
            if is_experts(mod) and sharded and path not in ep and path not in unsupported:
                got = _experts_shards(mod, path, plan, rank, world)
                if isinstance(got, str):
                    unsupported[path] = got
                else:
                    shards.update(got)
                    experts.add(path)
            continue
        w = mod.weight
        if not isinstance(w, DTensor):
            style = _plan_style(plan, path)
            if style is not None and style not in _WHOLE_STYLES:
                untrainable[path] = style
            continue
        style = _plan_style(plan, path)
        if style in _WHOLE_STYLES or all(isinstance(p, Replicate) for p in w.placements):
            continue  # the hook sees the whole input and output: the adapter runs whole
        split: dict[tuple[str, tuple[Any, ...]], int] = {("colwise", (Shard(0),)): 0, ("rowwise", (Shard(1),)): 1}
        dim = split.get((style or "", tuple(w.placements)))
        if dim is None:
            unsupported[path] = f"{style!r} with placements {tuple(w.placements)}"
            continue
        n, local = int(w.shape[dim]), int(w.to_local().shape[dim])
        span = _split(n, local, rank, world)
        if span is None:
            unsupported[path] = f"{style!r} with an uneven split ({local} of {n} on rank {rank})"
            continue
        start = span[0]
        shards[path] = LinearShard("colwise" if dim == 0 else "rowwise", ((start, start + local),))
    group = mesh.get_group()
    return TPModel(rank, world, group, dist.get_global_rank(group, 0), shards, frozenset(experts), unsupported,
                   untrainable, ep)


def _ep_shards(model: nn.Module, ep: dict[str, EPExperts]) -> dict[str, LinearShard]:
    """The expert-dimension cut of every parameter of the expert-parallel experts."""
    out = {}
    for path, e in ep.items():
        for name, _ in model.get_submodule(path).named_parameters(recurse=False):
            out[f"{path}.{name}"] = LinearShard("experts", ((e.start, e.stop),))
    return out


def _split(n: int, local: int, rank: int, world: int) -> tuple[int, int] | None:
    """``[start, stop)`` of rank's chunk of ``n`` (torch.chunk's split, as DTensor's Shard), if ``local`` fits it."""
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    return (start, start + local) if local == min(chunk, n - start) else None


def _experts_shards(mod: nn.Module, path: str, plan: dict[str, str], rank: int,
                    world: int) -> dict[str, LinearShard] | str:
    """The shards of a fused-experts module run by transformers' ``moe_tp_experts`` (``gate_up_proj``
    packed colwise: this rank's rows of the gate half and of the up half; ``down_proj`` rowwise),
    or why LoRA cannot follow it."""
    styles = (_plan_style(plan, path), _plan_style(plan, f"{path}.gate_up_proj"),
              _plan_style(plan, f"{path}.down_proj"))
    why = f"fused experts ({', '.join(str(s) for s in styles)})"
    gate_up, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if (styles != ("moe_tp_experts", "packed_colwise", "rowwise") or getattr(mod, "is_transposed", False)
            or gate_up is None or down is None):
        return why
    half = int(gate_up.shape[1]) // 2  # [E, 2I, H]: gate rows, then up rows
    g = _split(half, int(gate_up.to_local().shape[1]) // 2, rank, world)
    d = _split(int(down.shape[2]), int(down.to_local().shape[2]), rank, world)  # [E, H, I]
    if g is None or d is None or g != d:
        return why + " with an uneven split"
    return {f"{path}.gate_up_proj": LinearShard("colwise", (g, (half + g[0], half + g[1]))),
            f"{path}.down_proj": LinearShard("rowwise", (d,))}


def check_tp_layout(layout: Layout, targets: dict[str, Target], tpm: TPModel, *, what: str) -> None:
    """Raise :class:`LayoutMismatch` if ``layout`` targets a module sharded in a way LoRA cannot follow."""
    for m in layout.modules:
        t = targets[m.name]
        how = tpm.unsupported.get(t.module)
        if how is not None:
            raise LayoutMismatch(
                f"{what}: module {m.name!r} is sharded as {how}; a tensor-parallel LoRAEngine runs adapters on "
                "colwise, rowwise and unsharded linears, on replicated experts, on moe_tp_experts and on "
                "expert-parallel experts (grouped_gemm with ep_size == tp_size) only (leave it out of the adapter "
                "or out of the model's tp_plan / ep_plan)"
            )


def slice_layout(layout: Layout, targets: dict[str, Target], tpm: TPModel) -> tuple[Layout, tuple[Cut, ...]]:
    """This rank's layout of ``layout`` (same tensor order, sliced shapes) and each tensor's cut."""
    shapes: list[tuple[str, tuple[int, ...], str]] = []
    cuts: list[tuple[int | None, tuple[tuple[int, int], ...]]] = []
    for t in layout.tensors:
        mod, _, kind = t.name.rpartition(".")
        sh = None
        if kind in ("lora_A", "lora_B"):
            target = targets[mod]
            sh = tpm.shards.get(target.name if target.kind == "experts" else target.module)
        dim = None
        if sh is not None and sh.style == "experts":
            dim = len(t.shape) - 3  # A [E, r, in] and B [E, out, r]: this rank's experts
        elif sh is not None and (sh.style, kind) == ("colwise", "lora_B"):
            dim = len(t.shape) - 2  # B [out, r] (or [E, out, r]): its output rows
        elif sh is not None and (sh.style, kind) == ("rowwise", "lora_A"):
            dim = len(t.shape) - 1  # A [r, in] (or [E, r, in]): its input columns
        shape = list(t.shape)
        if dim is not None and sh is not None:
            shape[dim] = sh.size
            cuts.append((dim, sh.pieces))
        else:
            cuts.append((None, ()))
        shapes.append((t.name, tuple(shape), t.dtype))
    sliced = build_layout(layout.base, shapes)
    return sliced, tuple(Cut(s, d, *c) for s, d, c in zip(layout.tensors, sliced.tensors, cuts, strict=True))


class SlicedPool(DevicePool):
    """Device slots holding this rank's slice of each row of ``source``.

    It takes whole (verified) rows of the stored layout and copies each tensor's slice into
    the slot: one strided copy per tensor instead of one per row.
    """

    def __init__(self, source: Layout, targets: dict[str, Target], tpm: TPModel, slots: int,
                 device: torch.device | str, reader: SliceReader | None = None) -> None:
        sliced, self.cuts = slice_layout(source, targets, tpm)
        super().__init__(sliced, slots, device)
        self.source = source
        self.runs = runs_of(self.cuts)  # the byte runs of a stored row that make this rank's slice
        self.slice_ranges = merged([(r.src, r.nbytes) for r in self.runs])  # what a later read fetches
        self._needed: dict[Grid, tuple[tuple[Block, ...], list[tuple[int, int]]]] = {}
        self.reader = reader  # gets the slice digest of every whole (verified) row loaded

    @property
    def layout_id(self) -> str:
        return self.source.layout_id

    @property
    def row_nbytes(self) -> int:
        return self.source.row_nbytes

    def blocks_needed(self, grid: Grid) -> tuple[tuple[Block, ...], list[tuple[int, int]]]:
        """The blocks of a row (cut by ``grid``) that a first read fetches and checks, and their ranges."""
        got = self._needed.get(grid)
        if got is None:
            needed = blocks_needed(self.source, self.runs, grid)
            got = self._needed[grid] = (needed, merged([r for b in needed for r in b.runs]))
        return got

    def _whole_rows(self) -> bool:
        return False  # a slot holds this rank's slice: rows are copied in tensor by tensor

    def _takes(self, row: torch.Tensor, sliced: bool) -> bool:
        # a whole stored row, or (sliced) this rank's slice of one, read by ranges and checked by SliceReader
        return row.shape == ((self.layout.row_nbytes,) if sliced else (self.source.row_nbytes,))

    def _copy_row(self, slot: int, row: torch.Tensor, non_blocking: bool, sliced: bool) -> None:
        if sliced:  # (said by the caller: the two sizes can be equal, with 64-byte padding)
            self.data[slot].copy_(row)
            return
        part = self.slice_row(row)
        cid = self.content_of(slot)
        if self.reader is not None and cid is not None:
            self.reader.record(cid, slice_digest(self.layout.layout_id, part))
        self.data[slot].copy_(part)

    def slice_row(self, row: torch.Tensor) -> torch.Tensor:
        """This rank's sliced row (host uint8, zero padded) of a whole stored ``row``."""
        out = torch.zeros(self.layout.row_nbytes, dtype=torch.uint8)
        for c in self.cuts:
            dt = DTYPES[c.src.dtype][0]
            src = row[c.src.offset : c.src.offset + c.src.nbytes].view(dt).view(c.src.shape)
            dst = out[c.dst.offset : c.dst.offset + c.dst.nbytes].view(dt).view(c.dst.shape)
            if c.dim is None:
                dst.copy_(src)
                continue
            at = 0
            for a, b in c.pieces:
                dst.narrow(c.dim, at, b - a).copy_(src.narrow(c.dim, a, b - a))
                at += b - a
        return out


class RowwiseLoRA(LinearLoRA):
    """A row-parallel linear: transformers' TP forward, with the partial delta added before its all-reduce.

    transformers installs ``forward = tp_forward`` on the instance, a closure over its
    parallel style, the mesh and the original forward. A forward hook would run after the
    all-reduce (and see only this rank's input shard), so this replaces ``tp_forward`` with
    the same three steps plus the LoRA delta between the local matmul and the collective.
    """

    def __init__(self, path: str, module: nn.Linear) -> None:
        tp_forward, style, mesh, inner = _tp_forward(path, module)
        self.entries = []
        self.module = module
        self._tp_forward: Any = tp_forward
        lora = super().__call__
        style_ = style

        def forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = style_.transform_inputs_pre_forward(module, args, kwargs, mesh)
            with style_.context_around_forward(module, mesh):
                out = inner(*args, **kwargs)  # this rank's partial sum: x_shard @ W_shard^T
                ctx = current_batch()  # a trainer's batch on this base runs none of ours
                if ctx is not None and any(e.layout_id in ctx.layouts for e in self.entries):
                    _check_local(path, out)
                    got = lora(module, args, kwargs, out)
                    out = out if got is None else got
            return style_.transform_output_post_forward(module, out, mesh)  # the all-reduce

        module.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        self.module.forward = self._tp_forward  # type: ignore[method-assign]


def _tp_forward(path: str, module: nn.Module) -> tuple[Any, Any, Any, Callable[..., Any]]:
    """transformers' TP forward of ``module``: (itself, its parallel style, the mesh, the original forward).

    transformers installs ``forward = tp_forward`` on the instance, a closure over those.
    """
    tp_forward = module.__dict__.get("forward")
    env = inspect.getclosurevars(tp_forward).nonlocals if callable(tp_forward) else {}
    style, mesh, inner = env.get("self"), env.get("mesh"), env.get("original_forward")
    steps = ("transform_inputs_pre_forward", "context_around_forward", "transform_output_post_forward")
    if mesh is None or not callable(inner) or not all(hasattr(style, s) for s in steps):
        raise LayoutMismatch(
            f"module {path!r} is sharded but its forward is not transformers' tensor-parallel forward "
            "(transformers 5.x installs one per module of the tp_plan); load the model with "
            "distributed_config=DistributedConfig(tp_size=N) (tp_plan='auto' in older transformers)"
        )
    return tp_forward, style, mesh, inner


class TPExpertsLoRA(ExpertsLoRA):
    """Fused experts run by transformers' ``moe_tp_experts``: this rank's slice of every expert.

    The grouped LoRA loop of :class:`ExpertsLoRA` runs inside transformers' TP steps (local
    inputs, local parameters), on the local gate/up rows and down columns with the matching
    slices of the adapters; its partial output joins the experts' own all-reduce.
    """

    def __init__(self, path: str, module: nn.Module) -> None:
        _, self._style, self._mesh, _ = _tp_forward(path, module)
        self._path = path
        super().__init__(module)  # its _original is transformers' tp_forward (used with no LoRA)

    def _lora_forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      live: Any, ctx: BatchContext) -> torch.Tensor:
        m, style, mesh = self.module, self._style, self._mesh
        (h, idx, w), _ = style.transform_inputs_pre_forward(m, (hidden, top_k_index, top_k_weights), {}, mesh)
        with style.context_around_forward(m, mesh):
            out = super()._lora_forward(h, idx, w, live, ctx)  # partial: this rank's rows of every expert
            _check_local(self._path, out)
        got: torch.Tensor = style.transform_output_post_forward(m, out, mesh)  # the all-reduce
        return got


def experts_hook(tpm: TPModel) -> Callable[[str, nn.Module], ExpertsLoRA]:
    """The experts hook factory for :func:`~engine_client.engine.lora_layers.attach` on this rank's model."""

    def make(path: str, module: nn.Module) -> ExpertsLoRA:
        if path in tpm.ep:
            return EPExpertsLoRA(path, module, tpm.ep[path])
        return TPExpertsLoRA(path, module) if path in tpm.experts else ExpertsLoRA(module)

    return make


def linear_hook(tpm: TPModel) -> Callable[[str, nn.Linear], LinearLoRA]:
    """The hook factory for :func:`~engine_client.engine.lora_layers.attach` on this rank's model."""

    def make(path: str, module: nn.Linear) -> LinearLoRA:
        sh = tpm.shards.get(path)
        return RowwiseLoRA(path, module) if sh is not None and sh.style == "rowwise" else LinearLoRA(module)

    return make
