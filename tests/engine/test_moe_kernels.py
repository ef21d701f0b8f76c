"""The experts paths (issue 15) against pair-by-pair reference loops: the padded per-(expert, sequence)
one, the grouped CPU kernels' one (float32),
uneven routing, sequences outside the layout, slot progressions read as views and other slots
gathered, several layouts in one batch, decode and prefill, and the fall back to the
differentiable path when gradients are needed."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from engine_client.engine import lora_layers
from engine_client.engine.lora_layers import BatchContext, Entry, ExpertsLoRA, LayoutBatch, use_batch
from engine_client.kernels import cpu as cpu_kernels
from engine_client.kernels import moe as moe_kernels
from engine_client.kernels.moe import add_expert_lora, add_expert_lora_reference, route
from engine_client.kernels.ops import KERNELS_ENV, progression_of

E, K, H, INTER, R = 4, 2, 12, 6, 3


def _pool(slots: int, n_in: int, n_out: int, g: torch.Generator,
          dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """a [S, E, r, in], b [S, E, out, r] and scaling as strided views of one [slots, width] pool."""
    na, nb = E * R * n_in, E * n_out * R
    pool = (torch.randn(slots, na + nb + 3, generator=g, dtype=torch.float64) / n_in**0.5).to(dtype)
    return (pool, pool[:, :na].view(slots, E, R, n_in), pool[:, na : na + nb].view(slots, E, n_out, R),
            pool[:, -1].abs().float() + 0.5)


def _routing(n_seq: int, per: int, g: torch.Generator, uneven: bool) -> torch.Tensor:
    """top_k_index [N, k], distinct experts per token; uneven: sequence 0 sends every token to 0 and 1."""
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n_seq * per)])
    if uneven:
        idx[:per] = torch.tensor([0, 1])
        idx[per : 2 * per, 0] = 3  # and sequence 1 always picks expert 3 first
        idx[per : 2 * per, 1] = torch.where(idx[per : 2 * per, 1] == 3, 2, idx[per : 2 * per, 1])
    return idx


def _layout(seq_slots: list[int]) -> LayoutBatch:
    active = [i for i, s in enumerate(seq_slots) if s >= 0]
    slots = [seq_slots[i] for i in active]
    return LayoutBatch(torch.tensor(seq_slots), torch.tensor(active, dtype=torch.int64),
                       torch.tensor(slots, dtype=torch.int64), len(active), progression_of(slots))


CASES = pytest.mark.parametrize(("seq_slots", "per"), [
    ([1, 2, 3, 4], 5),  # prefill, a progression: views
    ([1, 2, 3, 4], 1),  # decode, every sequence: the hidden states are the up projection's input
    ([2, -1, 4, 6], 3),  # a sequence without adapter; slots 2, 4, 6 still a progression
    ([5, 1, -1, 3], 1),  # decode, not a progression: the gather fallback
    ([3, 3, 3], 4),  # one adapter for all: a stride-0 view
])


@CASES
@pytest.mark.parametrize("uneven", [False, True], ids=["random", "uneven"])
def test_add_expert_lora_matches_the_pair_by_pair_loop(seq_slots: list[int], per: int, uneven: bool) -> None:
    g = torch.Generator().manual_seed(len(seq_slots) * 10 + per)
    _, a, b, scaling = _pool(7, H, 2 * INTER, g)
    n_seq = len(seq_slots)
    idx = _routing(n_seq, per, g, uneven)
    lb = _layout(seq_slots)
    act = torch.full((n_seq,), -1, dtype=torch.int64)
    act[lb.active] = torch.arange(lb.n_active)
    r = route(idx, E, per, (act, lb.n_active))
    assert r.pad is not None and sum(r.counts) == idx.numel()
    assert r.pad.direct == (per == 1 and lb.n_active == n_seq)
    hidden = torch.randn(n_seq * per, H, generator=g, dtype=torch.float64)
    x = hidden[r.tok]
    y = torch.randn(x.shape[0], 2 * INTER, generator=g, dtype=torch.float64)
    want = add_expert_lora_reference(y, x, a, b, scaling, lb.seq_slots[r.seq], r.experts)
    got = add_expert_lora(y.clone(), x, a, b, scaling, lb.active_slots, r.pad, progression=lb.progression,
                          hidden=hidden)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert torch.equal(got[lb.seq_slots[r.seq] < 0], y[lb.seq_slots[r.seq] < 0])  # no adapter: exactly the base
    assert not torch.allclose(got, y)


def test_route_sorts_pairs_by_expert_then_sequence_and_drops_other_ranks_experts() -> None:
    idx = torch.tensor([[1, 0], [2, 1], [0, 9], [1, 2]])  # 2 sequences of 2 tokens; 9: not this rank's
    r = route(idx, 3, 2, (torch.tensor([0, 1]), 2))
    assert r.counts == [2, 3, 2]
    assert r.experts.tolist() == [0, 0, 1, 1, 1, 2, 2] and r.seq.tolist() == [0, 1, 0, 0, 1, 0, 1]
    assert torch.equal(idx.reshape(-1)[r.perm], r.experts) and torch.equal(r.perm // 2, r.tok)
    assert r.pad is not None and r.pad.caps == [1, 2, 1] and r.pad.offs == [0, 2, 6] and r.pad.n_rows == 8
    assert r.pad.at.tolist() == [0, 1, 2, 3, 4, 6, 7]


def _experts(g: torch.Generator, dtype: torch.dtype = torch.float64) -> Qwen3MoeExperts:
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=16)
    m = Qwen3MoeExperts(cfg).double()
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g, dtype=torch.float64) / H**0.5)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g, dtype=torch.float64) / INTER**0.5)
    return m.to(dtype).requires_grad_(False)


def _experts_reference(m: Qwen3MoeExperts, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, per: int,
                       loras: dict[str, list[tuple[torch.Tensor, ...]]]) -> torch.Tensor:
    """Token by token, pair by pair: the base experts plus every layout's LoRA of the pair's slot and expert."""
    def delta(name: str, x: torch.Tensor, q: int, e: int) -> torch.Tensor:
        d = torch.zeros(())
        for a, b, sc, seq_slots in loras.get(name, ()):
            s = int(seq_slots[q])
            if s >= 0:
                d = d + sc[s] * (b[s, e] @ (a[s, e] @ x))
        return d

    out = []
    for t in range(hidden.shape[0]):
        acc = torch.zeros(H, dtype=torch.float64)
        for j in range(idx.shape[1]):
            e, x = int(idx[t, j]), hidden[t]
            gate, up = (m.gate_up_proj[e] @ x + delta("gate_up_proj", x, t // per, e)).chunk(2)
            h = m.act_fn(gate) * up
            acc = acc + w[t, j] * (m.down_proj[e] @ h + delta("down_proj", h, t // per, e))
        out.append(acc)
    return torch.stack(out)


def _two_layouts(g: torch.Generator, n_seq: int, dtype: torch.dtype = torch.float64,
                 ) -> tuple[dict[str, list[Entry]], BatchContext, dict[str, list]]:
    """Layout "L" on most sequences (its slots a progression but for one hole), layout "M" (only down_proj,
    another rank) on the rest: the lead runs padded, the other through BGMV."""
    pool_l = {p: _pool(n_seq + 1, n_in, n_out, g, dtype) for p, n_in, n_out in
              (("gate_up_proj", H, 2 * INTER), ("down_proj", INTER, H))}
    _, am, bm, sm = _pool(4, INTER, H, g, dtype)
    l_slots = [1 + i - i // 4 if i % 4 != 3 else -1 for i in range(n_seq)]  # 1, 2, 3, -1, 4, 5, 6
    m_slots = [-1 if s >= 0 else 2 for s in l_slots]
    m_slots[-1] = -1  # a sequence with no adapter at all
    entries = {p: [Entry("L", v[1], v[2], v[3])] for p, v in pool_l.items()}
    entries["down_proj"].append(Entry("M", am, bm, sm))
    ctx = BatchContext(n_seq, {"L": _layout(l_slots), "M": _layout(m_slots)})
    assert ctx.layouts["L"].progression == (1, 1)  # the lead reads views
    loras = {p: [(e.a, e.b, e.scaling, ctx.layouts[e.layout_id].seq_slots) for e in es] for p, es in entries.items()}
    return entries, ctx, loras


@pytest.mark.parametrize("per", [1, 4], ids=["decode", "prefill"])
@pytest.mark.parametrize("limit", [100.0, 0.0], ids=["padded", "segments"])
def test_experts_forward_with_two_layouts_matches_the_reference_loop(per: int, limit: float,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """limit: the padding a prefill may take before the segment path runs instead (0: always; decode pads anyway)."""
    monkeypatch.setattr(lora_layers, "_MAX_PADDING", limit)
    g = torch.Generator().manual_seed(per)
    m = _experts(g)
    hook = ExpertsLoRA(m)
    n_seq = 7
    hook.entries, ctx, loras = _two_layouts(g, n_seq)
    hidden = torch.randn(n_seq * per, H, generator=g, dtype=torch.float64)
    idx = _routing(n_seq, per, g, uneven=True)
    w = torch.rand(n_seq * per, K, generator=g, dtype=torch.float64)
    want = _experts_reference(m, hidden, idx, w, per, loras)
    with torch.inference_mode(), use_batch(ctx):
        got = m(hidden, idx, w)
        padded = limit > 0  # (decode is not "direct" here: the lead layout leaves sequence 3 out)
        assert ("bufs" in moe_kernels._WORKSPACE.__dict__) == padded  # the padded buffers, reused by the next layer
    assert "bufs" not in moe_kernels._WORKSPACE.__dict__  # and not kept past the batch
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    hook.remove()
    torch.testing.assert_close(m(hidden, idx, w), _experts_reference(m, hidden, idx, w, per, {}), rtol=0, atol=1e-12)


def test_experts_forward_with_gradients_falls_back_to_the_differentiable_path() -> None:
    g = torch.Generator().manual_seed(9)
    m = _experts(g)
    hook = ExpertsLoRA(m)
    n_seq, per = 5, 3
    entries, ctx, _ = _two_layouts(g, n_seq)
    leaves = {p: [Entry(e.layout_id, e.a.clone().requires_grad_(True), e.b.clone().requires_grad_(True),
                        e.scaling.clone()) for e in es] for p, es in entries.items()}
    hook.entries = leaves
    loras = {p: [(e.a, e.b, e.scaling, ctx.layouts[e.layout_id].seq_slots) for e in es] for p, es in leaves.items()}
    hidden = torch.randn(n_seq * per, H, generator=g, dtype=torch.float64, requires_grad=True)
    idx = _routing(n_seq, per, g, uneven=True)
    w = torch.rand(n_seq * per, K, generator=g, dtype=torch.float64)
    with use_batch(ctx):
        got = m(hidden, idx, w)
    params = [hidden, *(t for es in leaves.values() for e in es for t in (e.a, e.b))]
    got_grads = torch.autograd.grad(got.pow(2).sum(), params)
    want = _experts_reference(m, hidden, idx, w, per, loras)
    want_grads = torch.autograd.grad(want.pow(2).sum(), params)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)
    assert leaves["gate_up_proj"][0].a.grad is None and got_grads[1].abs().sum() > 0


class _PoolCopies(TorchDispatchMode):
    """Records every op that copies out of one storage (a gather, a clone, a contiguous copy)."""

    COPIES = ("index.Tensor", "index_select.default", "clone.default", "copy_.default", "_to_copy.default",
              "gather.default", "take.default")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        super().__init__()
        self.ptr, self.seen = storage.data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._opname + "." + func._overloadname
        src = args[1] if name == "copy_.default" else args[0]  # what the op reads (copy_: into args[0])
        if name in self.COPIES and any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.ptr
                                       for t in tree_flatten(src)[0]):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("per", [1, 6], ids=["decode", "prefill"])
def test_experts_forward_reads_a_slot_progression_in_place_without_copying_the_pool(
        per: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 15): the segment path copied every (adapter, expert) weight it used out of
    the pool each forward (``a[slots, experts]``); a progression of slots is now read as views."""
    monkeypatch.setattr(lora_layers, "_MAX_PADDING", 100.0)  # the padded path, however uneven the routing
    g = torch.Generator().manual_seed(11)
    m = _experts(g)
    hook = ExpertsLoRA(m)
    n_seq = 5
    pools = {p: _pool(n_seq + 2, n_in, n_out, g) for p, n_in, n_out in
             (("gate_up_proj", H, 2 * INTER), ("down_proj", INTER, H))}
    hook.entries = {p: [Entry("L", v[1], v[2], v[3])] for p, v in pools.items()}
    ctx = BatchContext(n_seq, {"L": _layout([2 + i for i in range(n_seq)])})
    loras = {p: [(e.a, e.b, e.scaling, ctx.layouts["L"].seq_slots) for e in es] for p, es in hook.entries.items()}
    hidden = torch.randn(n_seq * per, H, generator=g, dtype=torch.float64)
    idx = _routing(n_seq, per, g, uneven=True)
    w = torch.rand(n_seq * per, K, generator=g, dtype=torch.float64)
    for p, v in pools.items():
        with torch.inference_mode(), use_batch(ctx), _PoolCopies(v[0].untyped_storage()) as seen:
            got = m(hidden, idx, w)
        assert seen.seen == [], f"{p}'s pool was copied by {seen.seen}"
    torch.testing.assert_close(got, _experts_reference(m, hidden, idx, w, per, loras), rtol=0, atol=1e-12)


