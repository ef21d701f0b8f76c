"""A tensor-parallel engine: a Llama base sharded by transformers' ``tp_plan`` over 2 ranks
(torchrun, gloo, CPU), adapters streamed from a real local store, compared with PEFT on the
unsharded model. One torchrun launch (tests/engine/tp_worker.py) runs the Llama base and the MoE
and MLA bases one after the other, and serves every test here."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from mint_store import blocks
from tests.support.engine import TENANT, publish_dirs
from tests.support.hf_models import ATTN, MLA, MLP, MOE_PARAMS, build_model, load_peft, peft_model, sample_ids
from tests.support.targets import StoreTarget

WORKER = Path(__file__).with_name("tp_worker.py")
ADAPTERS: dict[str, tuple[int, dict[str, Any]]] = {  # name -> (seed of its factors, LoRA config)
    "a": (1, dict(r=1, lora_alpha=2, target_modules=[*ATTN, *MLP])),
    "a_v2": (2, dict(r=1, lora_alpha=2, target_modules=[*ATTN, *MLP])),
    "b": (3, dict(r=16, lora_alpha=8, target_modules=ATTN, rank_pattern={"o_proj": 4}, use_rslora=True)),
    "b2": (4, dict(r=16, lora_alpha=8, target_modules=ATTN, rank_pattern={"o_proj": 4}, use_rslora=True)),
    "c": (5, dict(r=2, lora_alpha=3, target_modules=["v_proj", "down_proj"],
                  target_parameters=["self_attn.q_proj.weight"])),
}
BATCH = ["t/a:prod", "t/b", None, "t/c", "t/a:prod", "t/b"]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match"),
    pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                       reason="torchrun is not installed next to this Python"),
]


@dataclass
class Run:
    logits: list[dict[str, torch.Tensor]]  # per rank: step -> logits
    reports: list[dict[str, Any]]
    peft: dict[str | None, torch.Tensor]  # adapter name (None: base) -> PEFT logits on the unsharded model
    ids: torch.Tensor
    kind: str
    layouts: dict[str, str]  # adapter name -> layout id


@contextlib.contextmanager
def fine_grid() -> Iterator[None]:
    """Publish these tiny rows with block digests, 8 blocks per sliced tensor (the defaults give
    none to rows under 256 KiB), so that ranks read them by slices from the first load."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks, "MIN_ROW_BYTES", 0)
        mp.setattr(blocks, "MIN_BLOCK_BYTES", 1)
        yield


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Planned:
    """One run of the worker, written before the launch; PEFT's side is computed after it."""
    tmp: Path
    spec: dict[str, Any]
    kind: str
    dirs: dict[str, Path]
    ids: torch.Tensor
    layouts: dict[str, str]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every base's run, from one torchrun launch: "llama", then each of FAMILIES."""
    planned = [_plan_llama(tmp_path_factory.mktemp("tp"))]
    planned += [_plan_family(tmp_path_factory.mktemp(kind), kind) for kind in FAMILIES]
    return _launch(tmp_path_factory.mktemp("tp_launch"), planned)


@pytest.fixture(scope="module")
def run(runs: dict[str, Run]) -> Run:
    return runs["llama"]


def _plan_llama(tmp: Path) -> Planned:
    dirs = {}
    for name, (seed, lora) in ADAPTERS.items():
        peft_model(build_model("llama"), seed=seed, **lora).save_pretrained(str(tmp / name))
        dirs[name] = tmp / name
    build_model("llama").save_pretrained(str(tmp / "base"))
    target = StoreTarget("local", str(tmp / "store"), str(tmp / "index"), None)
    with fine_grid():
        published = publish_dirs(target, {"a": dirs["a"]}, tag="prod")
        published |= publish_dirs(target, {n: dirs[n] for n in ("b", "b2", "c")})
    ids = sample_ids(batch=len(BATCH), seq=6, seed=3)
    spec = {
        "base": str(tmp / "base"), "store": target.url, "index": target.index_dir, "out": str(tmp),
        "ids": ids.tolist(),
        "steps": [
            {"name": "mixed", "adapters": BATCH},
            {"name": "swapped", "adapters": BATCH,
             "publish": {"tenant": TENANT, "name": "a", "dir": str(dirs["a_v2"]), "tag": "prod"}},
        ],
        "fail_steps": [
            {"name": "fail", "adapters": ["t/b", "t/b2", None, None, None, None]},
            {"name": "after_fail", "adapters": ["t/b2", None, None, None, None, "t/b2"]},
            # a rank's own list is not used (rank 0's is broadcast): one too long on rank 1 runs
            {"name": "rank1_list_ignored", "adapters": ["t/b2", None, None, None, None, None], "rank1_extra": 1},
            # rank 0's bad list fails the batch on every rank (raised before the broadcast, rank 1 waited)
            {"name": "rank0_bad_list", "adapters": ["t/b2", 5, None, None, None, None]},
        ],
        "churn_steps": [
            {"name": "churn1", "adapters": ["t/b", None, None, None, None, None]},
            {"name": "churn2", "adapters": [None, "t/b2", None, None, None, None]},
            {"name": "churn3", "adapters": ["t/b", None, None, None, None, None]},
            {"name": "churn4", "adapters": [None, "t/b2", None, None, None, None]},
            {"name": "corrupt", "adapters": ["t/b", None, None, None, None, None], "corrupt": "t/b"},
        ],
        "beside_trainer": ["t/a:prod", "t/b2", None, "t/c", "t/a:prod", "t/b2"],
    }
    return Planned(tmp, spec, "llama", dirs, ids, {n: r.layout_id for n, r in published.items()})


