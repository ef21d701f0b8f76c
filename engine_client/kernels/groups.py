"""Groups of tokens sharing one adapter slot, and the multi-LoRA ops built from SHRINK and EXPAND.

Two backends implement SHRINK and EXPAND over the same :class:`Groups`: Triton on CUDA
(:mod:`.triton_ops`) and a small C library on CPU (:mod:`.cpu`). A *group* is a
run of tokens that share one slot (and expert): a sequence in prefill, a segment, a single
token in decode / BGMV, an (expert, sequence) run of an MoE layer's sorted pairs::

    # x  [R, T, in] (3-D: token t of group g is x[rows[g], t])
    #    or [N, in] (2-D: token t of group g is x[rows[g] + t])      rows = None: rows[g] = g
    # a  [S, r, in] or [S, E, r, in];  b [S, out, r] or [S, E, out, r];  scaling [S] float32
    # slots [G] (-1: skip the group), experts [G], lens [G] (None: every group has L tokens)
    # y  laid out as x, with out features

    # SHRINK: h float32 laid out like x, with R >= r features ([R, T, R] or [N, 1, R]:
    # h_row(g, t) is h[rows[g], t] or h[rows[g] + t, 0]; columns past r are the backend's padding)
    for g in range(G):
        s = slots[g]
        if s < 0:
            continue
        A = a[s] if experts is None else a[s, experts[g]]            # [r, in]
        for t in range(lens[g]):
            h_row(g, t)[:r] = scaling[s] * (A @ x_row(g, t).to(a.dtype))  # accumulated in fp32

    # EXPAND: in place into y, the base layer's output
    for g in range(G):
        s = slots[g]
        if s < 0:
            continue
        B = b[s] if experts is None else b[s, experts[g]]            # [out, r]
        for t in range(lens[g]):
            y_row(g, t)[:] += B @ h_row(g, t)[:r].to(b.dtype)        # fp32 sum, then y's dtype

``a`` and ``b`` may be strided views of a slot pool: the backends read them through their
strides, the pool is never copied. Groups must not overlap in ``y`` (the layouts of a batch
and the segments of a call are disjoint): EXPAND adds without atomics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["GroupedKernels", "Groups", "feature_strides"]


@dataclass(frozen=True, slots=True)
class Groups:
    """Runs of tokens sharing one slot (see the module docstring); int64 tensors of ``[G]`` on x's device.

    ``tokens`` is ``L``, the most tokens of a group (all of them when ``lens`` is None).
    """

    slots: torch.Tensor
    tokens: int
    rows: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    experts: torch.Tensor | None = None

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """slots, experts, rows, lens as contiguous tensors (absent ones stand in as slots: never read)."""
        s = self.slots.contiguous()
        return tuple(s if t is None else t.contiguous() for t in (s, self.experts, self.rows, self.lens))

    def with_slots(self, slots: torch.Tensor) -> Groups:
        """The same runs of tokens under another layout's slots (-1 where a group is not in it)."""
        return dataclasses.replace(self, slots=slots)


def feature_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(per row index, per token of a group, per feature) of x or y: 3-D ``[R, T, f]`` as laid out;
    2-D ``[N, f]`` has token t of a group at row ``rows[g] + t``: both steps are one row."""
    if t.dim() == 3:
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(0), t.stride(1)


def h_strides(h: torch.Tensor, acts: torch.Tensor) -> tuple[int, int]:
    """(per row index, per token of a group) of SHRINK's ``h``, laid out like the activations
    ``acts``' rows: ``[R, T, r]`` as laid out; for 2-D ``[N, f]`` activations ``h`` is ``[N, 1, r]``
    and token t of a group is row ``rows[g] + t``: both steps are ``h.stride(0)`` (the stride of
    its size-1 dimension is arbitrary, and stepping by it would read outside ``h``)."""
    return (h.stride(0), h.stride(1)) if acts.dim() == 3 else (h.stride(0), h.stride(0))


Shrink = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Groups], torch.Tensor]
Expand = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Groups], torch.Tensor]
Add = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Groups], torch.Tensor]


@dataclass(frozen=True)
class GroupedKernels:
    """One backend's SHRINK and EXPAND, and the ops of :mod:`.ops` built from them.

    ``dtypes`` are the ones its kernels take; the callers in :mod:`.ops` checked the
    shapes and that no gradient is needed (the kernels are not differentiable). ``add``, where a
    backend has it, is SHRINK then EXPAND in one call ``add(y, x, a, b, scaling, groups)`` (the CPU
    library: one foreign call instead of two, whose overhead is most of a decode step's).
    """

    name: str
    shrink: Shrink
    expand: Expand
    dtypes: tuple[torch.dtype, ...]
    add: Add | None = None

    def add_grouped(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    scaling: torch.Tensor, groups: Groups) -> torch.Tensor:
        """``y += `` the delta of every live group of ``x``, in place; returns ``y``."""
        if self.add is not None:
            return self.add(y, x, a, b, scaling, groups)
        return self.expand(y, self.shrink(x, a, scaling, groups), b, groups)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                 slots: torch.Tensor, seqs: torch.Tensor | None = None) -> torch.Tensor:
        """ADD_LORA of :mod:`.ops` in place: ``y [B, T, out]`` += the delta of ``x [B, T, in]``.

        One group per sequence of this layout (``seqs [A]``, distinct; None: all ``B``) with its
        slot ``slots [A]``; returns ``y``.
        """
        return self.add_grouped(y, x, a, b, scaling, Groups(slots, x.shape[1], rows=seqs))

    def bgmv(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
             indices: torch.Tensor, experts: torch.Tensor | None = None) -> torch.Tensor:
        """BGMV of :mod:`.ops`: the per-token delta ``[N, out]`` in ``a``'s dtype (slot -1: zeros)."""
        y = torch.zeros((x.shape[0], b.shape[-2]), dtype=a.dtype, device=x.device)
        return self.add_grouped(y, x, a, b, scaling, Groups(indices, 1, experts=experts))

    def sgmv(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
             seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_indices: torch.Tensor,
             max_len: int) -> torch.Tensor:
        """SGMV of :mod:`.ops` over disjoint segments: the delta ``[N, out]`` in ``a``'s dtype.

        Ragged segments: one group per segment, ``max_len`` bounds ``seg_lens``.
        """
        y = torch.zeros((x.shape[0], b.shape[-2]), dtype=a.dtype, device=x.device)
        groups = Groups(seg_indices, max_len, rows=seg_starts, lens=seg_lens)
        return self.add_grouped(y, x, a, b, scaling, groups)
