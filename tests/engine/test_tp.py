"""A tensor-parallel engine: a Llama base sharded by transformers' ``tp_plan`` over 2 ranks
(torchrun, gloo, CPU), adapters streamed from a real local store, compared with PEFT on the
unsharded model; MoE and MLA bases under ``tp_plan`` (experts replicated), ``ep_plan`` (expert
parallelism: each rank its experts) and the deprecated ``moe_tp_experts``. One torchrun launch
(tests/engine/tp_worker.py) runs every base one after the other, and serves every test here."""

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

from mint_store.format import blocks
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
    name: str = ""  # the run's name ("llama" or one of FAMILIES)


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
    name: str = ""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every base's run, from one torchrun launch: "llama", then each of FAMILIES."""
    planned = [_plan_llama(tmp_path_factory.mktemp("tp"))]
    planned += [_plan_family(tmp_path_factory.mktemp(name), name) for name in _families()]
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
        # a column-parallel and a row-parallel target
        "trainer": [{"name": "t/p", "target_modules": ["o_proj", "v_proj"]}],
    }
    return Planned(tmp, spec, "llama", dirs, ids, {n: r.layout_id for n, r in published.items()}, "llama")


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
        runs[p.name] = Run([load_file(str(p.tmp / f"rank{r}.safetensors")) for r in range(2)],
                           [json.loads((p.tmp / f"rank{r}.json").read_text()) for r in range(2)],
                           peft, p.ids, p.kind, p.layouts, p.name)
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
        # its SFT steps ran beside a LoRAEngine holding adapters of the same (row-parallel) modules
        (got,) = r["trainer"]
        assert got["result"] == "accepted" and got["policies"] == ["t/p"], got
        assert got["losses"][0] > 0 and got["losses"] == run.reports[0]["trainer"][0]["losses"]
    # the engine's batches before and after the trainer's step, on the same base (t/b was corrupted by now)
    names = ["a_v2", "b2", None, "c", "a_v2", "b2"]
    _check_rows(run, "beside_trainer", names)
    _check_rows(run, "after_trainer", names)
    assert not any(r["trainer_frozen"] for r in run.reports)  # close() gave the base its requires_grad back


