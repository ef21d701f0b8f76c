"""One rank of a tensor-parallel engine run (launched by tests/engine/test_tp.py with torchrun).

    torchrun --nproc_per_node 2 tests/engine/tp_worker.py SPEC.json

SPEC is a list of runs, done one after the other in this one launch (a launch costs more than
a run). Each names the saved base model, the store, the batches to run and where to write. Every
rank writes ``rank{R}.safetensors`` (the logits of each step) and ``rank{R}.json`` (what
it held, read and raised); the pytest process compares them with PEFT. Rank 1 passes
``None`` for every sequence: what it runs is what rank 0 decided and broadcast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def main(spec_path: str) -> None:
    for spec in json.loads(Path(spec_path).read_text()):
        run_spec(spec)


def run_spec(spec: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    from engine_client import LoRAEngine, MintClient
    from engine_client.errors import TPBatchFailed
    from engine_client.tp.sharding import SlicedPool
    from tests.support.hf_models import load_sharded

    model = load_sharded(spec["base"], spec.get("parallel", {}))
    rank = dist.get_rank()
    ids = torch.tensor(spec["ids"])
    out: dict[str, torch.Tensor] = {}
    report: dict[str, Any] = {"rank": rank, "errors": {}, "pools": {}, "step_bytes": {}}

    def run(engine: LoRAEngine, step: dict[str, Any]) -> None:
        adapters = step["adapters"] if rank == 0 else [None] * (len(step["adapters"]) + step.get("rank1_extra", 0))
        try:
            with torch.no_grad():
                out[step["name"]] = engine.forward(ids, adapters=adapters).logits.contiguous()
        except TPBatchFailed as e:
            report["errors"][step["name"]] = str(e)

    # one writer per store: rank 0 (it also publishes below); the other ranks only read
    client = MintClient(spec["store"], index_dir=spec["index"], readonly=rank > 0)
    engine = LoRAEngine(model, client, slots=4, follow=rank == 0)
    for step in spec["steps"]:
        if step.get("publish") and rank == 0:  # a new version takes the tag mid-run
            p = step["publish"]
            engine.call(engine.client.publish(p["tenant"], p["name"], p["dir"], tag=p["tag"]))
            engine.sync_events()
        dist.barrier()
        before = engine.metrics.snapshot().tiers["storage"].bytes
        run(engine, step)
        report["step_bytes"][step["name"]] = engine.metrics.snapshot().tiers["storage"].bytes - before
    for lid, pool in engine.pools.items():
        if isinstance(pool, SlicedPool):
            cut = sum(c.dst.nbytes for c in pool.cuts if c.dim is not None)
            whole = sum(c.dst.nbytes for c in pool.cuts if c.dim is None)
            report["pools"][lid] = {"row_nbytes": pool.source.row_nbytes, "slot_nbytes": pool.layout.row_nbytes,
                                    "cut_nbytes": cut, "whole_nbytes": whole,
                                    "cut_full_nbytes": sum(c.src.nbytes for c in pool.cuts if c.dim is not None),
                                    "slice_read_nbytes": sum(r.nbytes for r in pool.runs),
                                    # the experts each expert tensor's cut keeps (expert-parallel: this rank's)
                                    "expert_pieces": sorted({c.pieces for c in pool.cuts
                                                             if c.dim is not None and c.dim == len(c.src.shape) - 3})}
    tpm = engine._tp
    report["tp_experts"] = sorted(tpm.experts) if tpm else []
    report["ep_experts"] = {p: [e.start, e.stop] for p, e in tpm.ep.items()} if tpm else {}
    report["storage_bytes"] = engine.metrics.snapshot().tiers["storage"].bytes
    engine.close()

    # a rank that cannot load fails the batch on every rank: rank 1 has one slot, the batch needs two
    client = MintClient(spec["store"], index_dir=spec["index"], readonly=rank > 0)
    engine = LoRAEngine(model, client, slots=4 if rank == 0 else 1)
    for step in spec.get("fail_steps", []):
        dist.barrier()
        run(engine, step)
    engine.close()

    # LRU churn: one slot per layout and no host cache, so every switch reloads from storage; the
    # second load of a row reads only this rank's slice
    client = MintClient(spec["store"], index_dir=spec["index"], readonly=rank > 0)
    engine = LoRAEngine(model, client, slots=1, cache_bytes=1)
    report["churn_bytes"] = {}
    for step in spec.get("churn_steps", []):
        if step.get("corrupt") and rank == 0:
            _corrupt_rank1_slice(engine, spec["store"], step["corrupt"], experts=step.get("in_experts", False))
        dist.barrier()
        before = engine.metrics.snapshot().tiers["storage"].bytes
        run(engine, step)
        report["churn_bytes"][step["name"]] = engine.metrics.snapshot().tiers["storage"].bytes - before
    report["churn_pools"] = {
        lid: {"row_nbytes": p.source.row_nbytes, "slice_read_nbytes": sum(r.nbytes for r in p.runs)}
        for lid, p in engine.pools.items() if isinstance(p, SlicedPool)
    }
    engine.close()
    # the trainer on this base: each attempt a fresh trainer with one policy, two SFT steps (or refused
    # before anything changes); beside an engine on the same base that holds adapters of the same modules
    engine = LoRAEngine(model, MintClient(spec["store"], index_dir=spec["index"], readonly=rank > 0), slots=4)
    beside = spec.get("beside_trainer", spec["steps"][0]["adapters"])
    run(engine, {"name": "beside_trainer", "adapters": beside})
    report["trainer"] = [attempt_training(model, ids, a) for a in spec["trainer"]]
    run(engine, {"name": "after_trainer", "adapters": beside})
    engine.close()
    report["trainer_frozen"] = any(not p.requires_grad for p in model.parameters())
    save_file(out, str(Path(spec["out"]) / f"rank{rank}.safetensors"))
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(report))


def attempt_training(model: Any, ids: torch.Tensor, attempt: dict[str, Any]) -> dict[str, Any]:
    """One policy of ``attempt`` trained two SFT steps: what the trainer said and the losses."""
    from engine_client.errors import TrainerError
    from engine_client.train import MultiLoRATrainer

    trainer = MultiLoRATrainer(model)
    got: dict[str, Any] = {"losses": []}
    try:
        spec, optim = policy_spec(attempt)
        trainer.add_policy(attempt["name"], spec, optim=optim)
        got["result"] = "accepted"
        for _ in range(2):
            loss, _ = trainer.sft_step(ids, ids, [attempt["name"]] * len(ids))
            got["losses"].append(float(loss.loss.detach()))
    except (TrainerError, RuntimeError) as e:
        got["result"] = f"{type(e).__name__}: {e}"
    got["policies"] = trainer.policies
    trainer.close()
    return got


def policy_spec(attempt: dict[str, Any]) -> tuple[Any, Any]:
    """The LoraSpec and OptimConfig of an attempt (the unsharded reference uses the same)."""
    from engine_client.train import LoraSpec, OptimConfig

    return LoraSpec(r=2, lora_alpha=4, target_modules=tuple(attempt["target_modules"]), init_b_std=0.05, seed=7,
                    target_parameters=tuple(attempt.get("target_parameters", ()))), OptimConfig(lr=1e-2)


def _corrupt_rank1_slice(engine: Any, store: str, ref: str, *, experts: bool = False) -> None:
    """Flip one byte of ``ref``'s row inside rank 1's rows of the first column-parallel B (``experts``:
    inside rank 1's first expert of the first expert tensor an expert-parallel rank cuts)."""
    from engine_client.tp.sharding import SlicedPool

    loc = engine.call(engine.client.resolve_many([ref]))[0]
    pool = engine.pools[loc.layout_id]
    assert isinstance(pool, SlicedPool)
    if experts:  # rank 0 holds experts [0, stop)
        c = next(c for c in pool.cuts if c.dim is not None and c.dim == len(c.src.shape) - 3)
        pos = loc.offset + c.src.offset + c.pieces[0][1] * (c.src.nbytes // c.src.shape[0])
    else:
        c = next(c for c in pool.cuts if c.dim is not None and c.dim == len(c.src.shape) - 2)
        pos = loc.offset + c.src.offset + c.pieces[0][1] * c.src.shape[-1] * 4  # rank 0 holds rows [0, stop)
    with open(Path(store) / loc.shard_key, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0xFF]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.support
    main(sys.argv[1])
