"""The trainer and the store / engine around it: resume after a crash, rollback by moving the
tag (an engine following the feed swaps back), PEFT-style init that PEFT itself loads, and
one resident base shared by a serving engine and a trainer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_client import LoRAEngine, MintClient, SyncMintClient
from engine_client.errors import NoVersionToRollBack, PolicyExists, PolicyNotFound
from engine_client.train.lora_stack import LoraSpec
from engine_client.train.multi_adamw import OptimConfig
from engine_client.train.trainer import MultiLoRATrainer
from tests.support.hf_models import ATTN, MOE_PARAMS, build_model, make_peft_dir, sample_ids
from tests.support.targets import StoreTarget
from tests.support.train import same_adapter

IDS = sample_ids(batch=2, seq=6, seed=7)
SPEC = LoraSpec(r=4, target_modules=ATTN, seed=5, init_b_std=0.05)


@pytest.fixture
def client(local_target: StoreTarget) -> Iterator[SyncMintClient]:
    c = SyncMintClient(local_target.url, index_dir=local_target.index_dir)
    c.names("t")  # the writable store opens first; engines read it read-only in this process
    yield c
    c.close()


def _follower(target: StoreTarget, model: Any) -> LoRAEngine:
    return LoRAEngine(model, MintClient(target.url, index_dir=target.index_dir, readonly=True, poll_interval=0.02),
                      slots=4, follow=True, follow_wait=0.5)


def test_resume_after_a_crash_continues_the_version_line(client: SyncMintClient) -> None:
    with MultiLoRATrainer(build_model("llama"), client, publish_every=2) as first:
        first.add_policy("t/p", SPEC, optim=OptimConfig(lr=1e-2))
        for _ in range(3):  # publishes after step 2; step 3 is lost in the "crash"
            first.sft_step(IDS, IDS, ["t/p", "t/p"])
        assert first.policy("t/p").versions == [1]
        at_v1 = client.load("t/p@1")
    with MultiLoRATrainer(build_model("llama"), client, publish_every=2) as again:
        pol = again.add_policy("t/p", "t/p:latest", optim=OptimConfig(lr=1e-2))
        assert pol.versions == [1] and same_adapter(again.adapter("t/p"), at_v1)
        with pytest.raises(PolicyExists):
            again.add_policy("t/p", SPEC)
        again.sft_step(IDS, IDS, ["t/p", "t/p"])
        report = again.sft_step(IDS, IDS, ["t/p", "t/p"])[1]
        assert report.published["t/p"].version == 2 and pol.versions == [1, 2]
        assert client.version("t/p:latest").version == 2
        assert same_adapter(client.load("t/p@2"), again.adapter("t/p"))


def test_loaded_weights_are_published_with_their_own_peft_config(client: SyncMintClient, tmp_path: Path) -> None:
    """load_weights of an adapter trained with another alpha: the next version carries that
    adapter's config, so its scalings and config agree and PEFT can load it."""
    from mint_store.peft.directory import load_peft_dir

    for name, alpha, seed in (("a", 4, 1), ("b", 16, 2)):  # r 4: scalings 1 and 4
        d = make_peft_dir(tmp_path / name, r=4, lora_alpha=alpha, target_modules=list(ATTN), seed=seed)
        client.publish("t", name, str(d))
    with MultiLoRATrainer(build_model("llama"), client) as trainer:
        trainer.add_policy("t/a", "t/a@1")
        trainer.load_weights("t/a", "t/b@1")
        assert trainer.policy("t/a").peft_config == client.version("t/b@1").peft_config
        assert trainer.policy("t/a").source == "t/b@1"
        version = trainer.publish(["t/a"])["t/a"].version
    pulled = load_peft_dir(client.pull(f"t/a@{version}", tmp_path / "pulled"))
    assert pulled.peft_config is not None and pulled.peft_config["lora_alpha"] == 16
    assert same_adapter(pulled, client.load("t/b@1"))


def test_rollback_moves_the_tag_back_and_followers_swap(local_target: StoreTarget, client: SyncMintClient) -> None:
    with MultiLoRATrainer(build_model("llama"), client, publish_every=1) as trainer:
        trainer.add_policy("t/p", SPEC, optim=OptimConfig(lr=1e-2))
        weights = {}
        for _ in range(3):
            trainer.sft_step(IDS, IDS, ["t/p", "t/p"])
            weights[trainer.policy("t/p").versions[-1]] = trainer.adapter("t/p")
        assert sorted(weights) == [1, 2, 3]
        with _follower(local_target, build_model("llama")) as engine, torch.no_grad():
            def served(ref: str) -> torch.Tensor:
                engine.sync_events()
                return engine.forward(IDS, adapters=[ref, ref]).logits

            v3 = served("t/p:latest")
            assert trainer.rollback("t/p") == 2
            assert client.version("t/p:latest").version == 2
            assert torch.equal(served("t/p:latest"), served("t/p@2"))
            assert not torch.equal(served("t/p:latest"), v3)
            assert trainer.rollback("t/p") == 1
            with pytest.raises(NoVersionToRollBack):
                trainer.rollback("t/p")
            assert trainer.rollback("t/p", 3) == 3  # "rollback" to any version, forward too
            assert torch.equal(served("t/p:latest"), v3)
        # restore: training continues from version 2's weights, with fresh moments
        assert trainer.rollback("t/p", 2, restore=True) == 2
        assert same_adapter(trainer.adapter("t/p"), weights[2])
        pol = trainer.policy("t/p")
        assert trainer._optim[pol.stack.stack_id].steps[pol.slot] == 0
        with pytest.raises(PolicyNotFound):
            trainer.rollback("t/nope")


