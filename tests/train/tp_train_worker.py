"""One rank of a tensor-parallel training run (launched by tests/train/test_train_tp.py with torchrun).

    torchrun --nproc_per_node 2 tests/train/tp_train_worker.py SPEC.json

SPEC names the saved base model, the store and the batch. Every rank loads the base with
``DistributedConfig(tp_size=2)`` (the model's ``tp_plan``), trains the policies of :func:`train`
(SFT steps, then a GRPO step) (rank 0 with a store client, the others without), and writes
``rank{R}.json`` (losses, grad norms, what publish returned) and ``rank{R}.safetensors`` (its
policies' final factors). The pytest process runs :func:`train` on the unsharded base and compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

POLICIES = ("t/all", "t/few")
ROWS = ["t/all", "t/few", "t/all", "t/few"]
STEPS = 3
PROMPTS = [[1, 2, 3], [4, 5, 6]]


def reward(policy: str, prompt: list[int], completion: list[int]) -> float:
    """Deterministic and varied within a group: the share of even tokens (odd ones for t/few)."""
    want = 0 if policy == POLICIES[0] else 1
    return sum(t % 2 == want for t in completion) / max(len(completion), 1)


def train(model: Any, client: Any, ids: torch.Tensor, labels: torch.Tensor, *, steps: int = STEPS,
          publish: bool = True) -> tuple[Any, dict[str, Any]]:
    """The run both sides make: two policies of different layouts, a few mixed SFT steps, publish."""
    from engine_client.train import GRPO, GRPOConfig, LoraSpec, MultiLoRATrainer, OptimConfig

    trainer = MultiLoRATrainer(model, client)
    trainer.add_policy(POLICIES[0], LoraSpec(r=4, lora_alpha=8, target_modules="all-linear", seed=1,
                                             init_b_std=0.05), optim=OptimConfig(lr=1e-2))
    trainer.add_policy(POLICIES[1], LoraSpec(r=2, lora_alpha=4, target_modules=("q_proj", "o_proj", "down_proj",
                                                                                "lm_head"),
                                             use_rslora=True, seed=2, init_b_std=0.05), optim=OptimConfig(lr=5e-3))
    report: dict[str, Any] = {"losses": [], "norms": []}
    for _ in range(steps):
        loss, step = trainer.sft_step(ids, labels, ROWS)
        report["losses"].append({p: v for p, (v, _) in loss.per_policy.items()})
        report["norms"].append(step.grad_norms)
    if steps:  # then one GRPO step (seeded sampling: the same completions on every rank)
        grpo = GRPO(trainer, reward, GRPOConfig(group_size=4, max_new_tokens=3, kl_coef=0.02, seed=3))
        got = grpo.step({p: PROMPTS for p in POLICIES})
        report["grpo"] = {p: [st.reward_mean, st.loss, st.kl] for p, st in got.stats.items()}
        report["grpo_stepped"] = [list(s.stepped) for s in got.steps]
    if publish:  # on a tensor-parallel base: rank 0 publishes, the others (no client here) return {}
        report["published"] = {n: r.version for n, r in trainer.publish().items()}
    return trainer, report


def main(spec_path: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from engine_client import SyncMintClient
    from tests.support.hf_models import load_sharded

    spec = json.loads(Path(spec_path).read_text())
    model = load_sharded(spec["base"])
    rank = dist.get_rank()
    client = SyncMintClient(spec["store"], index_dir=spec["index"]) if rank == 0 else None
    trainer, report = train(model, client, torch.tensor(spec["ids"]), torch.tensor(spec["labels"]))
    tensors = {}
    for name in POLICIES:
        for m in trainer.adapter(name).modules:
            tensors[f"{name}/{m.name}.a"], tensors[f"{name}/{m.name}.b"] = m.a.contiguous(), m.b.contiguous()
    trainer.close()
    if client is not None:
        client.close()
    save_file(tensors, str(Path(spec["out"]) / f"rank{rank}.safetensors"))
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.support
    main(sys.argv[1])
