"""One run of the mixed-batch peer comparison (``tools/bench_batch.py --part peer``): the dense
rows (:mod:`.mixed_bench`) and the MoE rows (:mod:`.mixed_moe`, built on the dense ones).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import mixed_moe
from .mixed_bench import MixedBenchConfig, bench_count, build_base, measure_machine, settings
from .mixed_rounds import clock
from .report import write_json


def run(cfg: MixedBenchConfig) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    machine = measure_machine(cfg.device)
    base = build_base(cfg)
    root = Path(tempfile.mkdtemp(prefix="mint-bench-mixed-"))
    rows: list[dict[str, Any]] = []
    try:
        for n in cfg.counts if "dense" in cfg.families else ():
            rows += bench_count(cfg, base, n, root, machine, rows)
            shutil.rmtree(root / f"n{n}", ignore_errors=True)
        if "moe" in cfg.families:
            moe = mixed_moe.build_moe_base(cfg)
            for n in cfg.counts:
                rows += mixed_moe.bench_moe_count(cfg, moe, n, root, machine)
                shutil.rmtree(root / f"moe{n}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {"config": settings(cfg), "torch_threads": torch.get_num_threads(), "clock": clock(cfg.device)[0],
               "machine": machine, "rows": rows}
    if cfg.out is not None:
        write_json(cfg.out, "mixed", results)
    return results
