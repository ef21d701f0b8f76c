"""The reference loops of :mod:`.ops`, verbatim: the tests' ground truth.

Each is the pseudo-code of the kernels' docstring run as written, one token (or sequence) at a
time, with the scaling applied exactly (in float64, rounded once to the adapter's dtype, as
PEFT's multiply by a Python float does). Slow on purpose: nothing here is batched, gathered
or fused, so a kernel that agrees with these is right by construction, not by shared code.
"""

from __future__ import annotations

import torch

__all__ = ["add_lora_reference", "bgmv_reference", "sgmv_reference"]



def bgmv_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    indices: torch.Tensor,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    y = torch.zeros(x.shape[0], b.shape[-2], dtype=a.dtype)
    for t in range(x.shape[0]):
        s = int(indices[t])
        if s < 0:
            continue
        e = None if experts is None else int(experts[t])
        A, B = (a[s], b[s]) if e is None else (a[s, e], b[s, e])
        y[t] = (scaling[s].double() * (B @ (A @ x[t].to(a.dtype))).double()).to(a.dtype)  # the exact scaling
    return y


def sgmv_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_indices: torch.Tensor,
) -> torch.Tensor:
    y = torch.zeros(x.shape[0], b.shape[-2], dtype=a.dtype)
    for g in range(seg_indices.shape[0]):
        s = int(seg_indices[g])
        if s < 0:
            continue
        for t in range(int(seg_starts[g]), int(seg_starts[g]) + int(seg_lens[g])):
            y[t] += (scaling[s].double() * (b[s] @ (a[s] @ x[t].to(a.dtype))).double()).to(a.dtype)
    return y


def add_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    slots: torch.Tensor,
    seqs: torch.Tensor | None = None,
) -> torch.Tensor:
    y = y.clone()
    for i in range(slots.shape[0]):
        q = i if seqs is None else int(seqs[i])
        s = int(slots[i])
        h = (scaling[s].double() * (x[q].to(a.dtype) @ a[s].T).double()).to(a.dtype)  # the exact scaling
        y[q] += (h @ b[s].T).to(y.dtype)
    return y
