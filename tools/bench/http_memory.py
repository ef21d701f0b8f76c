"""Peak memory of the HTTP service under concurrent maximum-size uploads and PEFT exports.

Not a test: a measurement with a stated bound, printed as a result. The service runs in
its own process with ``body_limit`` just above the upload size (so every upload is a
maximum-size one); a thread samples its anonymous RSS (``RssAnon + RssShmem``, see
memwatch) every few milliseconds. Phases, each from the RSS it starts at:

1. ``uploads``: ``concurrent`` uploads of ``size_mib`` MiB of weights at once;
2. ``exports``: ``concurrent`` ``GET .../peft`` of those versions at once, read to the end.

The stated bound: an upload holds its spool buffer while it arrives and, once complete,
at most ``upload_slots`` of them are decoded at once, each holding the decoded tensors and
their row (``UPLOAD_FACTOR`` x its size), and no more than ``upload_memory`` bytes of weights
(one upload alone always); an export holds the loaded row and PEFT's state
dict (``EXPORT_FACTOR`` x) and streams the rest. So a phase's peak stays under
``start + min(concurrent, upload_slots, max(1, upload_memory // size)) x UPLOAD_FACTOR x size`` (uploads) or
``start + concurrent x EXPORT_FACTOR x size`` (exports), plus ``SLACK``.
"""

from __future__ import annotations

import asyncio
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .http_bench import _stop, _wait_ready, free_port
from .memwatch import anon_bytes
from .report import print_table, write_json

MiB = 2**20
UPLOAD_FACTOR = 4  # decoded tensors, the row, the finite check's and the content hash's passes
EXPORT_FACTOR = 2  # the loaded row and PEFT's state dict
SLACK = 64 * MiB  # allocator slack, aiohttp buffers, Python objects


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCheckConfig:
    concurrent: int = 4
    size_mib: int = 64  # weights per upload: the maximum size under test
    upload_slots: int = 16  # the service's default
    upload_memory_mib: int = 1024  # the service's default: weights decoded at once
    hidden: int = 4096
    rank: int = 64
    out: str | None = "docs/results/http_memory.json"

    def __post_init__(self) -> None:
        if self.concurrent < 1 or self.size_mib < 1 or self.upload_slots < 1:
            raise ValueError("concurrent, size_mib and upload_slots must be >= 1")


