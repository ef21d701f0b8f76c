"""Trainer options users set: set_optim between steps, bf16 master weights, and GRPO's sampling
options (temperature, top_k, top_p, seed) reaching the rollout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_client import SyncMintClient
from engine_client.errors import PolicyNotFound
from engine_client.train.grpo import GRPO, GRPOConfig
from engine_client.train.lora_stack import LoraSpec
from engine_client.train.multi_adamw import OptimConfig
from engine_client.train.trainer import MultiLoRATrainer
from tests.support.hf_models import ATTN, MOE_PARAMS, build_model, sample_ids
from tests.support.train import same_adapter, toy_model

OPT = OptimConfig(lr=1e-2)


def twins(trainer: MultiLoRATrainer) -> None:
    """Two policies of one layout with the same init: the same data gives them the same updates."""
    for name in ("t/a", "t/b"):
        trainer.add_policy(name, LoraSpec(r=2, target_modules=ATTN, seed=1, init_b_std=0.05), optim=OPT)


def test_set_optim_changes_the_next_steps_and_keeps_the_moments() -> None:
    ids = sample_ids(batch=2, seq=8, seed=2)
    ids[1] = ids[0]  # each policy's row holds the same tokens: equal gradients
    with MultiLoRATrainer(build_model("llama")) as trainer:
        twins(trainer)
        trainer.sft_step(ids, ids, ["t/a", "t/b"])
        assert same_adapter(trainer.adapter("t/a"), trainer.adapter("t/b"))
        b = trainer.policy("t/b")
        moments = trainer._optim[b.stack.stack_id].exp_avg
        kept = {k: m[b.slot].clone() for k, m in moments.items()}
        trainer.set_optim("t/b", OptimConfig(lr=0.0))
        assert b.optim.lr == 0.0 and trainer.policy("t/a").optim == OPT
        assert all(torch.equal(moments[k][b.slot], v) for k, v in kept.items())  # set_optim keeps the moments
        before = trainer.adapter("t/b")
        trainer.sft_step(ids, ids, ["t/a", "t/b"])
        assert same_adapter(trainer.adapter("t/b"), before)  # lr 0: no move, though it was stepped
        assert b.steps == 2 and not same_adapter(trainer.adapter("t/a"), before)
        trainer.set_optim("t/b", OPT)
        trainer.sft_step(ids, ids, ["t/a", "t/b"])
        assert not same_adapter(trainer.adapter("t/b"), before)
        with pytest.raises(PolicyNotFound):
            trainer.set_optim("t/nope", OPT)


def test_bf16_master_weights_train_and_publish_as_bf16(tmp_path: Path) -> None:
    ids = sample_ids(batch=2, seq=8, seed=3)
    with SyncMintClient(str(tmp_path / "store")) as client:
        with MultiLoRATrainer(build_model("llama"), client, dtype=torch.bfloat16) as bf16, \
                MultiLoRATrainer(build_model("llama")) as fp32:
            for trainer in (bf16, fp32):
                trainer.add_policy("t/p", LoraSpec(r=2, target_modules=ATTN, seed=1, init_b_std=0.05), optim=OPT)
            start = bf16.adapter("t/p")
            assert {m.a.dtype for m in start.modules} == {m.b.dtype for m in start.modules} == {torch.bfloat16}
            # the same init, rounded: bf16 holds fp32's starting weights to bf16 precision
            for m16, m32 in zip(start.modules, fp32.adapter("t/p").modules, strict=True):
                assert torch.equal(m16.a, m32.a.to(torch.bfloat16)) and torch.equal(m16.b, m32.b.to(torch.bfloat16))
            losses = [t.sft_loss(ids, ids, ["t/p", "t/p"]).loss for t in (bf16, fp32)]
            torch.testing.assert_close(losses[0].float(), losses[1], rtol=2e-2, atol=2e-2)
            bf16.sft_step(ids, ids, ["t/p", "t/p"])
            trained = bf16.adapter("t/p")
            assert not same_adapter(trained, start)
            result = bf16.publish()["t/p"]
        stored = client.load(f"t/p@{result.version}")
        assert same_adapter(stored, trained)  # published bit for bit, in bf16


def test_fp32_policies_on_a_bf16_moe_base_train_and_generate() -> None:
    """The experts' LoRA sums in fp32 and rounds to the base's bf16 (as PEFT does) before the
    next base expert matmul, which took the fp32 sum and failed on the dtypes."""
    ids = sample_ids(batch=2, seq=8, seed=3)
    spec = LoraSpec(r=2, target_modules=ATTN, target_parameters=MOE_PARAMS, seed=1, init_b_std=0.05)
    with MultiLoRATrainer(build_model("qwen3_moe", dtype=torch.bfloat16)) as trainer:
        trainer.add_policy("t/p", spec, optim=OPT)
        start = trainer.adapter("t/p")
        assert {m.a.dtype for m in start.modules} == {torch.float32}
        loss = trainer.sft_step(ids, ids, ["t/p", "t/p"])[0].loss
        assert torch.isfinite(loss) and not same_adapter(trainer.adapter("t/p"), start)
        out = trainer.generate(ids[:, :4], ["t/p", None], max_new_tokens=3, do_sample=False)
        assert out.shape == (2, 7)


def _completions(grpo: GRPO, prompts: dict[str, list[list[int]]]) -> torch.Tensor:
    rollout = grpo.rollout(prompts)
    return rollout.input_ids[:, rollout.prompt_len:]


@pytest.mark.parametrize("greedy", [{"top_k": 1}, {"top_p": 1e-6}, {"temperature": 1e-4}])
def test_grpo_sampling_options_reach_the_rollout(greedy: dict[str, float]) -> None:
    prompts = {"t/a": [[1, 2, 3], [4, 5, 6, 7]]}
    with MultiLoRATrainer(toy_model()) as trainer:
        trainer.add_policy("t/a", LoraSpec(r=2, target_modules=("lm_head",), seed=0, init_b_std=0.1), optim=OPT)

        def grpo(**options: float) -> GRPO:
            return GRPO(trainer, lambda *_: 0.0, GRPOConfig(group_size=6, max_new_tokens=6, **options))  # type: ignore[arg-type]

        sampled = _completions(grpo(), prompts)
        assert _completions(grpo(), prompts).equal(sampled)  # seeded: the same rollout again
        assert not _completions(grpo(seed=5), prompts).equal(sampled)  # another seed, other samples
        assert any(len({tuple(r) for r in sampled[g * 6:(g + 1) * 6].tolist()}) > 1 for g in range(2))
        # an option that leaves one candidate token per step: every completion of a group is the greedy one
        narrow = _completions(grpo(**greedy), prompts)
        for g, prompt in enumerate(prompts["t/a"]):
            ids = torch.tensor([prompt])
            best = trainer.generate(ids, ["t/a"], do_sample=False, max_new_tokens=6, pad_token_id=0)[0, len(prompt):]
            assert all(torch.equal(row, best) for row in narrow[g * 6:(g + 1) * 6]), (greedy, g)
