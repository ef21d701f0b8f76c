"""MultiLoRATrainer on a tensor-parallel base: a Llama base sharded by transformers' ``tp_plan``
over 2 ranks (torchrun, gloo, CPU) trains two policies of different layouts in mixed SFT
batches and one GRPO step; losses, the published adapters and every rank's policies equal the same run on the
unsharded base. One torchrun run (tests/train/tp_train_worker.py) serves every test here."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_client import SyncMintClient
from tests.support.hf_models import build_model, sample_ids
from tests.train.tp_train_worker import POLICIES, STEPS, train

WORKER = Path(__file__).with_name("tp_train_worker.py")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                                 reason="torchrun is not installed next to this Python")]


@dataclass
class Run:
    reports: list[dict[str, Any]]  # per rank
    tensors: list[dict[str, torch.Tensor]]  # per rank: "policy/module.a|b" -> its final factor
    published: dict[str, dict[str, torch.Tensor]]  # policy -> what the TP run's store holds (tag latest)
    ref_report: dict[str, Any]  # the unsharded run
    ref: dict[str, dict[str, torch.Tensor]]  # policy -> the unsharded run's final factors
    init: dict[str, dict[str, torch.Tensor]]  # policy -> its factors before training


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _factors(adapter: Any) -> dict[str, torch.Tensor]:
    out = {}
    for m in adapter.modules:
        out[f"{m.name}.a"], out[f"{m.name}.b"] = m.a, m.b
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    import transformers as tf
    from safetensors.torch import load_file

    tmp = tmp_path_factory.mktemp("tp_train")
    build_model("llama").save_pretrained(str(tmp / "base"))
    ids = sample_ids(batch=4, seq=6, seed=11)
    labels = ids.clone()
    labels[:, :2] = -100  # a prompt without loss
    spec = {"base": str(tmp / "base"), "store": str(tmp / "store"), "index": str(tmp / "index"), "out": str(tmp),
            "ids": ids.tolist(), "labels": labels.tolist()}
    (tmp / "spec.json").write_text(json.dumps(spec))
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(WORKER), str(tmp / "spec.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    with SyncMintClient(spec["store"], index_dir=spec["index"]) as client:
        published = {p: _factors(client.load(f"{p}:latest")) for p in POLICIES}
    # the same run on the unsharded base (no store: compare the trainer's own policies)
    reports, ref, init = [], {}, {}
    for steps, got in ((STEPS, ref), (0, init)):
        model = tf.AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32).eval()
        trainer, report = train(model, None, ids, labels, steps=steps, publish=False)
        got.update({p: _factors(trainer.adapter(p)) for p in POLICIES})
        reports.append(report)
        trainer.close()
    return Run([json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)],
               [load_file(str(tmp / f"rank{r}.safetensors")) for r in range(2)], published, reports[0], ref, init)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def test_tp_trainer_sft_and_grpo_losses_equal_the_unsharded_trainers(run: Run) -> None:
    for rank, rep in enumerate(run.reports):
        assert len(rep["losses"]) == STEPS
        for step, (got, want) in enumerate(zip(rep["losses"], run.ref_report["losses"], strict=True)):
            for p in POLICIES:
                assert abs(got[p] - want[p]) <= 1e-5 * abs(want[p]), (rank, step, p, got[p], want[p])
            for p in POLICIES:
                g, w = rep["norms"][step][p], run.ref_report["norms"][step][p]
                assert w > 0 and abs(g - w) <= 1e-5 * w, (rank, step, p, g, w)
        # the GRPO step: the same completions (rewards), losses and KL as on the unsharded base
        for p in POLICIES:
            for g, w in zip(rep["grpo"][p], run.ref_report["grpo"][p], strict=True):
                assert abs(g - w) <= 1e-5 * max(abs(w), 1e-3), (rank, p, rep["grpo"][p], run.ref_report["grpo"][p])
        assert rep["grpo_stepped"] == run.ref_report["grpo_stepped"] and rep["grpo_stepped"][0]
    # training moved the losses: the comparison is not of a constant
    for p in POLICIES:
        assert run.ref_report["losses"][-1][p] < run.ref_report["losses"][0][p] - 1e-3


def test_tp_trainer_publishes_from_rank_0_what_the_unsharded_trainer_trains(run: Run) -> None:
    assert run.reports[0]["published"] == {p: 1 for p in POLICIES}
    assert run.reports[1]["published"] == {}  # rank 1 publishes nothing (and needs no client)
    worst = 0.0
    for p in POLICIES:
        assert run.published[p].keys() == run.ref[p].keys()
        n_b = sum(1 for k in run.ref[p] if k.endswith(".b"))
        assert n_b == (7 * 2 if p == "t/all" else 3 * 2 + 1)  # every layer's targets, sharded and whole
        for k, want in run.ref[p].items():
            got = run.published[p][k]
            assert got.shape == want.shape
            assert _rel(got, want) <= 1e-5, (p, k, _rel(got, want))
            worst = max(worst, _rel(got, want))
            assert _rel(run.init[p][k], want) > 1e-3, (p, k)  # every factor trained (A and B alike)
    print(f"worst relative difference from the unsharded run: {worst:.2e}")


def test_tp_trainer_every_rank_holds_the_same_full_policies(run: Run) -> None:
    assert run.tensors[0].keys() == run.tensors[1].keys()
    for k, t0 in run.tensors[0].items():
        assert torch.equal(t0, run.tensors[1][k]), k
        tenant, name, m = k.split("/", 2)
        p = f"{tenant}/{name}"
        assert t0.shape == run.ref[p][m].shape  # whole, not this rank's slice


def test_a_linear_whose_backward_transformers_transforms_is_refused_for_training() -> None:
    """MLA's kv_a_proj runs unsharded, but transformers all-reduces part of its output's
    gradient in a transform the LoRA hook runs after: its LoRA would step on each rank's share
    of the gradient, and the ranks' policies would drift apart. Served, but not trained."""
    import pytest

    from engine_client.engine.targets import Target
    from engine_client.errors import TrainerError
    from engine_client.tp.sharding import TPModel
    from engine_client.train.tp_train import check_trainable

    path = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    tpm = TPModel(0, 2, None, 0, {}, frozenset(), {}, {path: "mla_kv_a_proj"})
    target = Target(path, "linear", path, None, 32, 24, None)
    with pytest.raises(TrainerError, match="mla_kv_a_proj"):
        check_trainable(tpm, [target])
    check_trainable(TPModel(0, 2, None, 0, {}, frozenset(), {}), [target])  # a plain unsharded linear: fine