def _launch(tmp: Path, planned: list[Planned]) -> dict[str, Run]:
    """Run the worker on 2 ranks over every planned spec; PEFT's logits of every adapter on the
    unsharded model, per base."""
    from safetensors.torch import load_file

    (tmp / "spec.json").write_text(json.dumps([p.spec for p in planned]))
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(WORKER), str(tmp / "spec.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    runs = {}
    for p in planned:
        peft: dict[str | None, torch.Tensor] = {}
        with torch.no_grad():
            peft[None] = build_model(p.kind)(p.ids).logits
            for name, path in p.dirs.items():
                peft[name] = load_peft(path, p.kind)(p.ids).logits
        runs[p.kind] = Run([load_file(str(p.tmp / f"rank{r}.safetensors")) for r in range(2)],
                           [json.loads((p.tmp / f"rank{r}.json").read_text()) for r in range(2)],
                           peft, p.ids, p.kind, p.layouts)
    return runs


def _check_rows(run: Run, step: str, names: list[str | None]) -> None:
    for rank in range(2):
        out = run.logits[rank][step]
        for row, name in enumerate(names):
            want = run.peft[name][row]
            diff = (out[row] - want).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} step {step} row {row} ({name or 'base'}): max abs diff {diff}"
            if name is not None:  # the adapter changes the row: the comparison is not vacuous
                assert (want - run.peft[None][row]).abs().max().item() > 1e-2


def test_tp_mixed_batch_equals_peft_on_the_unsharded_model_on_every_rank(run: Run) -> None:
    # rank 1 passed None for every sequence: it ran rank 0's adapters, broadcast at the batch start
    _check_rows(run, "mixed", ["a", "b", None, "c", "a", "b"])


def test_tp_ranks_hold_only_their_slice(run: Run) -> None:
    pools = [r["pools"] for r in run.reports]
    assert set(pools[0]) == set(pools[1]) and len(pools[0]) == 3  # the layouts of a, b and c
    for lid, p0 in pools[0].items():
        p1 = pools[1][lid]
        # the sharded tensors are split exactly in two, the replicated ones held whole by both
        assert p0["cut_nbytes"] + p1["cut_nbytes"] == p0["cut_full_nbytes"] > 0
        assert p0["whole_nbytes"] == p1["whole_nbytes"]
        for p in (p0, p1):
            assert p["slot_nbytes"] < p["row_nbytes"]
            assert p["cut_nbytes"] * 2 == p["cut_full_nbytes"]  # every linear here splits evenly


def test_tp_tag_moved_mid_run_switches_both_ranks_at_the_next_batch(run: Run) -> None:
    _check_rows(run, "swapped", ["a_v2", "b", None, "c", "a_v2", "b"])


def test_tp_a_rank_that_cannot_load_fails_the_batch_on_every_rank(run: Run) -> None:
    for r in run.reports:
        msg = r["errors"].get("fail", "")
        assert "rank 1: OutOfSlots" in msg and "rank 0" not in msg.replace("rank 0 ran", ""), msg
    assert all("fail" not in lg for lg in run.logits)
    # both ranks go on together after it
    assert all("after_fail" not in r["errors"] for r in run.reports)
    _check_rows(run, "after_fail", ["b2", None, None, None, None, "b2"])
    _check_rows(run, "rank1_list_ignored", ["b2", None, None, None, None, None])
    for r in run.reports:  # on every rank, not only rank 0: rank 1 no longer waits in the broadcast
        assert "rank 0 could not resolve the batch: TypeError" in r["errors"].get("rank0_bad_list", ""), r["errors"]


def test_tp_every_read_of_a_row_reads_only_this_ranks_slice_verified(run: Run) -> None:
    # one slot and no host cache: every step reloads; the first load of a row reads only the
    # blocks of this rank's slice (checked against the block digests its commit recorded), later
    # loads exactly the slice (checked against its digest): never the whole row
    for r in run.reports:
        (pool,) = [p for p in r["churn_pools"].values()]
        got = r["churn_bytes"]
        assert got["churn1"] == got["churn2"] == pool["slice_read_nbytes"] < pool["row_nbytes"]
        assert got["churn3"] == got["churn4"] == pool["slice_read_nbytes"]
    _check_rows(run, "churn3", ["b", None, None, None, None, None])
    _check_rows(run, "churn4", [None, "b2", None, None, None, None])


