"""A rank's slice of a row, in one process: the byte runs a slice read fetches rebuild exactly
the sliced row a whole read gives, for dense linears (colwise, rowwise, the 2-d weight form)
and fused experts (packed gate/up, down), on every rank of a TP group of 2 and 3; an expert-parallel
rank's experts, and the per-expert block grid whose blocks are exactly them."""

from __future__ import annotations

import struct

import pytest
import torch

from engine_client.engine.targets import model_targets
from engine_client.tp.reads import slice_digest
from engine_client.tp.sharding import LinearShard, SlicedPool, TPModel
from mint_store.format.layout import build_layout, encode_rows
from tests.support.hf_models import build_model

P = "model.layers.1"
# name, shape of A and B: q_proj colwise, o_proj rowwise, v_proj 2-d weight form (colwise), k_proj
# left whole, experts gate_up packed colwise and down rowwise (Qwen3-MoE: H 32, I 24, 4 experts)
TENSORS = [
    (f"{P}.self_attn.q_proj", (3, 32), (32, 3)),
    (f"{P}.self_attn.o_proj", (5, 32), (32, 5)),
    (f"{P}.self_attn.v_proj.weight", (1, 2, 32), (1, 16, 2)),
    (f"{P}.self_attn.k_proj", (2, 32), (16, 2)),
    (f"{P}.mlp.experts.gate_up_proj", (4, 3, 32), (4, 48, 3)),
    (f"{P}.mlp.experts.down_proj", (4, 2, 24), (4, 32, 2)),
]


def _split(n: int, rank: int, world: int) -> tuple[int, int]:
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    return start, min(start + chunk, n)


def _tp(rank: int, world: int) -> TPModel:
    q, o, v = _split(32, rank, world), _split(32, rank, world), _split(16, rank, world)
    g = _split(24, rank, world)
    shards = {
        f"{P}.self_attn.q_proj": LinearShard("colwise", (q,)),
        f"{P}.self_attn.o_proj": LinearShard("rowwise", (o,)),
        f"{P}.self_attn.v_proj": LinearShard("colwise", (v,)),
        f"{P}.mlp.experts.gate_up_proj": LinearShard("colwise", (g, (24 + g[0], 24 + g[1]))),
        f"{P}.mlp.experts.down_proj": LinearShard("rowwise", (g,)),
    }
    return TPModel(rank, world, None, 0, shards, frozenset({f"{P}.mlp.experts"}), {})


