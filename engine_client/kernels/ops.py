"""Batched multi-LoRA kernels over stacked adapters (one stack per layout).

Shapes (``S`` slots, ``E`` experts, ``N`` tokens, ``G`` segments)::

    x        [N, in]                 activations
    a        [S, r, in]              stacked lora_A   (or [S, E, r, in] for fused experts)
    b        [S, out, r]             stacked lora_B   (or [S, E, out, r])
    scaling  [S]                     float32, one module's column of the slot scaling table
    indices  [N] / seg_indices [G]   int64 slot per token / per segment; -1 = base only

Both ops return the LoRA delta ``[N, out]`` (in ``a``'s dtype; ``x`` is cast to it, as
PEFT does), which the caller adds to the base layer's output. They are plain torch ops,
so they run on CPU and CUDA and are differentiable in ``x``, ``a``, ``b`` and
``scaling`` (the multi-policy trainer backpropagates through them). ``a`` and ``b`` may
be strided views into a device slot pool; they are gathered, never made contiguous.

BGMV (batched gather matrix-vector; decode, one token per sequence)::

    y = zeros(N, out)
    for t in range(N):
        s = indices[t]
        if s < 0:
            continue
        A, B = (a[s], b[s]) if experts is None else (a[s, experts[t]], b[s, experts[t]])
        y[t] = scaling[s] * (B @ (A @ x[t]))

SGMV (segmented gather matrix-vector; prefill, runs of tokens sharing an adapter)::

    y = zeros(N, out)
    for g in range(G):
        s = seg_indices[g]
        if s < 0:
            continue
        for t in range(seg_starts[g], seg_starts[g] + seg_lens[g]):
            y[t] += scaling[s] * (b[s] @ (a[s] @ x[t]))

Tokens outside every segment get zero. BGMV gathers one ``[r, in]`` weight per token, so
it suits few tokens; SGMV gathers one per segment and runs two batched matmuls over the
segments padded to ``max_len`` (pass it when known on the host: no device sync then).
Rows of different layouts in one batch are one call per layout.

ADD_LORA (what a wrapped linear runs: every sequence has ``T`` tokens, prefill or decode)
adds the delta into the base layer's output instead of returning it::

    # y [B, T, out] (the base output), x [B, T, in]; seqs [A] sequences of this layout
    # (None: all B), slots [A] their slots
    for i in range(A):
        q, s = seqs[i], slots[i]
        y[q] += (scaling[s] * (x[q] @ a[s].T)) @ b[s].T

One weight gather per sequence (none when the slots run in an arithmetic progression, as
they do when a batch's adapters were loaded together: a strided view of the pool then), the
activations used in place (a view, no padded copy),
the scaling applied on the ``[A, T, r]`` intermediate, and the second matmul accumulating
into ``y`` (``baddbmm_``): one pass over the ``[B, T, out]`` output instead of five. In
place when autograd does not need the inputs; otherwise the same math out of place, so
the trainer backpropagates through it.

Where no gradient is needed the ops may run the grouped SHRINK/EXPAND kernels of
:mod:`.groups` instead (the same semantics, into the output in place; slots read by
index there, so ``progression`` is not needed), chosen by :func:`fast_kernels`: on a CUDA
device with Triton installed, :mod:`.triton_ops`; on CPU in float32, the C library of
:mod:`.cpu`. Both take all four ops (``linear_lora`` as the base matmul, then SHRINK
and EXPAND into its output).
``MINT_LORA_KERNELS=torch`` keeps every call on the torch ops.
"""

from __future__ import annotations

import functools
import os

import torch

from . import cpu as cpu_kernels
from .groups import GroupedKernels
from .reference import add_lora_reference, bgmv_reference, sgmv_reference

__all__ = [
    "add_lora", "add_lora_reference", "bgmv", "bgmv_reference", "fast_kernels", "linear_lora", "progression_of",
    "segment_lora", "sgmv", "sgmv_reference", "slot_rows",
]


KERNELS_ENV = "MINT_LORA_KERNELS"  # "auto" (default): Triton on CUDA when it imports; "torch": never


@functools.cache
def _triton_kernels() -> GroupedKernels | None:
    try:
        from .triton_ops import KERNELS
    except ImportError:  # no triton (CPU machines): the torch ops
        return None
    return KERNELS