class _Peak:
    """Samples a process's anonymous RSS in a thread; ``peak`` since the last ``reset``."""

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-peak", daemon=True)
        self._thread.start()

    def now(self) -> int:
        return anon_bytes(self.pid) or 0

    def reset(self) -> int:
        self.peak = self.now()
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.now())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _payload(cfg: MemoryCheckConfig) -> tuple[bytes, bytes, int]:
    import torch

    from mint_store.format.adapter import make_adapter
    from mint_store.peft.directory import peft_files

    module_bytes = 2 * cfg.rank * cfg.hidden * 4
    n = max(1, cfg.size_mib * MiB // module_bytes)
    g = torch.Generator().manual_seed(0)
    mods = {f"model.layers.{i}.mlp.proj": (torch.randn(cfg.rank, cfg.hidden, generator=g) * 0.01,
                                           torch.randn(cfg.hidden, cfg.rank, generator=g) * 0.01, 2.0)
            for i in range(n)}
    config, weights = peft_files(make_adapter(mods, base="bench"))
    return config, weights, 8 + struct.unpack("<Q", weights[:8])[0]


def _distinct(weights: bytes, data_start: int, i: int) -> bytes:
    body = bytearray(weights)
    body[data_start] = i & 0xFF  # the lowest mantissa byte of the first float32: still finite
    return bytes(body)


async def _upload(session: aiohttp.ClientSession, url: str, name: str, config: bytes, weights: bytes) -> None:
    form = aiohttp.FormData()
    form.add_field("adapter_config.json", config, filename="adapter_config.json")
    form.add_field("adapter_model.safetensors", weights, filename="adapter_model.safetensors")
    async with session.put(f"{url}/v1/adapters/bench/{name}", data=form) as r:
        body = await r.read()
        if r.status != 201:
            raise RuntimeError(f"upload {name}: {r.status} {body[:200]!r}")


async def _export(session: aiohttp.ClientSession, url: str, name: str) -> int:
    async with session.get(f"{url}/v1/adapters/bench/{name}/versions/1/peft") as r:
        if r.status != 200:
            raise RuntimeError(f"export {name}: {r.status}")
        got = 0
        async for chunk in r.content.iter_chunked(MiB):
            got += len(chunk)
        return got


async def _warm(session: aiohttp.ClientSession, url: str, payload: tuple[bytes, bytes, int]) -> None:
    """One upload and one export: imports, thread pools and caches exist before a phase starts."""
    config, weights, start = payload
    async with session.get(f"{url}/v1/adapters/bench/warm") as r:
        if r.status == 404:
            await _upload(session, url, "warm", config, _distinct(weights, start, 0))
    await _export(session, url, "warm")
    await asyncio.sleep(0.5)


async def _uploads(url: str, cfg: MemoryCheckConfig, peak: _Peak, payload: tuple[bytes, bytes, int]) -> dict[str, Any]:
    config, weights, start = payload
    bodies = [_distinct(weights, start, i + 1) for i in range(cfg.concurrent)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _warm(session, url, payload)
        base = peak.reset()
        t0 = time.perf_counter()
        await asyncio.gather(*(_upload(session, url, f"u{i}", config, b) for i, b in enumerate(bodies)))
        return {"start": base, "peak": peak.peak, "seconds": time.perf_counter() - t0}


async def _exports(url: str, cfg: MemoryCheckConfig, peak: _Peak, payload: tuple[bytes, bytes, int]) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _warm(session, url, payload)
        base = peak.reset()
        t0 = time.perf_counter()
        await asyncio.gather(*(_export(session, url, f"u{i}") for i in range(cfg.concurrent)))
        return {"start": base, "peak": peak.peak, "seconds": time.perf_counter() - t0}


def _phase(store: Path, cfg: MemoryCheckConfig, payload: tuple[bytes, bytes, int], body: Any) -> dict[str, Any]:
    """``body`` against a fresh server process (memory an earlier phase freed would hide a rise)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mint_store.service", "--store", str(store), "--port", str(port),
           "--body-limit", str(len(payload[1]) + len(payload[0]) + MiB)]
    if cfg.upload_slots != 16:
        cmd += ["--upload-slots", str(cfg.upload_slots)]
    if cfg.upload_memory_mib != 1024:
        cmd += ["--upload-memory", str(cfg.upload_memory_mib * MiB)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = _wait_ready(proc, f"http://127.0.0.1:{port}", "/healthz")
        peak = _Peak(proc.pid)
        try:
            return dict(asyncio.run(body(url, cfg, peak, payload)))
        finally:
            peak.close()
    finally:
        _stop(proc, 15)


def run(cfg: MemoryCheckConfig) -> dict[str, Any]:
    payload = _payload(cfg)
    size = len(payload[1])
    work = Path(tempfile.mkdtemp(prefix="mint-http-memory-"))
    try:
        phases = {"uploads": _phase(work / "store", cfg, payload, _uploads),
                  "exports": _phase(work / "store", cfg, payload, _exports)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = cfg.concurrent
    decoding = min(n, cfg.upload_slots, max(1, cfg.upload_memory_mib * MiB // size))
    bounds = {"uploads": decoding * UPLOAD_FACTOR * size + SLACK,
              "exports": n * EXPORT_FACTOR * size + SLACK}
    for phase, r in phases.items():
        r["rise"] = r["peak"] - r["start"]
        r["bound"] = bounds[phase]
        r["rise_per_request_in_sizes"] = r["rise"] / (n * size)
        r["within_bound"] = r["rise"] <= r["bound"]
    return {"config": asdict(cfg), "upload_bytes": size, **phases}


def report(results: dict[str, Any], out: str | None = None) -> None:
    c = results["config"]
    rows = [("upload size", f"{results['upload_bytes'] / MiB:.1f} MiB (the body limit)"),
            ("concurrent", str(c["concurrent"])), ("upload slots", str(c["upload_slots"])),
            ("upload memory", f"{c['upload_memory_mib']} MiB")]
    for phase in ("uploads", "exports"):
        r = results[phase]
        rows.append((f"{phase}: peak RSS rise",
                     f"{r['rise'] / MiB:8.1f} MiB ({r['rise_per_request_in_sizes']:.2f} x size per request) "
                     f"bound {r['bound'] / MiB:.0f} MiB: {'within' if r['within_bound'] else 'OVER'}"))
    print_table("HTTP service memory (anonymous RSS of the server process)", rows)
    if out:
        print(f"\nwrote {write_json(out, 'http_memory', results)}")