def test_from_scratch_init_is_peft_like_and_peft_loads_the_published_version(
    client: SyncMintClient, tmp_path: Path
) -> None:
    from peft import PeftModel

    spec = LoraSpec(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), target_parameters=MOE_PARAMS, seed=1)
    base_logits = build_model("qwen3_moe")(IDS).logits.detach()
    with MultiLoRATrainer(build_model("qwen3_moe"), client) as trainer:
        trainer.add_policy("t/zero", spec)
        trainer.add_policy("t/rand", replace(spec, init_b_std=0.05))
        zero = trainer.adapter("t/zero")
        assert {m.name.rsplit(".", 1)[-1] for m in zero.modules} == {"q_proj", "v_proj", "gate_up_proj", "down_proj"}
        for m in zero.modules:
            bound = 1 / m.a.shape[-1] ** 0.5  # kaiming-uniform(a=sqrt(5)) over fan_in
            assert not m.b.any() and m.a.abs().max() <= bound and m.a.std() > 0.5 * bound / 3**0.5
            assert m.scaling == 2.0
        with torch.no_grad():
            # B = 0: the base (up to the order of the experts' sums in the LoRA path)
            assert (trainer.forward(IDS, ["t/zero"] * 2).logits - base_logits).abs().max().item() <= 1e-6
            mine = trainer.forward(IDS, ["t/rand"] * 2).logits
        trainer.publish()
    client.pull("t/rand", tmp_path / "rand")
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(build_model("qwen3_moe"), str(tmp_path / "rand")).eval()(IDS).logits
    assert (theirs - mine).abs().max().item() <= 1e-5
    assert (mine - base_logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("engine_first", [True, False])
def test_a_trainer_and_an_engine_share_one_resident_moe_base(local_target: StoreTarget, tmp_path: Path,
                                                             engine_first: bool) -> None:
    """The same adapter served by the engine and trained by the trainer, on one model object."""
    d = make_peft_dir(tmp_path / "x", "qwen3_moe", r=2, target_modules=["q_proj"], target_parameters=MOE_PARAMS)
    with local_target.open() as store:
        from mint_store.peft.directory import load_peft_dir

        store.publish("t", "x", load_peft_dir(d))
    model = build_model("qwen3_moe")
    engine = LoRAEngine(model, MintClient(local_target.url, index_dir=local_target.index_dir), slots=2)
    trainer = None
    try:
        if not engine_first:
            trainer = MultiLoRATrainer(model)
        with torch.no_grad():
            want = engine.forward(IDS, adapters=["t/x", None]).logits  # wraps the experts (or stacks on ours)
        if trainer is None:
            trainer = MultiLoRATrainer(model)
        trainer.add_policy("t/y", engine.call(engine.client.load("t/x")))
        with torch.no_grad():
            got = trainer.forward(IDS, ["t/y", None]).logits
            assert (got - want).abs().max().item() <= 1e-5
            loss = trainer.sft_loss(IDS, IDS, ["t/y", "t/y"]).loss
        assert loss.requires_grad is False  # no_grad block: nothing recorded
        trainer.sft_loss(IDS, IDS, ["t/y", "t/y"]).loss.backward()
        assert all(p.grad is None for p in model.parameters())  # the base stays frozen
        trainer.close()
        assert all(p.requires_grad for p in model.parameters())  # ... and is given back as it was
        with torch.no_grad():
            assert torch.equal(engine.forward(IDS, adapters=["t/x", None]).logits, want)
    finally:
        if trainer is not None:
            trainer.close()
        engine.close()


def test_targets_are_matched_like_peft_and_a_growing_stack_keeps_its_moments() -> None:
    from engine_client.errors import BatchMismatch, LayoutMismatch

    with MultiLoRATrainer(build_model("llama")) as trainer:
        every = trainer.add_policy("t/all", LoraSpec(r=2, target_modules="all-linear"))
        assert len(every.stack.modules) == 14 and "lm_head" not in every.stack.modules  # 7 linears x 2 layers
        mixed = trainer.add_policy("t/mixed", LoraSpec(r=2, target_modules=("layers.1.self_attn.q_proj",),
                                                       target_parameters=("self_attn.v_proj.weight",)))
        assert mixed.stack.modules == ["model.layers.0.self_attn.v_proj.weight", "model.layers.1.self_attn.q_proj",
                                       "model.layers.1.self_attn.v_proj.weight"]
        assert trainer.adapter("t/mixed").modules[0].a.shape == (1, 2, 32)  # M.weight: one "expert" in the store
        with pytest.raises(LayoutMismatch, match="'nope'"):
            trainer.add_policy("t/bad", LoraSpec(target_modules=("nope",)))
        with pytest.raises(BatchMismatch):
            trainer.forward(IDS, ["t/all"])
        trainer.add_policy("t/p", SPEC, optim=OptimConfig(lr=1e-2))
        trainer.sft_step(IDS, IDS, ["t/p", "t/p"])
        pol = trainer.policy("t/p")
        moments = {k: v[pol.slot].clone() for k, v in trainer._optim[pol.stack.stack_id].exp_avg.items()}
        trainer.add_policy("t/p2", SPEC)  # same layout: p's stack grows by a row
        assert len(pol.stack) == 2
        for k, v in trainer._optim[pol.stack.stack_id].exp_avg.items():
            assert torch.equal(v[pol.slot], moments[k]) and not v[1].any()
        trainer.sft_step(IDS, IDS, ["t/p", "t/p2"])  # and trains on after the growth
        assert pol.steps == 2 and trainer.policy("t/p2").steps == 1


def test_a_resumed_policy_keeps_its_base_and_a_foreign_base_is_refused(client: SyncMintClient) -> None:
    """A trainer that declares no base publishes a resumed policy under its source's base (it
    stamped 'unspecified', which the vLLM plugin never serves); one that declares a base refuses
    an adapter published for another, as an engine of that base does."""
    from engine_client.errors import LayoutMismatch

    with MultiLoRATrainer(build_model("llama"), client, base="tiny-llama") as first:
        first.add_policy("t/p", SPEC)
        assert first.publish()["t/p"].version == 1
    assert client.version("t/p@1").base == "tiny-llama"
    with MultiLoRATrainer(build_model("llama"), client) as again:  # no base declared
        again.add_policy("t/p", "t/p@1")
        again.sft_step(IDS, IDS, ["t/p", "t/p"])
        assert again.publish()["t/p"].version == 2
    assert client.version("t/p@2").base == "tiny-llama"
    with MultiLoRATrainer(build_model("llama"), client, base="other-base") as other:
        with pytest.raises(LayoutMismatch, match="base 'tiny-llama'"):
            other.add_policy("t/q", "t/p@2")
        assert other.policies == []


def test_a_failed_handoff_keeps_the_step_and_is_tried_again(client: SyncMintClient,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The step is taken before its handoff: a store that fails the publish must not lose the
    step's report (nor the rest of a GRPO update); the next step publishes."""
    from engine_client.errors import ServiceUnavailable

    with MultiLoRATrainer(build_model("llama"), client, publish_every=1) as trainer:
        trainer.add_policy("t/p", SPEC, optim=OptimConfig(lr=1e-2))
        real = client.publish
        monkeypatch.setattr(client, "publish", lambda *a, **k: (_ for _ in ()).throw(ServiceUnavailable("restarting")))
        report = trainer.sft_step(IDS, IDS, ["t/p", "t/p"])[1]
        assert report.step == 1 and report.stepped == ("t/p",) and report.published == {}
        assert report.publish_error is not None and "restarting" in report.publish_error
        monkeypatch.setattr(client, "publish", real)
        report = trainer.sft_step(IDS, IDS, ["t/p", "t/p"])[1]
        assert report.publish_error is None and report.published["t/p"].version == 1
        from mint_store.errors import CommitConflict  # the writer lease changing hands passes too

        monkeypatch.setattr(client, "publish", lambda *a, **k: (_ for _ in ()).throw(CommitConflict("handover")))
        assert "handover" in (trainer.sft_step(IDS, IDS, ["t/p", "t/p"])[1].publish_error or "")
        monkeypatch.setattr(client, "publish", real)
        with pytest.raises(PolicyNotFound):  # every name checked before any is published
            trainer.publish(["t/p", "t/none"])
        assert client.version("t/p:latest").version == 1


def test_a_handoff_that_cannot_work_raises_instead_of_passing_for_an_outage(client: SyncMintClient,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an outage is tried again at the next step: no client, a refused token, a bad adapter
    raise, or a run trained for hours and published nothing while its reports said it would retry."""
    from engine_client.errors import Forbidden, TrainerError

    with MultiLoRATrainer(build_model("llama"), None, publish_every=1) as trainer:
        trainer.add_policy("t/p", SPEC)
        with pytest.raises(TrainerError, match="no store client"):
            trainer.sft_step(IDS, IDS, ["t/p", "t/p"])
    with MultiLoRATrainer(build_model("llama"), client, publish_every=1) as trainer:
        trainer.add_policy("t/p", SPEC)
        monkeypatch.setattr(client, "publish", lambda *a, **k: (_ for _ in ()).throw(Forbidden("not yours")))
        with pytest.raises(Forbidden):
            trainer.sft_step(IDS, IDS, ["t/p", "t/p"])


def test_a_dtype_the_store_cannot_hold_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="dtype must be one the store holds"):
        MultiLoRATrainer(build_model("llama"), None, dtype=torch.float64)
