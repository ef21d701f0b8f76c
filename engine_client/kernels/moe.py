"""The routed-pair bookkeeping and the padded per-(expert, sequence) LoRA of fused experts.

A fused-experts forward sees ``N`` tokens of ``B`` sequences (``T = N // B`` each, batch-major)
and ``top_k_index [N, k]``: ``P = N * k`` (token, expert) pairs. :func:`route` sorts them once
per forward by (expert, sequence) -- the base matmuls run per expert on the compact rows --
and, for one layout of ``A`` active sequences, plans the padded blocks its LoRA runs on::

    # cnt[e, q]: pairs of sequence q routed to expert e;  cap[e] = max over active q of cnt[e, q]
    # block of expert e: rows off[e] : off[e] + A * cap[e] of the padded buffer, seen as [A, cap[e], in]
    # the j-th pair of (expert e, active sequence i) sits at padded row off[e] + i * cap[e] + j
    # pairs of a sequence outside the layout sit at the dump row (the last one), whose delta is 0

ADD_EXPERT_LORA (:func:`add_expert_lora`; ``y [P, out]`` the base output of the sorted pairs,
``x [P, in]`` their inputs, ``a [S, E, r, in]``, ``b [S, E, out, r]``, ``slots [A]``)::

    for e in range(E):
        for i in range(A):
            s = slots[i]
            for each pair p of (e, active sequence i):
                y[p] += (scaling[s] * (a[s, e] @ x[p])) @ b[s, e].T

Per expert it is two batched matmuls over the ``A`` sequences: ``a[:, e]`` is a ``[S, r, in]``
view of the pool, so when the slots run in an arithmetic progression (``LayoutBatch.progression``)
every weight is read in place, once, and never copied (else one gather per sequence and expert,
:func:`~.ops.slot_rows`); the scaling is applied on the ``[A, r, cap]`` intermediate; the
deltas land in one padded buffer and come back to ``y`` by one gather and one in-place add.
Padding costs at most ``A * cap[e] - cnt[e]`` rows of the rank-r matmuls (decode: ``cap = 1``;
the inputs of the up projection are then the hidden states themselves, a view, no copy). The
padded buffers live in a per-thread workspace reused by every layer of a forward (fresh
allocations per layer cost page faults above the copies themselves) and dropped when the
batch ends (:func:`release_workspace`). No autograd: the caller takes the differentiable
segment path when gradients are needed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .groups import Groups
from .ops import _tokens_major, scaled, slot_rows

__all__ = ["Pad", "Routing", "add_expert_lora", "add_expert_lora_reference", "gather_rows", "release_workspace",
           "route"]


@dataclass(slots=True)
class Pad:
    """One layout's padded blocks (see the module docstring)."""

    caps: list[int]  # [E] cap[e] (host)
    offs: list[int]  # [E] off[e] (host)
    at: torch.Tensor  # [P] padded row of each sorted pair (n_rows: the dump row)
    n_rows: int  # Σ A * cap[e]
    n_active: int  # A
    direct: bool  # decode with every sequence active: the up projection's padded input is the hidden states


@dataclass(slots=True)
class Routing:
    """The routed pairs of one forward, sorted by (expert, sequence)."""

    perm: torch.Tensor  # [P] flat pair id (token * k + j) of each sorted pair
    tok: torch.Tensor  # [P] its token
    seq: torch.Tensor  # [P] its sequence
    experts: torch.Tensor  # [P] its expert
    counts: list[int]  # [E] pairs per expert (host); pairs routed to ids >= E are dropped
    pad: Pad | None
    groups: Groups | None = None  # one per (expert, sequence), e-major: the sorted order (slots unset)
    group_seq: torch.Tensor | None = None  # [E*B] the sequence of each group


