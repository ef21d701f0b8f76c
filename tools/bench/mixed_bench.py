"""Mixed-adapter batches against the peer a user would pick, and against the machine's limit.

For N sequences that each run their own adapter (all adapters already resident), one run
times, on the same inputs and threads:

- the base model alone (no LoRA anywhere),
- PEFT's mixed batch (``PeftModel(..., adapter_names=[...])``, one loop over the adapters
  inside every LoRA layer),
- ``LoRAEngine.forward`` (one ADD_LORA per layout and layer).

"LoRA overhead" is a variant's time minus the base's: the median over paired, interleaved
rounds of the within-round difference, with its spread, and beside it the LoRA ops' own time
from a profiled forward (``tools/bench/mixed_rounds.py`` says how, and when an overhead is
only "within noise"). The **roofline floor** of that
overhead is what the adapters alone must cost on this machine: max(adapter bytes read /
memory bandwidth, adapter FLOPs / matmul rate), with the bandwidth (a large copy) and the
matmul rate (a large fp32 GEMM) measured in the same run. Beside it, the **unfused bound**
(:func:`roofline`) adds the activations a LoRA in passes of its own must move (each
module's input read, its output read and rewritten): how much of the gap to the floor is that
traffic, which only a LoRA fused into the base GEMM avoids. Shapes: prefill (``tokens`` per
sequence), a ragged prefill (left-padded lengths from ``tokens // 4`` to ``tokens``), and
decode (one new token per sequence on a KV cache of ``tokens``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mint_store.format.adapter import make_adapter
from mint_store.store import Store

from .mixed_rounds import lora_ops_fields, ratios, time_rounds, timing_fields
from .report import default_device, print_table, require_positive

DENSE_TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


@dataclass(frozen=True, slots=True, kw_only=True)
class MixedBenchConfig:
    hidden: int = 512
    layers: int = 6
    intermediate: int = 1408
    vocab: int = 1024
    rank: int = 8
    tokens: int = 32  # tokens per sequence in prefill; the KV cache length in decode
    counts: tuple[int, ...] = (1, 8, 64, 256, 1000)  # N: sequences, each with its own adapter
    shapes: tuple[str, ...] = ("prefill", "ragged", "decode")
    repeat: int = 3  # rounds at least (each round: every variant once, back to back)
    budget_s: float = 2.0  # more rounds until every variant has run this long (per N and shape)
    max_rounds: int = 15  # rounds at most (decode: twice), unless ``repeat`` asks for more
    peft_max_n: int = 256  # above it PEFT is not run (its mixed batch is a Python loop over N adapters)
    families: tuple[str, ...] = ("dense", "moe")  # moe: a Qwen3-MoE base with LoRA on its experts too
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 256
    threads: int = 0  # torch intra-op threads (0: torch's default)
    device: str = field(default_factory=default_device)
    out: str | None = "docs/results/mixed.json"  # None: the results are returned, not written

    def __post_init__(self) -> None:
        require_positive(self, "hidden", "layers", "intermediate", "vocab", "rank", "tokens", "repeat", "max_rounds")
        if not self.budget_s >= 0:
            raise ValueError(f"budget_s must be >= 0 seconds, got {self.budget_s}")
        if not self.counts or min(self.counts) < 1:
            raise ValueError(f"counts must be one or more sequence counts >= 1, got {self.counts}")
        if not self.families or set(self.families) - {"dense", "moe"}:
            raise ValueError(f"families must be among dense, moe; got {self.families}")
        unknown = set(self.shapes) - {"prefill", "ragged", "decode"}
        if unknown or not self.shapes:
            raise ValueError(f"shapes must be among prefill, ragged, decode; got {self.shapes}")


def build_base(cfg: MixedBenchConfig) -> Any:
    import transformers as tf

    heads = max(1, cfg.hidden // 64)
    config = tf.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                            num_hidden_layers=cfg.layers, num_attention_heads=heads, num_key_value_heads=heads,
                            max_position_embeddings=4 * cfg.tokens + 8, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tf.LlamaForCausalLM(config).eval().to(cfg.device)


def build_peft(base: Any, cfg: MixedBenchConfig, n: int) -> tuple[Any, list[dict[str, tuple[Any, Any, float]]]]:
    """A PeftModel over a copy of ``base`` holding ``n`` random adapters, and their factors."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.rank, lora_alpha=2 * cfg.rank, target_modules=list(DENSE_TARGETS))
    pm = get_peft_model(copy.deepcopy(base), lora, adapter_name="a0")
    for i in range(1, n):
        pm.add_adapter(f"a{i}", lora)
    model: Any = pm.base_model.model
    factors = random_factors(model, cfg, n)
    with torch.no_grad():
        for path, mod in model.named_modules():
            for i, f in enumerate(factors):
                if path in f:
                    mod.lora_A[f"a{i}"].weight.copy_(f[path][0])
                    mod.lora_B[f"a{i}"].weight.copy_(f[path][1])
    return pm.eval(), factors


