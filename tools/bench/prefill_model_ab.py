"""A/B of LoRAEngine.forward in prefill with the fused linear path (new) and without (old).

One process, one engine, the two variants interleaved rep by rep (the machine may be shared and
noisy) on the mixed bench's Llama (hidden 512, 6 layers, intermediate 1408, rank 8 on q/v/o/down),
N sequences of 32 tokens each with its own adapter; prints medians and minima of the LoRA
overhead (engine minus the base alone). "old" switches the fused path off by raising its
minimum tokens per sequence. Run:
``PYTHONPATH=$PWD python -m tools.bench.prefill_model_ab [reps] [threads] [N ...]``.
"""

from __future__ import annotations

import copy
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine_client import LoRAEngine, MintClient
from engine_client.engine import lora_layers

from .mixed_bench import MixedBenchConfig, build_base, inputs, publish, random_factors


def main(reps: int = 10, threads: int = 2, counts: tuple[int, ...] = (64, 256)) -> None:
    torch.set_num_threads(threads)
    cfg = MixedBenchConfig(device="cpu")
    base = build_base(cfg)
    fused_min = lora_layers._FUSED_MIN_TOKENS
    for n in counts:
        root = Path(tempfile.mkdtemp(prefix="mint-prefill-ab-"))
        try:
            refs, row = publish(random_factors(base, cfg, n), root)
            client = MintClient(str(root / "store"), index_dir=str(root / "index"))
            kw = inputs(cfg, n, "prefill")
            with LoRAEngine(copy.deepcopy(base), client, device="cpu", slots=n + 1,
                            host_bytes=2 * n * row + (64 << 20)) as eng, torch.inference_mode():
                def run(kw: dict = kw, refs: list = refs) -> object:
                    return eng.forward(adapters=refs, **kw)

                variants = {"base": lambda kw=kw: base(**kw), "old": run, "new": run}
                gates = {"old": 1 << 30, "new": fused_min}
                lora_layers._FUSED_MIN_TOKENS = gates["old"]
                ref = eng.forward(adapters=refs, **kw).logits
                lora_layers._FUSED_MIN_TOKENS = gates["new"]
                diff = float((eng.forward(adapters=refs, **kw).logits - ref).abs().max())
                times: dict[str, list[float]] = {k: [] for k in variants}
                for _ in range(reps):
                    for k, f in variants.items():
                        lora_layers._FUSED_MIN_TOKENS = gates.get(k, fused_min)
                        t0 = time.perf_counter()
                        f()
                        times[k].append(time.perf_counter() - t0)
                lora_layers._FUSED_MIN_TOKENS = fused_min
            for name, stat in (("median", statistics.median), ("min", min)):
                m = {k: stat(v) * 1e3 for k, v in times.items()}
                print(f"N={n:4d} {name:>6}: base {m['base']:.1f} ms | LoRA overhead old {m['old'] - m['base']:.1f} ms, "
                      f"new {m['new'] - m['base']:.1f} ms | max logit diff new vs old {diff:.2e}", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    args = [int(v) for v in sys.argv[1:]]
    main(args[0] if args else 10, args[1] if len(args) > 1 else 2, tuple(args[2:]) or (64, 256))
