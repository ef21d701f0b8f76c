#!/usr/bin/env python3
"""Packed MoE adapter load benchmark (not a test).

A rank-1 LoRA on the attention and on every expert of a Qwen3-30B-A3B-shaped model
(128 experts; layers cut by flag), loaded into an engine's device slot from one packed store
row, against the same adapter read from per-expert safetensors one tensor at a time.
Logic: ``tools/bench/moe_pack_bench.py``.

    python tools/bench_moe_pack.py                # 48 layers
    python tools/bench_moe_pack.py --layers 4     # quicker
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401  (puts the repository root on sys.path: tools.bench imports)
import torch

from tools.bench.moe_pack_bench import MoePackBenchConfig, report, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="docs/results/moe_pack.json")
    a = p.parse_args()
    try:
        cfg = MoePackBenchConfig(layers=a.layers, experts=a.experts, hidden=a.hidden, inter=a.inter, rank=a.rank,
                                 repeat=a.repeat, device=a.device, out=a.out)
    except ValueError as e:  # a bad flag: usage and exit 2, as argparse does for its own checks
        p.error(str(e))
    report(run(cfg), cfg)
    print(f"\nwrote {cfg.out}")


if __name__ == "__main__":
    main()
