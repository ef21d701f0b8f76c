"""Policies do not touch each other: a policy without loss in a step stays bit-identical (even
with momentum and decoupled weight decay, which torch's AdamW would apply), the others move.
Also the GRPO pieces that decide what a step sees: group advantages, completion masks,
micro-batching."""

from __future__ import annotations

import pytest
import torch

from engine_client.train.grpo import GRPO, GRPOConfig, _completion_mask, _group_advantages
from engine_client.train.lora_stack import LoraSpec
from engine_client.train.multi_adamw import OptimConfig
from engine_client.train.trainer import MultiLoRATrainer
from tests.support.hf_models import ATTN, MOE_PARAMS, build_model, sample_ids
from tests.support.train import same_adapter, toy_model

OPT = OptimConfig(lr=1e-2, weight_decay=0.1)  # decay would move any parameter torch's AdamW saw


def _three(trainer: MultiLoRATrainer, moe: bool) -> None:
    extra = {"target_parameters": MOE_PARAMS} if moe else {}
    trainer.add_policy("t/p", LoraSpec(r=4, target_modules=ATTN, seed=1, init_b_std=0.05, **extra), optim=OPT)
    trainer.add_policy("t/q", LoraSpec(r=4, target_modules=ATTN, seed=2, init_b_std=0.05, **extra), optim=OPT)
    trainer.add_policy("t/r", LoraSpec(r=2, target_modules=("v_proj",), seed=3, init_b_std=0.05), optim=OPT)


def test_zero_loss_policy_stays_bit_identical_while_others_change() -> None:
    for kind in ("llama", "qwen3_moe"):
        with MultiLoRATrainer(build_model(kind)) as trainer:
            _three(trainer, kind == "qwen3_moe")
            order = ["t/p", "t/q", "t/r", "t/q"]
            ids = sample_ids(batch=4, seq=8, seed=4)
            trainer.sft_step(ids, ids, order)  # every policy gets moments
            before = {n: trainer.adapter(n) for n in trainer.policies}
            q = trainer.policy("t/q")
            moments = trainer._optim[q.stack.stack_id].exp_avg
            assert any(m[q.slot].abs().sum() > 0 for m in moments.values())  # AdamW alone would move q
            labels = ids.clone()
            labels[[1, 3]] = -100  # q's rows: in the batch, but no loss
            out = trainer.sft_loss(ids, labels, order)
            out.loss.backward()
            assert all(not ga.any() and not gb.any()  # type: ignore[union-attr]
                       for ga, gb in trainer.gradients("t/q").values())
            report = trainer.step()
            assert set(report.stepped) == {"t/p", "t/r"} and report.grad_norms["t/q"] == 0.0
            assert same_adapter(trainer.adapter("t/q"), before["t/q"]), kind
            assert q.steps == 1 and trainer.policy("t/p").steps == 2
            for n in ("t/p", "t/r"):
                assert not same_adapter(trainer.adapter(n), before[n]), (kind, n)


@pytest.mark.parametrize(("constant", "group_size"), [(0.5, 4), (0.1, 8)])  # 0.1: not exact in binary
def test_grpo_policy_with_constant_reward_is_not_stepped(constant: float, group_size: int) -> None:
    with MultiLoRATrainer(toy_model()) as trainer:
        for i, n in enumerate(("t/a", "t/b")):
            trainer.add_policy(n, LoraSpec(r=2, target_modules=("lm_head",), seed=i, init_b_std=0.1), optim=OPT)
        before = trainer.adapter("t/b")

        def reward(policy: str, prompt: list[int], completion: list[int]) -> float:
            return constant if policy == "t/b" else float(3 in completion)

        grpo = GRPO(trainer, reward, GRPOConfig(group_size=group_size, max_new_tokens=4, seed=1))
        prompts = [[1, 2, 3], [4, 5, 6]]
        report = grpo.step({"t/a": prompts, "t/b": prompts})
        assert report.steps[0].stepped == ("t/a",)
        assert report.stats["t/b"].reward_std == pytest.approx(0.0, abs=1e-6)
        assert same_adapter(trainer.adapter("t/b"), before)


