"""The trainer's gradients are PEFT's: one policy alone, and each policy of a mixed batch on its rows.

The reference is PEFT training the same adapter alone (``model(ids, labels=labels).loss``,
fp32). Measured here: dense llama about 1.2e-7, Qwen3-MoE (experts + attention) about
7.6e-7 relative (PEFT merges the expert delta into the weight, the kernels add it to the
output: the same math rounded differently).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine_client.train.lora_stack import LoraSpec
from engine_client.train.multi_adamw import OptimConfig, StackedAdamW
from engine_client.train.trainer import MultiLoRATrainer
from tests.support.hf_models import ATTN, MLP, MOE_PARAMS, build_model, sample_ids
from tests.support.train import peft_reference, relative_diffs

CASES = {
    "llama": (dict(r=4, lora_alpha=8, target_modules=[*ATTN, *MLP]), 1e-6),
    "qwen3_moe": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], target_parameters=MOE_PARAMS), 2e-6),
}


def _batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = sample_ids(batch=rows, seq=9, seed=seed)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt part without loss
    return ids, labels


@pytest.mark.parametrize("kind", list(CASES))
def test_one_policy_gradients_equal_peft(kind: str, tmp_path: Path) -> None:
    lora, tol = CASES[kind]
    ids, labels = _batch(3, seed=1)
    weights, want = peft_reference(kind, lora, ids, labels, tmp_path)
    with MultiLoRATrainer(build_model(kind)) as trainer:
        trainer.add_policy("t/p", weights)
        trainer.sft_loss(ids, labels, ["t/p"] * 3).loss.backward()
        diffs = relative_diffs(trainer.gradients("t/p"), want)
    assert max(diffs.values()) <= tol, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    if kind == "qwen3_moe":  # the experts really were trained (not only attention)
        assert any(".experts." in k for k in diffs)


def test_mixed_batch_each_policy_gets_its_own_peft_gradient(tmp_path: Path) -> None:
    """Three policies, two layouts (rank 4 on attention+MLP, rank 2 on v_proj), rows interleaved."""
    loras = {
        "t/p": dict(r=4, lora_alpha=8, target_modules=[*ATTN, *MLP]),
        "t/q": dict(r=4, lora_alpha=8, target_modules=[*ATTN, *MLP]),
        "t/r": dict(r=2, lora_alpha=4, target_modules=["v_proj"], target_parameters=["self_attn.q_proj.weight"]),
    }
    order = ["t/p", "t/q", "t/r", "t/p", "t/r", "t/q"]
    ids, labels = _batch(len(order), seed=2)
    refs = {}
    for i, (name, lora) in enumerate(loras.items()):
        rows = [k for k, n in enumerate(order) if n == name]
        d = tmp_path / name.replace("/", "_")
        d.mkdir()
        refs[name] = peft_reference("llama", lora, ids[rows], labels[rows], d, seed=10 + i)
    with MultiLoRATrainer(build_model("llama")) as trainer:
        for name, (weights, _) in refs.items():
            trainer.add_policy(name, weights)
        assert len({trainer.policy(n).stack.stack_id for n in loras}) == 2  # p and q share one stack
        out = trainer.sft_loss(ids, labels, order)
        out.loss.backward()
        for name, (_, want) in refs.items():
            diffs = relative_diffs(trainer.gradients(name), want)
            assert max(diffs.values()) <= 1e-6, (name, max(diffs.values()))
    assert set(out.per_policy) == set(loras)


def test_a_policy_absent_from_the_batch_gets_exactly_zero_gradient() -> None:
    with MultiLoRATrainer(build_model("qwen3_moe")) as trainer:
        spec = LoraSpec(r=2, target_modules=("q_proj",), target_parameters=MOE_PARAMS, init_b_std=0.1)
        for i, name in enumerate(("t/a", "t/b", "t/c")):
            trainer.add_policy(name, replace(spec, seed=i))
        ids, labels = _batch(4, seed=3)
        trainer.sft_loss(ids, labels, ["t/a", "t/c", "t/a", "t/c"]).loss.backward()
        for name, (ga, gb) in trainer.gradients("t/b").items():
            assert ga is not None and gb is not None
            assert not ga.any() and not gb.any(), name
        assert all(ga is not None and ga.any() for ga, _ in trainer.gradients("t/a").values())


def test_stacked_adamw_is_torch_adamw_per_policy() -> None:
    """Per-policy lr / betas / weight decay / clipping, rows updated together = one torch AdamW each."""
    torch.manual_seed(0)
    configs = [OptimConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5),
               OptimConfig(lr=3e-3, betas=(0.8, 0.99), weight_decay=0.0, max_grad_norm=None),
               OptimConfig(lr=5e-2, eps=1e-6, weight_decay=0.01, max_grad_norm=10.0)]
    n = len(configs)
    stacked = [("a", torch.nn.Parameter(torch.randn(n, 2, 5))), ("b", torch.nn.Parameter(torch.randn(n, 4, 2)))]
    alone = [[torch.nn.Parameter(p.detach()[i].clone()) for _, p in stacked] for i in range(n)]
    torch_opts = [torch.optim.AdamW(ps, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)
                  for ps, c in zip(alone, configs, strict=True)]
    opt = StackedAdamW()
    opt.resize(stacked)
    for _ in range(4):
        grads = [torch.randn_like(p) for _, p in stacked]
        for (_, p), g in zip(stacked, grads, strict=True):
            p.grad = g.clone()
        opt.step(stacked, configs, [True] * n, opt.grad_norms(stacked))
        for i, (ps, c, o) in enumerate(zip(alone, configs, torch_opts, strict=True)):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g[i].clone()
            if c.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(ps, c.max_grad_norm)
            o.step()
    for i in range(n):
        for (_, p), q in zip(stacked, alone[i], strict=True):
            torch.testing.assert_close(p.detach()[i], q.detach(), rtol=1e-6, atol=1e-7)
    assert opt.steps == [4, 4, 4]


def test_bf16_first_moments_are_torch_adamws_bit_for_bit() -> None:
    """bf16 master weights: the first moment mixes in the gradient with a float32 weight, as
    torch's lerp does (1 - 0.9 rounded to bf16 is 0.10009765625: 1 ulp off on 2% of entries)."""
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(1, 64, 64).bfloat16())
    q = torch.nn.Parameter(p.detach()[0].clone())
    opt, ref = StackedAdamW(), torch.optim.AdamW([q], lr=1e-3, weight_decay=0.0)
    opt.resize([("p", p)])
    config = OptimConfig(lr=1e-3, weight_decay=0.0, max_grad_norm=None)
    for _ in range(20):
        g = torch.randn(1, 64, 64).bfloat16()
        p.grad, q.grad = g.clone(), g[0].clone()
        opt.step([("p", p)], [config], [True], opt.grad_norms([("p", p)]))
        ref.step()
    assert torch.equal(opt.exp_avg["p"][0], ref.state[q]["exp_avg"])

