"""Which adapters a vLLM server holds, where, and how long each took to load: for routers.

LoRA-affinity routers place a request on a server that already holds its adapter. vLLM's
own ``vllm:lora_requests_info`` lists the adapters of running and waiting requests; what a
server *holds* (in a GPU slot, or only in its CPU cache; pinned; at which rank) is what
vLLM's proposed ``vllm:lora_adapter_loaded`` adds (vllm-project/vllm#54830). This module
exports those series under the ``mint:`` prefix, with the same labels, from a vLLM that does
not have them yet:

- ``mint:lora_adapter_loaded{adapter_name, level, pinned, rank, content_id}`` 1 per adapter held,
  ``level`` ``gpu`` (in a LoRA slot) or ``cpu`` (in the CPU LoRA cache only);
- ``mint:lora_adapter_load_seconds{adapter_name, content_id, how}``: its last load (``how``:
  ``direct`` from the row, or ``files``);
- ``mint:num_gpu_loaded_lora_adapters``, ``mint:num_cpu_loaded_lora_adapters``, and
  ``mint:max_gpu_lora_adapters`` (vLLM's GPU slots, ``--max-loras``).

The worker knows (it loads adapters and owns the slots); the API server serves
``/metrics``. So the worker writes a snapshot of its LoRA manager (a JSON file, replaced
atomically, at most once a second and only when it changed) into a directory the API
server named in ``MINT_VLLM_RESIDENCY_DIR`` before starting its engine; the API server's
collector reads the snapshots at each scrape. A snapshot of a process that is gone is
ignored. Names are those requests use (``lora_name``): what a router matches.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm.plugins.mint_lora_resolver.residency")  # where vLLM's own lines go

DIR_ENV = "MINT_VLLM_RESIDENCY_DIR"
PERIOD_S = 1.0  # how often the worker looks at its manager
RECORDS = 4096  # loads remembered (by lora_int_id): vLLM's CPU cache is far smaller
WARM_MARK = "#mint-warm-"  # names the plugin loads under only to warm content (preload.py): never exported


class Residency:
    """The worker's side: what loaded, and a thread that writes the manager's state."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._records: dict[int, dict[str, Any]] = {}  # lora_int_id -> name, content id, load time, how
        self._manager: Any = None
        self._thread: threading.Thread | None = None
        self._last = ""

    @classmethod
    def from_env(cls) -> Residency:
        d = os.environ.get(DIR_ENV)
        return cls(Path(d) if d else None)

    def loaded(self, manager: Any, lora_request: Any, lora: Any, seconds: float, *, content_id: str | None,
               how: str) -> None:
        with self._lock:
            self._manager = weakref.ref(manager)
            self._records[int(lora_request.lora_int_id)] = {
                "name": str(lora_request.lora_name), "content_id": content_id, "rank": int(lora.rank),
                "load_s": seconds, "how": how,
            }
            while len(self._records) > RECORDS:
                self._records.pop(next(iter(self._records)))
            if self.directory is not None and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mint-vllm-residency", daemon=True)
                self._thread.start()
        # (not written here: vLLM registers the adapter after this load returns; the thread sees it)

    def snapshot(self) -> dict[str, Any] | None:
        with self._lock:
            manager = self._manager() if self._manager is not None else None
            records = dict(self._records)
        if manager is None:
            return None
        for _ in range(3):  # the engine thread may change the manager meanwhile: look again
            try:
                slots = {int(i) for i in list(manager.lora_index_to_id) if i is not None}
                cache = manager._registered_adapters
                registered = {int(i) for i in list(cache.cache if hasattr(cache, "cache") else cache)}
                pinned = set(getattr(cache, "pinned_items", ())) | set(
                    getattr(manager._active_adapters, "pinned_items", ()))
                break
            except RuntimeError:
                continue
        else:
            return None
        # a name the server moved (a tag) is held under its newest id; vLLM may still hold the old
        # content under an older id until its cache evicts it: not what the name serves, not exported
        newest: dict[str, int] = {}
        for lid, rec in records.items():  # (in load order)
            if lid in registered and WARM_MARK not in rec["name"]:
                newest[rec["name"]] = lid
        adapters = [records[lid] | {"id": lid, "level": "gpu" if lid in slots else "cpu", "pinned": lid in pinned}
                    for lid in newest.values()]
        return {"pid": os.getpid(), "max_gpu": int(manager.lora_slots), "adapters": adapters}

    def write(self) -> None:
        if self.directory is None:
            return
        snap = self.snapshot()
        if snap is None:
            return
        text = json.dumps(snap, sort_keys=True)
        if text == self._last:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.directory / f".{os.getpid()}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.directory / f"{os.getpid()}.json")
            self._last = text
        except OSError as e:  # advisory: a router places less well, nothing fails
            log.warning("MinT: could not write the LoRA residency snapshot (%s)", e)

    def _run(self) -> None:
        while True:
            time.sleep(PERIOD_S)
            self.write()


def read_snapshots(directory: Path) -> Iterator[dict[str, Any]]:
    """The snapshots in ``directory`` of processes still running."""
    try:
        files = sorted(directory.glob("*.json"))
    except OSError:
        return
    for f in files:
        try:
            snap = json.loads(f.read_text())
            os.kill(int(snap["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # gone, or half-written by a process that died
        yield snap


class ResidencyCollector:
    """A ``prometheus_client`` collector of the snapshots (registered in the API server)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only (names are not known in advance)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        loaded = GaugeMetricFamily("mint:lora_adapter_loaded", "LoRA adapters this server holds (1 each)",
                                   labels=["adapter_name", "level", "pinned", "rank", "content_id"])
        seconds = GaugeMetricFamily("mint:lora_adapter_load_seconds", "Seconds the adapter's last load took",
                                    labels=["adapter_name", "content_id", "how"])
        n_gpu = GaugeMetricFamily("mint:num_gpu_loaded_lora_adapters", "Adapters in GPU LoRA slots")
        n_cpu = GaugeMetricFamily("mint:num_cpu_loaded_lora_adapters", "Adapters in the CPU LoRA cache only")
        slots = GaugeMetricFamily("mint:max_gpu_lora_adapters", "GPU LoRA slots (--max-loras)")
        gpu = cpu = max_gpu = 0
        for snap in read_snapshots(self.directory):
            max_gpu += int(snap.get("max_gpu", 0))
            for a in snap.get("adapters", []):
                cid = a.get("content_id") or ""
                loaded.add_metric([a["name"], a["level"], str(bool(a["pinned"])).lower(), str(a["rank"]), cid], 1)
                seconds.add_metric([a["name"], cid, a["how"]], float(a["load_s"]))
                gpu += a["level"] == "gpu"
                cpu += a["level"] == "cpu"
        n_gpu.add_metric([], gpu)
        n_cpu.add_metric([], cpu)
        slots.add_metric([], max_gpu)
        yield from (loaded, seconds, n_gpu, n_cpu, slots)