# MoE and MLA bases, loaded the ways transformers shards them now. Their linears follow the tp_plan
# (Qwen3-MoE: attention colwise/rowwise; DeepSeek-V3: MLA's q_b/kv_b colwise, o_proj rowwise, kv_a
# whole); the fused experts are replicated under tp_plan (the adapter runs whole on every rank),
# split by expert under ep_plan (ep_size: each rank holds and reads only its experts' slices), or,
# through the deprecated moe_tp_experts style named in a tp_plan, split within every expert.
QWEN_MOE = {
    "a": (1, dict(r=2, lora_alpha=4, target_modules=ATTN)),
    "b": (2, dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                  rank_pattern={"o_proj": 3}, use_rslora=True)),
    "x": (3, dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=MOE_PARAMS,
                  rank_pattern={"model.layers.1.mlp.experts.down_proj": 3}, use_rslora=True)),
}
DEEPSEEK = {
    # MLA only: PEFT 0.21 maps gate_proj/up_proj/down_proj of this model onto the fused experts'
    # parameters, so its sharded dense MLP cannot be targeted through PEFT here
    "a": (1, dict(r=2, lora_alpha=4, target_modules=list(MLA))),
    "b": (2, dict(r=16, lora_alpha=8, target_modules=["q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"],
                  rank_pattern={"kv_b_proj": 3}, use_rslora=True)),
    "x": (3, dict(r=2, lora_alpha=4, target_modules=["q_b_proj"], target_parameters=MOE_PARAMS)),
}
EXPERTS_POLICY = {"name": "t/p", "target_modules": ["o_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]}
# the deprecated style (removal announced for transformers 5.28), named in a tp_plan override
MOE_TP_EXPERTS = {"model.layers.*.mlp.experts": "moe_tp_experts",
                  "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                  "model.layers.*.mlp.experts.down_proj": "rowwise"}


@dataclass(frozen=True)
class Family:
    kind: str  # the base (tests/support/hf_models.py)
    adapters: dict[str, tuple[int, dict[str, Any]]]
    parallel: dict[str, Any]  # DistributedConfig fields beyond tp_size=2
    trainer: list[dict[str, Any]]  # policies the trainer is given, one attempt each
    expect: list[str]  # per attempt: "accepted", or a phrase of its TrainerError
    experts: str  # how the engine runs the fused experts: "whole" | "ep" | "tp"
    corrupt: bool = False  # also: a fresh engine's first load of a row whose rank-1 experts were damaged


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family("qwen3_moe", QWEN_MOE, {}, [EXPERTS_POLICY], ["accepted"], "whole"),
    "deepseek_v3": Family("deepseek_v3", DEEPSEEK, {},
                          [EXPERTS_POLICY, {"name": "t/k", "target_modules": ["kv_a_proj_with_mqa"]}],
                          ["accepted", "as mla_kv_a_proj"], "whole"),
    "qwen3_moe_ep": Family("qwen3_moe", QWEN_MOE, {"ep_size": 2},
                           [EXPERTS_POLICY, {"name": "t/q", "target_modules": ["o_proj", "v_proj"]}],
                           ["is expert-parallel", "accepted"], "ep", corrupt=True),
    # experts only (tp_plan={}): the EP group runs the batches, everything else whole
    "deepseek_v3_ep": Family("deepseek_v3", DEEPSEEK, {"ep_size": 2, "tp_plan": {}},
                             [EXPERTS_POLICY, {"name": "t/q", "target_modules": ["o_proj", "q_b_proj"]}],
                             ["is expert-parallel", "accepted"], "ep"),
    "qwen3_moe_tp_experts": Family("qwen3_moe", QWEN_MOE, {"tp_plan": MOE_TP_EXPERTS}, [EXPERTS_POLICY],
                                   ["as moe_tp_experts"], "tp"),
}


def _has_moe_tp_experts() -> bool:
    """Whether the installed transformers still registers the deprecated ``moe_tp_experts`` style."""
    try:
        from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    except ImportError:
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    return "moe_tp_experts" in ALL_PARALLEL_STYLES


def _families() -> list[str]:
    return [f for f in FAMILIES if FAMILIES[f].experts != "tp" or _has_moe_tp_experts()]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_run(request: pytest.FixtureRequest, runs: dict[str, Run]) -> Run:
    if request.param not in runs:
        pytest.fail(_GONE)
    return runs[request.param]


_GONE = ("transformers no longer registers the moe_tp_experts parallel style (its removal was announced for 5.28): "
         "remove the engine's path for it (TPExpertsLoRA, _experts_shards and the tp.experts cases in "
         "engine_client/tp/sharding.py and engine_client/train/tp_train.py), the qwen3_moe_tp_experts family here, "
         "and the moe_tp_experts lines of docs/architecture.md and docs/training.md")


def test_tp_the_deprecated_moe_tp_experts_style_is_still_there() -> None:
    # fails loudly the day transformers drops the style, naming what to remove
    assert _has_moe_tp_experts(), _GONE


def _plan_family(tmp: Path, name: str) -> Planned:
    fam = FAMILIES[name]
    dirs = {}
    adapters = dict(fam.adapters)
    if fam.corrupt:  # another row of x's layout, damaged before any engine reads it
        adapters["x2"] = (4, adapters["x"][1])
    for adapter, (seed, lora) in adapters.items():
        peft_model(build_model(fam.kind), seed=seed, **lora).save_pretrained(str(tmp / adapter))
        dirs[adapter] = tmp / adapter
    build_model(fam.kind).save_pretrained(str(tmp / "base"))
    target = StoreTarget("local", str(tmp / "store"), str(tmp / "index"), None)
    with fine_grid():
        published = publish_dirs(target, dirs)
    ids = sample_ids(batch=4, seq=6, seed=3)
    spec = {"base": str(tmp / "base"), "store": target.url, "index": target.index_dir, "out": str(tmp),
            "ids": ids.tolist(), "parallel": fam.parallel, "trainer": fam.trainer,
            "steps": [{"name": "mixed", "adapters": ["t/a", "t/b", None, "t/x"]}]}
    if fam.corrupt:  # a fresh engine (one slot): x makes the pool, then x2's first load
        spec["churn_steps"] = [{"name": "x_first", "adapters": [None, None, None, "t/x"]},
                               {"name": "corrupt", "adapters": [None, None, None, "t/x2"], "corrupt": "t/x2",
                                "in_experts": True}]
    return Planned(tmp, spec, fam.kind, dirs, ids, {n: r.layout_id for n, r in published.items()}, name)


def test_tp_moe_and_mla_bases_mixed_batch_equals_peft(family_run: Run) -> None:
    fam = FAMILIES[family_run.name]
    attention_sharded = fam.parallel.get("tp_plan") != {}
    _check_rows(family_run, "mixed", ["a", "b", None, "x"])
    for r in family_run.reports:
        assert set(r["errors"]) <= ({"corrupt"} if fam.corrupt else set()), r["errors"]
        assert bool(r["tp_experts"]) == (fam.experts == "tp"), r["tp_experts"]
        layers = [f"model.layers.{i}.mlp.experts" for i in range(2) if fam.kind == "qwen3_moe" or i == 1]
        want = {p: [2 * r["rank"], 2 * r["rank"] + 2] for p in layers} if fam.experts == "ep" else {}
        assert r["ep_experts"] == want  # each rank its half of the 4 experts
        for lid, p in r["pools"].items():
            name = next(n for n, got in family_run.layouts.items() if got == lid)
            # attention adapters are held sliced where the plan shards attention (not under tp_plan={})
            assert (p["cut_nbytes"] > 0) == ((name == "x" and fam.experts != "whole") or attention_sharded), name
            # an expert-parallel rank holds only its experts of every expert tensor; elsewhere none is cut by expert
            assert p["expert_pieces"] == ([[[2 * r["rank"], 2 * r["rank"] + 2]]] if fam.experts == "ep"
                                          and name == "x" else []), (name, p["expert_pieces"])
        # the first load of each row read only the blocks of this rank's slice (checked against the
        # row's block digests): on an expert-parallel base, only its experts' blocks of the expert tensors
        pools = r["pools"].values()
        assert r["step_bytes"]["mixed"] == sum(p["slice_read_nbytes"] for p in pools)
        x = r["pools"][family_run.layouts["x"]]
        assert (x["slice_read_nbytes"] < x["row_nbytes"]) == (fam.experts != "whole" or attention_sharded)


def test_tp_the_trainer_on_moe_and_mla_bases_trains_what_it_can_and_refuses_the_rest(family_run: Run) -> None:
    from tests.engine.tp_worker import attempt_training

    fam = FAMILIES[family_run.name]
    for r in family_run.reports:
        assert not r["trainer_frozen"]  # a refused policy changed nothing, a closed trainer restored the base
        for attempt, want, got in zip(fam.trainer, fam.expect, r["trainer"], strict=True):
            if want != "accepted":
                assert got["result"].startswith("TrainerError: module") and want in got["result"], got["result"]
                assert got["policies"] == [] and got["losses"] == []
                continue
            assert got["result"] == "accepted", got["result"]
            # two SFT steps (the second after an optimizer step) equal the same policy on the unsharded base
            ref = attempt_training(build_model(fam.kind), family_run.ids, attempt)
            assert ref["result"] == "accepted"
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), (got["losses"], ref["losses"])


def test_tp_an_expert_shard_not_matching_its_block_digest_fails_the_batch_on_every_rank(runs: dict[str, Run]) -> None:
    # rank 0 flipped a byte of x2's row inside expert 2, rank 1's: only rank 1 reads that expert's
    # blocks (its first load, checked against the per-expert block digests), and catches it
    got = runs["qwen3_moe_ep"]
    for r in got.reports:
        msg = r["errors"].get("corrupt", "")
        assert "rank 1: IntegrityError" in msg and "rank 0:" not in msg and "[2])" in msg, msg
        assert "x_first" not in r["errors"]
    assert all("corrupt" not in lg for lg in got.logits)
