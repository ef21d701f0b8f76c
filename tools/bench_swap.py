#!/usr/bin/env python3
"""Adapter switch benchmark (not a test): a switch into a live engine against a full reload
of the base from safetensors, PEFT load_adapter + set_adapter, and vLLM add_lora.

Bases (random bf16 weights, nothing downloaded): a Qwen3-4B-shaped dense model (~8 GB) with
rank 1 and rank 16 adapters on every linear module, and a Qwen3-30B-A3B-shaped MoE model
(128 experts; layers cut by --moe-layers) with rank 1 on attention and every expert. See
tools/bench/swap_bench.py for what is timed and how.

    python tools/bench_swap.py                       # the full run (~8 GB base; a few minutes)
    python tools/bench_swap.py --quick               # small shapes, about a minute
    python tools/bench_swap.py --vllm-python .venv-vllm/bin/python   # with the vLLM baseline
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401  (puts the repository root on sys.path: tools.bench imports)

from tools.bench.swap_bench import SwapBenchConfig, report, run
from tools.bench.swap_models import QUICK_DENSE, QUICK_MOE, QWEN3_4B, QWEN3_30B_A3B_CUT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes and fewer repeats (about a minute)")
    p.add_argument("--dense-layers", type=int, help="layers of the dense base (default 36; --quick 4)")
    p.add_argument("--moe-layers", type=int, help="layers of the MoE base (default 6 of 48; --quick 2)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense base")
    p.add_argument("--no-moe", action="store_true", help="skip the MoE base")
    p.add_argument("--cold", type=int, help="timed cold switches per rank (distinct adapters; default 30)")
    p.add_argument("--warm", type=int, help="timed warm switches per rank (default 200)")
    p.add_argument("--probe", type=int, help="switches of the small fixed-cost probe row (default 500; 0: none)")
    p.add_argument("--reload-repeat", type=int, help="full reloads of the base (best is reported; default 3)")
    p.add_argument("--peft-repeat", type=int, help="PEFT / vLLM loads (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the whole run (default 1)")
    p.add_argument("--no-forward", action="store_true", help="skip the forward through the engine")
    p.add_argument("--vllm-python", help="an interpreter with vLLM for the add_lora baseline (e.g. "
                                         ".venv-vllm/bin/python); used only when vLLM is not importable here")
    p.add_argument("--root", help="work directory (default: a temp dir, removed after)")
    p.add_argument("--out", help="JSON results (default docs/results/swap.json; --quick: swap-quick.json)")
    a = p.parse_args()
    dense, moe = (QUICK_DENSE, QUICK_MOE) if a.quick else (QWEN3_4B, QWEN3_30B_A3B_CUT)
    if a.dense_layers:
        dense = dense.with_layers(a.dense_layers)
    if a.moe_layers:
        moe = moe.with_layers(a.moe_layers)
    quick = dict(cold=10, warm=50, probe=200, reload_repeat=3, peft_repeat=3) if a.quick else {}
    given = {k: v for k, v in dict(cold=a.cold, warm=a.warm, probe=a.probe, reload_repeat=a.reload_repeat,
                                   peft_repeat=a.peft_repeat).items() if v is not None}
    out = a.out or ("docs/results/swap-quick.json" if a.quick else "docs/results/swap.json")
    cfg = SwapBenchConfig(dense=None if a.no_dense else dense, moe=None if a.no_moe else moe,
                          forward=not a.no_forward, threads=a.threads, vllm_python=a.vllm_python, root=a.root, out=out,
                          **(quick | given))
    report(run(cfg), cfg.out)


if __name__ == "__main__":
    main()