def random_factors(model: Any, cfg: MixedBenchConfig, n: int) -> list[dict[str, tuple[Any, Any, float]]]:
    """``n`` random adapters (path -> (A [r, in], B [out, r], scaling)) on the targets of ``model``."""
    g = torch.Generator().manual_seed(1)
    factors: list[dict[str, tuple[Any, Any, float]]] = [{} for _ in range(n)]
    mods = [(p, m) for p, m in model.named_modules()
            if p.rsplit(".", 1)[-1] in DENSE_TARGETS and hasattr(m, "in_features")]
    for path, mod in mods:
        for f in factors:
            a = torch.randn(cfg.rank, mod.in_features, generator=g) / mod.in_features**0.5
            f[path] = (a, torch.randn(mod.out_features, cfg.rank, generator=g) * 0.02, 2.0)  # alpha 2r / r
    return factors


def publish(factors: list[dict[str, tuple[Any, Any, float]]], root: Path) -> tuple[list[str], int]:
    """The same adapters in a store; returns their refs and the row size."""
    adapters = [make_adapter(f) for f in factors]
    with Store.open(str(root / "store"), index_dir=str(root / "index")) as store:
        store.publish_many(("mixed", f"a{i}", a) for i, a in enumerate(adapters))
    return [f"mixed/a{i}@1" for i in range(len(factors))], adapters[0].layout.row_nbytes