def test_group_advantages_and_completion_mask() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = _group_advantages(r, g, scale=True)
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.5 + 1e-4))
    assert not adv[4:].any()  # a group of equal rewards carries no signal
    for value, n in ((0.1, 8), (0.3, 7)):  # sums that round: their mean is an ulp off the value
        same = torch.full((n,), value)
        assert not _group_advantages(same, torch.zeros(n, dtype=torch.long), scale=True).any()
    torch.testing.assert_close(_group_advantages(r, g, scale=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    comp = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert _completion_mask(comp, {2}).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert _completion_mask(comp, set()).all()


def test_micro_batches_give_the_same_gradients_and_left_padding_is_handled() -> None:
    """Prompts of different lengths (left-padded), KL on: one pass vs micro-batches of 3 rows."""
    grads = []
    for mb in (None, 3):
        model = toy_model()
        model.generation_config.eos_token_id = 2  # completions that stop early: masked tails
        with MultiLoRATrainer(model) as trainer:
            trainer.add_policy("t/a", LoraSpec(r=2, target_modules=("lm_head", "q_proj"), seed=0, init_b_std=0.1))
            trainer.add_policy("t/b", LoraSpec(r=3, target_modules=("v_proj",), seed=1, init_b_std=0.1))
            grpo = GRPO(trainer, lambda p, q, c: float(len(c)) + float(7 in c),
                        GRPOConfig(group_size=4, max_new_tokens=5, kl_coef=0.1, micro_batch=mb, seed=3))
            rollout = grpo.rollout({"t/a": [[1, 3, 4, 5], [6]], "t/b": [[7, 8]]})
            assert rollout.attention_mask[4, :3].tolist() == [0, 0, 0]  # "[6]" left-padded to 4 tokens
            grpo.backward(rollout, grpo.plan(rollout))
            grads.append({n: trainer.gradients(n) for n in trainer.policies})
            assert rollout.completion_mask.sum() < rollout.completion_mask.numel()  # some stopped at EOS
    for n in grads[0]:
        for mod, (a0, b0) in grads[0][n].items():
            a1, b1 = grads[1][n][mod]
            assert a0 is not None and b0 is not None and b0.any()
            torch.testing.assert_close(a1, a0, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(b1, b0, rtol=1e-5, atol=1e-7)



def test_unclosed_trainers_never_share_stack_ids_and_a_failed_add_policy_changes_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stack ids came from id(trainer): a trainer left unclosed (its hooks still on the model) and
    a later one at the same address applied the policy twice. An add_policy that fails (out of
    memory while the stack grows) left the stack detached, or an empty stack registered."""
    import gc

    import engine_client.train.lora_stack as lora_stack
    from tests.support.train import toy_model

    model = toy_model()
    ids = torch.randint(0, 16, (1, 6), generator=torch.Generator().manual_seed(0))
    spec = LoraSpec(r=2, target_modules=ATTN, seed=1, init_b_std=0.05)
    with MultiLoRATrainer(model) as ref, torch.no_grad():
        ref.add_policy("t/p", spec)
        expected = ref.forward(ids, ["t/p"]).logits
    seen = set()
    for _ in range(6):  # left unclosed, dropped: the next one may take its address
        t = MultiLoRATrainer(model)
        t.add_policy("t/p", spec)
        seen.add(t.policy("t/p").stack.stack_id)
        with torch.no_grad():
            assert torch.equal(t.forward(ids, ["t/p"]).logits, expected)
        del t
        gc.collect()
    assert len(seen) == 6

    with MultiLoRATrainer(toy_model()) as t:
        t.add_policy("t/p", spec)
        with torch.no_grad():
            before = t.forward(ids, ["t/p"]).logits
        real_cat, calls = torch.cat, [0]

        def cat_out_of_memory(*args: object, **kwargs: object) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 3:  # part of the way through growing the stack
                raise torch.OutOfMemoryError("no memory (test)")
            return real_cat(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(lora_stack.torch, "cat", cat_out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            t.add_policy("t/q", LoraSpec(r=2, target_modules=ATTN, seed=2, init_b_std=0.05))
        monkeypatch.undo()
        assert set(t.policies) == {"t/p"}
        with torch.no_grad():
            assert torch.equal(t.forward(ids, ["t/p"]).logits, before)  # still applied, unchanged

        def append_fails(*args: object, **kwargs: object) -> int:
            raise torch.OutOfMemoryError("no memory (test)")

        monkeypatch.setattr(lora_stack.PolicyStack, "append", append_fails)
        with pytest.raises(torch.OutOfMemoryError):  # a new layout (another rank)
            t.add_policy("t/r", LoraSpec(r=3, target_modules=("v_proj",), seed=3))
        monkeypatch.undo()
        from engine_client.train.multi_adamw import StackedAdamW

        monkeypatch.setattr(StackedAdamW, "resize", append_fails)  # the moments grown last: two copies
        with pytest.raises(torch.OutOfMemoryError):
            t.add_policy("t/q", LoraSpec(r=2, target_modules=ATTN, seed=2, init_b_std=0.05))
        monkeypatch.undo()
        assert t.policy("t/p").stack.names == ["t/p"]  # not grown: no row without a policy
        with torch.no_grad():
            assert torch.equal(t.forward(ids, ["t/p"]).logits, before)
        t.zero_grad()
        t.step()
        t.add_policy("t/q", LoraSpec(r=2, target_modules=ATTN, seed=2, init_b_std=0.05))
        assert set(t.policies) == {"t/p", "t/q"}


def test_tokens_past_eos_cannot_void_a_policys_step_with_the_kl_term_on() -> None:
    """A masked (post-EOS) token whose log-ratio to the base overflows exp() gave 0 * inf = NaN:
    the policy's loss and gradient NaN, its step skipped. Masked tokens must not count at all:
    changing them changes nothing."""
    import transformers as tf

    from engine_client.train.grpo import Rollout

    cfg = tf.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 3, 0, 0], [5, 6, 7, 8, 10, 11, 12, 13]])  # row 0: EOS (3), then pad
    with MultiLoRATrainer(model) as t:
        t.add_policy("t/a", LoraSpec(r=1, target_modules=("lm_head",), seed=1, init_b_std=0.0))
        pol = t.policy("t/a")
        with torch.no_grad():  # a policy far below the base on the pad token, where it is masked
            h = model.model(ids).last_hidden_state.reshape(-1, 32).mean(0)
            pol.stack.a["lm_head"][pol.slot, 0] = h / h.norm()
            pol.stack.b["lm_head"][pol.slot, 0, 0] = -60.0
        mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
        cmask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0], [1.0] * 6])
        grpo = GRPO(t, lambda *a: 0.0, GRPOConfig(group_size=2, kl_coef=0.05))
        stats = []
        for pad in (0, 3):  # the masked tokens: the pad, or EOS again
            row = ids.clone()
            row[0, 6:] = pad
            rollout = Rollout(["t/a", "t/a"], [0, 0], row, mask, cmask, torch.tensor([1.0, 0.0]),
                              torch.tensor([1.0, -1.0]))
            t.zero_grad()
            stats.append(grpo.backward(rollout, grpo.plan(rollout))["t/a"])
            assert all(torch.isfinite(g).all() for pair in t.gradients("t/a").values() for g in pair)
        assert all(torch.isfinite(torch.tensor(s)).all() for s in stats)
        assert stats[0] == pytest.approx(stats[1], rel=1e-5, abs=1e-7)
        assert set(t.step().stepped) == {"t/a"}


def test_rollouts_sample_the_tempered_policy_whatever_the_models_generation_config_says() -> None:
    """generate fills unset settings from model.generation_config: a checkpoint's
    no_repeat_ngram_size (or repetition penalty) changed the samples but not the loss."""
    from tests.support.train import toy_model

    prompts = {"t/p": [[1, 2, 3]]}
    outs = []
    for extra in ({}, {"no_repeat_ngram_size": 1, "repetition_penalty": 5.0}):
        model = toy_model()
        for k, v in extra.items():
            setattr(model.generation_config, k, v)
        with MultiLoRATrainer(model) as t:
            t.add_policy("t/p", LoraSpec(r=2, target_modules=ATTN, seed=1, init_b_std=0.05))
            grpo = GRPO(t, lambda *a: 0.0, GRPOConfig(group_size=8, max_new_tokens=12, temperature=3.0, seed=5))
            outs.append(grpo.rollout(prompts).input_ids)
            assert model.generation_config.no_repeat_ngram_size == extra.get("no_repeat_ngram_size")  # restored
    assert torch.equal(outs[0], outs[1])
    # 8 x 12 tokens from 16 at temperature 3: repeats happen (no_repeat_ngram_size=1 forbade any)
    assert any(len(set(row[3:].tolist())) < 12 for row in outs[1])
