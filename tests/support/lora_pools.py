"""Adapter stacks laid out like a device slot pool's rows, and the float64 comparison, for the
Triton kernel tests (tests/engine/test_triton_kernels.py and its interpreted cases)."""

from __future__ import annotations

import torch

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative to the largest |value| of the float64 truth
N_IN, N_OUT = 70, 72  # a full block and a tail of BLOCK_K = BLOCK_N = 64


def pool(slots: int, rank: int, dtype: torch.dtype, g: torch.Generator, experts: int | None = None,
         device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a, b, scaling as strided views of bigger buffers, like a device slot pool's rows: ``a`` every
    other slot of padded rows, ``b`` transposed (``[S, out, r]`` read from ``[S, r, out]``),
    ``scaling`` a column of a table."""
    lead = (2 * slots,) if experts is None else (2 * slots, experts)
    a_buf = (torch.randn(*lead, rank, N_IN + 6, generator=g) / N_IN**0.5).to(dtype).to(device)
    b_buf = (torch.randn(*lead, rank, N_OUT, generator=g) / rank**0.5).to(dtype).to(device)
    table = (torch.rand(slots, 3, generator=g) * 2 + 0.1).to(device)
    a, b, scaling = a_buf[::2, ..., :N_IN], b_buf.transpose(-1, -2)[slots:], table[:, 1]  # views, on the device
    assert not a.is_contiguous() and b.stride(-2) == 1 and not scaling.is_contiguous()
    return a, b, scaling


def close(got: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    scale = max(truth.abs().max().item(), 1e-3)
    torch.testing.assert_close(got.cpu().double(), truth, rtol=0, atol=TOL[dtype] * scale)


def f64(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.cpu().double() for t in ts]
