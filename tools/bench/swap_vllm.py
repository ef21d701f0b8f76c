"""vLLM's ``add_lora`` for the swap benchmark, in an interpreter that has vLLM.

    python -m tools.bench.swap_vllm SPEC.json OUT.json

SPEC: ``{"model": dir, "loras": {label: PEFT dir}, "repeat": n, "max_lora_rank": r,
"dtype": "bfloat16", "moe": bool}`` (``moe``: the adapters hold fused 3-d expert weights,
PEFT's ``target_parameters`` form, which vLLM takes with ``enable_mixed_moe_lora_format``).

Starts an offline ``LLM`` with LoRA enabled (no tokenizer: nothing is generated), then
times ``add_lora`` of each adapter ``repeat`` times, each time under a new id so vLLM loads
it again (removed, untimed, after each). Writes ``{label: [seconds]}`` plus the start-up
time. Its own process: vLLM starts workers (hence the ``__main__`` guard), and its model
must not sit in memory next to the benchmark's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tools.bench.memwatch import MemoryWatch


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    with MemoryWatch(0.5, tree=True) as mem:  # vLLM's engine core is a child process
        out = run(spec)
    out["peak_anon_bytes"] = mem.peak
    Path(sys.argv[2]).write_text(json.dumps(out))


def run(spec: dict) -> dict:
    t0 = time.perf_counter()
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    moe = bool(spec.get("moe"))
    extra = {"enable_mixed_moe_lora_format": True} if moe else {}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, enable_lora=True,
              max_lora_rank=spec["max_lora_rank"], max_loras=1, max_cpu_loras=2, max_model_len=128,
              max_num_seqs=1, dtype=spec["dtype"], seed=0, kv_cache_memory_bytes=64 << 20, **extra)
    out: dict = {"start_s": time.perf_counter() - t0, "add_lora_s": {}}
    engine = llm.llm_engine
    next_id = 1
    for label, path in spec["loras"].items():
        times = []
        for _ in range(spec["repeat"]):
            req = LoRARequest(f"{label}-{next_id}", next_id, path, is_3d_lora_weight=moe)
            t = time.perf_counter()
            engine.add_lora(req)
            times.append(time.perf_counter() - t)
            engine.remove_lora(next_id)
            next_id += 1
        out["add_lora_s"][label] = times
    return out


if __name__ == "__main__":
    main()
