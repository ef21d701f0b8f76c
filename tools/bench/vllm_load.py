"""A cold adapter in vLLM: MinT's direct row path and files path vs vLLM's own local directory.

Runs in an interpreter that has vLLM (``.venv-vllm``), started by ``tools/bench_vllm.py``. One
offline ``LLM`` with the plugin registered from the environment (``MINT_SERVER``: a MinT
service on loopback). For each rank and round, interleaved, the latency of a first request
(``max_tokens=1``) for content vLLM and the plugin have never seen, minus the median base step
of the round, is taken for:

- ``local``: a ``LoRARequest`` on a PEFT directory on local disk (just written: page cache warm);
- ``direct``: the MinT ref through the plugin's resolver, rows straight into vLLM (the resolver
  checks the ref, vLLM's worker reads and verifies the row: one read, views, vLLM's copy);
- ``files``: the same ref through the files path (the resolver reads the row, writes and
  fsyncs PEFT files; vLLM reads and parses them).

Two differences per first request: over the round's base step (``*_s``, what the issue's
table measured: it includes vLLM's LoRA compute in the forward, the same for every path and
on CPU most of it), and over a second, warm request of the same adapter right after
(``*_load_s``). The resolver's part is timed on its own too (``*_resolve_s``). On a 2-core
machine a step's own spread (tens of ms) is as large as a load, so the loads are also timed
where they happen: ``add_adapter`` of vLLM's worker LoRA manager, which loads an adapter and
copies it into its slot, is timed in vLLM's engine process (``vllm_trace/sitecustomize.py``)
on the step that loads it (``*_worker_s``), and so is its part after the adapter was read into
a ``LoRAModel`` (``*_vllm_s``: vLLM's merge, CPU cache and activation copy, the same work on
every path); a MinT path's cold load is that plus its
resolver's part (``*_cold_s``), vLLM's own directory's is that alone.
Each round's three loads are of three different contents (each cold); after the round,
untimed, the MinT loads' tokens are compared with vLLM's own directory of the same content:
the numbers are of loads that give vLLM's own answer.

The machine's own limit, in the same run: after each round, untimed for the loads, one
``os.preadv`` of the direct load's row from its shard file on one CPU (vLLM's CPU worker is
pinned to one), page cache warm, into a buffer already faulted in and placed as the row is
in its page (the kernel's copy at its fastest), the best of three
(``direct_read_floor_s``): no read of the row's bytes can cost less here. vLLM's own part plus
that is the least any path that reads the row can take (``bench_vllm.py`` reports it against the
local directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tools.bench.read_floor import page_matched, preadv_all


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolverRegistry

    from engine_client.vllm_plugin import RESOLVER_NAME, MintResolver, PluginConfig
    from engine_client.vllm_plugin.plugin import MintLoRAResolver

    worker_s = _WorkerLoads(Path(os.environ["MINT_BENCH_TRACE"]))
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, enable_lora=True,
              max_lora_rank=max(spec["ranks"]), max_loras=1, max_cpu_loras=2, max_model_len=128, max_num_seqs=1,
              dtype=spec["dtype"], seed=0, kv_cache_memory_bytes=64 << 20)
    start_s = time.perf_counter() - t0
    direct = LoRAResolverRegistry.get_resolver(RESOLVER_NAME)
    config = PluginConfig.from_env()
    assert config is not None and direct.resolver.direct, "the plugin must run with MINT_VLLM_LOAD=direct"
    files = MintLoRAResolver(MintResolver(config, direct=False))  # the fallback path, same store
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    prompt = [{"prompt_token_ids": spec["prompt"]}]

    def step(request: Any) -> tuple[float, list[int]]:
        t = time.perf_counter()
        out = llm.generate(prompt, params, lora_request=request, use_tqdm=False)
        return time.perf_counter() - t, list(out[0].outputs[0].token_ids)

    # vLLM's OpenAI server awaits resolve_lora on its one running loop: so does this, on one loop
    # (asyncio.run per call would time a new loop and a new default executor thread each time)
    loop = asyncio.new_event_loop()

    def through(resolver: Any, ref: str) -> tuple[float, float, float, list[int]]:
        """(first request incl. the resolver, the resolver's part, a warm request after it, tokens)."""
        t = time.perf_counter()
        req = loop.run_until_complete(resolver.resolve_lora(spec["model"], ref))
        resolved = time.perf_counter() - t
        took, tokens = step(req)
        last_id[0], last_path[0] = req.lora_int_id, req.lora_path
        return resolved + took, resolved, step(req)[0], tokens

    next_id = [10_000]  # ids of local directories: never one the resolvers hand out
    last_id = [0]  # the LoRA id of the last first request
    last_path = [""]  # the path the resolver gave it
    rows_of = _RowFiles(spec["server_url"], Path(spec["store"]))

    def local(path: str) -> tuple[float, float, list[int]]:
        next_id[0] += 1
        req = LoRARequest(f"local-{next_id[0]}", next_id[0], path)
        last_id[0] = next_id[0]
        took, tokens = step(req)
        return took, step(req)[0], tokens

    # warm-up: the engine, a first LoRA of each path (opens the plugin's clients), not timed
    for _ in range(3):
        step(None)
    warm = spec["warmup"]
    local(warm["dir"])
    through(direct, warm["ref"])
    through(files, warm["ref2"])

    out: dict[str, Any] = {"start_s": start_s, "ranks": {}}
    for r in spec["ranks"]:
        rows: dict[str, list[float]] = {k: [] for k in (
            "base_s", "local_s", "direct_s", "files_s", "direct_resolve_s", "files_resolve_s",
            "local_load_s", "direct_load_s", "files_load_s", "local_worker_s", "direct_worker_s", "files_worker_s",
            "local_vllm_s", "direct_vllm_s", "files_vllm_s",
            "local_cold_s", "direct_cold_s", "files_cold_s", "direct_read_floor_s")}
        mismatched = 0
        for i, item in enumerate(spec["adapters"][str(r)]):
            base = statistics.median(step(None)[0] for _ in range(3))
            order = ["local", "direct", "files"]
            order = order[i % 3:] + order[: i % 3]  # interleaved: no path always first after the base steps
            got: dict[str, list[int]] = {}
            direct_path = ""  # the row path of this round's direct load
            for path in order:
                resolved = 0.0
                if path == "local":
                    s, warm, got[path] = local(item["local_dir"])
                else:
                    s, resolved, warm, got[path] = through(direct if path == "direct" else files,
                                                           item[f"{path}_ref"])
                    rows[f"{path}_resolve_s"].append(resolved)
                    if path == "direct":
                        direct_path = last_path[0]
                loaded = worker_s.pop(last_id[0])
                rows[f"{path}_worker_s"].append(loaded)
                # vLLM's part after the adapter is read (merge, CPU cache, activation copy): the
                # same work on every path, so no path's cold load can be below it
                rows[f"{path}_vllm_s"].append(loaded - worker_s.load_of(last_id[0]))
                rows[f"{path}_cold_s"].append(resolved + loaded)
                rows[f"{path}_s"].append(s - base)  # over a base step: vLLM's LoRA compute included
                rows[f"{path}_load_s"].append(s - warm)  # over a warm request of that adapter: the load alone
            rows["base_s"].append(base)
            rows["direct_read_floor_s"].append(rows_of.read_floor(Path(direct_path).name))
            # untimed: each MinT load gave what vLLM's own directory of the same content gives
            mismatched += sum(got[p] != local(item[f"{p}_dir"])[2] for p in ("direct", "files"))
        out["ranks"][str(r)] = rows | {"tokens_mismatched": mismatched}
    loop.close()
    return out


class _RowFiles:
    """Where the service's store keeps a row, and the least a read of it costs on this machine."""

    def __init__(self, server_url: str, store: Path) -> None:
        from engine_client.client.http_rows import HttpRowReader
        from mint_store.storage import LocalStorage

        self.rows, self.storage = HttpRowReader(server_url), LocalStorage(store)

    def read_floor(self, content_id: str) -> float:
        """Seconds of one ``os.preadv`` of the row's bytes from its shard file, on one CPU, page
        cache warm, into a buffer already faulted in: the best of three (no hash, nothing after)."""
        loc = self.rows.resolve(f"sha:{content_id}")
        path = self.storage.local_path(loc.shard_key)
        assert path is not None
        room, buf = page_matched(loc.length, loc.offset)  # (tools/bench/read_floor.py)
        took: list[float] = []

        def run() -> None:  # a thread of its own, pinned as vLLM pins its CPU worker
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            fd = os.open(path, os.O_RDONLY)
            try:
                for _ in range(3):
                    t = time.perf_counter()
                    preadv_all(fd, buf, loc.offset)
                    took.append(time.perf_counter() - t)
            finally:
                os.close(fd)

        thread = threading.Thread(target=run, name="read-floor")
        thread.start()
        thread.join()
        buf.release()
        room.close()
        return min(took)


class _WorkerLoads:
    """The loads vLLM's worker timed (``vllm_trace/sitecustomize.py``, in the engine's process)."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos = path, 0
        self.took: dict[int, float] = {}
        self.loads: dict[int, float] = {}

    def pop(self, lora_id: int) -> float:
        """Seconds of the load of ``lora_id`` (KeyError: vLLM did not load it)."""
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self.pos)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.pos += end
            for line in data[:end].decode().splitlines():
                k, v, load = line.split()
                self.took[int(k)] = float(v)
                self.loads[int(k)] = float(load)
        return self.took.pop(lora_id)

    def load_of(self, lora_id: int) -> float:
        """Seconds of the ``_load_adapter`` part of the last :meth:`pop` of ``lora_id``."""
        return self.loads.pop(lora_id)


if __name__ == "__main__":
    main()