def fast_kernels(x: torch.Tensor, *tensors: torch.Tensor) -> GroupedKernels | None:
    """The grouped SHRINK/EXPAND kernels (:mod:`.groups`) this call takes, or None for the torch ops.

    Taken when no gradient is needed through ``tensors`` (the trainer's autograd takes the torch
    ops), the backend has their dtypes, and ``MINT_LORA_KERNELS`` is not ``torch``: Triton when
    ``x`` is on CUDA and triton imports; the C library on CPU (float32) when it builds. On CPU the C
    loops are also faster than torch's batched matmuls over pool views for a prefill's equal groups
    (one 512 -> 512 module, 8 and 64 sequences of 32 tokens: 1.1x and 1.25x timed right after the
    base matmul, as the hooks run them; 1.6-1.9x in a warm loop, up to 256 sequences; measured).
    """
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in ("auto", "torch"):
        raise ValueError(f"{KERNELS_ENV} must be 'auto' or 'torch', got {choice!r}")
    if choice == "torch" or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None
    if x.is_cuda:
        k = _triton_kernels()
    elif x.device.type == "cpu":
        k = cpu_kernels.kernels()
    else:
        return None
    if k is None or any(t.dtype not in k.dtypes for t in tensors):
        return None
    return k


def scaled(h: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    """``h * scaling`` (broadcast) in float32, rounded once to ``h``'s dtype: a bf16/fp16 ``h``
    times the float32 scalings rounded them first (alpha / r = 16 / 12 became 1.3359, a bias
    of ~0.2% on every delta against PEFT, Triton and the C kernels, which scale in float32)."""
    wide = torch.promote_types(h.dtype, torch.float32)  # (float64 stays float64: gradcheck)
    if h.dtype == wide:
        return h * scaling.to(wide)
    return (h.to(wide) * scaling.to(wide)).to(h.dtype)


def _check(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, experts: bool) -> None:
    dims = 4 if experts else 3
    if x.dim() != 2 or a.dim() != dims or b.dim() != dims:
        raise ValueError(
            f"expected x [N, in], a and b with {dims} dimensions; got x {tuple(x.shape)}, a {tuple(a.shape)}, "
            f"b {tuple(b.shape)}"
        )
    if a.shape[-1] != x.shape[1] or b.shape[-1] != a.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}")
    if scaling.dim() != 1 or scaling.shape[0] != a.shape[0]:
        raise ValueError(f"scaling must be [slots] = [{a.shape[0]}], got {tuple(scaling.shape)}")


