"""Cases of tests/engine/test_triton_kernels.py run under Triton's interpreter, in a subprocess.

``TRITON_INTERPRET=1`` must be set before triton is imported (its own library functions are
decorated then), so test_triton_kernels.py runs this file in a fresh interpreter with it set;
without it, collected on its own, this file skips. Not named ``test_*``: the suite collects it
only through that subprocess. Small cases on purpose (the interpreter runs each program in numpy).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_triton_kernels.py under TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from engine_client.kernels import ops as kernels
from engine_client.kernels import triton_ops as tk
from tests.support.lora_pools import N_IN, N_OUT, close, f64, pool

F32, BF16 = torch.float32, torch.bfloat16
DTYPES = [F32, BF16]


def test_the_module_was_decorated_for_the_interpreter() -> None:
    assert tk.INTERPRETED


# every rank in both dtypes, decode (1 token: the broadcast-and-sum path) and prefill (tl.dot) in both
@pytest.mark.parametrize(("dtype", "rank", "tokens"), [
    (F32, 1, 1), (F32, 8, 5), (F32, 16, 1), (BF16, 1, 5), (BF16, 8, 1), (BF16, 16, 5)])
def test_add_lora_adds_each_sequence_delta_in_place(dtype: torch.dtype, rank: int,
                                                     tokens: int) -> None:
    g = torch.Generator().manual_seed(rank * 10 + tokens)
    a, b, scaling = pool(6, rank, dtype, g)
    x = torch.randn(4, tokens, N_IN, generator=g).to(dtype)
    y0 = torch.randn(4, tokens, N_OUT, generator=g).to(dtype)
    slots, seqs = torch.tensor([5, 0, 3]), torch.tensor([3, 0, 2])  # sequence 1 is another layout's
    y = y0.clone()
    out = tk.add_lora(y, x, a, b, scaling, slots, seqs)
    assert out is y  # in place, into the base output
    close(y, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots, seqs), dtype)
    assert torch.equal(y[1], y0[1])  # a sequence outside the layout is not touched at all
    if rank != 8:
        return  # (the interpreter is slow: the rest once per dtype)
    y = y0.clone()
    every = torch.tensor([1, 5, 0, 1])
    tk.add_lora(y, x, a, b, scaling, every)  # seqs None: every sequence, a slot shared by two
    close(y, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), every), dtype)


def test_add_lora_casts_x_to_the_weights_dtype_and_sums_in_the_outputs() -> None:
    g = torch.Generator().manual_seed(7)
    a, b, scaling = pool(3, 8, torch.bfloat16, g)
    x = torch.randn(2, 3, N_IN, generator=g)  # float32 activations, bf16 adapters, float32 output
    y0 = torch.randn(2, 3, N_OUT, generator=g)
    slots = torch.tensor([2, 1])
    y = tk.add_lora(y0.clone(), x, a, b, scaling, slots)
    truth = kernels.add_lora_reference(y0.double(), x.to(torch.bfloat16).double(), *f64(a, b, scaling), slots)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), truth, rtol=0, atol=2e-2 * truth.abs().max().item())


@pytest.mark.parametrize(("dtype", "rank"), [(F32, 1), (BF16, 8), (F32, 16)])
def test_bgmv_per_token_with_skipped_tokens(dtype: torch.dtype, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    a, b, scaling = pool(5, rank, dtype, g)
    x = torch.randn(7, N_IN, generator=g).to(dtype)
    idx = torch.tensor([-1, 4, 0, 4, -1, 2, 1])
    got = tk.bgmv(x, a, b, scaling, idx)
    close(got, kernels.bgmv_reference(*f64(x, a, b, scaling), idx), dtype)
    assert torch.equal(got[idx < 0], torch.zeros(2, N_OUT, dtype=dtype))  # exactly 0, whatever slot 0 holds


@pytest.mark.parametrize("dtype", DTYPES)
def test_bgmv_with_experts_reads_the_pair_of_each_token(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    a, b, scaling = pool(4, 8, dtype, g, experts=3)  # a [S, E, r, in], b [S, E, out, r]
    x = torch.randn(6, N_IN, generator=g).to(dtype)
    idx, experts = torch.tensor([3, -1, 0, 3, 1, 0]), torch.tensor([2, 1, 0, 0, 2, 2])
    got = tk.bgmv(x, a, b, scaling, idx, experts)
    close(got, kernels.bgmv_reference(*f64(x, a, b, scaling), idx, experts), dtype)


@pytest.mark.parametrize(("dtype", "rank"), [(F32, 1), (BF16, 16)])
def test_sgmv_ragged_segments(dtype: torch.dtype, rank: int) -> None:
    g = torch.Generator().manual_seed(rank + 3)
    a, b, scaling = pool(4, rank, dtype, g)
    lens = torch.tensor([3, 0, 70, 1, 9, 4])  # 70: two blocks of 64 tokens; 0: an empty segment
    starts = torch.cumsum(lens, 0) - lens
    segs = torch.tensor([2, 1, 0, 3, -1, 2])  # -1: base only; slot 2 in two segments
    x = torch.randn(int(lens.sum()) + 2, N_IN, generator=g).to(dtype)  # 2 tokens in no segment
    got = tk.sgmv(x, a, b, scaling, starts, lens, segs, 70)
    close(got, kernels.sgmv_reference(*f64(x, a, b, scaling), starts, lens, segs), dtype)


def test_the_ops_of_kernels_hand_their_arguments_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring of the dispatch in engine_client.kernels.ops, run here by letting its gate (which
    says yes only for CUDA tensors) say yes for these CPU ones."""
    taken: list[int] = []

    def gate(x: torch.Tensor, *tensors: torch.Tensor) -> object:
        taken.append(1)
        return tk.KERNELS

    monkeypatch.setattr(kernels, "fast_kernels", gate)
    g = torch.Generator().manual_seed(23)
    a, b, scaling = pool(4, 8, F32, g)
    x, y0 = torch.randn(3, 2, N_IN, generator=g), torch.randn(3, 2, N_OUT, generator=g)
    slots, seqs = torch.tensor([3, 1]), torch.tensor([2, 0])
    y = y0.clone()
    assert kernels.add_lora(y, x, a, b, scaling, slots, seqs, progression=None) is y
    close(y, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots, seqs), F32)
    w, bias = torch.randn(N_OUT, N_IN, generator=g), torch.randn(N_OUT, generator=g)
    every = torch.tensor([3, 1, 0])
    base = torch.nn.functional.linear(x, w, bias)
    close(kernels.linear_lora(x, w, bias, a, b, scaling, every),
          kernels.add_lora_reference(*f64(base, x, a, b, scaling), every), F32)
    x2, idx = x.reshape(6, N_IN), torch.tensor([0, -1, 3, 3, 1, 2])
    close(kernels.bgmv(x2, a, b, scaling, idx), kernels.bgmv_reference(*f64(x2, a, b, scaling), idx), F32)
    starts, lens, segs = torch.tensor([0, 4]), torch.tensor([4, 2]), torch.tensor([2, -1])
    close(kernels.sgmv(x2, a, b, scaling, starts, lens, segs),
          kernels.sgmv_reference(*f64(x2, a, b, scaling), starts, lens, segs), F32)
    ea, eb, es = pool(4, 8, F32, g, experts=3)
    experts = torch.tensor([2, 0, 1, 0, 2, 1])
    close(kernels.bgmv(x2, ea, eb, es, idx, experts=experts),
          kernels.bgmv_reference(*f64(x2, ea, eb, es), idx, experts), F32)
    assert len(taken) == 5
