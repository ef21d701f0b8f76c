"""BGMV and SGMV against their reference loops, over a grid; gradients in float64."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine_client.kernels.ops import add_lora, bgmv, bgmv_reference, sgmv, sgmv_reference

# tolerance relative to the largest |value| of the float64 truth
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _stacks(slots: int, rank: int, n_in: int, n_out: int, dtype: torch.dtype, g: torch.Generator,
            experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lead = (slots,) if experts is None else (slots, experts)
    a = (torch.randn(*lead, rank, n_in, generator=g) / n_in**0.5).to(dtype)
    b = (torch.randn(*lead, n_out, rank, generator=g) / rank**0.5).to(dtype)
    scaling = torch.rand(slots, generator=g) * 2 + 0.1
    return a, b, scaling


def _indices(n: int, slots: int, g: torch.Generator) -> torch.Tensor:
    idx = torch.randint(-1, slots, (n,), generator=g)
    idx[0] = -1  # always a base-only token ...
    if n > 1:
        idx[1] = slots - 1  # ... and one with an adapter
    return idx


def _close(got: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    scale = max(truth.abs().max().item(), 1e-3)
    torch.testing.assert_close(got.double(), truth, rtol=0, atol=TOL[dtype] * scale)


def _f64(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.double() for t in ts]


GRID = pytest.mark.parametrize(
    ("tokens", "slots", "rank", "n_in", "n_out"),
    [
        (1, 1, 1, 16, 24),
        (5, 4, 1, 64, 8),
        (5, 4, 8, 16, 24),
        (33, 4, 16, 64, 8),
        (33, 2, 64, 16, 24),
        (9, 8, 64, 64, 40),
        (17, 3, 3, 7, 5),
    ],
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@GRID
@DTYPES
def test_bgmv_matches_the_reference_loop(tokens: int, slots: int, rank: int, n_in: int, n_out: int,
                                         dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(tokens * 1000 + slots * 100 + rank)
    a, b, scaling = _stacks(slots, rank, n_in, n_out, dtype, g)
    x = torch.randn(tokens, n_in, generator=g).to(dtype)
    idx = _indices(tokens, slots, g)
    got = bgmv(x, a, b, scaling, idx)
    truth = bgmv_reference(*_f64(x, a, b), scaling.double(), idx)
    _close(got, truth, dtype)
    _close(bgmv_reference(x, a, b, scaling, idx), truth, dtype)
    assert (got[idx < 0] == 0).all()  # exactly the base model


@GRID
@DTYPES
def test_bgmv_with_experts_matches_the_reference_loop(tokens: int, slots: int, rank: int, n_in: int, n_out: int,
                                                      dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7 + tokens * 1000 + slots * 100 + rank)
    a, b, scaling = _stacks(slots, rank, n_in, n_out, dtype, g, experts=3)
    x = torch.randn(tokens, n_in, generator=g).to(dtype)
    idx = _indices(tokens, slots, g)
    experts = torch.randint(0, 3, (tokens,), generator=g)
    got = bgmv(x, a, b, scaling, idx, experts=experts)
    _close(got, bgmv_reference(*_f64(x, a, b), scaling.double(), idx, experts), dtype)


@GRID
@DTYPES
def test_sgmv_matches_the_reference_loop(tokens: int, slots: int, rank: int, n_in: int, n_out: int,
                                         dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11 + tokens * 1000 + slots * 100 + rank)
    a, b, scaling = _stacks(slots, rank, n_in, n_out, dtype, g)
    x = torch.randn(tokens, n_in, generator=g).to(dtype)
    # ragged segments with gaps between them; one of them base-only
    cuts = sorted(torch.randperm(tokens + 1, generator=g)[: min(tokens + 1, 6)].tolist())
    starts = torch.tensor(cuts[:-1])
    lens = torch.tensor([max(0, e - s - (1 if e - s > 1 else 0)) for s, e in itertools.pairwise(cuts)])
    seg_idx = _indices(len(starts), slots, g)
    got = sgmv(x, a, b, scaling, starts, lens, seg_idx)
    truth = sgmv_reference(*_f64(x, a, b), scaling.double(), starts, lens, seg_idx)
    _close(got, truth, dtype)
    assert torch.equal(got, sgmv(x, a, b, scaling, starts, lens, seg_idx, max_len=int(lens.max()) if len(lens) else 0))
    covered = torch.zeros(tokens, dtype=torch.bool)
    for s, n, i in zip(starts.tolist(), lens.tolist(), seg_idx.tolist(), strict=True):
        covered[s : s + n] |= i >= 0
    assert (got[~covered] == 0).all()


def test_kernels_gather_from_strided_views_without_copying_them() -> None:
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(4, 2, 3, 8, generator=g)  # [slots, 2, r, in]: a[:, 1] is not contiguous
    a = pool[:, 1]
    b = torch.randn(4, 5, 8, generator=g)[..., 2:5]  # [slots, out, r] with a row stride of 8
    assert not a.is_contiguous() and not b.is_contiguous()
    x = torch.randn(6, 8, generator=g)
    idx = torch.tensor([0, 3, -1, 2, 2, 1])
    scaling = torch.ones(4)
    torch.testing.assert_close(bgmv(x, a, b, scaling, idx), bgmv_reference(x, a, b, scaling, idx))
    starts, lens = torch.tensor([0, 3]), torch.tensor([3, 3])
    seg = torch.tensor([1, 2])
    torch.testing.assert_close(sgmv(x, a, b, scaling, starts, lens, seg),
                               sgmv_reference(x, a, b, scaling, starts, lens, seg))


def test_kernels_refuse_shapes_that_do_not_chain() -> None:
    x = torch.zeros(3, 8)
    a, b, s = torch.zeros(2, 4, 8), torch.zeros(2, 5, 4), torch.ones(2)
    with pytest.raises(ValueError, match="do not chain"):
        bgmv(x, a[..., :7], b, s, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[N\]"):
        bgmv(x, a, b, s, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="scaling"):
        bgmv(x, a, b, torch.ones(3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[G\]"):
        sgmv(x, a, b, s, torch.zeros(2, dtype=torch.long), torch.ones(1, dtype=torch.long),
             torch.zeros(2, dtype=torch.long))


def test_empty_segments_give_zeros() -> None:
    x = torch.randn(3, 8)
    a, b, s = torch.randn(2, 4, 8), torch.randn(2, 5, 4), torch.ones(2)
    none = torch.zeros(0, dtype=torch.long)
    assert torch.equal(sgmv(x, a, b, s, none, none, none), torch.zeros(3, 5))


def test_bgmv_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    a = torch.randn(3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.rand(3, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, -1, 2, 0, 1])
    assert torch.autograd.gradcheck(lambda *t: bgmv(*t, idx), (x, a, b, s))


def test_bgmv_experts_gradcheck() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, 3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.rand(2, generator=g, dtype=torch.float64, requires_grad=True)
    idx, experts = torch.tensor([0, -1, 1, 0, 1]), torch.tensor([2, 0, 1, 2, 0])
    assert torch.autograd.gradcheck(lambda *t: bgmv(*t, idx, experts=experts), (x, a, b, s))


def test_sgmv_gradcheck() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    a = torch.randn(3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.rand(3, generator=g, dtype=torch.float64, requires_grad=True)
    starts, lens, seg = torch.tensor([0, 2, 5]), torch.tensor([2, 2, 2]), torch.tensor([1, -1, 0])
    assert torch.autograd.gradcheck(lambda *t: sgmv(*t, starts, lens, seg, max_len=2), (x, a, b, s))


# -- ADD_LORA: what a wrapped linear runs (in place for inference, differentiable for training) --


@pytest.mark.parametrize(("seqs", "tokens", "slots", "rank", "n_in", "n_out"),
                         [(1, 1, 1, 1, 16, 24), (6, 1, 4, 8, 64, 40), (5, 7, 8, 16, 24, 16), (3, 33, 2, 64, 16, 8)])
@pytest.mark.parametrize("subset", [False, True], ids=["all", "subset"])
@DTYPES
def test_add_lora_matches_the_reference_loop(seqs: int, tokens: int, slots: int, rank: int, n_in: int, n_out: int,
                                             subset: bool, dtype: torch.dtype) -> None:
    from engine_client.kernels.ops import add_lora, add_lora_reference

    g = torch.Generator().manual_seed(seqs * 1000 + tokens)
    a, b, scaling = _stacks(slots, rank, n_in, n_out, dtype, g)
    x = torch.randn(seqs, tokens, n_in, generator=g).to(dtype)
    y = torch.randn(seqs, tokens, n_out, generator=g).to(dtype)
    picked = torch.tensor([q for q in range(seqs) if q % 2 == 0], dtype=torch.int64) if subset else None
    n = seqs if picked is None else picked.numel()
    slot_of = torch.randint(0, slots, (n,), generator=g)
    truth = add_lora_reference(*_f64(y, x, a, b), scaling.double(), slot_of, picked)
    before = y.clone()
    got = add_lora(y, x, a, b, scaling, slot_of, picked)
    assert got.data_ptr() == y.data_ptr()  # in place: no gradient needed
    _close(got, truth, dtype)
    if picked is not None:  # sequences of other layouts are untouched, bit for bit
        others = [q for q in range(seqs) if q % 2]
        assert torch.equal(got[others], before[others])


def test_add_lora_reads_strided_slot_views_and_skips_nothing() -> None:
    """Slots are views into one [slots, S] byte pool: strided, never made contiguous first."""
    from engine_client.kernels.ops import add_lora, add_lora_reference

    g = torch.Generator().manual_seed(7)
    pool = torch.randn(4, 2 * (8 * 32) + 16, generator=g)  # [slots, S] in float32 units
    a = pool[:, : 8 * 32].view(4, 8, 32)  # [slots, r, in]
    b = pool[:, 8 * 32 : 2 * 8 * 32].view(4, 32, 8)  # [slots, out, r]
    scaling = pool[:, -1].abs() + 0.5
    assert not a.is_contiguous()
    x, y = torch.randn(3, 5, 32, generator=g), torch.randn(3, 5, 32, generator=g)
    slots = torch.tensor([3, 0, 3])
    truth = add_lora_reference(*_f64(y, x, a, b), scaling.double(), slots)
    _close(add_lora(y, x, a, b, scaling, slots), truth, torch.float32)


@pytest.mark.parametrize("subset", [False, True], ids=["all", "subset"])
def test_add_lora_gradients_match_the_reference_loop(subset: bool) -> None:
    from engine_client.kernels.ops import add_lora, add_lora_reference

    g = torch.Generator().manual_seed(3)
    a, b, scaling = _stacks(3, 4, 12, 10, torch.float64, g)
    x = torch.randn(4, 3, 12, generator=g, dtype=torch.float64)
    y = torch.randn(4, 3, 10, generator=g, dtype=torch.float64)
    seqs = torch.tensor([0, 2, 3]) if subset else None
    slots = torch.tensor([2, 0, 2]) if subset else torch.tensor([2, 0, 1, 2])
    grads = []
    for fn in (add_lora, add_lora_reference):
        leaves = [t.clone().requires_grad_(True) for t in (y, x, a, b, scaling.double())]
        out = fn(*leaves, slots, seqs)
        out.pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)
    assert grads[0][2].abs().sum() > 0 and grads[0][3].abs().sum() > 0  # a and b do get gradients


def test_add_lora_with_a_narrower_output_sums_in_the_wider_dtype_as_peft_does() -> None:
    from engine_client.kernels.ops import add_lora

    g = torch.Generator().manual_seed(5)
    a, b, scaling = _stacks(2, 4, 16, 8, torch.float32, g)
    x = torch.randn(3, 2, 16, generator=g).to(torch.bfloat16)
    y = torch.randn(3, 2, 8, generator=g).to(torch.bfloat16)
    slots = torch.tensor([1, 0, 1])
    # PEFT: result (bf16) + delta (fp32) promotes to fp32, then back to the result's dtype
    want = torch.stack([
        (y[q].float() + (scaling[s] * (x[q].float() @ a[s].T)) @ b[s].T).to(torch.bfloat16)
        for q, s in enumerate(slots.tolist())
    ])
    got = add_lora(y.clone(), x, a, b, scaling, slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    subset = add_lora(y.clone(), x, a, b, scaling, slots[[0, 2]], torch.tensor([0, 2]))
    torch.testing.assert_close(subset[[0, 2]], want[[0, 2]], rtol=0, atol=0)
    assert torch.equal(subset[1], y[1])


def test_half_precision_deltas_are_scaled_by_the_exact_scaling_not_its_bf16_rounding() -> None:
    """alpha / r = 16 / 12 rounded to bf16 is 1.3359 (+0.2%): the torch paths multiplied by that,
    biasing every delta against PEFT (and the C and Triton kernels, which scale in float32)."""
    g = torch.Generator().manual_seed(3)
    n, r, d_in, d_out = 64, 12, 96, 80
    a = (torch.randn(2, r, d_in, generator=g) / d_in**0.5).bfloat16()
    b = (torch.randn(2, d_out, r, generator=g) / r**0.5).bfloat16()
    x = torch.randn(n, 8, d_in, generator=g).bfloat16()
    scaling = torch.tensor([16 / 12, 16 / 12**0.5])  # LoRA and rsLoRA
    slots = torch.arange(n) % 2
    y = torch.zeros(n, 8, d_out, dtype=torch.bfloat16)
    got = add_lora(y.clone(), x, a, b, scaling, slots).double()
    exact = torch.stack([(x[i].double() @ a[s].double().T * float(scaling[s])) @ b[s].double().T
                         for i, s in enumerate(slots.tolist())])
    bias = ((got - exact) * exact.sign()).sum() / exact.abs().sum()  # signed, relative: rounding averages out
    assert abs(float(bias)) < 3e-4, float(bias)
