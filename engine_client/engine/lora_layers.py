"""LoRA inside a transformers model, driven by the batch the engine runs.

How a layer learns which adapter each token uses: around every model call the engine
sets a :class:`BatchContext` (a ``ContextVar``) holding, per layout, the slot of every
sequence (``seq_slots [B]``, -1 = none of this layout). A wrapped layer sees activations
whose leading dimensions flatten, batch-major, to ``N`` tokens (``[B, T, in]`` for the
projections, ``[B*T, H]`` inside the experts, ``[B, 1, S, r]`` for DeepSeek's
``kv_b_proj`` over its latent cache), so token ``t`` belongs to sequence
``t // (N // B)``. That holds at every step of ``generate`` with a KV cache (``T`` = 1)
and when ``generate`` repeats each sequence (``num_return_sequences``: the copies of a
sequence are adjacent rows).

* Dense ``nn.Linear``: a forward hook adds, per layout in the batch, one ADD_LORA
  (:func:`~..kernels.ops.add_lora`; prefill and decode alike: every sequence has ``T`` tokens)
  into the output, in place when no gradient is needed. On a plain ``nn.Linear`` the hook
  is the instance's forward instead, and a prefill batch of one layout without gradients
  takes :func:`~..kernels.ops.linear_lora` (with the torch ops the delta first, the base matmul
  accumulating into it; with the grouped kernels the base matmul, then the kernels into its
  output). The module's parameters and state-dict names are untouched.
* Fused experts: the module's forward is replaced (on the instance) by a grouped loop over
  the routed (token, expert) pairs with the LoRA of each pair's slot and expert applied to
  the up projection before the gate and to the down projection, exactly where the expert's
  own matmuls are; with no adapter of these parameters in the batch the original forward
  runs unchanged. The pairs are sorted once per forward by (expert, sequence) (one host
  sync): the base matmuls run per expert, each writing its rows of one output, and the LoRA
  is added in place into those outputs. Where the grouped kernels run (:mod:`..kernels.groups`:
  the C library on CPU, Triton on CUDA; no gradient, their dtypes) every layout of the batch
  takes one SHRINK and one EXPAND over the (expert, sequence) runs, each run reading its
  slot's expert weights in place, no padding. Otherwise the batch's first layout runs per
  expert over its sequences, padded to the most pairs one sequence sends to the expert
  (:func:`~..kernels.moe.add_expert_lora`: the weights read as views of the pool when the
  slots are a progression), and the other layouts :func:`~..kernels.ops.bgmv`, one gather per
  pair. When autograd needs the inputs (the trainer) or the dtypes differ, the
  differentiable segment path runs instead: pairs sorted by (expert, slot),
  :func:`~..kernels.ops.segment_lora` per (adapter, expert) segment, one weight gather per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import BatchMismatch, LayoutMismatch
from ..kernels.groups import GroupedKernels
from ..kernels.moe import Routing, add_expert_lora, gather_rows, release_workspace, route
from ..kernels.ops import add_lora, bgmv, fast_kernels, linear_lora, segment_lora

if TYPE_CHECKING:
    from ..device.device_pool import DevicePool
    from .targets import Target


@dataclass(slots=True)
class LayoutBatch:
    """One layout's share of a batch (device int64 tensors, views of the engine's buffer)."""

    seq_slots: torch.Tensor  # [B] slot per sequence, -1 = not this layout
    active: torch.Tensor  # [A] sequences that use this layout
    active_slots: torch.Tensor  # [A] their slots
    n_active: int
    # (first, step) when active_slots is that arithmetic progression (known on the host when
    # the batch is made, once per forward): the kernels then read weights as views, no gather
    progression: tuple[int, int] | None = None

    def seqs(self, batch_size: int) -> torch.Tensor | None:
        """``active``, or None when every sequence of the batch uses this layout (no gather)."""
        return None if self.n_active == batch_size else self.active


@dataclass(frozen=True, slots=True)
class BatchContext:
    batch_size: int
    layouts: dict[str, LayoutBatch]  # layout id -> its part; layouts with no sequence are absent


# below this many tokens per sequence (decode) ADD_LORA after the base matmul is as fast (measured)
_FUSED_MIN_TOKENS = 2
_FUSED_DTYPES = (torch.float32, torch.float64)

# prefill: the experts' padded path runs while its padded rows stay under this many times the
# routed pairs (per layer it won up to ~1.75x padding, but in the whole MoE model, routed by a
# random router, prefill measured no faster than the segment path at N = 64 and 256: kept tight)
_MAX_PADDING = 1.25
# adds one layout-set's delta into a module's output: (y, its input x, parameter name, hidden for decode)
AddDelta = Callable[[torch.Tensor, torch.Tensor, str, "torch.Tensor | None"], None]

_CURRENT: ContextVar[BatchContext | None] = ContextVar("mint_lora_batch", default=None)


def current_batch() -> BatchContext | None:
    return _CURRENT.get()


@contextmanager
def use_batch(ctx: BatchContext) -> Iterator[BatchContext]:
    if _CURRENT.get() is not None:
        raise RuntimeError("a LoRA batch is already running in this context; batches do not nest")
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
        release_workspace()  # the experts' scratch buffers live for one batch


@dataclass(frozen=True, slots=True)
class Entry:
    """One layout's factors for one target (views into its device pool)."""

    layout_id: str
    a: torch.Tensor  # [slots, r, in] or [slots, E, r, in]
    b: torch.Tensor  # [slots, out, r] or [slots, E, out, r]
    scaling: torch.Tensor  # [slots]


