"""Concurrent multi-policy training against the same policies trained one after another.

For each base (a dense llama and a Qwen3-MoE, tiny but not toy-sized) and each N:

* concurrent: one :class:`~engine_client.train.trainer.MultiLoRATrainer` holding N policies;
  every step is one GRPO step of all of them (one mixed-batch ``generate``, one
  forward+backward, one per-policy AdamW update);
* concurrent, micro-batched: the same, but the update runs in micro-batches of one
  policy's rows (GRPOConfig.micro_batch): the activation footprint of a single policy,
  the rollout and the optimizer step still batched over all N;
* one by one: for each policy in turn, a trainer holding only that policy runs the same
  number of steps on the same prompts (what N separate jobs on one machine would do, in
  sequence).

Same prompts, group size, completion length (no EOS: every completion has the same
length, so both arrangements do the same token work) and optimizer settings. Each
measurement runs in a fresh process (``spawn``), so the peak resident memory is that
arrangement's alone: the kernel's high-water mark (``VmHWM``) is reset after the model is
built and warmed up, and read at the end; ``ru_maxrss`` is the fallback. Times are the
best of ``repeats`` runs in that process: wall time, and the process's CPU time, which on
one thread is what the wall time would be on an idle machine (this one is often shared:
both ratios are reported, and they agree when it is quiet).

Threads: one torch thread per run by default. On a small shared CPU, OpenMP's parallel
small ops (``index_add`` in the kernels, for one) spin against other processes and run up
to 1000x slower than on one thread, which would measure the machine's load, not batching.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from typing import Any

from .profiling import profiled

PAPER = {"dense": 1.77, "moe": 1.45}  # MinT paper: wall-time ratio, one-by-one / concurrent
ARRANGEMENTS = ("concurrent", "concurrent_mb", "one_by_one")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBenchConfig:
    bases: tuple[str, ...] = ("dense", "moe")
    policies: tuple[int, ...] = (1, 2, 4, 8)
    steps: int = 3  # GRPO steps per policy (after one untimed warm-up step)
    prompts: int = 2  # per policy
    group_size: int = 4
    prompt_len: int = 16
    new_tokens: int = 16
    rank: int = 8
    threads: int = 1  # torch threads per run (0: torch default); see the module docstring
    repeats: int = 1  # timed runs per measurement (the best counts)
    seed: int = 0


def base_model(kind: str, seed: int) -> Any:
    """The bases, sized for a 2-core CPU: ~10M parameters dense, 8 experts (top-2) MoE."""
    import torch
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": 2048, "num_hidden_layers": 4, "max_position_embeddings": 128,
                              "tie_word_embeddings": False, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "head_dim": 64}
    if kind == "dense":
        config: Any = tf.LlamaConfig(hidden_size=256, intermediate_size=704, **common)
        cls: Any = tf.LlamaForCausalLM
    elif kind == "moe":
        config = tf.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                                   decoder_sparse_step=1, mlp_only_layers=[], **common)
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(f"unknown base {kind!r}: dense or moe")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).eval()
    model.generation_config.eos_token_id = None  # fixed-length completions: equal work in both arrangements
    return model


def _spec(kind: str, rank: int, i: int) -> Any:
    from engine_client.train.lora_stack import LoraSpec

    moe = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj") if kind == "moe" else ()
    mlp = () if kind == "moe" else ("gate_proj", "up_proj", "down_proj")
    return LoraSpec(r=rank, lora_alpha=2 * rank, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", *mlp),
                    target_parameters=moe, seed=i, init_b_std=0.01)


def _rss_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def run_case(kind: str, n: int, arrangement: str, cfg: TrainBenchConfig) -> dict[str, Any]:
    """One measurement (in its own process): wall time and peak RSS of ``arrangement`` for N policies."""
    import resource

    import torch

    from engine_client.train.grpo import GRPO, GRPOConfig
    from engine_client.train.multi_adamw import OptimConfig
    from engine_client.train.trainer import MultiLoRATrainer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = base_model(kind, cfg.seed)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(cfg.seed)
    names = [f"bench/p{i}" for i in range(n)]
    prompts = {p: [torch.randint(0, vocab, (cfg.prompt_len,), generator=gen).tolist() for _ in range(cfg.prompts)]
               for p in names}
    targets = {p: i % vocab for i, p in enumerate(names)}

    def reward(policy: str, prompt: list[int], completion: list[int]) -> float:
        return float(targets[policy] in completion)

    micro = cfg.prompts * cfg.group_size if arrangement == "concurrent_mb" else None
    gcfg = GRPOConfig(group_size=cfg.group_size, max_new_tokens=cfg.new_tokens, seed=cfg.seed, micro_batch=micro)

    def train(policies: list[str], steps: int) -> None:
        with MultiLoRATrainer(model) as trainer:
            for p in policies:
                trainer.add_policy(p, _spec(kind, cfg.rank, names.index(p)), optim=OptimConfig(lr=1e-3))
            grpo = GRPO(trainer, reward, gcfg)
            for _ in range(steps):
                grpo.step({p: prompts[p] for p in policies})

    train(names[:1], 1)  # warm-up: lazy imports, allocator, kernels
    rss0 = _rss_kib("VmRSS") or 0
    exact = _reset_peak()
    wall = cpu = float("inf")
    for _ in range(cfg.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        with profiled(f"{kind} N={n} {arrangement}"):
            if arrangement == "one_by_one":
                for p in names:
                    train([p], cfg.steps)
            else:
                train(names, cfg.steps)
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    peak = _rss_kib("VmHWM") if exact else None
    if peak is None:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return {"base": kind, "policies": n, "arrangement": arrangement, "wall_s": wall, "cpu_s": cpu,
            "peak_rss_mib": peak / 1024, "peak_over_start_mib": (peak - rss0) / 1024, "peak_exact": exact,
            "threads": torch.get_num_threads()}


def run(cfg: TrainBenchConfig, progress: Any = None) -> list[dict[str, Any]]:
    """Every (base, N, arrangement), each in a fresh process; returns one row per (base, N)."""
    rows = []
    ctx = get_context("spawn")
    for kind in cfg.bases:
        for n in cfg.policies:
            got = {}
            for arrangement in ARRANGEMENTS:
                with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                    got[arrangement] = pool.submit(run_case, kind, n, arrangement, cfg).result()
                if progress is not None:
                    progress(got[arrangement])
            s = got["one_by_one"]
            row: dict[str, Any] = {"base": kind, "policies": n, "paper_speedup": PAPER[kind], "threads": s["threads"],
                                   "peak_exact": all(g["peak_exact"] for g in got.values())}
            for a, g in got.items():
                row[f"{a}_s"] = g["wall_s"]
                row[f"{a}_cpu_s"] = g["cpu_s"]
                row[f"{a}_peak_mib"] = g["peak_rss_mib"]
                row[f"{a}_peak_over_start_mib"] = g["peak_over_start_mib"]
                if a != "one_by_one":
                    row[f"{a}_speedup"] = s["wall_s"] / g["wall_s"]
                    row[f"{a}_cpu_speedup"] = s["cpu_s"] / g["cpu_s"]
            rows.append(row)
    return rows


def table_rows(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One line per (base, N): wall times, ratios one-by-one / concurrent (wall, CPU), peak RSS above start."""
    out = [("base   N", "concurrent: wall  ratio (cpu) | micro-batched: wall  ratio (cpu) | one by one | "
                        "peak RSS over start, MiB: conc / mb / 1-by-1")]
    for r in rows:
        out.append((f"{r['base']:<5} {r['policies']:>2}",
                    f"{r['concurrent_s']:6.2f} s  {r['concurrent_speedup']:4.2f}x ({r['concurrent_cpu_speedup']:4.2f}x)"
                    f"   |   {r['concurrent_mb_s']:6.2f} s  {r['concurrent_mb_speedup']:4.2f}x "
                    f"({r['concurrent_mb_cpu_speedup']:4.2f}x)   | {r['one_by_one_s']:6.2f} s | "
                    f"{r['concurrent_peak_over_start_mib']:5.0f} / {r['concurrent_mb_peak_over_start_mib']:4.0f} / "
                    f"{r['one_by_one_peak_over_start_mib']:4.0f}"))
    return out


def config_dict(cfg: TrainBenchConfig) -> dict[str, Any]:
    return asdict(cfg) | {"cpus": os.cpu_count()}
