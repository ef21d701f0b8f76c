"""The fused prefill path of a wrapped linear (issue 15): the LoRA delta first, the base matmul
accumulated into it. Checked against the reference loop, in a model layer and as a kernel, and
its fall-backs (gradients, a layout on part of the batch, two layouts) against the same truth."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_client.engine.lora_layers import BatchContext, Entry, LayoutBatch, LinearLoRA, use_batch
from engine_client.kernels.ops import add_lora_reference, linear_lora


def _factors(slots: int, rank: int, n_in: int, n_out: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A, B (strided views of one pool row per slot, as the device pool holds them) and scaling."""
    pool = torch.randn(slots, rank * (n_in + n_out) + 1, generator=g) / n_in**0.5
    a = pool[:, : rank * n_in].view(slots, rank, n_in)
    b = pool[:, rank * n_in : rank * (n_in + n_out)].view(slots, n_out, rank)
    return a, b, pool[:, -1].abs() + 0.5


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("progression", [None, (1, 2), (3, 0)])
def test_linear_lora_matches_the_base_linear_plus_the_reference_loop(bias: bool,
                                                                      progression: tuple[int, int] | None) -> None:
    g = torch.Generator().manual_seed(7)
    a, b, scaling = _factors(8, 4, 12, 10, g)
    lin = nn.Linear(12, 10, bias=bias)
    n = 3
    slots = torch.tensor([4, 0, 6]) if progression is None else torch.tensor(
        [progression[0] + i * progression[1] for i in range(n)])
    x = torch.randn(n, 5, 12, generator=g)
    with torch.no_grad():
        truth = add_lora_reference(lin(x), x, a, b, scaling, slots)
        got = linear_lora(x, lin.weight, lin.bias, a, b, scaling, slots, progression=progression)
    torch.testing.assert_close(got, truth, rtol=1e-5, atol=1e-5)


def _wrapped(g: torch.Generator) -> tuple[nn.Linear, LinearLoRA, tuple[torch.Tensor, ...]]:
    lin = nn.Linear(12, 10)
    hook = LinearLoRA(lin)
    a, b, scaling = _factors(6, 4, 12, 10, g)
    hook.entries = [Entry("L", a, b, scaling)]
    return lin, hook, (a, b, scaling)


def _ctx(seq_slots: list[int], layout: str = "L", progression: tuple[int, int] | None = None) -> BatchContext:
    t = torch.tensor(seq_slots)
    active = (t >= 0).nonzero().flatten()
    lb = LayoutBatch(t, active, t[active], int(active.shape[0]), progression)
    return BatchContext(len(seq_slots), {layout: lb})


@pytest.mark.parametrize("progression", [None, (1, 1)])
def test_a_wrapped_linear_adds_each_sequences_adapter_without_gradients(progression: tuple[int, int] | None) -> None:
    g = torch.Generator().manual_seed(3)
    lin, hook, (a, b, s) = _wrapped(g)
    assert "forward" in lin.__dict__  # a plain nn.Linear: the fused forward is installed
    x = torch.randn(4, 6, 12, generator=g)
    slots = [1, 2, 3, 4]
    with torch.no_grad():
        base = nn.functional.linear(x, lin.weight, lin.bias)
        truth = add_lora_reference(base, x, a, b, s, torch.tensor(slots))
        with use_batch(_ctx(slots, progression=progression)):
            got = lin(x)
        torch.testing.assert_close(got, truth, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, base)  # the adapters did change the output
        torch.testing.assert_close(lin(x), base)  # outside a batch: the base layer alone
    hook.remove()
    assert "forward" not in lin.__dict__


class _TwoStep(nn.Linear):
    """A linear with a forward of its own (as Falcon's: the matmul and the bias rounded apart)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * (x @ self.weight.T) + self.bias


def test_a_linear_subclass_keeps_its_own_forward_and_gets_the_delta_added() -> None:
    """Only an exact nn.Linear gets the fused forward: a subclass's own forward runs (in a batch
    or not, for base-only sequences too) and the hook adds each sequence's delta to its output."""
    g = torch.Generator().manual_seed(5)
    lin = _TwoStep(12, 10)
    hook = LinearLoRA(lin)
    a, b, s = _factors(6, 4, 12, 10, g)
    hook.entries = [Entry("L", a, b, s)]
    assert "forward" not in lin.__dict__
    x = torch.randn(3, 5, 12, generator=g)
    with torch.no_grad():
        own = _TwoStep.forward(lin, x)
        torch.testing.assert_close(lin(x), own)  # outside a batch: its own forward, untouched
        with use_batch(_ctx([1, -1, 4])):
            got = lin(x)
        truth = add_lora_reference(own[[0, 2]], x[[0, 2]], a, b, s, torch.tensor([1, 4]))
        torch.testing.assert_close(got[[0, 2]], truth, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], own[1])  # base-only: exactly its own forward
    hook.remove()


def test_a_wrapped_linear_takes_its_input_by_keyword_as_nn_linear_does() -> None:
    g = torch.Generator().manual_seed(6)
    lin, _, (a, b, s) = _wrapped(g)
    x = torch.randn(2, 5, 12, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(lin(input=x), nn.functional.linear(x, lin.weight, lin.bias))
        with use_batch(_ctx([3, 1])):
            got = lin(input=x)
        truth = add_lora_reference(nn.functional.linear(x, lin.weight, lin.bias), x, a, b, s, torch.tensor([3, 1]))
        torch.testing.assert_close(got, truth, rtol=1e-5, atol=1e-5)


def test_a_wrapped_linear_falls_back_to_the_differentiable_path_when_gradients_are_needed() -> None:
    g = torch.Generator().manual_seed(4)
    lin, _, (a, b, s) = _wrapped(g)
    a.requires_grad_(True)
    x = torch.randn(3, 5, 12, generator=g, requires_grad=True)
    slots = [0, 2, 5]
    with use_batch(_ctx(slots)):
        got = lin(x)
    truth = add_lora_reference(nn.functional.linear(x, lin.weight, lin.bias), x, a, b, s, torch.tensor(slots))
    torch.testing.assert_close(got, truth, rtol=1e-5, atol=1e-5)
    gx, ga = torch.autograd.grad(got.square().sum(), (x, a))
    tx, ta = torch.autograd.grad(truth.square().sum(), (x, a))
    torch.testing.assert_close(gx, tx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ga, ta, rtol=1e-4, atol=1e-5)


def test_a_layout_on_part_of_the_batch_and_a_second_layout_add_their_own_deltas() -> None:
    g = torch.Generator().manual_seed(5)
    lin, hook, (a, b, s) = _wrapped(g)
    a2, b2, s2 = _factors(3, 2, 12, 10, g)
    hook.entries = [*hook.entries, Entry("M", a2, b2, s2)]
    x = torch.randn(4, 3, 12, generator=g)
    slots_l, slots_m = [3, -1, 0, -1], [-1, 2, -1, 1]
    ctx_l, ctx_m = _ctx(slots_l), _ctx(slots_m, "M")
    with torch.no_grad():
        base = nn.functional.linear(x, lin.weight, lin.bias)
        truth = add_lora_reference(base, x, a, b, s, torch.tensor([3, 0]), torch.tensor([0, 2]))
        truth = add_lora_reference(truth, x, a2, b2, s2, torch.tensor([2, 1]), torch.tensor([1, 3]))
        with use_batch(BatchContext(4, {**ctx_l.layouts, **ctx_m.layouts})):
            got = lin(x)
    torch.testing.assert_close(got, truth, rtol=1e-5, atol=1e-5)
