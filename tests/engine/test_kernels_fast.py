"""The fast paths of the kernels (issue 15) against the reference loops: slot progressions
read as views of the pool, and the (adapter, expert) segments of the experts path."""

from __future__ import annotations

import pytest
import torch

from engine_client.kernels.ops import (
    add_lora,
    add_lora_reference,
    bgmv_reference,
    progression_of,
    segment_lora,
    slot_rows,
)


def _pool(slots: int, rank: int, n_in: int, n_out: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A, B and scaling as strided views of one [slots, S] pool, as the device pool holds them."""
    width = rank * (n_in + n_out) + 3
    pool = torch.randn(slots, width, generator=g, dtype=torch.float64) / n_in**0.5
    a = pool[:, : rank * n_in].view(slots, rank, n_in)
    b = pool[:, rank * n_in : rank * (n_in + n_out)].view(slots, n_out, rank)
    return pool, a, b, pool[:, -1].abs() + 0.5


@pytest.mark.parametrize(("first", "step", "n"), [(0, 1, 5), (2, 1, 4), (1, 2, 3), (3, 0, 4), (5, 1, 1)])
@pytest.mark.parametrize("subset", [False, True], ids=["all", "subset"])
def test_add_lora_over_a_slot_progression_matches_the_reference_loop(first: int, step: int, n: int,
                                                                    subset: bool) -> None:
    g = torch.Generator().manual_seed(first * 100 + step * 10 + n)
    _, a, b, scaling = _pool(6, 4, 12, 10, g)
    slots = torch.tensor([first + i * step for i in range(n)])
    batch = 2 * n if subset else n
    seqs = torch.arange(0, batch, 2) if subset else None
    x, y = torch.randn(batch, 3, 12, generator=g, dtype=torch.float64), torch.randn(batch, 3, 10, generator=g,
                                                                                   dtype=torch.float64)
    truth = add_lora_reference(y, x, a, b, scaling, slots, seqs)
    got = add_lora(y.clone(), x, a, b, scaling, slots, seqs, progression=(first, step))
    torch.testing.assert_close(got, truth, rtol=0, atol=1e-12)
    # and what a wrong progression would give is different: the view does follow the progression
    if n > 1 and step:
        wrong = add_lora(y.clone(), x, a, b, scaling, slots, seqs, progression=(first, 0))
        assert not torch.allclose(wrong, truth)


def test_slot_rows_of_a_progression_is_a_view_of_the_pool() -> None:
    pool, a, _, _ = _pool(6, 4, 12, 10, torch.Generator().manual_seed(1))
    slots = torch.tensor([1, 3, 5])
    rows = slot_rows(a, slots, (1, 2))
    assert rows.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()  # no copy
    assert torch.equal(rows, a[slots])
    same = slot_rows(a, torch.tensor([4, 4]), (4, 0))
    assert same.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr() and torch.equal(same, a[[4, 4]])
    assert torch.equal(slot_rows(a, slots, None), a[slots])
    with pytest.raises(ValueError, match="does not fit"):
        slot_rows(a, slots, (2, 2))  # 2, 4, 6: past the last slot


@pytest.mark.parametrize(("slots", "want"), [
    ([0, 1, 2, 3], (0, 1)), ([7], (7, 1)), ([2, 2, 2], (2, 0)), ([1, 3, 5], (1, 2)),
    ([], None), ([0, 2, 3], None), ([3, 2, 1], None), ([0, 1, 1], None),
])
def test_progression_of(slots: list[int], want: tuple[int, int] | None) -> None:
    assert progression_of(slots) == want


@pytest.mark.parametrize("tokens", [1, 2], ids=["decode", "prefill"])
@pytest.mark.parametrize("subset", [False, True], ids=["all", "subset"])
def test_add_lora_gradients_over_a_progression_match_the_reference_loop(tokens: int, subset: bool) -> None:
    g = torch.Generator().manual_seed(3)
    _, a0, b0, s0 = _pool(5, 4, 12, 10, g)
    x = torch.randn(4, tokens, 12, generator=g, dtype=torch.float64)
    y = torch.randn(4, tokens, 10, generator=g, dtype=torch.float64)
    slots = torch.tensor([1, 2, 3])
    seqs = torch.tensor([0, 1, 3]) if subset else None
    if not subset:
        x, y = x[:3], y[:3]
    grads = []
    for fn, kw in ((add_lora, {"progression": (1, 1)}), (add_lora_reference, {})):
        leaves = [t.detach().clone().requires_grad_(True) for t in (y, x, a0, b0, s0)]
        fn(*leaves, slots, seqs, **kw).pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)
    assert grads[0][2][0].abs().sum() == 0 and grads[0][2][1].abs().sum() > 0  # only the batch's slots learn


def _segments(lens: list[int], slots: list[int], experts: list[int] | None) -> tuple[torch.Tensor, ...]:
    """Per-row slot (and expert) of back-to-back segments: what BGMV's reference loop takes."""
    rows = torch.tensor([s for ln, s in zip(lens, slots, strict=True) for _ in range(ln)], dtype=torch.int64)
    if experts is None:
        return (rows,)
    return rows, torch.tensor([e for ln, e in zip(lens, experts, strict=True) for _ in range(ln)], dtype=torch.int64)


SEGMENTS = pytest.mark.parametrize(("lens", "slots", "chunk"), [
    ([5], [2], 32),  # one segment
    ([3, 1, 4, 7], [0, 3, 3, 1], 2),  # chunks of 2: tails padded
    ([3, 0, 4, 9], [1, 2, -1, 0], 4),  # an empty segment and a base-only one
    ([1, 1, 1, 1, 1], [3, 2, 1, 0, 3], 32),  # one row each (decode-like)
    ([2, 6], [-1, -1], 32),  # nothing to add
    ([33, 7], [1, 0], 16),
    ([1, 1, 30], [0, 1, 2], 32),  # chunks of the mean length (11): the long segment in three
])


@SEGMENTS
@pytest.mark.parametrize("with_experts", [False, True], ids=["dense", "experts"])
def test_segment_lora_matches_the_reference_loop(lens: list[int], slots: list[int], chunk: int,
                                                 with_experts: bool) -> None:

    g = torch.Generator().manual_seed(sum(lens) * 10 + chunk)
    n_exp = 3 if with_experts else None
    lead = (4,) if n_exp is None else (4, n_exp)
    a = torch.randn(*lead, 4, 12, generator=g, dtype=torch.float64)
    b = torch.randn(*lead, 10, 4, generator=g, dtype=torch.float64)
    scaling = torch.rand(4, generator=g, dtype=torch.float64) + 0.5
    experts = [(3 * i + 1) % 3 for i in range(len(lens))] if with_experts else None
    x = torch.randn(sum(lens), 12, generator=g, dtype=torch.float64)
    truth = bgmv_reference(x, a, b, scaling, *_segments(lens, slots, experts))
    got = segment_lora(x, a, b, scaling, lens, slots, experts, chunk=chunk)
    torch.testing.assert_close(got, truth, rtol=0, atol=1e-12)
    base_rows = _segments(lens, slots, None)[0] < 0
    assert (got[base_rows] == 0).all()  # exactly the base model, whatever slot 0 holds


def test_segment_lora_gradients_match_the_reference_loop() -> None:

    g = torch.Generator().manual_seed(4)
    lens, slots, experts = [3, 2, 5], [1, -1, 0], [2, 0, 1]
    leaves0 = (torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randn(2, 3, 4, 6, generator=g,
               dtype=torch.float64), torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64),
               torch.rand(2, generator=g, dtype=torch.float64) + 0.5)
    grads = []
    for run in (lambda x, a, b, s: segment_lora(x, a, b, s, lens, slots, experts, chunk=2),
                lambda x, a, b, s: bgmv_reference(x, a, b, s, *_segments(lens, slots, experts))):
        leaves = [t.clone().requires_grad_(True) for t in leaves0]
        run(*leaves).pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)
    assert grads[0][1].abs().sum() > 0