def tokens_per_sequence(n: int, ctx: BatchContext) -> int:
    if n % ctx.batch_size:
        raise BatchMismatch(
            f"a LoRA layer saw {n} tokens, not a multiple of the batch's {ctx.batch_size} sequences; "
            "the batch dimension must lead the activations"
        )
    return n // ctx.batch_size


class LinearLoRA:
    """Forward hook of one ``nn.Linear``: ``y += Σ_layouts delta``.

    On a plain ``nn.Linear`` (exactly that class, no forward of its own on the instance) the
    module's forward is replaced instead (on the instance; the hook's work then runs inside it): when one layout
    covers the whole batch and no gradient is needed, the delta is computed first and the
    base matmul accumulates into it (:func:`~..kernels.ops.linear_lora`, one pass less over the
    output); otherwise the base forward runs and the hook's ADD_LORA follows, as before.
    """

    def __init__(self, module: nn.Linear) -> None:
        self.entries: list[Entry] = []
        self.module = module
        self._handle: Any = None
        # a subclass (Falcon's two-step bf16 linear, a quantized linear, a router returning a
        # tuple) keeps its own forward: the hook adds the delta to what it returns
        if (type(module) is not nn.Linear or "forward" in module.__dict__ or module._forward_hooks
                or module._forward_pre_hooks):
            self._handle = module.register_forward_hook(self, with_kwargs=True)
        else:
            module.forward = self._forward  # type: ignore[method-assign]

    def _forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's parameter name: m(input=x) works
        x = input
        ctx = _CURRENT.get()
        m = self.module
        if ctx is not None:
            y = self._fused(m, x, ctx)
            if y is not None:
                return y
        out = nn.functional.linear(x, m.weight, m.bias)
        got = None if ctx is None else self(m, (x,), {}, out)
        return out if got is None else got

    def _fused(self, m: nn.Linear, x: torch.Tensor, ctx: BatchContext) -> torch.Tensor | None:
        """The base output plus the delta by :func:`linear_lora`, or None where it does not apply:
        several layouts, a layout on part of the batch, a gradient, mixed dtypes or a half dtype
        (whose rounding PEFT does in two steps)."""
        live = [(e, lb) for e in self.entries if (lb := ctx.layouts.get(e.layout_id)) is not None]
        if len(live) != 1 or x.dtype not in _FUSED_DTYPES or not x.is_contiguous():
            return None
        e, lb = live[0]
        parts = (x, m.weight, e.a, e.b) if m.bias is None else (x, m.weight, m.bias, e.a, e.b)
        if lb.n_active != ctx.batch_size or any(t.dtype != x.dtype for t in parts) or (
                torch.is_grad_enabled() and any(t.requires_grad for t in (*parts, e.scaling))):
            return None
        per = tokens_per_sequence(x.numel() // x.shape[-1], ctx)
        if per < _FUSED_MIN_TOKENS:
            return None
        x3 = x.view(ctx.batch_size, per, x.shape[-1])
        y = linear_lora(x3, m.weight, m.bias, e.a, e.b, e.scaling, lb.active_slots, progression=lb.progression)
        return y.view(*x.shape[:-1], y.shape[-1])

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        ctx = _CURRENT.get()
        if ctx is None:
            return None
        x = args[0] if args else kwargs["input"]
        x3 = None
        for e in self.entries:
            lb = ctx.layouts.get(e.layout_id)
            if lb is None:
                continue
            if x3 is None:
                b = ctx.batch_size
                per = tokens_per_sequence(x.numel() // x.shape[-1], ctx)
                x3 = x.reshape(b, per, x.shape[-1])  # [B, T, in]: a view, batch-major
                y = out.reshape(b, per, out.shape[-1])  # [B, T, out]
            y = add_lora(y, x3, e.a, e.b, e.scaling, lb.active_slots, lb.seqs(ctx.batch_size),
                         progression=lb.progression, distinct=True)  # (a layout's sequences: each once)
        return None if x3 is None else y.view(out.shape)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        elif self.module.__dict__.get("forward") == self._forward:
            del self.module.forward

    def drop(self, layout_id: str) -> None:
        # a new list, not an edit in place: a forward iterating the old one is unaffected
        self.entries = [e for e in self.entries if e.layout_id != layout_id]


class ExpertsLoRA:
    """Replaces a fused-experts module's forward with one that applies LoRA per routed pair."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.entries: dict[str, list[Entry]] = {}  # parameter name -> entries
        self._had_own_forward = "forward" in module.__dict__
        self._original: Callable[..., torch.Tensor] = module.forward
        module.forward = self.forward

    def remove(self) -> None:
        if self._had_own_forward:
            self.module.forward = self._original
        else:
            del self.module.forward

    def drop(self, layout_id: str) -> None:
        self.entries = {p: [e for e in es if e.layout_id != layout_id] for p, es in self.entries.items()}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        ctx = _CURRENT.get()
        live = {} if ctx is None else {
            p: [(e, ctx.layouts[e.layout_id]) for e in es if e.layout_id in ctx.layouts]
            for p, es in self.entries.items()
        }
        if ctx is None or not any(live.values()):
            return self._original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return self._lora_forward(hidden_states, top_k_index, top_k_weights, live, ctx)

    def _lora_forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        live: dict[str, list[tuple[Entry, LayoutBatch]]], ctx: BatchContext,
    ) -> torch.Tensor:
        """The grouped kernels' path, else the padded per-(expert, sequence) one (:mod:`..kernels.moe`),
        in place; the segment path (differentiable) when autograd needs the inputs, the dtypes
        differ, or the padding would be mostly padding."""
        m: Any = self.module
        entries = [e for es in live.values() for e, _ in es]
        ts = [hidden, top_k_weights, *m.parameters(), *(t for e in entries for t in (e.a, e.b, e.scaling))]
        if (torch.is_grad_enabled() and any(t.requires_grad for t in ts)) or any(
                t.dtype != hidden.dtype for t in (m.down_proj, *(t for e in entries for t in (e.a, e.b)))):
            return self._segment_forward(hidden, top_k_index, top_k_weights, live, ctx)
        per = tokens_per_sequence(top_k_index.shape[0], ctx)
        gk = fast_kernels(hidden, hidden, *(t for e in entries for t in (e.a, e.b, e.scaling)))
        add = self._grouped_adder(gk, top_k_index, per, live) if gk is not None else self._padded_adder(
            hidden, top_k_index, per, live, ctx)
        if add is None:
            return self._segment_forward(hidden, top_k_index, top_k_weights, live, ctx)
        r, add_delta = add
        xs = gather_rows(hidden, r.tok)  # [P, H], in this thread's workspace
        up_name = self._up_name()
        h = self._grouped(xs, up_name, r.counts, r.experts, inplace=True)  # [P, 2I] or [P, I]
        add_delta(h, xs, up_name, hidden)
        h = self._activate(h)
        y = self._grouped(h, "down_proj", r.counts, r.experts, inplace=True)  # [P, H]
        add_delta(y, h, "down_proj", None)
        if getattr(m, "has_post_expert_norm", False):
            y = m.post_expert_norm(y)
        y = y.mul_(top_k_weights.reshape(-1)[r.perm].unsqueeze(-1))
        return torch.zeros_like(hidden).index_add_(0, r.tok, y.to(hidden.dtype))

    def _grouped_adder(self, gk: GroupedKernels, top_k_index: torch.Tensor, per: int,
                       live: dict[str, list[tuple[Entry, LayoutBatch]]]) -> tuple[Routing, AddDelta]:
        """Every layout through the grouped kernels: one group per (expert, sequence) run of the
        sorted pairs, each layout's slots by sequence; weights read in place, no padding."""
        r = route(top_k_index, self._n_experts(), per, groups=True)
        groups, group_seq = r.groups, r.group_seq
        assert groups is not None and group_seq is not None

        def add(y: torch.Tensor, x: torch.Tensor, name: str, _direct: torch.Tensor | None) -> None:
            for e, elb in live.get(name, ()):
                gk.add_grouped(y, x, e.a, e.b, e.scaling, groups.with_slots(elb.seq_slots[group_seq]))

        return r, add

    def _padded_adder(self, hidden: torch.Tensor, top_k_index: torch.Tensor, per: int,
                      live: dict[str, list[tuple[Entry, LayoutBatch]]],
                      ctx: BatchContext) -> tuple[Routing, AddDelta] | None:
        """The lead layout padded per (expert, sequence) (:func:`..kernels.moe.add_expert_lora`), the
        others by BGMV; None where the padding would exceed ``_MAX_PADDING`` times the pairs."""
        lead = next(e for es in live.values() for e, _ in es)
        lb = ctx.layouts[lead.layout_id]
        active_of_seq = torch.full((ctx.batch_size,), -1, dtype=torch.int64, device=hidden.device)
        active_of_seq[lb.active] = torch.arange(lb.n_active, device=hidden.device)
        r = route(top_k_index, self._n_experts(), per, (active_of_seq, lb.n_active))
        if r.pad is not None and not r.pad.direct and r.pad.n_rows > _MAX_PADDING * max(1, sum(r.counts)):
            # prefill routed so unevenly (a sequence sending most of its tokens to one expert) that
            # the padded blocks would be mostly padding: the segment path does less work (decode
            # pads every expert to all sequences on purpose: one pass over the weights, as views)
            return None

        def add(y: torch.Tensor, x: torch.Tensor, name: str, direct: torch.Tensor | None) -> None:
            for e, elb in live.get(name, ()):
                if e.layout_id == lead.layout_id and r.pad is not None:
                    add_expert_lora(y, x, e.a, e.b, e.scaling, lb.active_slots, r.pad, progression=lb.progression,
                                    hidden=direct)
                else:  # another layout in the batch: one weight gather per pair
                    y.add_(bgmv(x, e.a, e.b, e.scaling, elb.seq_slots[r.seq], experts=r.experts))

        return r, add

    def _n_experts(self) -> int:
        m: Any = self.module
        return int(m.num_experts) if hasattr(m, "num_experts") else int(m.down_proj.shape[0])

    def _up_name(self) -> str:
        return "gate_up_proj" if getattr(self.module, "has_gate", hasattr(self.module, "gate_up_proj")) else "up_proj"

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        m: Any = self.module
        if self._up_name() == "up_proj":
            return m.act_fn(h)
        return m._apply_gate(h) if hasattr(m, "_apply_gate") else _gate(m, h)

    def _segment_forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        live: dict[str, list[tuple[Entry, LayoutBatch]]], ctx: BatchContext,
    ) -> torch.Tensor:
        m: Any = self.module
        n_tok, k = top_k_index.shape
        per = tokens_per_sequence(n_tok, ctx)
        n_exp = self._n_experts()
        # pairs sorted by (expert, slot of one layout): grouped by expert for the base matmuls,
        # and within an expert in runs of one adapter, the segments that layout's LoRA runs on
        lead = next(e for es in live.values() for e, _ in es)
        lead_lb, n_slots = ctx.layouts[lead.layout_id], lead.a.shape[0] + 1
        pair_seq = torch.arange(n_tok * k, device=top_k_index.device) // k // per
        keys, perm = torch.sort(top_k_index.reshape(-1) * n_slots + lead_lb.seq_slots[pair_seq] + 1, stable=True)
        experts = keys // n_slots  # [P] pairs grouped by expert
        counts = torch.bincount(experts, minlength=n_exp + 1)[:n_exp].tolist()  # ids >= E: other ranks
        n_pairs = sum(counts)
        experts, perm, keys = experts[:n_pairs], perm[:n_pairs], keys[:n_pairs]
        seg_keys, seg_lens = torch.unique_consecutive(keys, return_counts=True)
        segs = (seg_lens.tolist(), (seg_keys % n_slots - 1).tolist(), (seg_keys // n_slots).tolist())
        tok = perm // k  # [P] token of each pair
        seq = tok // per  # [P] sequence of each pair
        xs = hidden[tok]  # [P, H]
        has_gate = getattr(m, "has_gate", hasattr(m, "gate_up_proj"))
        up_name = "gate_up_proj" if has_gate else "up_proj"

        def delta(x: torch.Tensor, e: Entry, lb: LayoutBatch) -> torch.Tensor:
            if e.layout_id == lead.layout_id:  # one weight gather per chunk of a segment
                return segment_lora(x, e.a, e.b, e.scaling, *segs)
            return bgmv(x, e.a, e.b, e.scaling, lb.seq_slots[seq], experts=experts)  # one per pair

        h = self._grouped(xs, up_name, counts, experts)  # [P, 2I] or [P, I]
        # summed in the wider dtype, then rounded to the base's (as PEFT does): fp32 policies on a
        # bf16 base must hand the next base matmul bf16, not fp32
        for e, lb in live.get(up_name, ()):
            h = (h + delta(xs, e, lb)).to(h.dtype)
        if not has_gate:
            h = m.act_fn(h)
        elif hasattr(m, "_apply_gate"):
            h = m._apply_gate(h)
        else:
            h = _gate(m, h)
        y = self._grouped(h, "down_proj", counts, experts)  # [P, H]
        for e, lb in live.get("down_proj", ()):
            y = (y + delta(h, e, lb)).to(y.dtype)
        if getattr(m, "has_post_expert_norm", False):
            y = m.post_expert_norm(y)
        y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        out = torch.zeros_like(hidden)
        return out.index_add(0, tok, y.to(hidden.dtype))

    def _grouped(self, x: torch.Tensor, name: str, counts: list[int], experts: torch.Tensor, *,
                 inplace: bool = False) -> torch.Tensor:
        """The base expert matmuls over pairs sorted by expert (one matmul per expert hit);
        ``inplace`` (no autograd): each writes its rows of one output, no concatenation."""
        m: Any = self.module
        w = getattr(m, name)  # [E, out, in] (or [E, in, out] when transposed)
        transposed = getattr(m, "is_transposed", False)
        out_f = w.shape[2] if transposed else w.shape[1]
        if inplace:
            y = x.new_empty((x.shape[0], out_f))
            start = 0
            for ex, c in enumerate(counts):
                if c:
                    torch.mm(x[start : start + c], w[ex] if transposed else w[ex].t(), out=y[start : start + c])
                    start += c
            return y.add_(getattr(m, f"{name}_bias")[experts]) if getattr(m, "has_bias", False) else y
        parts = []
        start = 0
        for ex, c in enumerate(counts):
            if c:
                seg = x[start : start + c]
                parts.append(seg @ w[ex] if transposed else nn.functional.linear(seg, w[ex]))
                start += c
        y = torch.cat(parts) if parts else x.new_zeros((0, out_f))
        if getattr(m, "has_bias", False):
            y = y + getattr(m, f"{name}_bias")[experts]
        return y


def _gate(m: Any, h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return m.act_fn(gate) * up


def attach(pool: DevicePool, model: nn.Module, targets: Mapping[str, Target],
           hooks: dict[str, LinearLoRA | ExpertsLoRA],
           linear_hook: Callable[[str, nn.Linear], LinearLoRA] | None = None,
           experts_hook: Callable[[str, nn.Module], ExpertsLoRA] | None = None) -> None:
    """Route ``pool``'s modules to the hooks of their targets in ``model`` (made on first use).

    ``linear_hook(path, module)`` / ``experts_hook(path, module)`` make the hooks (default
    :class:`LinearLoRA` / :class:`ExpertsLoRA`; a tensor-parallel engine passes ones that
    know each module's sharding).
    """
    lid = pool.layout_id
    for m in pool.layout.modules:
        t = targets[m.name]
        v = pool.modules[m.name]
        hook = hooks.get(t.module)
        if t.kind == "experts":
            if hook is None:
                mod = model.get_submodule(t.module)
                hook = hooks[t.module] = ExpertsLoRA(mod) if experts_hook is None else experts_hook(t.module, mod)
            if not isinstance(hook, ExpertsLoRA) or t.param is None:
                raise LayoutMismatch(f"module {t.module!r} is wrapped as a linear and as experts")
            # copies, not edits in place: a forward on another thread may be iterating them
            hook.entries = {**hook.entries, t.param: [*hook.entries.get(t.param, []), Entry(lid, v.a, v.b, v.scaling)]}
        else:
            if hook is None:
                mod = model.get_submodule(t.module)
                if not isinstance(mod, nn.Linear):
                    raise LayoutMismatch(f"module {t.module!r} is not an nn.Linear")
                hook = hooks[t.module] = LinearLoRA(mod) if linear_hook is None else linear_hook(t.module, mod)
            if not isinstance(hook, LinearLoRA):
                raise LayoutMismatch(f"module {t.module!r} is wrapped as experts and as a linear")
            # M.weight (2-d target_parameters) is stored with one "expert": [slots, 1, r, in]
            a, b = (v.a, v.b) if t.kind == "linear" else (v.a[:, 0], v.b[:, 0])
            hook.entries = [*hook.entries, Entry(lid, a, b, v.scaling)]