def _taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The backend names the experts forward's dispatch returns ("torch" for None)."""
    seen: list[str] = []
    real = lora_layers.fast_kernels

    def spy(*args: torch.Tensor, **kw: bool) -> object:
        k = real(*args, **kw)
        seen.append("torch" if k is None else k.name)
        return k

    monkeypatch.setattr(lora_layers, "fast_kernels", spy)
    return seen


@pytest.mark.parametrize("per", [1, 4], ids=["decode", "prefill"])
def test_experts_forward_through_the_grouped_cpu_kernels_matches_the_reference_loop(
        per: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 on CPU: every layout through the C SHRINK/EXPAND over (expert, sequence) runs, the
    uneven routing and the sequences outside a layout included; nothing copied out of the pool."""
    try:
        cpu_kernels.compiler()
    except cpu_kernels.BuildError:
        pytest.skip("no C compiler: the CPU kernels are not built (apt-get install -y gcc)")
    assert cpu_kernels.kernels() is not None  # a compiler, so the library must build
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    taken = _taken(monkeypatch)
    g = torch.Generator().manual_seed(40 + per)
    m = _experts(g, torch.float32)
    hook = ExpertsLoRA(m)
    n_seq = 7
    hook.entries, ctx, loras = _two_layouts(g, n_seq, torch.float32)
    hidden = torch.randn(n_seq * per, H, generator=g)
    idx = _routing(n_seq, per, g, uneven=True)
    w = torch.rand(n_seq * per, K, generator=g)
    m64, loras64 = _experts(torch.Generator(), torch.float64), {
        p: [tuple(t.double() for t in v) for v in vs] for p, vs in loras.items()}
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    want = _experts_reference(m64, hidden.double(), idx, w.double(), per, loras64)
    seq_pool = hook.entries["gate_up_proj"][0].a
    with torch.inference_mode(), use_batch(ctx), _PoolCopies(seq_pool.untyped_storage()) as seen:
        got = m(hidden, idx, w)
    assert taken == ["cpu"] and seen.seen == []
    assert "bufs" not in moe_kernels._WORKSPACE.__dict__
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    monkeypatch.setenv(KERNELS_ENV, "torch")  # the padded path: the same numbers
    with torch.inference_mode(), use_batch(ctx):
        torch.testing.assert_close(m(hidden, idx, w), got, rtol=0, atol=1e-5 * want.abs().max().item())
    assert taken == ["cpu", "torch"]


def test_route_groups_are_the_expert_sequence_runs_of_the_sorted_pairs() -> None:
    idx = torch.tensor([[0, 2], [2, 1], [0, 1], [3, 0]])  # 2 sequences of 2 tokens, top-2 of 4 experts
    r = route(idx, 4, 2, groups=True)
    assert r.groups is not None and r.group_seq is not None
    assert r.groups.lens.tolist() == [1, 2, 1, 1, 2, 0, 0, 1]  # (expert, sequence) e-major
    assert r.groups.rows.tolist() == [0, 1, 3, 4, 5, 7, 7, 7] and r.groups.tokens == 2
    assert r.groups.experts.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and r.group_seq.tolist() == [0, 1] * 4
    for g in range(8):  # each run holds exactly its expert's pairs of its sequence
        rows = slice(int(r.groups.rows[g]), int(r.groups.rows[g] + r.groups.lens[g]))
        assert (r.experts[rows] == g // 2).all() and (r.seq[rows] == g % 2).all()
    with pytest.raises(ValueError, match="not both"):
        route(idx, 4, 2, (torch.tensor([0, 1]), 2), groups=True)
