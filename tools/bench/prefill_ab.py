"""A/B of one wrapped linear in prefill: base GEMM then ADD_LORA (old) vs delta first, GEMM into it (new).

Interleaves the variants rep by rep in one process (the machine is shared and noisy) and prints
medians of the LoRA overhead (variant minus the base GEMM alone). Run:
``PYTHONPATH=$PWD python -m tools.bench.prefill_ab``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from engine_client.kernels.ops import add_lora, linear_lora


def main(reps: int = 40, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    t, r = 32, 8
    for n in (64, 256):
        for d_in, d_out in ((512, 512), (1408, 512)):
            x = torch.randn(n, t, d_in)
            w = torch.randn(d_out, d_in) / d_in**0.5
            a = torch.randn(n + 4, r, d_in) / d_in**0.5
            b = torch.randn(n + 4, d_out, r) * 0.02
            s = torch.full((n + 4,), 2.0)
            slots = torch.arange(n)
            prog = (0, 1)

            args = (x, w, a, b, s, slots, prog)

            def base(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                return F.linear(x, w)

            def old(args: tuple = args) -> torch.Tensor:
                x, w, a, b, s, slots, prog = args
                return add_lora(F.linear(x, w), x, a, b, s, slots, progression=prog)

            def new(args: tuple = args) -> torch.Tensor:
                x, w, a, b, s, slots, prog = args
                return linear_lora(x, w, None, a, b, s, slots, progression=prog)

            torch.testing.assert_close(old(), new(), rtol=1e-4, atol=1e-4)
            fns: dict[str, Callable[[], torch.Tensor]] = {"base": base, "old": old, "new": new}
            times: dict[str, list[float]] = {k: [] for k in fns}
            with torch.no_grad():
                for _ in range(3):
                    for f in fns.values():
                        f()
                for _ in range(reps):
                    for k, f in fns.items():
                        t0 = time.perf_counter()
                        f()
                        times[k].append(time.perf_counter() - t0)
            for name, stat in (("median", statistics.median), ("min", min)):
                m = {k: stat(v) * 1e3 for k, v in times.items()}
                print(f"N={n:4d} in={d_in:5d} out={d_out} {name:>6}: base {m['base']:.2f} ms  old {m['old']:.2f} "
                      f"(+{m['old'] - m['base']:.2f})  new {m['new']:.2f} (+{m['new'] - m['base']:.2f})", flush=True)


if __name__ == "__main__":
    main(*(int(v) for v in sys.argv[1:]))
