"""Benchmark hook (tools/bench/vllm_load.py): times vLLM's worker-side adapter loads.

On ``PYTHONPATH`` only for the benchmark's vLLM processes, with ``MINT_BENCH_TRACE`` naming a
file. Python imports this at start in every such process, vLLM's engine core included (a
process of its own), where ``add_adapter`` of the worker's LoRA manager loads an adapter and
copies it into its slot. Each call that loads (the LoRA id not held yet) appends
``<lora id> <seconds> <load seconds>`` to the file: the whole call, and the part of it in
``WorkerLoRAManager._load_adapter`` (reading the adapter into a ``LoRAModel``; the rest is
vLLM's: merging packed modules, its CPU cache, the activation copy into the slot). Without the
variable this does nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any


def _install(path: str) -> None:
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    add = LRUCacheWorkerLoRAManager.add_adapter
    load = WorkerLoRAManager._load_adapter  # (the plugin, installed later, wraps this wrapper)
    loaded: dict[int, float] = {}

    def timed_load(self: Any, lora_request: Any) -> Any:
        t = time.perf_counter()
        try:
            return load(self, lora_request)
        finally:
            loaded[lora_request.lora_int_id] = time.perf_counter() - t

    def timed(self: Any, lora_request: Any) -> Any:
        fresh = lora_request.lora_int_id not in self.list_adapters()
        t = time.perf_counter()
        try:
            return add(self, lora_request)
        finally:
            if fresh:
                took = time.perf_counter() - t
                line = f"{lora_request.lora_int_id} {took:.9f} {loaded.pop(lora_request.lora_int_id, 0.0):.9f}\n"
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())  # one write of a short line: whole, in order
                finally:
                    os.close(fd)

    timed_load.__wrapped__ = load  # type: ignore[attr-defined]  # (compat.check_vllm reads the signature)
    WorkerLoRAManager._load_adapter = timed_load
    LRUCacheWorkerLoRAManager.add_adapter = timed


if os.environ.get("MINT_BENCH_TRACE"):
    _install(os.environ["MINT_BENCH_TRACE"])
