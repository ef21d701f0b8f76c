"""The C SHRINK/EXPAND kernels (engine_client/kernels/cpu.py) against the reference loops, their
dispatch from engine_client.kernels.ops, their thread split, and their build."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from engine_client.kernels import cpu as cpu_kernels
from engine_client.kernels import ops as kernels
from engine_client.kernels.groups import Groups
from mint_store import native
from tests.support.lora_pools import N_IN, N_OUT, close, f64, pool

F32 = torch.float32


def _has_compiler() -> bool:
    try:
        cpu_kernels.compiler()
    except cpu_kernels.BuildError:
        return False
    return True


# skipped only without a compiler: where one exists, a library that does not build fails here
pytestmark = pytest.mark.skipif(not _has_compiler(),
                                reason="no C compiler: the CPU kernels are not built (apt-get install -y gcc)")
K = cpu_kernels.kernels() if _has_compiler() else None


def test_the_library_builds_and_loads_where_a_compiler_exists() -> None:
    assert cpu_kernels.build().exists()
    assert K is not None and K.name == "cpu" and K.dtypes == (F32,)


@pytest.fixture(autouse=True)
def _auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)


# ranks below, at and past one register block of 8 (13: a tail); tokens 1 (decode) and an odd 5;
# b read in place ([r, out] rows, as pool() lays it) or transposed first ([out, r] as PEFT and the
# device pool store it: 16 x 8 blocks by shuffles, the 8 rows past them one by one)
@pytest.mark.parametrize("b_layout", ["r_out", "out_r"])
@pytest.mark.parametrize(("rank", "tokens"), [(1, 1), (8, 5), (13, 5), (16, 1), (16, 5)])
def test_add_lora_adds_each_sequence_delta_in_place(rank: int, tokens: int, b_layout: str) -> None:
    assert K is not None
    g = torch.Generator().manual_seed(rank * 10 + tokens)
    a, b, scaling = pool(6, rank, F32, g)  # strided views, b transposed, as a slot pool's rows
    if b_layout == "out_r":
        b = b.contiguous()
        assert b.is_contiguous() and N_OUT % 16 == 8
    x = torch.randn(4, tokens, N_IN, generator=g)
    y0 = torch.randn(4, tokens, N_OUT, generator=g)
    slots, seqs = torch.tensor([5, 0, 3]), torch.tensor([3, 0, 2])  # sequence 1 is another layout's
    y = y0.clone()
    assert K.add_lora(y, x, a, b, scaling, slots, seqs) is y
    close(y, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots, seqs), F32)
    assert torch.equal(y[1], y0[1])  # a sequence outside the layout: not touched at all
    y = y0.clone()
    every = torch.tensor([1, 5, 0, 1])
    K.add_lora(y, x, a, b, scaling, every)  # every sequence, one slot shared by two
    close(y, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), every), F32)


@pytest.mark.parametrize("d_out", [8, 16, 24, 48, 120])
def test_expand_over_tokens_covers_every_width_past_its_vector_blocks(d_out: int) -> None:
    """A prefill's groups (4+ tokens) hold 32 columns of B at a time, then 16, then one by one."""
    assert K is not None
    g = torch.Generator().manual_seed(d_out)
    a, b = torch.randn(3, 16, N_IN, generator=g), torch.randn(3, d_out, 16, generator=g)  # rank 16: 2 blocks
    scaling = torch.rand(3, generator=g)
    x, y0 = torch.randn(2, 7, N_IN, generator=g), torch.randn(2, 7, d_out, generator=g)
    slots = torch.tensor([2, 0])
    y = K.add_lora(y0.clone(), x, a, b, scaling, slots)
    close(y, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots), F32)


