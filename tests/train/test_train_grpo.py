"""GRPO on a toy task, three policies at once: each learns its own reward, every handoff is
published bit-for-bit, and an engine following the change feed serves each version at once.

The task: a random tiny llama (16-token vocabulary) continues a prompt by 4 tokens; policy
``t/a`` is rewarded when token 5 appears, ``t/b`` token 9, ``t/c`` token 12. About 25% of
random completions contain a given token, so groups carry signal from the start. Fully
seeded (init, prompts, sampling), so the curves are the same on every run; the asserted
rise (0.4 in mean reward) is well inside what they show (about 0.25 -> 0.95).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_client import LoRAEngine, MintClient, SyncMintClient
from engine_client.train.grpo import GRPO, GRPOConfig
from engine_client.train.lora_stack import LoraSpec
from engine_client.train.multi_adamw import OptimConfig
from engine_client.train.trainer import MultiLoRATrainer
from mint_store.format.adapter import Adapter
from tests.support.train import TOY_VOCAB, same_adapter, toy_model

pytestmark = pytest.mark.slow
TARGET = {"t/a": 5, "t/b": 9, "t/c": 12}
STEPS = 20
PUBLISH_EVERY = 4  # optimizer steps; 2 per GRPO step (updates_per_rollout=2): every 2nd GRPO step


@dataclass
class Run:
    rewards: dict[str, list[float]] = field(default_factory=dict)
    snapshots: dict[tuple[str, int], Adapter] = field(default_factory=dict)  # (policy, version) -> weights
    served: list[float] = field(default_factory=list)  # max |engine - trainer| logits at each handoff
    trainer: Any = None
    client: Any = None


def _reward(policy: str, prompt: list[int], completion: list[int]) -> float:
    return float(TARGET[policy] in completion)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp: Path = tmp_path_factory.mktemp("grpo")
    url, index = str(tmp / "store"), str(tmp / "index")
    client = SyncMintClient(url, index_dir=index)
    client.names("t")  # opens the store for writing before the engine's read-only view of it
    trainer = MultiLoRATrainer(toy_model(), client, publish_every=PUBLISH_EVERY)
    trainer.add_policy("t/a", LoraSpec(r=4, target_modules=("lm_head", "q_proj", "v_proj"), seed=1),
                       optim=OptimConfig(lr=1e-2))
    trainer.add_policy("t/b", LoraSpec(r=2, target_modules=("lm_head",), seed=2), optim=OptimConfig(lr=1e-2))
    trainer.add_policy("t/c", LoraSpec(r=4, target_modules=("lm_head", "q_proj", "v_proj"), seed=3),
                       optim=OptimConfig(lr=5e-3, weight_decay=0.01, max_grad_norm=0.5))
    grpo = GRPO(trainer, _reward, GRPOConfig(group_size=4, max_new_tokens=4, kl_coef=0.02, updates_per_rollout=2,
                                             seed=0))
    gen = torch.Generator().manual_seed(0)
    prompts = {p: [torch.randint(0, TOY_VOCAB, (4,), generator=gen).tolist() for _ in range(4)] for p in TARGET}
    probe = torch.tensor([prompts[p][0] for p in TARGET])
    out = Run(rewards={p: [] for p in TARGET}, trainer=trainer, client=client)
    engine = LoRAEngine(toy_model(), MintClient(url, index_dir=index, readonly=True, poll_interval=0.02),
                        slots=4, follow=True, follow_wait=0.5)
    try:
        for _ in range(STEPS):
            report = grpo.step(prompts)
            for p in TARGET:
                out.rewards[p].append(report.stats[p].reward_mean)
            published = report.steps[-1].published
            assert not any(s.published for s in report.steps[:-1])  # handoffs land at GRPO step ends
            if published:
                for p, res in published.items():
                    out.snapshots[(p, res.version)] = trainer.adapter(p)
                engine.sync_events()
                with torch.no_grad():
                    served = engine.forward(probe, adapters=[f"{p}:latest" for p in TARGET]).logits
                    mine = trainer.forward(probe, list(TARGET)).logits
                out.served.append((served - mine).abs().max().item())
        yield out
    finally:
        engine.close()
        trainer.close()
        client.close()


def test_every_policy_learns_its_reward(run: Run) -> None:
    for p, curve in run.rewards.items():
        first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
        assert last >= first + 0.4, (p, [round(x, 2) for x in curve])


def test_each_handoff_is_published_and_tagged(run: Run) -> None:
    expected = STEPS * 2 // PUBLISH_EVERY
    for p in TARGET:
        assert run.trainer.policy(p).versions == list(range(1, expected + 1))
        assert run.client.version(f"{p}:latest").version == expected


def test_published_versions_reproduce_the_trained_weights_bit_for_bit(run: Run) -> None:
    assert len(run.snapshots) == len(TARGET) * STEPS * 2 // PUBLISH_EVERY
    for (p, v), weights in run.snapshots.items():
        stored = run.client.load(f"{p}@{v}")
        assert same_adapter(stored, weights), (p, v)
        assert stored.modules[0].a.dtype == torch.float32
    last = STEPS * 2 // PUBLISH_EVERY
    for p in TARGET:  # the trainer has not moved since its last handoff
        assert same_adapter(run.trainer.adapter(p), run.snapshots[(p, last)])
    # versions really differ (training moved them between handoffs)
    assert not same_adapter(run.snapshots[("t/a", 1)], run.snapshots[("t/a", last)])


def test_an_engine_following_the_feed_serves_each_handoff_at_once(run: Run) -> None:
    assert len(run.served) == STEPS * 2 // PUBLISH_EVERY
    assert max(run.served) <= 1e-5


def test_resume_from_a_stored_version(run: Run) -> None:
    """A new trainer (a restarted job) starts from ``t/b@2``: the weights of that handoff exactly."""
    with MultiLoRATrainer(toy_model(), run.client) as again:
        pol = again.add_policy("t/b", "t/b@2")
        assert pol.versions == [2] and pol.source == "t/b@2"
        assert same_adapter(again.adapter("t/b"), run.snapshots[("t/b", 2)])
        forked = again.add_policy("t/b-fork", "t/c@3")  # any stored version can seed another policy
        assert forked.versions == [] and same_adapter(again.adapter("t/b-fork"), run.snapshots[("t/c", 3)])