def inputs(cfg: MixedBenchConfig, n: int, shape: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, cfg.vocab, (n, cfg.tokens), generator=g).to(cfg.device)
    if shape == "prefill":
        return {"input_ids": ids}
    lengths = torch.randint(max(1, cfg.tokens // 4), cfg.tokens + 1, (n,), generator=g)
    mask = (torch.arange(cfg.tokens) >= (cfg.tokens - lengths).unsqueeze(1)).long().to(cfg.device)  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def floor_s(cfg: MixedBenchConfig, n: int, new_tokens: int, machine: dict[str, float]) -> dict[str, Any]:
    """The :func:`roofline` of a dense batch: every adapter's factors read once (fp32), their FLOPs
    per token; each module's input and output as the activations of a LoRA in passes of its own."""
    h, i, r, L = cfg.hidden, cfg.intermediate, cfg.rank, cfg.layers
    dims = [(h, h), (h, h), (h, h), (i, h)]  # (in, out) of q, v, o, down
    params = L * sum(r * (a + b) for a, b in dims)
    act = n * new_tokens * L * sum(a + 2 * b for a, b in dims) * 4
    return roofline(n * params * 4, 2 * n * new_tokens * params, act, machine)


def roofline(adapter_bytes: int, flops: float, activation_bytes: int, machine: dict[str, float]) -> dict[str, Any]:
    """The floor of the LoRA overhead and, beside it, the unfused bound.

    ``floor_s``: what the adapters alone must cost, max(adapter bytes / bandwidth, FLOPs / matmul
    rate), ``bound_by`` the larger. ``unfused_floor_s``: the same with ``activation_bytes`` added
    to the bytes, what a LoRA in passes of its own beside the base layer must also move (SHRINK
    reads each module's input, EXPAND reads and rewrites its output: ``in + 2 * out`` fp32 values
    per module and token). The unfused bound is an estimate, not a floor: a LoRA fused into the
    base GEMM reads the activations while they are in cache, and activations still in a large
    last-level cache move faster than the copy bandwidth. It says how much of the gap to the
    floor that traffic explains.
    """
    bw = machine["bandwidth_Bps"]
    t_bytes, t_flops = adapter_bytes / bw, flops / machine["matmul_flops"]
    return {"adapter_bytes": adapter_bytes, "adapter_flops": flops, "floor_s": max(t_bytes, t_flops),
            "bound_by": "memory" if t_bytes >= t_flops else "compute", "activation_bytes": activation_bytes,
            "unfused_floor_s": max(t_bytes + activation_bytes / bw, t_flops)}


def measure_machine(device: str) -> dict[str, float]:
    """Memory bandwidth (a 256 MiB copy: read + write) and fp32 matmul rate (2048^3 GEMM)."""
    src = torch.ones(64 << 20, device=device)
    dst = torch.empty_like(src)
    t = _best(lambda: dst.copy_(src), 5, device)
    a = torch.randn(2048, 2048, device=device)
    tm = _best(lambda: a @ a, 5, device)
    return {"bandwidth_Bps": 2 * src.numel() * 4 / t, "matmul_flops": 2 * 2048**3 / tm}


def _best(fn: Callable[..., object], repeat: int, device: str, setup: Callable[[], Any] | None = None) -> float:
    """The best of ``repeat`` runs of ``fn()`` (``fn(setup())`` with a setup, made untimed)."""
    best = float("inf")
    for _ in range(repeat):
        args = (setup(),) if setup else ()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_count(cfg: MixedBenchConfig, base: Any, n: int, root: Path, machine: dict[str, float],
                earlier: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The rows of one N; ``earlier`` rows (smaller N) estimate PEFT where it is skipped."""
    from engine_client import LoRAEngine, MintClient

    with_peft = n <= cfg.peft_max_n
    pm, factors = build_peft(base, cfg, n) if with_peft else (None, random_factors(base, cfg, n))
    refs, row_bytes = publish(factors, root / f"n{n}")
    names = [f"a{i}" for i in range(n)]
    out = []
    client = MintClient(str(root / f"n{n}" / "store"), index_dir=str(root / f"n{n}" / "index"))
    with LoRAEngine(copy.deepcopy(base), client, device=cfg.device, slots=n + 1,
                    host_bytes=2 * n * row_bytes + (64 << 20)) as engine, torch.inference_mode():
        engine.forward(inputs(cfg, 1, "prefill")["input_ids"].expand(n, -1), adapters=refs)  # all resident
        variants: dict[str, Callable[..., Any]] = {
            "base": base, "engine": lambda **kw: engine.forward(adapters=refs, **kw)}
        diff = None
        if pm is not None:
            variants["peft"] = lambda **kw: pm(**kw, adapter_names=names)
            # the same work or no comparison: the engine's logits must be PEFT's, sequence by sequence
            kw = inputs(cfg, n, "ragged")
            diff = float((variants["peft"](**kw).logits - variants["engine"](**kw).logits).abs().max())
        for shape in cfg.shapes:
            row = {"family": "dense", "n": n, "shape": shape, "tokens": cfg.tokens, "max_logit_diff": diff,
                   **floor_s(cfg, n, 1 if shape == "decode" else cfg.tokens, machine)}
            row |= measure(cfg, variants, inputs(cfg, n, shape), decode=shape == "decode")
            row |= ratios(row)
            if not with_peft:
                row["peft_estimate_s"] = _peft_estimate(earlier or [], shape, n)
            print(_line(row), flush=True)  # a long run shows each row as it is measured
            out.append(row)
    return out


def _peft_estimate(earlier: list[dict[str, Any]], shape: str, n: int) -> float | None:
    """PEFT's overhead at ``n`` from the largest measured N of ``shape`` (its loop is linear in N)."""
    done = [r for r in earlier if r["shape"] == shape and r["peft_overhead_s"] is not None]
    if not done:
        return None
    last = max(done, key=lambda r: r["n"])
    return last["peft_overhead_s"] * n / last["n"]


def measure(cfg: MixedBenchConfig, variants: dict[str, Callable[..., Any]], kw: dict[str, Any], *,
            decode: bool) -> dict[str, Any]:
    """A row's timing fields (paired rounds, :func:`.mixed_rounds.time_rounds`) and the LoRA ops' own time."""
    times = time_rounds(variants, kw, decode=decode, repeat=cfg.repeat, max_rounds=cfg.max_rounds,
                        budget_s=cfg.budget_s, device=cfg.device)
    out = timing_fields(times)
    runs = max(2, min(5, int(cfg.budget_s / max(out["engine_s"], 1e-9))))  # more profiled forwards where cheap
    return out | lora_ops_fields(variants["engine"], kw, decode=decode, runs=runs, device=cfg.device)


def settings(cfg: MixedBenchConfig) -> dict[str, Any]:
    """What a results file records of its run's config (not where it was written)."""
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__ if k != "out"}


def report(results: dict[str, Any]) -> None:
    c, m = results["config"], results["machine"]
    print(f"\nmachine: {m['bandwidth_Bps'] / 1e9:.1f} GB/s copy bandwidth, {m['matmul_flops'] / 1e9:.1f} GFLOP/s fp32 "
          f"GEMM, {results['torch_threads']} threads, rounds timed in {results.get('clock', 'wall clock')}")
    rows = [(f"{r.get('family', 'dense'):>5} {r['shape']:>7} N={r['n']:<5}", _line(r).split(": ", 1)[1])
            for r in results["rows"]]
    moe = (f"; moe: Qwen3-MoE, {c['experts']} experts top-{c['top_k']}, expert intermediate {c['moe_intermediate']}, "
           "LoRA on q, v, o and the experts") if "moe" in c.get("families", ()) else ""
    print_table(f"mixed batches: Llama hidden {c['hidden']}, {c['layers']} layers, intermediate {c['intermediate']}, "
                f"rank {c['rank']} on {', '.join(DENSE_TARGETS)}, {c['tokens']} tokens per sequence{moe}", rows)


def _ratio(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:6.1f}x"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _overhead_text(r: dict[str, Any], variant: str) -> str:
    """Median [interquartile range] ms, or "within noise (< X ms)" where not resolved."""
    med, (q1, q3) = r[f"{variant}_overhead_s"], r[f"{variant}_overhead_iqr_s"]
    text = f"{_ms(med):>7} [{_ms(q1)}, {_ms(q3)}] ms"
    return text if r[f"{variant}_resolved"] else f"{text} within noise (< {_ms(r[f'{variant}_noise_bound_s'])} ms)"


def _peft_text(r: dict[str, Any]) -> str:
    if r["peft_overhead_s"] is not None:
        return _overhead_text(r, "peft")
    if r.get("peft_skipped"):
        return "n/a (no mixed batch on experts)"
    est = r.get("peft_estimate_s")
    return "skipped" + ("" if est is None else f" (would take ~{est:.1f} s)")


def _line(r: dict[str, Any]) -> str:
    vs_peft = _ratio(r["peft_over_engine"]) if r.get("peft_over_engine_at_least") is None else \
        f">= {r['peft_over_engine_at_least']:.1f}x"
    return (f"{r['shape']} N={r['n']}: base {_ms(r['base_s']):>8} ms (spread {_ms(r['base_spread_s'])} ms, "
            f"{r['rounds']} rounds) | LoRA overhead, median [IQR] of paired rounds: PEFT {_peft_text(r)}, engine "
            f"{_overhead_text(r, 'engine')} | LoRA ops alone {r['lora_ops_s'] * 1e3:.2f} ms | floor "
            f"{r['floor_s'] * 1e3:6.2f} ms ({r['bound_by']}) | engine/floor "
            f"{_ratio(r['engine_over_floor'] if r['engine_resolved'] else None)}, "
            f"ops/floor {r['lora_ops_over_floor']:5.1f}x"
            + (f" | unfused bound {r['unfused_floor_s'] * 1e3:.2f} ms, engine/bound {r['engine_over_unfused']:.2f}x"
               if r.get("engine_over_unfused") is not None and r["engine_resolved"] else "")
            + f" | PEFT/engine {vs_peft}")
