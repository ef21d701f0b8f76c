"""Triton kernels of the batched multi-LoRA ops, for CUDA: Punica's SHRINK and EXPAND.

:mod:`.ops` calls these when the activations are on a CUDA device, Triton imports and no
gradient is needed; everything else (CPU, the trainer's autograd, ``MINT_LORA_KERNELS=torch``)
runs the torch ops there. The tests run these kernels on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``) against the reference loops, and on a CUDA device where one is lent.

The work is cut into the *groups* of :mod:`.groups` (runs of tokens sharing one slot,
and expert), whose module docstring gives SHRINK and EXPAND as loops; a block of a group's
tokens reads one weight tile.

Products accumulate in fp32 whatever the dtype (fp32, fp16, bf16; fp32 products in IEEE
precision, not TF32); ``h`` is kept in fp32 and rounded to the weights' dtype for the second
product, as the torch path rounds its intermediate. ``a`` and ``b`` may be strided views of a
slot pool: their strides are passed to the kernels, the pool is never copied. Groups must not
overlap in ``y`` (the layouts of a batch and the segments of a call are disjoint): EXPAND
adds without atomics.

Groups of one token (decode, BGMV) take a broadcast-and-sum path (``tl.dot`` wants 16 rows);
longer groups take ``tl.dot`` on blocks of 16-64 tokens. Block sizes are fixed guesses: GPU
speed has not been measured (no device was lent when this was written).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .groups import GroupedKernels, Groups, feature_strides, h_strides

__all__ = ["KERNELS", "Groups", "add_lora", "bgmv", "expand", "sgmv", "shrink"]

BLOCK_K = 64  # input features per step of SHRINK
BLOCK_N = 64  # output features per program of EXPAND
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# decorated under TRITON_INTERPRET=1 (the CPU tests): the interpreter's tl.dot multiplies bf16 as
# its raw 16-bit integers (Triton 3.9), so dots there take fp32 operands: the same numbers (a
# product of two bf16 is exact in fp32, and the sum is fp32 either way); on a GPU, native dots
INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _group(g, slot_ptr, expert_ptr, row_ptr, len_ptr, n_tokens, w_ptr, sw_s, sw_e,
           HAS_EXPERTS: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_LENS: tl.constexpr):
    """Group g's slot, length, row and weight block (a[s, e] or b[s, e]); the caller returns early
    on slot -1 or past the length (a jit helper cannot end its caller)."""
    s = tl.load(slot_ptr + g).to(tl.int64)
    length = tl.load(len_ptr + g) if HAS_LENS else n_tokens  # constexpr conditions: resolved at compile time
    row = tl.load(row_ptr + g).to(tl.int64) if HAS_ROWS else g
    w_base = w_ptr + s * sw_s
    if HAS_EXPERTS:
        w_base += tl.load(expert_ptr + g).to(tl.int64) * sw_e
    return s, length, row, w_base


@triton.jit
def _product(u, v, USE_DOT: tl.constexpr, WIDE_DOT: tl.constexpr):
    """``u @ v`` in fp32: tl.dot on blocks of 16+ tokens (fp32 operands under the interpreter),
    a broadcast-and-sum for one token."""
    if USE_DOT and WIDE_DOT:
        return tl.dot(u.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    elif USE_DOT:
        return tl.dot(u, v, input_precision="ieee")
    else:
        return tl.sum(u.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, scaling_ptr, h_ptr, slot_ptr, expert_ptr, row_ptr, len_ptr,
    n_tokens, d_in, rank,
    sx_g, sx_t, sx_k,  # x: per row index, per token of a group, per input feature
    sa_s, sa_e, sa_r, sa_k,  # a: per slot, expert, rank, input feature
    s_scaling, sh_g, sh_t,  # h [rows of x, T or 1, BLOCK_R], laid out like x: rank stride 1
    HAS_EXPERTS: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_LENS: tl.constexpr, USE_DOT: tl.constexpr,
    WIDE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    m0 = tl.program_id(1) * BLOCK_M
    s, length, row, a_base = _group(g, slot_ptr, expert_ptr, row_ptr, len_ptr, n_tokens, a_ptr, sa_s, sa_e,
                                    HAS_EXPERTS, HAS_ROWS, HAS_LENS)
    if s < 0 or m0 >= length:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)  # tokens of the group
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    live_m = offs_m < length
    x_rows = x_ptr + row * sx_g + offs_m[:, None] * sx_t  # [M, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        kk = k0 + offs_k
        xt = tl.load(x_rows + kk[None, :] * sx_k, mask=live_m[:, None] & (kk[None, :] < d_in), other=0.0)  # [M, K]
        at = tl.load(a_base + offs_r[None, :] * sa_r + kk[:, None] * sa_k,
                     mask=(offs_r[None, :] < rank) & (kk[:, None] < d_in), other=0.0)  # [K, R]
        acc += _product(xt.to(at.dtype), at, USE_DOT, WIDE_DOT)  # x in the weights' dtype, as PEFT casts it
    acc *= tl.load(scaling_ptr + s * s_scaling).to(tl.float32)  # on the rank dimension: r columns, not out
    tl.store(h_ptr + row * sh_g + offs_m[:, None] * sh_t + offs_r[None, :], acc, mask=live_m[:, None])


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, y_ptr, slot_ptr, expert_ptr, row_ptr, len_ptr,
    n_tokens, d_out, rank,
    sh_g, sh_t,
    sb_s, sb_e, sb_n, sb_r,  # b: per slot, expert, output feature, rank
    sy_g, sy_t, sy_n,  # y: per row index, per token of a group, per output feature
    HAS_EXPERTS: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_LENS: tl.constexpr, USE_DOT: tl.constexpr,
    WIDE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    m0 = tl.program_id(1) * BLOCK_M
    n0 = tl.program_id(2) * BLOCK_N
    s, length, row, b_base = _group(g, slot_ptr, expert_ptr, row_ptr, len_ptr, n_tokens, b_ptr, sb_s, sb_e,
                                    HAS_EXPERTS, HAS_ROWS, HAS_LENS)
    if s < 0 or m0 >= length:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    live_m = offs_m < length
    live_n = offs_n < d_out
    ht = tl.load(h_ptr + row * sh_g + offs_m[:, None] * sh_t + offs_r[None, :], mask=live_m[:, None], other=0.0)
    bt = tl.load(b_base + offs_r[:, None] * sb_r + offs_n[None, :] * sb_n,
                 mask=(offs_r[:, None] < rank) & live_n[None, :], other=0.0)  # [R, N]
    # the intermediate rounded to the weights' dtype, as the torch path has it
    acc = _product(ht.to(bt.dtype), bt, USE_DOT, WIDE_DOT)  # [M, N] fp32
    y_tile = y_ptr + row * sy_g + offs_m[:, None] * sy_t + offs_n[None, :] * sy_n
    mask = live_m[:, None] & live_n[None, :]
    yt = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (yt.to(tl.float32) + acc).to(yt.dtype), mask=mask)


def _flags(groups: Groups) -> dict[str, bool]:
    return {"HAS_EXPERTS": groups.experts is not None, "HAS_ROWS": groups.rows is not None,
            "HAS_LENS": groups.lens is not None, "USE_DOT": groups.tokens > 1, "WIDE_DOT": INTERPRETED}


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the tensors' (cuda:1 while cuda:0 is current)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _block_m(tokens: int) -> int:
    return 1 if tokens <= 1 else min(64, max(16, triton.next_power_of_2(tokens)))


def _block_r(rank: int, tokens: int) -> int:
    p = triton.next_power_of_2(rank)
    return p if tokens <= 1 else max(16, p)  # tl.dot wants 16 at least


def shrink(x: torch.Tensor, a: torch.Tensor, scaling: torch.Tensor, groups: Groups) -> torch.Tensor:
    """SHRINK of :mod:`.groups`: ``h`` float32 laid out like x's rows (``[R, T, BR]`` or
    ``[N, 1, BR]``, ``BR`` the rank padded to a power of two), ``scaling`` applied.

    Rows no live group covers, and the pad columns, are left unwritten.
    """
    n_groups, d_in, rank = groups.slots.shape[0], a.shape[-1], a.shape[-2]
    bm, br = _block_m(groups.tokens), _block_r(rank, groups.tokens)
    h = torch.empty((x.shape[0], x.shape[1] if x.dim() == 3 else 1, br), dtype=torch.float32, device=x.device)
    if n_groups == 0 or groups.tokens == 0:
        return h
    sa_e = a.stride(1) if groups.experts is not None else 0
    grid = (n_groups, triton.cdiv(groups.tokens, bm))
    with _on(x.device):
        _shrink_kernel[grid](
            x, a, scaling, h, *groups.pointers(),
            groups.tokens, d_in, rank, *feature_strides(x),
            a.stride(0), sa_e, a.stride(-2), a.stride(-1),
            scaling.stride(0), *h_strides(h, x),
            **_flags(groups), BLOCK_M=bm, BLOCK_R=br, BLOCK_K=BLOCK_K,
        )
    return h


def expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """EXPAND of the module docstring: ``y += b[s] @ h`` in place for every live group; returns ``y``."""
    n_groups, d_out, rank = groups.slots.shape[0], b.shape[-2], b.shape[-1]
    if n_groups == 0 or groups.tokens == 0:
        return y
    bm = _block_m(groups.tokens)
    sb_e = b.stride(1) if groups.experts is not None else 0
    grid = (n_groups, triton.cdiv(groups.tokens, bm), triton.cdiv(d_out, BLOCK_N))
    with _on(y.device):
        _expand_kernel[grid](
            h, b, y, *groups.pointers(),
            groups.tokens, d_out, rank, *h_strides(h, y),
            b.stride(0), sb_e, b.stride(-2), b.stride(-1), *feature_strides(y),
            **_flags(groups), BLOCK_M=bm, BLOCK_R=h.shape[2], BLOCK_N=BLOCK_N,
        )
    return y


KERNELS = GroupedKernels("triton", shrink, expand, DTYPES)
add_lora, bgmv, sgmv = KERNELS.add_lora, KERNELS.bgmv, KERNELS.sgmv