def route(top_k_index: torch.Tensor, n_exp: int, per: int, layout: tuple[torch.Tensor, int] | None = None, *,
          groups: bool = False) -> Routing:
    """Sort the pairs of ``top_k_index [N, k]`` by (expert, sequence); ``per`` tokens per sequence.

    ``layout = (active_of_seq [B], A)``: the index of each sequence among the layout's ``A``
    active ones (-1: not in it), to plan that layout's padded blocks; None plans none.
    ``groups``: the runs of the sorted pairs, one per (expert, sequence), empty ones included,
    for the grouped kernels (:meth:`.groups.GroupedKernels.add_grouped`; a layout's
    slots come from ``seq_slots[group_seq]``). One host sync (the counts, caps, longest run).
    """
    if groups and layout is not None:
        raise ValueError("route plans either a layout's padded blocks or the grouped runs, not both")
    n_tok, k = top_k_index.shape
    n_seq = n_tok // per
    dev = top_k_index.device
    pair_seq = torch.arange(n_tok * k, device=dev) // k // per  # [N*k]
    ex = top_k_index.reshape(-1).clamp(max=n_exp)  # ids >= E (another rank's experts) sort last
    keys, perm = torch.sort(ex * n_seq + pair_seq, stable=True)
    cnt = torch.bincount(keys, minlength=(n_exp + 1) * n_seq)[: n_exp * n_seq].view(n_exp, n_seq)  # [E, B]
    if layout is None:
        longest = cnt.amax().view(1) if cnt.numel() else cnt.new_zeros(1)
        host = torch.cat([cnt.sum(1), longest]).tolist() if groups else cnt.sum(1).tolist()
        counts, caps = host[:n_exp], []
    else:
        cap = (cnt * (layout[0] >= 0)).amax(1)  # [E]
        host = torch.cat([cnt.sum(1), cap]).tolist()  # the one sync
        counts, caps = host[:n_exp], host[n_exp:]
    n_pairs = sum(counts)
    perm, keys = perm[:n_pairs], keys[:n_pairs]
    experts, seq = keys // n_seq, keys % n_seq
    r = Routing(perm, perm // k, seq, experts, counts, None)
    if groups:
        lens = cnt.reshape(-1)  # [E*B], e-major as the pairs are sorted
        r.group_seq = torch.arange(n_exp * n_seq, device=dev) % n_seq
        r.groups = Groups(r.group_seq, int(host[-1]), rows=torch.cumsum(lens, 0) - lens, lens=lens,
                          experts=torch.arange(n_exp * n_seq, device=dev) // n_seq)
    if layout is not None:
        r.pad = _plan(r, keys, cnt, caps, *layout, per)
    return r


def _plan(r: Routing, keys: torch.Tensor, cnt: torch.Tensor, caps: list[int], active_of_seq: torch.Tensor,
          n_active: int, per: int) -> Pad:
    dev = keys.device
    offs = [0] * len(caps)
    for e in range(1, len(caps)):
        offs[e] = offs[e - 1] + n_active * caps[e - 1]
    n_rows = offs[-1] + n_active * caps[-1] if caps else 0
    flat = cnt.reshape(-1)
    start = torch.cumsum(flat, 0) - flat  # [E*B] first sorted row of each (expert, sequence)
    pos = torch.arange(keys.shape[0], device=dev) - start[keys]  # [P] rank of the pair in its group
    a_idx = active_of_seq[r.seq]  # [P]
    e_off = torch.tensor(offs, device=dev)[r.experts]
    e_cap = torch.tensor(caps, device=dev)[r.experts]
    at = torch.where(a_idx >= 0, e_off + a_idx * e_cap + pos, n_rows)
    direct = per == 1 and n_active == active_of_seq.shape[0] and all(c == 1 for c in caps if c)
    return Pad(caps, offs, at, n_rows, n_active, direct)


def add_expert_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    slots: torch.Tensor,
    pad: Pad,
    *,
    progression: tuple[int, int] | None = None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [P, out] += `` the LoRA delta of the sorted pairs' inputs ``x [P, in]``, in place.

    See ADD_EXPERT_LORA in the module docstring; ``slots [A]`` are the layout's active slots
    (``progression``: they are ``first + i * step``, read as views). ``hidden [B, in]``, with
    ``pad.direct``: the hidden states, used as every expert's padded input (decode).
    """
    n_out = b.shape[-2]
    if pad.direct and hidden is not None:
        xs = [hidden.view(pad.n_active, 1, hidden.shape[-1])] * len(pad.caps)
    else:
        xp = _scratch(0, (pad.n_rows + 1, x.shape[1]), x)  # padding rows stay unset: their outputs are never read
        xp.index_copy_(0, pad.at, x)  # the dump row takes what it gets: its delta is zeroed below
        xs = [xp[o : o + pad.n_active * c].view(pad.n_active, c, x.shape[1]) for o, c in zip(pad.offs, pad.caps,
                                                                                           strict=True)]
    d = _scratch(1, (pad.n_rows + 1, n_out), y)
    d[pad.n_rows].zero_()
    sc = slot_rows(scaling, slots, progression).view(-1, 1, 1)  # [A, 1, 1], float32
    for e, (o, c) in enumerate(zip(pad.offs, pad.caps, strict=True)):
        if not c:
            continue
        a_e = slot_rows(a[:, e], slots, progression)  # [A, r, in]: a view of the pool (or one gather)
        h = scaled(torch.bmm(a_e, xs[e].transpose(1, 2)), sc)  # [A, r, C], scaled on the rank dimension
        b_e = slot_rows(b[:, e], slots, progression).transpose(1, 2)  # [A, r, out]
        torch.bmm(_tokens_major(h), b_e, out=d[o : o + pad.n_active * c].view(pad.n_active, c, n_out))
    return y.add_(torch.index_select(d, 0, pad.at, out=_scratch(2, (y.shape[0], y.shape[1]), y)))


_WORKSPACE = threading.local()  # per thread (forwards may run on several): buffers reused across calls


def _scratch(key: int, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """A ``shape`` tensor from this thread's workspace buffer ``key`` (grown on demand, never shrunk).

    The padded buffers are the size of the batch's activations; allocating them afresh every
    layer costs the allocator fresh pages (page faults, the kernel zeroing them), measured
    above the copies into them. One forward uses them one layer after another.
    """
    bufs: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = _WORKSPACE.__dict__.setdefault("bufs", {})
    n = shape[0] * shape[1]
    buf = bufs.get((key, like.device, like.dtype))
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # usable in and out of inference mode
            buf = bufs[(key, like.device, like.dtype)] = torch.empty(n, dtype=like.dtype, device=like.device)
    return buf[:n].view(shape)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` into this thread's workspace (the sorted pairs' inputs: read only inside the forward)."""
    return torch.index_select(x, 0, index, out=_scratch(3, (index.shape[0], x.shape[1]), x))


def release_workspace() -> None:
    """Drop this thread's buffers (the engine calls it when a batch ends: they are reused across
    the layers of one forward, not kept between batches)."""
    _WORKSPACE.__dict__.pop("bufs", None)


def add_expert_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    pair_slots: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """The loop ADD_EXPERT_LORA computes, pair by pair (``pair_slots [P]``: -1 = no adapter)."""
    y = y.clone()
    for p in range(x.shape[0]):
        s, e = int(pair_slots[p]), int(experts[p])
        if s >= 0:
            h = (scaling[s].double() * (a[s, e] @ x[p].to(a.dtype)).double()).to(a.dtype)  # the exact scaling
            y[p] += (h @ b[s, e].T).to(y.dtype)
    return y