def test_bgmv_and_sgmv_dispatch_to_the_c_kernels_and_match_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(17)
    a, b, scaling = pool(5, 8, F32, g)
    x = torch.randn(9, N_IN, generator=g)
    assert kernels.fast_kernels(x, x, a, b, scaling) is K
    idx = torch.tensor([0, -1, 3, 3, 1, 4, -1, 2, 0])
    got = kernels.bgmv(x, a, b, scaling, idx)
    close(got, kernels.bgmv_reference(*f64(x, a, b, scaling), idx), F32)
    assert torch.equal(got[1], torch.zeros(N_OUT)) and torch.equal(got[6], torch.zeros(N_OUT))
    ea, eb, es = pool(4, 8, F32, g, experts=3)
    experts = torch.tensor([2, 0, 1, 0, 2, 1, 0, 0, 2])
    close(kernels.bgmv(x, ea, eb, es, idx.clamp(max=3), experts=experts),
          kernels.bgmv_reference(*f64(x, ea, eb, es), idx.clamp(max=3), experts), F32)
    starts, lens, segs = torch.tensor([0, 4, 5]), torch.tensor([4, 0, 3]), torch.tensor([2, 1, -1])
    got = kernels.sgmv(x, a, b, scaling, starts, lens, segs)
    close(got, kernels.sgmv_reference(*f64(x, a, b, scaling), starts, lens, segs), F32)
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")  # the torch ops give the same numbers
    assert kernels.fast_kernels(x, x, a, b, scaling) is None
    torch.testing.assert_close(kernels.sgmv(x, a, b, scaling, starts, lens, segs), got, rtol=0, atol=1e-5)


def test_the_torch_ops_run_where_the_c_kernels_do_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(2)
    a, b, scaling = pool(3, 4, F32, g)
    x = torch.randn(3, N_IN, generator=g)
    assert kernels.fast_kernels(x, x, a.double(), b, scaling) is None  # float32 only
    xg = x.clone().requires_grad_(True)
    assert kernels.fast_kernels(xg, xg, a, b, scaling) is None  # the trainer's autograd
    with torch.no_grad():
        assert kernels.fast_kernels(xg, xg, a, b, scaling) is K
    idx = torch.tensor([2, -1, 0])
    kernels.bgmv(xg, a, b, scaling, idx).sum().backward()
    assert xg.grad is not None and bool(xg.grad[1].eq(0).all()) and bool(xg.grad[0].ne(0).any())
    monkeypatch.setenv(kernels.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="MINT_LORA_KERNELS"):
        kernels.bgmv(x, a, b, scaling, idx)


def test_strided_features_take_the_plain_loops() -> None:
    """x and y whose features are not unit-stride (transposed views) still get exact groups."""
    assert K is not None
    g = torch.Generator().manual_seed(4)
    a, b, scaling = pool(4, 8, F32, g)
    x = torch.randn(N_IN, 6, generator=g).t()  # [6, in], feature stride 6
    y0 = torch.randn(N_OUT, 6, generator=g).t()
    groups = Groups(torch.tensor([1, -1, 3]), 3, rows=torch.tensor([0, 2, 3]), lens=torch.tensor([2, 1, 3]))
    y = y0.clone().t().contiguous().t()  # the same layout as y0, its own storage
    K.add_grouped(y, x, a, b, scaling, groups)
    want = kernels.sgmv_reference(*f64(x, a, b, scaling), groups.rows, groups.lens, groups.slots) + y0.double()
    close(y, want, F32)


def test_a_call_split_over_threads_gives_the_same_bits() -> None:
    """Each group's sums are ordered the same whichever thread runs it."""
    assert K is not None
    g = torch.Generator().manual_seed(8)
    a, b, scaling = pool(40, 8, F32, g)
    x = torch.randn(40, 1024, N_IN, generator=g)  # 40 x 1024 tokens x 8 x 70 multiply-adds: 5 threads. worth
    y0 = torch.randn(40, 1024, N_OUT, generator=g)
    slots = torch.arange(40) % 39
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = K.add_lora(y0.clone(), x, a, b, scaling, slots)
        torch.set_num_threads(3)
        three = K.add_lora(y0.clone(), x, a, b, scaling, slots)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)
    close(one, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots), F32)


