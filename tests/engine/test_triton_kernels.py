"""The Triton SHRINK/EXPAND kernels (engine_client/kernels/triton_ops.py) against the reference loops.

Three levels, none of which measures speed:

- on CPU, under Triton's interpreter: the cases of triton_interpreted.py (ragged groups, slot
  -1, strided views of a slot pool, slots out of order, ranks 1/8/16, features that are not
  multiples of the blocks, fp32 and bf16, experts), run in a subprocess because
  ``TRITON_INTERPRET=1`` must be set before triton is imported (and must not leak to other tests);
- on CPU, both kernels compiled for an H200 (sm_90): the interpreter accepts programs that the
  GPU compiler refuses;
- on a CUDA device (``-m cuda``): the ops of engine_client.kernels.ops dispatch to the kernels and
  match the references for real; forced to torch, and under autograd, they do not dispatch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_client.kernels import ops as kernels
from tests.support.lora_pools import N_IN, N_OUT, close, f64, pool

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install -e '.[test]'): its kernels are untested")

DTYPES = [torch.float32, torch.bfloat16]
ROOT = Path(__file__).resolve().parents[2]


@needs_triton
def test_the_kernels_match_the_references_under_the_interpreter() -> None:
    cases = Path(__file__).with_name("triton_interpreted.py")
    # (not the caller's PYTEST_ADDOPTS: options meant for the outer run, e.g. --durations, change this one's output)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, "TRITON_INTERPRET": "1"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", str(cases)]
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = [line for line in run.stdout.splitlines() if line.strip()][-1]  # "N passed in Xs": none skipped
    assert " passed" in summary and "skipped" not in summary, run.stdout[-2000:]


def test_cpu_tensors_never_take_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    g = torch.Generator().manual_seed(3)
    a, b, scaling = pool(3, 4, torch.float32, g)
    x, y0 = torch.randn(2, 3, N_IN, generator=g), torch.randn(2, 3, N_OUT, generator=g)
    slots = torch.tensor([2, 0])
    assert getattr(kernels.fast_kernels(x, y0, x, a, b, scaling), "name", "cpu") == "cpu"  # C, or torch: no cc
    y = y0.clone()
    assert kernels.add_lora(y, x, a, b, scaling, slots) is y
    close(y, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots), torch.float32)


@needs_triton
def test_the_kernels_compile_for_an_h200_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter accepts programs a GPU compiler refuses: compile both kernels for sm_90
    (ptxas ships in the triton wheel), the tl.dot path in bf16 and the one-token path in fp32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine_client.kernels import triton_ops as real

    assert not real.INTERPRETED
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud: no warning
    ptrs = {"scaling_ptr": "*fp32", "h_ptr": "*fp32", "slot_ptr": "*i64", "expert_ptr": "*i64", "row_ptr": "*i64",
            "len_ptr": "*i64"}  # x, a, b, y: the dtype's; the other arguments int32
    for dt, dot, experts in (("bf16", True, False), ("fp32", False, True)):
        for fn, block in ((real._shrink_kernel, "BLOCK_K"), (real._expand_kernel, "BLOCK_N")):
            consts = {"HAS_EXPERTS": experts, "HAS_ROWS": not experts, "HAS_LENS": experts, "USE_DOT": dot,
                      "WIDE_DOT": False, "BLOCK_M": 16 if dot else 1, "BLOCK_R": 16, block: 64}
            sig = {n: "constexpr" if n in consts else f"*{dt}" if n in ("x_ptr", "a_ptr", "b_ptr", "y_ptr")
                   else ptrs.get(n, "i32") for n in fn.arg_names}
            compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"]
            assert ("mma" in compiled.asm["ptx"]) == (dot and dt == "bf16")  # tensor cores on the bf16 dot


@needs_triton
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the kernels compiled for real)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_on_cuda_the_ops_dispatch_to_triton_and_match_the_references(dtype: torch.dtype,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    dev = "cuda"
    g = torch.Generator().manual_seed(5)
    a, b, scaling = pool(6, 16, dtype, g, device=dev)
    x = torch.randn(4, 20, N_IN, generator=g).to(dtype).to(dev)
    y0 = torch.randn(4, 20, N_OUT, generator=g).to(dtype).to(dev)
    slots, seqs = torch.tensor([5, 0, 3], device=dev), torch.tensor([3, 0, 2], device=dev)
    assert kernels.fast_kernels(x, y0, x, a, b, scaling).name == "triton"
    truth = kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots.cpu(), seqs.cpu())
    y = y0.clone()
    assert kernels.add_lora(y, x, a, b, scaling, slots, seqs) is y
    close(y, truth, dtype)
    x2 = x[:, 0].contiguous()
    idx = torch.tensor([-1, 4, 0, 4], device=dev)
    close(kernels.bgmv(x2, a, b, scaling, idx), kernels.bgmv_reference(*f64(x2, a, b, scaling), idx.cpu()), dtype)
    ea, eb, es = pool(4, 8, dtype, g, experts=3, device=dev)
    experts = torch.tensor([2, 1, 0, 0], device=dev)
    close(kernels.bgmv(x2, ea, eb, es, idx.clamp(max=3), experts=experts),
          kernels.bgmv_reference(*f64(x2, ea, eb, es), idx.clamp(max=3).cpu(), experts.cpu()), dtype)
    starts, lens, segs = (torch.tensor(v, device=dev) for v in ([0, 1], [1, 3], [4, 1]))
    close(kernels.sgmv(x2, a, b, scaling, starts, lens, segs),
          kernels.sgmv_reference(*f64(x2, a, b, scaling), starts.cpu(), lens.cpu(), segs.cpu()), dtype)
    w = (torch.randn(N_OUT, N_IN, generator=g) / N_IN**0.5).to(dtype).to(dev)
    every = torch.tensor([5, 0, 3, 0], device=dev)
    close(kernels.linear_lora(x, w, None, a, b, scaling, every),
          kernels.add_lora_reference(*f64(torch.nn.functional.linear(x, w), x, a, b, scaling), every.cpu()), dtype)
    # the torch ops when forced, or when autograd needs the inputs
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    assert kernels.fast_kernels(x, y0, x, a, b, scaling) is None
    close(kernels.add_lora(y0.clone(), x, a, b, scaling, slots, seqs), truth, dtype)
    monkeypatch.setenv(kernels.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="MINT_LORA_KERNELS"):
        kernels.add_lora(y0.clone(), x, a, b, scaling, slots, seqs)
    monkeypatch.delenv(kernels.KERNELS_ENV)
    xg = x.clone().requires_grad_(True)
    assert kernels.fast_kernels(xg, y0, xg, a, b, scaling) is None
    kernels.add_lora(y0, xg, a, b, scaling, slots, seqs).float().sum().backward()
    assert xg.grad is not None and bool(xg.grad[1].eq(0).all()) and bool(xg.grad[0].ne(0).any())
