"""Benchmark hook (tools/bench/vllm_load.py): times vLLM's worker-side adapter loads.

On ``PYTHONPATH`` only for the benchmark's vLLM processes, with ``MINT_BENCH_TRACE`` naming a
file. Python imports this at start in every such process, vLLM's engine core included (a
process of its own), where ``add_adapter`` of the worker's LoRA manager loads an adapter and
copies it into its slot. Each call that loads (the LoRA id not held yet) appends
``<lora id> <seconds>`` to the file. Without the variable this does nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any


def _install(path: str) -> None:
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    add = LRUCacheWorkerLoRAManager.add_adapter

    def timed(self: Any, lora_request: Any) -> Any:
        fresh = lora_request.lora_int_id not in self.list_adapters()
        t = time.perf_counter()
        try:
            return add(self, lora_request)
        finally:
            if fresh:
                line = f"{lora_request.lora_int_id} {time.perf_counter() - t:.9f}\n"
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())  # one write of a short line: whole, in order
                finally:
                    os.close(fd)

    LRUCacheWorkerLoRAManager.add_adapter = timed


if os.environ.get("MINT_BENCH_TRACE"):
    _install(os.environ["MINT_BENCH_TRACE"])