def test_the_library_is_built_once_per_machine_and_cache(tmp_path: os.PathLike[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    first = cpu_kernels.build()
    assert first.parent == tmp_path and first.exists() and first.name.startswith("lora_cpu-")
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no temporary left behind


def test_a_missing_or_failing_compiler_is_a_clear_error(tmp_path: os.PathLike[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(cpu_kernels.BuildError, match=r"no C compiler 'no-such-cc'.*apt-get install -y gcc"):
        cpu_kernels.build()
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(cpu_kernels.BuildError, match=r"compiling lora_cpu\.c failed"):
        cpu_kernels.build()
    assert list(os.listdir(tmp_path)) == []


def test_groups_outside_the_tensors_are_refused_before_the_c_loops_run() -> None:
    """The C loops trust their arguments: a slot, expert, row or length out of range is a ValueError,
    and nothing is written."""
    assert K is not None
    g = torch.Generator().manual_seed(6)
    a, b, scaling = pool(4, 8, F32, g)
    x, y0 = torch.randn(6, N_IN, generator=g), torch.randn(6, N_OUT, generator=g)
    bad = [Groups(torch.tensor([4]), 1),  # slot past the pool
           Groups(torch.tensor([-2]), 1),
           Groups(torch.tensor([1]), 3, rows=torch.tensor([4])),  # rows 4..6 of 6
           Groups(torch.tensor([1]), 2, rows=torch.tensor([0]), lens=torch.tensor([3])),  # longer than L
           Groups(torch.tensor([1]), 1, rows=torch.tensor([-1])),
           Groups(torch.tensor([1] * 7), 1)]  # 7 one-token groups over 6 rows
    for groups in bad:
        y = y0.clone()
        with pytest.raises(ValueError, match="out of range"):
            K.add_grouped(y, x, a, b, scaling, groups)
        assert torch.equal(y, y0)
    ea, eb, es = pool(4, 8, F32, g, experts=3)
    with pytest.raises(ValueError, match="out of range"):
        K.add_grouped(y0.clone(), x, ea, eb, es, Groups(torch.tensor([1]), 1, experts=torch.tensor([3])))
    with pytest.raises(ValueError, match="out of range"):  # through the public op
        kernels.sgmv(x, a, b, scaling, torch.tensor([5]), torch.tensor([2]), torch.tensor([0]))
    x3 = torch.randn(2, 3, N_IN, generator=g)
    with pytest.raises(ValueError, match="out of range"):  # 3-D: more groups than sequences
        K.shrink(x3, a, scaling, Groups(torch.tensor([0, 1, 2]), 3))


def test_shrink_and_expand_in_one_call_give_the_bits_of_two() -> None:
    """``add`` (one foreign call) runs the loops of ``shrink`` then ``expand``: the same bits, dense
    and expert weights, 2-D rows and 3-D sequences; weights that cannot chain are refused."""
    assert K is not None and K.add is cpu_kernels.add
    g = torch.Generator().manual_seed(21)
    a, b, scaling = pool(5, 8, F32, g)
    ea, eb, es = pool(5, 8, F32, g, experts=3)
    x2, y2 = torch.randn(7, N_IN, generator=g), torch.randn(7, N_OUT, generator=g)
    x3, y3 = torch.randn(3, 4, N_IN, generator=g), torch.randn(3, 4, N_OUT, generator=g)
    cases = [(x2, y2, a, b, scaling, Groups(torch.tensor([4, -1, 2]), 3, rows=torch.tensor([0, 3, 4]),
                                            lens=torch.tensor([3, 1, 3]))),
             (x2, y2, ea, eb, es, Groups(torch.tensor([1, 4, 0, 2, 3, 3, 1]), 1, experts=torch.tensor([0, 2, 1, 1, 0,
                                                                                                          2, 2]))),
             (x3, y3, a, b, scaling, Groups(torch.tensor([0, 4]), 4, rows=torch.tensor([2, 0])))]
    for x, y0, wa, wb, sc, groups in cases:
        want = K.expand(y0.clone(), K.shrink(x, wa, sc, groups), wb, groups)
        got = y0.clone()
        assert K.add_grouped(got, x, wa, wb, sc, groups) is got
        assert torch.equal(got, want)
        assert not torch.equal(got, y0)
    with pytest.raises(ValueError, match="do not fit"):  # rank 8 against rank 4
        cpu_kernels.add(y2.clone(), x2, a, b[..., :4], scaling, Groups(torch.tensor([1]), 1))
    with pytest.raises(ValueError, match="do not fit"):  # y without x's rows
        cpu_kernels.add(y2[:5].clone(), x2, a, b, scaling, Groups(torch.tensor([1]), 1))
    none = torch.zeros(0, dtype=torch.int64)  # no group to run: malformed groups are still refused
    with pytest.raises(ValueError, match=r"groups\.rows"):
        cpu_kernels.add(y2.clone(), x2, a, b, scaling, Groups(none, 1, rows=torch.tensor([0])))
    with pytest.raises(ValueError, match=r"groups\.lens"):
        K.shrink(x2, a, scaling, Groups(none, 0, lens=torch.tensor([0.5])))
    y = y2.clone()  # a b pool shorter than a's: the slot is checked against both before anything runs
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernels.add(y, x2, a, b[:3], scaling, Groups(torch.tensor([4]), 1))
    assert torch.equal(y, y2)


def test_decode_and_prefill_add_lora_and_linear_lora_take_the_c_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[object] = []
    real = kernels.fast_kernels

    def spy(*args: torch.Tensor, **kw: bool) -> object:
        taken.append(real(*args, **kw))
        return taken[-1]

    monkeypatch.setattr(kernels, "fast_kernels", spy)
    g = torch.Generator().manual_seed(12)
    a, b, scaling = pool(5, 8, F32, g)
    slots = torch.tensor([4, 0, 2])
    w, bias = torch.randn(N_OUT, N_IN, generator=g) / N_IN**0.5, torch.randn(N_OUT, generator=g)
    for tokens in (1, 6, 32):  # a decode step, a short and a longer prefill (EXPAND's token-streaming loop)
        x, y0 = torch.randn(3, tokens, N_IN, generator=g), torch.randn(3, tokens, N_OUT, generator=g)
        y = y0.clone()
        assert kernels.add_lora(y, x, a, b, scaling, slots, progression=None) is y
        assert taken[-1] is K
        close(y, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots), F32)
        got = kernels.linear_lora(x, w, bias, a, b, scaling, slots)
        assert taken[-1] is K
        base = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        close(got, kernels.add_lora_reference(*f64(base, x, a, b, scaling), slots), F32)


def test_a_cache_that_cannot_be_written_falls_back_to_the_temporary_directory(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = os.path.join(tmp_path, "file")
    with open(blocked, "w") as f:
        f.write("not a directory")
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, os.path.join(blocked, "kernels"))  # mkdir under a file: OSError
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = cpu_kernels.build()
    assert out.exists() and out.parent == cpu_kernels.Path(tmp_path) / f"mint_store-kernels-{os.getuid()}"
    assert os.stat(out.parent).st_mode & 0o777 == 0o700


def test_a_shared_temporary_directory_others_may_write_is_refused(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """/tmp is shared: a library there that another user could have planted would run in this
    process. The fallback directory is this user's, 0700, or refused (the torch ops run)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    d = cpu_kernels.Path(tmp_path) / f"mint_store-kernels-{os.getuid()}"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(cpu_kernels.BuildError, match="only it may write"):
        native._shared_tmp_dir()
    d.chmod(0o700)
    assert native._shared_tmp_dir() == d


def test_a_skipped_group_is_not_checked_against_the_tensors_as_in_the_torch_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot -1 skips a group (the references, the torch ops, Triton): its row, length and expert
    are never used, so they may be anything, as a padded punica-style call passes them."""
    g = torch.Generator().manual_seed(23)
    a, b, scaling = pool(4, 8, F32, g)
    x = torch.randn(4, N_IN, generator=g)
    starts, lens, segs = torch.tensor([0, 100]), torch.tensor([2, 3]), torch.tensor([1, -1])
    got = kernels.sgmv(x, a, b, scaling, starts, lens, segs)
    ea, eb, es = pool(4, 8, F32, g, experts=3)
    idx, experts = torch.tensor([0, -1, 2, -1]), torch.tensor([1, -1, 2, 99])
    got_e = kernels.bgmv(x, ea, eb, es, idx, experts=experts)
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    torch.testing.assert_close(got, kernels.sgmv(x, a, b, scaling, starts, lens, segs), rtol=0, atol=1e-5)
    torch.testing.assert_close(got_e, kernels.bgmv(x, ea, eb, es, idx, experts=experts), rtol=0, atol=1e-5)
    assert torch.equal(got[2:], torch.zeros(2, N_OUT)) and torch.equal(got_e[1], torch.zeros(N_OUT))


def test_arguments_the_c_loops_would_misread_are_refused_and_nothing_is_written() -> None:
    """Found in review: a row near 2**63 wrapped the bounds check; widths, dtypes, a short scaling
    column and index tensors of other lengths were not compared. Each is now a ValueError."""
    assert K is not None
    g = torch.Generator().manual_seed(9)
    a, b, scaling = pool(4, 8, F32, g)
    x, y0 = torch.randn(6, N_IN, generator=g), torch.randn(6, N_OUT, generator=g)
    one = torch.tensor([1])
    calls = {
        "row overflow": lambda y: K.add_grouped(y, x, a, b, scaling, Groups(one, 1, rows=torch.tensor([2**63 - 1]),
                                                                          lens=one)),
        "x narrower than a": lambda y: K.add_grouped(y, x[:, :40], a, b, scaling, Groups(one, 1)),
        "y narrower than b": lambda y: K.expand(y[:, :8], K.shrink(x, a, scaling, Groups(one, 1)), b, Groups(one, 1)),
        "short scaling": lambda y: K.add_grouped(y, x, a, b, scaling[:1], Groups(one, 1)),
        "experts with 3-D weights": lambda y: K.add_grouped(y, x, a, b, scaling, Groups(one, 1, experts=one)),
        "float64 x": lambda y: K.add_grouped(y, x.double(), a, b, scaling, Groups(one, 1)),
        "float16 h": lambda y: K.expand(y, torch.zeros(6, 1, 8, dtype=torch.float16), b, Groups(one, 1)),
        "short lens": lambda y: K.add_grouped(y, x, a, b, scaling, Groups(torch.tensor([1, 2]), 1,
                                                                        rows=torch.tensor([0, 1]), lens=one)),
        "expand rows past y": lambda y: K.expand(y, torch.zeros(6, 1, 8), b, Groups(one, 1, rows=torch.tensor([6]))),
    }
    for what, call in calls.items():
        y = y0.clone()
        with pytest.raises(ValueError):
            call(y)
        assert torch.equal(y, y0), what
    with pytest.raises(ValueError, match="out of range"):  # through the public op: the torch path raises too
        kernels.sgmv(x, a, b, scaling, torch.tensor([2**63 - 1]), torch.tensor([1]), torch.tensor([0]), max_len=1)


def test_overlapping_segments_take_the_torch_ops_and_sum() -> None:
    g = torch.Generator().manual_seed(10)
    a, b, scaling = pool(4, 8, F32, g)
    x = torch.randn(8, N_IN, generator=g)
    starts, lens, segs = torch.tensor([0, 2, 6]), torch.tensor([4, 4, 2]), torch.tensor([1, 3, 0])  # rows 2, 3 twice
    close(kernels.sgmv(x, a, b, scaling, starts, lens, segs),
          kernels.sgmv_reference(*f64(x, a, b, scaling), starts, lens, segs), F32)


def test_a_sequence_named_twice_gets_both_deltas_as_in_the_reference() -> None:
    """The C loops add without atomics and lay h out by x's rows: a repeated sequence takes the
    torch ops (which sum), unless the caller says the sequences are distinct."""
    g = torch.Generator().manual_seed(12)
    a, b, scaling = pool(4, 8, F32, g)
    x = torch.randn(3, 4, N_IN, generator=g)
    y0 = torch.randn(3, 4, N_OUT, generator=g)
    slots, seqs = torch.tensor([0, 1, 3]), torch.tensor([2, 0, 2])
    got = kernels.add_lora(y0.clone(), x, a, b, scaling, slots, seqs)
    close(got, kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots, seqs), F32)
    distinct = torch.tensor([2, 0, 1])
    close(kernels.add_lora(y0.clone(), x, a, b, scaling, slots, distinct, distinct=True),
          kernels.add_lora_reference(*f64(y0, x, a, b, scaling), slots, distinct), F32)


def test_expand_into_rows_steps_h_by_its_rows_whatever_the_stride_of_its_size_one_dimension() -> None:
    """2-D y [N, out]: token t of a group is row rows[g] + t of h [N, 1, r]. The stride of h's
    size-1 dimension is arbitrary (torch calls such an h contiguous); stepping by it read
    outside h."""
    assert K is not None
    g = torch.Generator().manual_seed(13)
    _, b, _ = pool(2, 8, F32, g)
    n = 6
    h = torch.randn(1, n, 8, generator=g).transpose(0, 1)  # [6, 1, 8], strides (8, 48, 1)
    assert h.is_contiguous() and h.stride(1) == n * 8
    groups = Groups(torch.tensor([1, 0]), 4, rows=torch.tensor([0, 4]), lens=torch.tensor([4, 2]))
    y0 = torch.randn(n, N_OUT, generator=g)
    want = K.expand(y0.clone(), torch.empty(n, 1, 8).copy_(h), b, groups)  # strides (8, 8, 1)
    assert torch.equal(K.expand(y0.clone(), h, b, groups), want)
    close(want[:4], (y0[:4] + h[:4, 0] @ b[1].T).double(), F32)


def test_expert_runs_at_model_widths_match_the_pair_loop() -> None:
    """The experts' grouped call as ExpertsLoRA makes it (route's runs, pool-shaped weights), at
    widths that take every vector path: SHRINK's 8-rank blocks, EXPAND's 16 x 8 transposes and
    its one-token path, widths with tails (72 in, 136 out)."""
    from engine_client.kernels.moe import route

    assert K is not None
    g = torch.Generator().manual_seed(11)
    n_exp, n_seq, d_in, d_out, rank = 4, 6, 72, 136, 8
    pool_a = torch.randn(n_seq + 1, n_exp, rank, d_in, generator=g) / d_in**0.5
    pool_b = torch.randn(n_seq + 1, n_exp, d_out, rank, generator=g) / rank**0.5  # [out, r] as stored
    scaling = torch.rand(n_seq + 1, generator=g) + 0.5
    seq_slots = torch.tensor([3, 1, -1, 6, 2, 5])
    for per in (1, 9):  # decode (one-token runs) and prefill (runs of several tokens, odd lengths)
        idx = torch.stack([torch.randperm(n_exp, generator=g)[:2] for _ in range(n_seq * per)])
        r = route(idx, n_exp, per, groups=True)
        assert r.groups is not None and r.group_seq is not None
        x = torch.randn(r.tok.shape[0], d_in, generator=g)
        y0 = torch.randn(r.tok.shape[0], d_out, generator=g)
        y = K.add_grouped(y0.clone(), x, pool_a, pool_b, scaling, r.groups.with_slots(seq_slots[r.group_seq]))
        want = y0.double() + kernels.bgmv_reference(*f64(x, pool_a, pool_b, scaling), seq_slots[r.seq], r.experts)
        close(y, want, F32)