def test_segment_lora_refuses_segments_that_do_not_cover_the_rows() -> None:

    a, b, s = torch.zeros(2, 4, 6), torch.zeros(2, 5, 4), torch.ones(2)
    with pytest.raises(ValueError, match="cover"):
        segment_lora(torch.zeros(7, 6), a, b, s, [3, 3], [0, 1])


@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "prefill"])
def test_add_lora_into_a_narrower_output_one_token_per_sequence(tokens: int) -> None:
    """bf16 outputs, fp32 adapters: the sum in fp32 then rounded, as PEFT does, in the decode form too."""
    g = torch.Generator().manual_seed(6)
    _, a, b, scaling = _pool(3, 4, 16, 8, g)
    a, b, scaling = a.float(), b.float(), scaling.float()
    x = torch.randn(3, tokens, 16, generator=g).to(torch.bfloat16)
    y = torch.randn(3, tokens, 8, generator=g).to(torch.bfloat16)
    slots = torch.tensor([2, 0, 1])
    want = torch.stack([(y[q].float() + (scaling[s] * (x[q].float() @ a[s].T)) @ b[s].T).to(torch.bfloat16)
                        for q, s in enumerate(slots.tolist())])
    torch.testing.assert_close(add_lora(y.clone(), x, a, b, scaling, slots), want, rtol=0, atol=0)
