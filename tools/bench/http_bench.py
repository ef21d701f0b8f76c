"""Load on the HTTP service over loopback, side by side with nginx serving the same bytes.

Closed loop: ``clients`` connections, each sending its next request when the last one's
body has been read. Phases of ``duration`` seconds each:

1. ``fetch``: every client GETs random rows (``/v1/blobs/{content_id}``) from our service;
2. ``nginx`` (optional): the same load on nginx, serving the same row bytes as one
   ``Range`` of the same shard files (sendfile, one worker, access log off). Where nginx is
   not installed the results say ``"missing": {"nginx": "nginx not installed"}`` and the
   other phases run;
3. ``mixed``: ``publishers`` of the clients upload new PEFT adapters while the rest fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .report import percentiles, print_table, write_json


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpBenchConfig:
    clients: int = 64
    duration: float = 10.0  # seconds per phase
    adapters: int = 256
    rank: int = 4
    hidden: int = 1024
    layers: int = 8  # 4 attention projections per layer
    publishers: int = 4  # of the clients, in the mixed phase
    workers: int = 8  # the service's executor threads
    nginx: bool = False
    root: str | None = None
    out: str = "docs/results/http.json"

    def __post_init__(self) -> None:
        if self.clients < 1 or self.adapters < 1 or self.duration <= 0 or not 0 <= self.publishers < self.clients:
            raise ValueError("need clients >= 1, adapters >= 1, duration > 0 and 0 <= publishers < clients")


@dataclass(frozen=True, slots=True)
class RowRef:
    content_id: str
    shard_key: str
    offset: int
    length: int


@dataclass(slots=True)
class Tally:
    requests: int = 0
    errors: int = 0
    nbytes: int = 0
    latencies_ns: list[int] | None = None

    def summary(self, seconds: float) -> dict[str, Any]:
        lat = self.latencies_ns or [0]
        return {"requests": self.requests, "errors": self.errors, "seconds": round(seconds, 3),
                "req_per_s": self.requests / seconds, "MB_per_s": self.nbytes / seconds / 1e6,
                "latency_us": percentiles(lat, (50, 90, 99))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _adapter(seed: int, cfg: HttpBenchConfig) -> Any:
    import torch

    from mint_store.format.adapter import make_adapter

    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(cfg.layers):
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            a = torch.randn(cfg.rank, cfg.hidden, generator=g) * 0.01
            b = torch.randn(cfg.hidden, cfg.rank, generator=g) * 0.01
            mods[f"model.layers.{layer}.self_attn.{m}"] = (a, b, 2.0)
    return make_adapter(mods, base="bench")


def populate(root: Path, cfg: HttpBenchConfig) -> list[RowRef]:
    """A local store with ``cfg.adapters`` distinct adapters; their row locations."""
    from mint_store.store import Store

    with Store.open(str(root)) as store:
        results = store.publish_many(("bench", f"a{i}", _adapter(i, cfg)) for i in range(cfg.adapters))
        locs = [store.resolve(f"sha:{r.content_id}") for r in results]
    return [RowRef(loc.content_id, loc.shard_key, loc.offset, loc.length) for loc in locs]


def peft_payload(cfg: HttpBenchConfig) -> tuple[bytes, bytes, int]:
    """PEFT files of one adapter, and where its tensor data starts (to make each upload distinct)."""
    from mint_store.peft.directory import peft_files

    config, weights = peft_files(_adapter(10**6, cfg))
    return config, weights, 8 + struct.unpack("<Q", weights[:8])[0]


@contextlib.contextmanager
def service(root: Path, cfg: HttpBenchConfig) -> Iterator[str]:
    """Our service in its own process (the load generator must not share its event loop)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mint_store.service", "--store", str(root), "--port", str(port),
           "--workers", str(cfg.workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield _wait_ready(proc, f"http://127.0.0.1:{port}", "/healthz")
    finally:
        _stop(proc, signal.SIGTERM)


NGINX_ENV = "MINT_BENCH_NGINX"  # the nginx binary to compare with (default: nginx on PATH, /usr/sbin/nginx)
NGINX_MISSING = "nginx not installed"


def nginx_binary() -> str | None:
    """The nginx executable to run, or None where there is none (an optional baseline)."""
    exe = os.environ.get(NGINX_ENV) or shutil.which("nginx") or "/usr/sbin/nginx"
    return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else None


@contextlib.contextmanager
def nginx(exe: str, root: Path, work: Path) -> Iterator[str]:
    """nginx on loopback serving ``root`` (one worker, sendfile, no access log), own temp config."""
    port = free_port()
    prefix = work / "nginx"
    prefix.mkdir(parents=True, exist_ok=True)
    temps = "\n".join(f"  {k}_temp_path {prefix}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (prefix / "nginx.conf").write_text(f"""
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  sendfile on;
  tcp_nopush on;
  keepalive_requests 1000000;
  default_type application/octet-stream;
{temps}
  server {{
    listen 127.0.0.1:{port};
    root {root};
    location /packs/ {{ }}
  }}
}}
""")
    proc = subprocess.Popen([exe, "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield _wait_ready(proc, f"http://127.0.0.1:{port}", "/packs/")
    finally:
        _stop(proc, signal.SIGQUIT)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, path: str) -> str:
    import urllib.error
    import urllib.request

    for _ in range(600):
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"{url} did not start: {err[-2000:]}")
        try:
            urllib.request.urlopen(url + path, timeout=1).close()
            return url
        except urllib.error.HTTPError:
            return url  # answering at all is ready
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not become ready")


def _stop(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _fetchers(session: aiohttp.ClientSession, n: int, deadline: float,
                    target: Any) -> Tally:
    """``n`` closed-loop clients; ``target(rng)`` gives (url, headers, expected length)."""
    tally = Tally(latencies_ns=[])

    async def one(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            url, headers, length = target(rng)
            t0 = time.perf_counter_ns()
            try:
                async with session.get(url, headers=headers) as r:
                    got = 0
                    async for chunk in r.content.iter_any():
                        got += len(chunk)
                    ok = r.status in (200, 206) and got == length
            except aiohttp.ClientError:
                ok, got = False, 0
            tally.latencies_ns.append(time.perf_counter_ns() - t0)  # type: ignore[union-attr]
            tally.requests += 1
            tally.nbytes += got
            tally.errors += not ok

    await asyncio.gather(*(one(i) for i in range(n)))
    return tally


async def _publishers(session: aiohttp.ClientSession, url: str, n: int, deadline: float,
                      payload: tuple[bytes, bytes, int]) -> Tally:
    config, weights, data_start = payload
    tally = Tally(latencies_ns=[])
    counter = iter(range(10**9))

    async def one() -> None:
        while time.monotonic() < deadline:
            i = next(counter)
            body = bytearray(weights)
            # the lowest mantissa byte of the first three float32s: a distinct, still finite adapter
            body[data_start] = i & 0xFF
            body[data_start + 4] = (i >> 8) & 0xFF
            body[data_start + 8] = (i >> 16) & 0xFF
            form = aiohttp.FormData()
            form.add_field("adapter_config.json", config, filename="adapter_config.json")
            form.add_field("adapter_model.safetensors", bytes(body), filename="adapter_model.safetensors")
            t0 = time.perf_counter_ns()
            try:
                async with session.put(f"{url}/v1/adapters/bench/p{i}", data=form) as r:
                    await r.read()
                    ok = r.status == 201
            except aiohttp.ClientError:
                ok = False
            tally.latencies_ns.append(time.perf_counter_ns() - t0)  # type: ignore[union-attr]
            tally.requests += 1
            tally.nbytes += len(body)
            tally.errors += not ok

    await asyncio.gather(*(one() for _ in range(n)))
    return tally


async def _phase(clients: int, duration: float, fetch_target: Any, publish: tuple[str, Any] | None = None,
                 publishers: int = 0) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=clients, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()
        deadline = t0 + duration
        jobs = [_fetchers(session, clients - publishers, deadline, fetch_target)]
        if publish is not None and publishers:
            jobs.append(_publishers(session, publish[0], publishers, deadline, publish[1]))
        tallies = await asyncio.gather(*jobs)
        seconds = time.monotonic() - t0
    out = {"fetch": tallies[0].summary(seconds)}
    if len(tallies) > 1:
        out["publish"] = tallies[1].summary(seconds)
    return out


def run(cfg: HttpBenchConfig) -> dict[str, Any]:
    work = Path(cfg.root) if cfg.root else Path(tempfile.mkdtemp(prefix="mint-http-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)  # nginx's worker runs as an unprivileged user: it must reach the shards
    root = work / "store"
    try:
        rows = populate(root, cfg)
        payload = peft_payload(cfg)
        results: dict[str, Any] = {"config": asdict(cfg), "row_bytes": rows[0].length}

        with service(root, cfg) as url:
            def ours(rng: random.Random) -> tuple[str, dict[str, str], int]:
                r = rng.choice(rows)
                return f"{url}/v1/blobs/{r.content_id}", {}, r.length

            asyncio.run(_phase(cfg.clients, min(1.0, cfg.duration), ours))  # warm up
            results["fetch"] = asyncio.run(_phase(cfg.clients, cfg.duration, ours))["fetch"]
            results["mixed"] = asyncio.run(
                _phase(cfg.clients, cfg.duration, ours, (url, payload), cfg.publishers))

        exe = nginx_binary() if cfg.nginx else None
        if cfg.nginx and exe is None:
            # an optional baseline: say it is missing and keep our own figures
            results["missing"] = {"nginx": NGINX_MISSING}
            print(f"nginx baseline skipped: {NGINX_MISSING} (Debian: apt-get install -y nginx; or set {NGINX_ENV})",
                  file=sys.stderr)
        elif exe is not None:
            with nginx(exe, root.resolve(), work) as nurl:
                def theirs(rng: random.Random) -> tuple[str, dict[str, str], int]:
                    r = rng.choice(rows)
                    rng_header = {"Range": f"bytes={r.offset}-{r.offset + r.length - 1}"}
                    return f"{nurl}/{r.shard_key}", rng_header, r.length

                asyncio.run(_phase(cfg.clients, min(1.0, cfg.duration), theirs))
                results["nginx"] = asyncio.run(_phase(cfg.clients, cfg.duration, theirs))["fetch"]
            results["ratio_vs_nginx"] = results["fetch"]["MB_per_s"] / max(results["nginx"]["MB_per_s"], 1e-9)
        return results
    finally:
        if not cfg.root:
            shutil.rmtree(work, ignore_errors=True)


def report(results: dict[str, Any], out: str | None = None) -> None:
    def line(t: dict[str, Any]) -> str:
        lat = t["latency_us"]
        return (f"{t['req_per_s']:9.0f} req/s {t['MB_per_s']:9.1f} MB/s   p50 {lat['p50'] / 1e3:7.2f} ms  "
                f"p90 {lat['p90'] / 1e3:7.2f} ms  p99 {lat['p99'] / 1e3:7.2f} ms  errors {t['errors']}")

    c = results["config"]
    rows = [("row bytes", f"{results['row_bytes']:,}"), ("clients", str(c["clients"])),
            ("GET rows (service)", line(results["fetch"]))]
    for what, why in results.get("missing", {}).items():
        rows += [(f"GET rows ({what})", f"missing: {why}")]
    if "nginx" in results:
        rows += [("GET rows (nginx)", line(results["nginx"])),
                 ("service / nginx", f"{results['ratio_vs_nginx']:.2f}x (MB/s)")]
    rows += [(f"mixed: GET ({c['clients'] - c['publishers']} clients)", line(results["mixed"]["fetch"]))]
    if "publish" in results["mixed"]:
        rows += [(f"mixed: PUT ({c['publishers']} clients)", line(results["mixed"]["publish"]))]
    print_table("HTTP load on loopback", rows)
    if out:
        print(f"\nwrote {write_json(out, 'http_load', results)}")