@pytest.mark.parametrize(("rank", "world"), [(0, 2), (1, 2), (0, 3), (2, 3)])
def test_slice_runs_rebuild_the_sliced_row_of_a_whole_read(rank: int, world: int) -> None:
    shapes = [(f"{n}.{k}", s, "float32") for n, a, b in TENSORS for k, s in (("lora_A", a), ("lora_B", b))]
    layout = build_layout("base", [*shapes, ("scaling", (len(TENSORS),), "float32")])
    targets = model_targets(build_model("qwen3_moe"))
    pool = SlicedPool(layout, targets, _tp(rank, world), 1, "cpu")
    row = torch.randint(0, 256, (layout.row_nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(world))
    whole = pool.slice_row(row)  # what a whole (verified) read gives this rank

    by_runs = torch.zeros(pool.layout.row_nbytes, dtype=torch.uint8)  # what a slice read assembles
    for r in pool.runs:
        by_runs[r.dst : r.dst + r.nbytes] = row[r.src : r.src + r.nbytes]
    assert torch.equal(by_runs, whole)
    assert slice_digest(pool.layout.layout_id, by_runs) == slice_digest(pool.layout.layout_id, whole)
    # the slice is what the rank's shards say (compared as bits: random bytes hold NaNs): its B rows of q
    got = {t.name: t for t in pool.layout.tensors}
    lo, hi = _split(32, rank, world)
    q_b = whole[got[f"{P}.self_attn.q_proj.lora_B"].offset:].view(torch.int32)[: (hi - lo) * 3].view(hi - lo, 3)
    full = row[layout.spec[f"{P}.self_attn.q_proj.lora_B"].offset:].view(torch.int32)[: 32 * 3].view(32, 3)
    assert torch.equal(q_b, full[lo:hi])
    g0, g1 = _split(24, rank, world)
    assert got[f"{P}.mlp.experts.gate_up_proj.lora_B"].shape == (4, 2 * (g1 - g0), 3)
    assert got[f"{P}.mlp.experts.down_proj.lora_A"].shape == (4, 2, g1 - g0)
    assert got[f"{P}.self_attn.k_proj.lora_B"].shape == (16, 2)  # not sharded: whole
    # fewer bytes than the row, and fewer the more ranks
    assert sum(r.nbytes for r in pool.runs) < sum(t.nbytes for t in layout.tensors)


def test_a_slice_the_size_of_the_whole_row_is_loaded_as_the_slice_it_is() -> None:
    """Rank 1 of q (colwise) and o (rowwise), rank 1, hidden 16, fp32: every sharded tensor
    shrinks by less than its 64-byte padding, so the sliced row is as long as the stored one.
    Whether a row is already sliced is said by the caller, not guessed from its size (the slice
    was sliced again: rank 1 got zeros for q's B)."""
    tensors = [(f"{P}.self_attn.q_proj", (1, 16), (16, 1)), (f"{P}.self_attn.o_proj", (1, 16), (16, 1))]
    shapes = [(f"{n}.{k}", s, "float32") for n, a, b in tensors for k, s in (("lora_A", a), ("lora_B", b))]
    layout = build_layout("base", [*shapes, ("scaling", (len(tensors),), "float32")])
    half = _split(16, 1, 2)
    tp = TPModel(1, 2, None, 0, {f"{P}.self_attn.q_proj": LinearShard("colwise", (half,)),
                                 f"{P}.self_attn.o_proj": LinearShard("rowwise", (half,))}, frozenset(), {})
    pool = SlicedPool(layout, model_targets(build_model("qwen3_moe")), tp, 2, "cpu")
    assert pool.layout.row_nbytes == pool.source.row_nbytes
    rows = encode_rows(layout, {t.name: torch.randn(1, *t.shape) for t in layout.tensors}, 1)
    whole = torch.from_numpy(rows[0].copy())
    want = pool.slice_row(whole)
    pool.load(0, want, sliced=True)  # read by ranges: this rank's slice already
    pool.load(1, whole)  # a whole stored row: sliced here
    assert torch.equal(pool.data[0], want) and torch.equal(pool.data[1], want)
    assert pool.data[0].any()


def _ep(rank: int, world: int) -> TPModel:
    """An expert-parallel rank: its experts of both expert tensors, the rest whole."""
    mine = _split(4, rank, world)
    shards = {f"{P}.mlp.experts.{p}": LinearShard("experts", (mine,)) for p in ("gate_up_proj", "down_proj")}
    return TPModel(rank, world, None, 0, shards, frozenset(), {})


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_holds_and_reads_only_its_experts(rank: int) -> None:
    from mint_store.format import blocks
    from mint_store.format.blocks import merged

    shapes = [(f"{n}.{k}", s, "float32") for n, a, b in TENSORS for k, s in (("lora_A", a), ("lora_B", b))]
    layout = build_layout("base", [*shapes, ("scaling", (len(TENSORS),), "float32")])
    pool = SlicedPool(layout, model_targets(build_model("qwen3_moe")), _ep(rank, 2), 1, "cpu")
    row = torch.randint(0, 256, (layout.row_nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    whole = pool.slice_row(row)
    by_runs = torch.zeros(pool.layout.row_nbytes, dtype=torch.uint8)
    for r in pool.runs:
        by_runs[r.dst : r.dst + r.nbytes] = row[r.src : r.src + r.nbytes]
    assert torch.equal(by_runs, whole)
    got = {t.name: t for t in pool.layout.tensors}
    assert got[f"{P}.mlp.experts.gate_up_proj.lora_B"].shape == (2, 48, 3)
    assert got[f"{P}.mlp.experts.down_proj.lora_A"].shape == (2, 2, 24)
    assert got[f"{P}.self_attn.q_proj.lora_B"].shape == (32, 3)  # not sharded here: whole
    # the expert tensors' runs are this rank's experts, one contiguous run each
    spec = layout.spec[f"{P}.mlp.experts.down_proj.lora_A"]
    each = spec.nbytes // 4
    assert [(r.src, r.nbytes) for r in pool.runs if spec.offset <= r.src < spec.offset + spec.nbytes] == [
        (spec.offset + 2 * rank * each, 2 * each)]
    # the per-expert grid (what a writer records for a row with expert tensors): the blocks a first
    # read fetches and checks are exactly the slice; the older grid's blocks span every expert
    per_expert = blocks.Grid(blocks.BLOCKS | blocks.EXPERT_BLOCKS, 1)
    _, ranges = pool.blocks_needed(per_expert)
    assert ranges == pool.slice_ranges
    _, old = pool.blocks_needed(blocks.Grid(blocks.BLOCKS, 1))
    assert sum(n for _, n in old) > sum(n for _, n in merged(pool.slice_ranges))


def test_a_row_with_expert_tensors_gets_the_per_expert_grid_and_a_dense_row_keeps_its_grid() -> None:
    from mint_store.format import blocks

    dense = build_layout("base", [("m.lora_A", (2, 32), "float32"), ("m.lora_B", (16, 2), "float32"),
                                  ("scaling", (1,), "float32")])
    moe = build_layout("base", [("e.lora_A", (4, 2, 32), "float32"), ("e.lora_B", (4, 16, 2), "float32"),
                                ("scaling", (1,), "float32")])
    for lay, flag in ((dense, 0), (moe, blocks.EXPERT_BLOCKS)):
        rows = encode_rows(lay, {t.name: torch.randn(1, *t.shape) for t in lay.tensors}, 1)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(blocks, "MIN_BLOCK_BYTES", 1)
            ((raw, _),) = blocks.shard_tables(lay, ["00" * 16], rows, ["packs/x"]).values()
        assert struct.unpack_from("<8sIIII", raw)[3] == blocks.BLOCKS | flag
    # per expert: each expert's A cut into 8 column blocks of its own (4 experts x 8), B likewise
    names = [b.tensor for b in blocks.grid_of(moe, blocks.Grid(blocks.BLOCKS | blocks.EXPERT_BLOCKS, 1))]
    assert names.count("e.lora_A[3]") == 8 and names.count("e.lora_B[0]") == 8 and len(names) == 65