def bgmv(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    indices: torch.Tensor,
    *,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token LoRA delta ``[N, out]``; see the module docstring for the reference loop."""
    _check(x, a, b, scaling, experts is not None)
    if indices.shape != (x.shape[0],) or (experts is not None and experts.shape != indices.shape):
        raise ValueError(f"indices (and experts) must be [N] = [{x.shape[0]}]")
    tk = fast_kernels(x, x, a, b, scaling)
    if tk is not None:
        return tk.bgmv(x, a, b, scaling, indices, experts)
    valid = indices >= 0  # [N]
    safe = indices.clamp(min=0)
    if experts is None:
        a_sel, b_sel = a[safe], b[safe]  # [N, r, in], [N, out, r]
    else:  # a skipped token's expert is never read (it may be anything, as its slot's row)
        e = torch.where(valid, experts, experts.new_zeros(()))
        a_sel, b_sel = a[safe, e], b[safe, e]
    h = torch.bmm(a_sel, x.to(a.dtype).unsqueeze(-1))  # [N, r, 1]
    h = scaled(h, scaling[safe].view(-1, 1, 1))  # on the rank dimension
    y = torch.bmm(b_sel, h).squeeze(-1)  # [N, out]
    # where, not a multiply by 0: a token without adapter must get exactly 0, whatever slot 0 holds
    return torch.where(valid.unsqueeze(-1), y, y.new_zeros(()))


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    slots: torch.Tensor,
    seqs: torch.Tensor | None = None,
    *,
    progression: tuple[int, int] | None = None,
    distinct: bool = False,
) -> torch.Tensor:
    """``y [B, T, out]`` plus the LoRA delta of ``x [B, T, in]``; see ADD_LORA in the module docstring.

    ``progression = (first, step)`` (``step >= 0``) tells that ``slots[i] == first + i * step``
    (the caller knows it on the host): the slots' weights are then read through a strided
    view of the pool instead of gathered into a copy. A sequence named twice in ``seqs`` gets
    both deltas, as in the reference loop; the grouped kernels add without atomics, so they
    run only where ``seqs`` is known distinct: ``distinct=True`` says the caller knows it (the
    engine's layouts), else it is checked (on CUDA that check waits for the device).

    Returns ``y`` itself (updated in place) when no gradient is needed, else a new tensor.
    """
    if y.dim() != 3 or x.dim() != 3 or y.shape[:2] != x.shape[:2]:
        raise ValueError(f"expected y [B, T, out] and x [B, T, in]; got y {tuple(y.shape)}, x {tuple(x.shape)}")
    _check(x.new_empty((0, x.shape[2])), a, b, scaling, False)
    if y.shape[2] != b.shape[1]:
        raise ValueError(f"y has {y.shape[2]} outputs, b {tuple(b.shape)} gives {b.shape[1]}")
    n_seq = x.shape[0] if seqs is None else seqs.shape[0]
    if slots.shape != (n_seq,):
        raise ValueError(f"slots must be [{n_seq}] (one per sequence of this layout), got {tuple(slots.shape)}")
    tk = fast_kernels(x, y, x, a, b, scaling)
    if tk is not None and (seqs is None or distinct or _distinct_rows(seqs)):
        return tk.add_lora(y, x, a, b, scaling, slots, seqs)
    xs = x if seqs is None else x.index_select(0, seqs)  # [A, T, in]
    a_s = slot_rows(a, slots, progression)  # [A, r, in]: a view, or the one gather of A
    # A @ x^T, not x @ A^T: the same numbers, and CPU BLAS runs [r, in] x [in, T] faster than
    # [T, in] x [in, r] (a wide output for a tiny one); h is then read transposed, a view
    h = torch.bmm(a_s, xs.to(a.dtype).transpose(1, 2))  # [A, r, T]
    h = scaled(h, slot_rows(scaling, slots, progression).view(-1, 1, 1))  # on the rank dimension
    h = _tokens_major(h)  # [A, T, r]
    bt = slot_rows(b, slots, progression).transpose(1, 2)  # [A, r, out]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (y, x, a, b, scaling))
    if y.dtype != h.dtype:  # as PEFT rounds: the sum in the wider dtype, then the output's
        wide = torch.promote_types(y.dtype, h.dtype)
        d = torch.bmm(h, bt).to(wide)  # [A, T, out]
        z = (y.to(wide) + d if seqs is None else y.to(wide).index_add(0, seqs, d)).to(y.dtype)
        return z if grad else y.copy_(z)
    if seqs is None:
        return y.baddbmm(h, bt) if grad else y.baddbmm_(h, bt)
    d = torch.bmm(h, bt)  # [A, T, out]
    return y.index_add(0, seqs, d) if grad else y.index_add_(0, seqs, d)


def linear_lora(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    slots: torch.Tensor,
    *,
    progression: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``linear(x, w, bias)`` plus the LoRA delta of every sequence of ``x [B, T, in]``: a new ``[B, T, out]``.

    The same numbers as ``add_lora(F.linear(x, w, bias), x, a, b, scaling, slots)`` with the order
    of the two passes swapped: the rank-r delta (plus the bias) is written first, and the base
    matmul accumulates into it (a GEMM with beta = 1, which adds C while its tiles are in cache).
    The output is written once and read once by the GEMM, instead of written by the GEMM and then
    read and rewritten by the delta. Where :func:`fast_kernels` gives kernels (C on CPU, Triton on
    CUDA) the base matmul runs first and they add into its output: on CPU that measured faster than
    this order with torch's batched matmuls. No autograd: the caller takes :func:`add_lora` when
    gradients are needed. ``x``, ``w``, ``a`` and ``b`` share one dtype; ``x`` is contiguous.
    """
    if x.dim() != 3 or w.dim() != 2 or x.shape[2] != w.shape[1]:
        raise ValueError(f"expected x [B, T, in] and w [out, in]; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    _check(x.new_empty((0, x.shape[2])), a, b, scaling, False)
    n_seq, _, d_in = x.shape
    d_out = w.shape[0]
    if b.shape[1] != d_out or slots.shape != (n_seq,):
        raise ValueError(f"b {tuple(b.shape)} and slots {tuple(slots.shape)} do not fit w {tuple(w.shape)}, "
                         f"{n_seq} sequences")
    tk = fast_kernels(x, x, w, a, b, scaling)
    if tk is not None:  # the base GEMM, then SHRINK and EXPAND into its output
        return tk.add_lora(torch.nn.functional.linear(x, w, bias), x, a, b, scaling, slots)
    a_s = slot_rows(a, slots, progression)  # [B, r, in]
    h = torch.bmm(a_s, x.transpose(1, 2))  # [B, r, T]; A @ x^T, as in add_lora
    h = scaled(h, slot_rows(scaling, slots, progression).view(-1, 1, 1))
    bt = slot_rows(b, slots, progression).transpose(1, 2)  # [B, r, out]
    ht = _tokens_major(h)
    y = torch.bmm(ht, bt) if bias is None else torch.baddbmm(bias.view(1, 1, d_out), ht, bt)  # [B, T, out]
    y.view(-1, d_out).addmm_(x.view(-1, d_in), w.t())
    return y


def _tokens_major(h: torch.Tensor) -> torch.Tensor:
    """``h [A, r, T]`` as ``[A, T, r]`` in the layout CPU BLAS multiplies fastest (measured, r = 8):
    one token, a view with plain strides (the transpose's (r, 1, 1) strides take a ~4x slower
    path); a few tokens, a copy (tiny: A x T x r); longer runs, the transposed view."""
    n, r, t = h.shape
    if t == 1:
        return h.view(n, 1, r)
    return h.transpose(1, 2).contiguous() if t < 8 else h.transpose(1, 2)


def slot_rows(t: torch.Tensor, slots: torch.Tensor, progression: tuple[int, int] | None) -> torch.Tensor:
    """``t[slots]``: a view when the slots are an arithmetic ``progression`` (first, step), else a gather."""
    if progression is None:
        return t.index_select(0, slots)
    first, step = progression
    n = slots.shape[0]
    if step == 0:  # one slot for every sequence: a stride-0 batch dimension
        return t[first].unsqueeze(0).expand(n, *t.shape[1:])
    if step < 0 or first < 0 or first + (n - 1) * step >= t.shape[0]:
        raise ValueError(f"progression {progression} of {n} slots does not fit {t.shape[0]} slots")
    return t[first : first + (n - 1) * step + 1 : step]


def progression_of(slots: list[int]) -> tuple[int, int] | None:
    """``(first, step)`` when ``slots`` (host ints, all >= 0) is an arithmetic progression with
    ``step >= 0``, else None: what :func:`add_lora` reads as views instead of gathering."""
    if not slots:
        return None
    first = slots[0]
    step = slots[1] - first if len(slots) > 1 else 1
    if step < 0 or any(s != first + i * step for i, s in enumerate(slots)):
        return None
    return first, step


def sgmv(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_indices: torch.Tensor,
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    """Per-segment LoRA delta ``[N, out]``; see the module docstring for the reference loop.

    ``max_len`` bounds ``seg_lens`` (computed with a device sync when omitted).
    """
    _check(x, a, b, scaling, False)
    g = seg_indices.shape[0]
    if seg_starts.shape != (g,) or seg_lens.shape != (g,):
        raise ValueError("seg_starts, seg_lens and seg_indices must all be [G]")
    n, out = x.shape[0], b.shape[-2]
    if max_len is None:
        max_len = int(seg_lens.max()) if g else 0
    if g == 0 or max_len == 0:
        return x.new_zeros((n, out), dtype=a.dtype)
    tk = fast_kernels(x, x, a, b, scaling)
    if tk is not None and _disjoint(seg_starts, seg_lens, seg_indices):  # (the kernels add without atomics)
        return tk.sgmv(x, a, b, scaling, seg_starts, seg_lens, seg_indices, max_len)
    pos = torch.arange(max_len, device=x.device)  # [L]
    live = (pos < seg_lens.unsqueeze(1)) & (seg_indices >= 0).unsqueeze(1)  # [G, L]
    tok = torch.where(live, seg_starts.unsqueeze(1) + pos, 0)  # [G, L]
    xg = torch.where(live.unsqueeze(-1), x.to(a.dtype)[tok], 0.0)  # [G, L, in]
    safe = seg_indices.clamp(min=0)
    h = torch.bmm(xg, a[safe].transpose(1, 2))  # [G, L, r]
    yg = torch.bmm(h, b[safe].transpose(1, 2))  # [G, L, out]
    yg = scaled(yg, scaling[safe].view(g, 1, 1))
    yg = torch.where(live.unsqueeze(-1), yg, yg.new_zeros(()))
    return yg.new_zeros((n, out)).index_add(0, tok.reshape(-1), yg.reshape(-1, out))


def _distinct_rows(seqs: torch.Tensor) -> bool:
    """Whether no sequence is named twice (the grouped kernels' condition for ADD_LORA)."""
    return seqs.numel() < 2 or bool((torch.sort(seqs).values.diff() != 0).all())


def _disjoint(starts: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether the live segments (a slot, some rows) cover no row twice: the grouped kernels'
    condition (overlapping segments sum on the torch ops)."""
    live = (slots >= 0) & (lens > 0)
    s, ln = starts[live], lens[live]
    order = torch.argsort(s)
    s, e = s[order], (s + ln)[order]
    return bool((e[:-1] <= s[1:]).all())


def segment_lora(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    seg_lens: list[int],
    seg_slots: list[int],
    seg_experts: list[int] | None = None,
    *,
    chunk: int = 32,
) -> torch.Tensor:
    """LoRA delta ``[N, out]`` of rows grouped in runs that share a slot (and expert).

    Row ``t`` of segment ``g`` (segments back to back from row 0, lengths ``seg_lens``
    summing to N; host lists, as the caller sorted the rows) gets
    ``scaling[s] * (b[s, e] @ (a[s, e] @ x[t]))`` with ``s, e = seg_slots[g], seg_experts[g]``
    (``a [S, E, r, in]``; without experts ``a [S, r, in]`` and no ``e``); slot -1 gives 0.
    Segments are cut into chunks (of the mean segment length, at most ``chunk`` rows) and the
    chunks run as two batched matmuls: one weight gather per chunk (not per row, as BGMV),
    padding under one chunk per segment, and the rows come back in order by one mask select,
    no scatter.
    """
    _check(x, a, b, scaling, seg_experts is not None)
    n, out = x.shape[0], b.shape[-2]
    if sum(seg_lens) != n or len(seg_slots) != len(seg_lens) or (
            seg_experts is not None and len(seg_experts) != len(seg_lens)):
        raise ValueError(f"segments must cover the {n} rows once: lengths {len(seg_lens)}, slots {len(seg_slots)}")
    live_segs = [g for g, (ln, s) in enumerate(zip(seg_lens, seg_slots, strict=True)) if ln and s >= 0]
    if not live_segs:
        return x.new_zeros((n, out), dtype=a.dtype)
    # chunks of the mean live segment length (at most ``chunk``): padding stays under one chunk per
    # segment, so at most as many padded rows as real ones, and at most twice as many gathers as segments
    c = max(1, min(chunk, -(-sum(seg_lens[g] for g in live_segs) // len(live_segs))))
    starts = [0] * len(seg_lens)
    for g in range(1, len(seg_lens)):
        starts[g] = starts[g - 1] + seg_lens[g - 1]
    ch_start, ch_len, ch_seg = [], [], []  # host bookkeeping: one entry per chunk
    for g in live_segs:
        for off in range(0, seg_lens[g], c):
            ch_start.append(starts[g] + off)
            ch_len.append(min(c, seg_lens[g] - off))
            ch_seg.append(g)
    dev = x.device
    pos = torch.arange(c, device=dev)
    rows = torch.tensor(ch_start, device=dev).unsqueeze(1) + pos  # [K, C]
    live = pos < torch.tensor(ch_len, device=dev).unsqueeze(1)  # [K, C]
    xg = x.to(a.dtype)[torch.where(live, rows, 0)]  # [K, C, in]: padded rows repeat row 0, masked below
    slots = torch.tensor([seg_slots[g] for g in ch_seg], device=dev)
    if seg_experts is None:
        a_c, b_c = a.index_select(0, slots), b.index_select(0, slots)  # [K, r, in], [K, out, r]
    else:
        experts = torch.tensor([seg_experts[g] for g in ch_seg], device=dev)
        a_c, b_c = a[slots, experts], b[slots, experts]
    h = torch.bmm(a_c, xg.transpose(1, 2))  # [K, r, C]
    h = scaled(h, scaling.index_select(0, slots).view(-1, 1, 1))
    yg = torch.bmm(h.transpose(1, 2), b_c.transpose(1, 2))  # [K, C, out]
    d = yg.reshape(-1, out)[live.reshape(-1)]  # the live rows of the chunks, in row order
    if len(live_segs) == len(seg_lens):
        return d
    keep = torch.tensor([t for g in live_segs for t in range(starts[g], starts[g] + seg_lens[g])], device=dev)
    return d.new_zeros((n, out)).index_copy(0, keep, d)