def test_tp_a_slice_that_does_not_match_its_digest_fails_the_batch_on_every_rank(run: Run) -> None:
    # rank 0 flipped a byte inside rank 1's rows of b: only rank 1 reads them, and catches it
    for r in run.reports:
        msg = r["errors"].get("corrupt", "")
        assert "rank 1: IntegrityError" in msg and "rank 0:" not in msg, msg
    assert all("corrupt" not in lg for lg in run.logits)


def test_tp_the_trainer_takes_a_tensor_parallel_base(run: Run) -> None:
    # (training on it equals the unsharded trainer: tests/train/test_train_tp.py)
    for r in run.reports:
        # its SFT step ran beside a LoRAEngine holding adapters of the same (row-parallel) modules
        assert r["trainer"] == "accepted" and r["trainer_policies"] == ["t/p"], r["trainer"]
        assert r["trainer_loss"] > 0 and r["trainer_loss"] == run.reports[0]["trainer_loss"]
    # the engine's batches before and after the trainer's step, on the same base (t/b was corrupted by now)
    names = ["a_v2", "b2", None, "c", "a_v2", "b2"]
    _check_rows(run, "beside_trainer", names)
    _check_rows(run, "after_trainer", names)
    assert not any(r["trainer_frozen"] for r in run.reports)  # close() gave the base its requires_grad back


# MoE and MLA bases: their linears follow the plan (Qwen3-MoE: attention colwise/rowwise; DeepSeek-V3:
# attention is not in its plan, so MLA adapters run whole beside a sharded MLP), and so do their fused
# experts (moe_tp_experts: each rank holds its rows of the gate and up halves and its columns of down)
FAMILIES: dict[str, dict[str, tuple[int, dict[str, Any]]]] = {
    "qwen3_moe": {
        "a": (1, dict(r=2, lora_alpha=4, target_modules=ATTN)),
        "b": (2, dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                      rank_pattern={"o_proj": 3}, use_rslora=True)),
        "x": (3, dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=MOE_PARAMS,
                      rank_pattern={"model.layers.1.mlp.experts.down_proj": 3}, use_rslora=True)),
    },
    "deepseek_v3": {
        # MLA only: PEFT 0.21 maps gate_proj/up_proj/down_proj of this model onto the fused experts'
        # parameters, so its sharded dense MLP cannot be targeted through PEFT here
        "a": (1, dict(r=2, lora_alpha=4, target_modules=list(MLA))),
        "b": (2, dict(r=16, lora_alpha=8, target_modules=["q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"],
                      rank_pattern={"kv_b_proj": 3}, use_rslora=True)),
        "x": (3, dict(r=2, lora_alpha=4, target_modules=["q_b_proj"], target_parameters=MOE_PARAMS)),
    },
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_run(request: pytest.FixtureRequest, runs: dict[str, Run]) -> Run:
    return runs[request.param]


def _plan_family(tmp: Path, kind: str) -> Planned:
    dirs = {}
    for name, (seed, lora) in FAMILIES[kind].items():
        peft_model(build_model(kind), seed=seed, **lora).save_pretrained(str(tmp / name))
        dirs[name] = tmp / name
    build_model(kind).save_pretrained(str(tmp / "base"))
    target = StoreTarget("local", str(tmp / "store"), str(tmp / "index"), None)
    with fine_grid():
        published = publish_dirs(target, dirs)
    ids = sample_ids(batch=4, seq=6, seed=3)
    spec = {"base": str(tmp / "base"), "store": target.url, "index": target.index_dir, "out": str(tmp),
            "ids": ids.tolist(),
            "steps": [{"name": "mixed", "adapters": ["t/a", "t/b", None, "t/x"]}]}
    return Planned(tmp, spec, kind, dirs, ids, {n: r.layout_id for n, r in published.items()})


def test_tp_moe_and_mla_bases_mixed_batch_equals_peft(family_run: Run) -> None:
    _check_rows(family_run, "mixed", ["a", "b", None, "x"])
    for r in family_run.reports:  # the trainer refuses fused experts run tensor-parallel, changing nothing
        assert r["trainer"].startswith("TrainerError: module") and "moe_tp_experts" in r["trainer"], r["trainer"]
        assert r["trainer_policies"] == [] and not r["trainer_frozen"]
    for r in family_run.reports:  # Qwen3-MoE's attention adapters are held sliced, DeepSeek's MLA ones whole
        assert not r["errors"]
        for lid, p in r["pools"].items():
            name = next(n for n, got in family_run.layouts.items() if got == lid)
            assert (p["cut_nbytes"] > 0) == (name == "x" or family_run.kind == "qwen3_moe"), name
