"""Every benchmark in tools/, run as subprocesses at sizes that fit the machine, reduced to
one table of measures (ours, the baseline measured in the same run, the ratio, the paper's
figure, the target). Nothing in the report is typed in by hand: every figure comes from a
JSON a tool wrote in this run, with the command that wrote it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tools._repo import ROOT

from .local_copy_measures import local_copy_measures
from .measure import Measure
from .mixed_measures import mixed_measures
from .replica_measures import replica_measures
from .s3read_measures import s3read_measures
from .vllm_measures import vllm_measures

PAPER = "MinT (arXiv 2605.13779)"


@dataclass(frozen=True, slots=True)
class Run:
    """One tool invocation and what it wrote."""

    name: str
    command: list[str]
    results: dict[str, Any]
    seconds: float

    @property
    def command_text(self) -> str:
        return " ".join(shlex.quote(c) for c in ["python", *self.command[1:]])


@dataclass(frozen=True, slots=True)
class Bench:
    name: str
    tool: str
    quick: list[str]
    full: list[str]
    measures: Callable[[dict[str, Any], str], list[Measure]]
    optional: bool = False  # a missing tool is reported, not fatal
    profile: list[str] | None = None  # arguments of the profiled run (default: the quick ones)


def _read_target(rank: int) -> float:
    """A verified read against a raw pread of the same bytes: 0.9x at rank 16 and up, 0.8x below
    (a small row's fixed cost weighs more)."""
    return 0.9 if rank >= 16 else 0.8


def _store_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    n = r["config"]["n"]
    sizes = f"{n:,} rank-{r['config']['rank']} adapters, row {r['row_nbytes']:,} B"
    out = [
        Measure(key=f"store.publish_per_s.n{n}", title=f"bulk publish ({n:,} adapters)",
                ours=r["publish"]["adapters_per_s"], unit="adapters/s", target=">= 10,000/s",
                met=r["publish"]["adapters_per_s"] >= 10_000, command=cmd, sizes=sizes),
        Measure(key=f"store.overhead.n{n}",
                title=f"storage overhead over raw row bytes: packs and log ({n:,} adapters; index checkpoints, a "
                      "replica's cold-start copy, not counted)",
                ours=100 * r["storage"]["overhead"], unit="%", target="<= 2%", met=r["storage"]["overhead"] <= 0.02,
                higher_is_better=False, command=cmd, sizes=sizes),
        Measure(key=f"store.resolve_p99_us.n{n}", title=f"resolve p99 at {n:,} adapters",
                ours=r["resolve_us"]["p99"], unit="us", target="<= 20 us" if n >= 10**6 else "",
                met=(r["resolve_us"]["p99"] <= 20) if n >= 10**6 else None, higher_is_better=False,
                paper="10^6 adapter catalog" if n >= 10**6 else "", command=cmd, sizes=sizes),
    ]
    for rank, v in sorted(r.get("reads_by_rank", {}).items(), key=lambda kv: int(kv[0])):
        out.append(Measure(
            key=f"store.read_ratio.rank{rank}.n{n}",
            title=f"row read vs os.pread, rank {rank} ({v['row_nbytes']:,} B), {n:,} adapters",
            ours=v["ours_gbps"], unit="GB/s", baseline=v["raw_gbps"], baseline_label="raw os.pread",
            ratio=v["ratio"], target=f">= {_read_target(int(rank))}x",
            met=v["ratio"] >= _read_target(int(rank)), command=cmd, sizes=sizes))
    return out


def _http_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    c = r["config"]
    sizes = f"{c['clients']} clients, rows of {r['row_bytes']:,} B, {c['duration']:g} s per phase"
    out = [Measure(key="http.fetch_req_per_s", title="service blob GET throughput", ours=r["fetch"]["req_per_s"],
                   unit="req/s", command=cmd, sizes=sizes)]
    if "nginx" in r:
        out[0] = Measure(key="http.fetch_req_per_s", title="service blob GET vs nginx, same bytes",
                         ours=r["fetch"]["req_per_s"], unit="req/s", baseline=r["nginx"]["req_per_s"],
                         baseline_label="nginx", ratio=r["ratio_vs_nginx"], target=">= 0.5x",
                         met=r["ratio_vs_nginx"] >= 0.5, command=cmd, sizes=sizes)
    elif "nginx" in r.get("missing", {}):
        out[0] = Measure(key="http.fetch_req_per_s", title="service blob GET vs nginx, same bytes",
                         ours=r["fetch"]["req_per_s"], unit="req/s", baseline_label=f"missing: {r['missing']['nginx']}",
                         target=">= 0.5x", command=cmd, sizes=sizes)
    return out


def _batch_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    c = r["config"]
    sizes = f"{c['seqs']} sequences x {c['seq']} tokens, rank {c['rank']}, hidden {c['hidden']}"
    if "torch_threads" in r:
        sizes += f", {r['torch_threads']} torch thread{'s' if r['torch_threads'] != 1 else ''}"
    out = []
    for b in r["batching"]:
        big = b["distinct"] >= 1000
        out.append(Measure(
            key=f"batch.speedup.d{b['distinct']}", title=f"one batch of {b['distinct']:,} distinct adapters",
            ours=b["batched_s"] * 1e3, unit="ms", baseline=b["one_at_a_time_s"] * 1e3,
            baseline_label="one adapter at a time", ratio=b["speedup"], higher_is_better=False,
            target=">= 10x" if big else "", met=(b["speedup"] >= 10) if big else None,
            paper="waves of 1,000 active adapters" if big else "", command=cmd, sizes=sizes))
    s = r["sweep"]
    out.append(Measure(
        key="batch.switch_sweep_p99_us", title=f"{s['switches']:,} switches from a {s['catalog']:,} catalog (p99)",
        ours=s["all"]["p99"], unit="us", higher_is_better=False, paper="100,000 switches in one engine",
        command=cmd, sizes=f"{s['slots']} slots, row {s['row_bytes']:,} B, zipf {s['zipf']}"))
    return out


def _moe_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    sizes = (f"{r['layers']} layers x {r['experts']} experts, rank {r['rank']}, row {r['row_bytes']:,} B, "
             f"{r['per_expert_tensors']:,} per-expert tensors")
    return [Measure(key="moe_pack.load", title="packed MoE adapter load (cold from the store)",
                    ours=r["packed_cold_s"] * 1e3, unit="ms", baseline=r["per_expert_s"] * 1e3,
                    baseline_label="per-expert tensors, one by one", ratio=r["speedup_cold"],
                    higher_is_better=False, paper="8.5-8.7x", target=">= 20x", met=r["speedup_cold"] >= 20,
                    command=cmd, sizes=sizes)]


def _peer_target(case: dict[str, Any], peer_s: float, ratio: float) -> tuple[str, bool | None]:
    """The >= 20x target against a peer's switch "where the bytes allow": where one read of the
    row alone (the least byte work a switch can do, timed in the same run) leaves the peer under
    20x, no switch could meet it; the target names that bound and gives no verdict."""
    pread = case.get("bytes_us", {}).get("pread", {}).get("p50")
    allowed = peer_s * 1e6 / pread if pread else None
    if allowed is not None and allowed < 20:
        return f">= 20x where the bytes allow (one read of the row bounds it at {allowed:.1f}x here)", None
    return ">= 20x", ratio >= 20


def _swap_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    out: list[Measure] = []
    for case in r.get("cases", []):
        name = case["case"]
        kind = "moe" if case["base"].get("experts") else "dense"
        key = f"{kind}-r{case['rank']}"
        judged = key in ("dense-r1", "dense-r16", "moe-r1")  # >= 0.7 of the bound (base bytes / row bytes)
        paper = {"dense-r1": "18.3x", "moe-r1": "2.85x"}.get(key, "")
        b = case["base"]
        sizes = (f"{b['name']}: {b['layers']} layers, hidden {b['hidden']}"
                 f"{', ' + str(b['experts']) + ' experts' if b.get('experts') else ''}; "
                 f"base {case['base_bytes'] / 2**30:.2f} GiB, adapter {case['adapter_bytes']:,} B")
        cold_ms = case["switch"]["cold"]["p50"] / 1e3
        reload_ms = case["reload_safetensors_s"]["best"] * 1e3
        ratio = case["ratio"]["reload_vs_cold"]
        bound = case["bound"]
        out.append(Measure(
            key=f"swap.{key}.vs_reload",
            title=f"switch (cold, p50) vs full base reload, {name} ({ratio / bound:.2f} of its bound)",
            ours=cold_ms, unit="ms", baseline=reload_ms, baseline_label="reload from safetensors",
            ratio=ratio, higher_is_better=False, paper=paper,
            target=f">= {0.7 * bound:,.0f}x (0.7 of the bound {bound:,.0f}x)" if judged else f"(bound {bound:,.0f}x)",
            met=(ratio >= 0.7 * bound) if judged else None, command=cmd, sizes=sizes))
        if case.get("peft_hotswap_s"):  # PEFT's fastest switch: the peer the target is judged against
            hot = case["ratio"]["peft_hotswap_vs_cold"]
            target, met = _peer_target(case, case["peft_hotswap_s"]["best"], hot)
            out.append(Measure(
                key=f"swap.{key}.vs_peft_hotswap", title=f"switch vs PEFT hotswap_adapter (its fastest switch), {name}",
                ours=cold_ms, unit="ms", baseline=case["peft_hotswap_s"]["best"] * 1e3,
                baseline_label="PEFT hotswap_adapter (best run)", ratio=hot, higher_is_better=False,
                target=target, met=met, command=cmd, sizes=sizes))
        if case.get("peft_s"):
            peft_ratio = case["ratio"]["peft_vs_cold"]
            # load_adapter builds and initialises new LoRA modules every time: PEFT's slow path.
            # Judged only where the run also timed hotswap_adapter (older runs did not)
            hot_run = bool(case.get("peft_hotswap_s"))
            out.append(Measure(
                key=f"swap.{key}.vs_peft", title=f"switch vs PEFT load_adapter + set_adapter, {name}"
                + ("" if hot_run else " (PEFT's slow path; its hotswap_adapter was not timed in this run: no verdict)"),
                ours=cold_ms, unit="ms", baseline=case["peft_s"]["best"] * 1e3, baseline_label="PEFT (best run)",
                ratio=peft_ratio, higher_is_better=False, target="", met=None, command=cmd, sizes=sizes))
        if case.get("vllm_add_lora_s"):
            vr = case["ratio"]["vllm_vs_cold"]
            target, met = _peer_target(case, case["vllm_add_lora_s"]["best"], vr)
            out.append(Measure(
                key=f"swap.{key}.vs_vllm", title=f"switch vs vLLM add_lora, {name}", ours=cold_ms, unit="ms",
                baseline=case["vllm_add_lora_s"]["best"] * 1e3, baseline_label="vLLM add_lora (best run)", ratio=vr,
                higher_is_better=False, target=target, met=met, command=cmd, sizes=sizes))
        fixed = case.get("fixed_us", {}).get("cold_above_memcpy")
        if fixed is not None:
            out.append(Measure(
                key=f"swap.{key}.fixed_cost_us",
                title=f"cold switch above one memcpy of its row, {name} ({case['adapter_bytes']:,} B)",
                ours=fixed, unit="us", higher_is_better=False, target="", met=None,  # (the target is on small rows)
                command=cmd, sizes=sizes))
    probe = r.get("probe")
    if probe and probe.get("fixed_us"):
        sizes = f"{probe['base']}, rank 1 on {probe['module']} only: row {probe['row_bytes']:,} B"
        for kind in ("cold", "warm"):
            fixed = probe["fixed_us"][f"{kind}_above_memcpy"]
            out.append(Measure(
                key=f"swap.probe.fixed_cost_{kind}_us",
                title=f"{kind} switch above one memcpy of its row, small row ({probe['row_bytes']:,} B)",
                ours=fixed, unit="us", higher_is_better=False, target="<= 20 us", met=fixed <= 20,
                command=cmd, sizes=sizes))
    return out


def _train_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    out: list[Measure] = []
    c = r["config"]
    for row in r.get("rows", []):
        kind, n = row["base"], row["policies"]
        paper = f"{row['paper_speedup']}x" if n > 1 else ""
        ratio = row["concurrent_speedup"]
        peak_ok = row["concurrent_peak_mib"] <= row["one_by_one_peak_mib"] * 1.05
        out.append(Measure(
            key=f"train.{kind}.n{n}",
            title=f"{n} {'policy' if n == 1 else 'policies'} trained concurrently vs one by one ({kind})",
            ours=row["concurrent_s"], unit="s", baseline=row["one_by_one_s"], baseline_label="one after another",
            ratio=ratio, higher_is_better=False, paper=paper,
            target=f">= {row['paper_speedup']}x, no higher peak" if n > 1 else "",
            met=(ratio >= row["paper_speedup"] and peak_ok) if n > 1 else None, command=cmd,
            # the peaks are in the report's breakdown: sizes name the configuration only
            sizes=f"{kind} base, {c['steps']} GRPO steps, {c['prompts']} prompts x {c['group_size']} samples, "
                  f"rank {c['rank']}, {row['threads']} thread(s) per run"))
    return out


def benches(quick: bool) -> list[Bench]:
    del quick
    vllm = ROOT / ".venv-vllm" / "bin" / "python"  # `make venv-vllm`: vLLM lives in its own environment
    swap_full = ["--vllm-python", str(vllm.relative_to(ROOT))] if vllm.exists() else []
    return [
        Bench("store", "bench_store.py", ["--n", "2000", "--read-ranks", "16"], ["--n", "100000"], _store_measures),
        Bench("store-1m", "bench_store.py", ["--n", "10000"], ["--n", "1000000"], _store_measures,
              profile=["--n", "200000", "--read-ranks", ""]),
        Bench("http", "load_http.py", ["--clients", "16", "--duration", "2", "--adapters", "32", "--nginx"],
              ["--clients", "64", "--duration", "10", "--nginx"], _http_measures),
        Bench("batch", "bench_batch.py", ["--part", "self", "--seqs", "256", "--distinct", "1,8,64,256",
                                          "--switches", "5000", "--catalog", "1000"], ["--part", "self"],
              _batch_measures),  # (the peer part is the "mixed" run's: run once, its file not overwritten)
        Bench("mixed", "bench_batch.py", ["--part", "peer", "--peer-counts", "1,8,64,256", "--repeat", "2"],
              ["--part", "peer", "--peer-counts", "1,8,64,256,1000"], mixed_measures),
        Bench("moe_pack", "bench_moe_pack.py", ["--layers", "4", "--experts", "32", "--hidden", "512",
                                                "--inter", "256"], [], _moe_measures),
        Bench("swap", "bench_swap.py", ["--quick"], swap_full, _swap_measures, optional=True,
              profile=["--quick", "--cold", "200", "--probe", "1000", "--no-forward"]),
        Bench("train", "bench_train.py", ["--quick"], [], _train_measures, optional=True,
              profile=["--quick", "--policies", "4"]),
        Bench("replicas", "bench_replicas.py", REPLICAS_QUICK, REPLICAS_FULL, replica_measures),
        Bench("s3read", "bench_s3_read.py", ["--quick"], [], s3read_measures),
        Bench("vllm", "bench_vllm.py", ["--quick"], [], vllm_measures, optional=True),
        # the same cold loads with the plugin on the store's directory (MINT_STORE), no service between
        Bench("vllm-store", "bench_vllm.py", ["--quick", "--part", "cold", "--access", "store"],
              ["--part", "cold", "--access", "store"], vllm_measures, optional=True),
        # the service's Unix socket on this machine: rows copied into vLLM's worker, no loopback stream
        Bench("vllm-socket", "bench_vllm.py", ["--quick", "--part", "cold", "--access", "socket"],
              ["--part", "cold", "--access", "socket"], vllm_measures, optional=True),
        Bench("local-copy", "bench_local_copy.py", ["--reads", "5"], [], local_copy_measures),
    ]


REPLICAS_QUICK = ["--replicas", "1,3", "--publishes", "50", "--sizes", "10000", "--tail", "100",
                  "--failover-trials", "2", "--lease-ttl", "4", "--lease-renew", "1"]
REPLICAS_FULL = ["--replicas", "1,3", "--publishes", "200", "--sizes", "100000,1000000",
                 "--failover-trials", "5", "--lease-ttl", "10", "--lease-renew", "3"]


CATALOG_SIZES = {"quick": [1_000, 3_000], "full": [1_000, 10_000, 100_000]}


def machine() -> dict[str, Any]:
    cpu = _first("/proc/cpuinfo", "model name", lambda ln: ln.split(":", 1)[1].strip()) or platform.processor()
    mem = _first("/proc/meminfo", "MemTotal", lambda ln: int(ln.split()[1]) * 1024) or 0
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "python": platform.python_version(),
            "torch": torch.__version__, "accelerator": "cuda" if torch.cuda.is_available() else "none",
            "commit": _git("rev-parse", "--short", "HEAD")}


def _first(path: str, prefix: str, parse: Callable[[str], Any]) -> Any:
    try:
        with open(path) as f:
            return next((parse(ln) for ln in f if ln.startswith(prefix)), None)
    except OSError:
        return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_tool(name: str, tool: str, args: list[str], workdir: Path, *, timeout: float) -> Run:
    out = workdir / f"{name}.json"
    command = [sys.executable, f"tools/{tool}", *args, "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{tool} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    shown = [sys.executable, f"tools/{tool}", *args]  # the temp --out is not part of the recipe
    return Run(name, shown, json.loads(out.read_text())["results"], seconds)


@dataclass(slots=True)
class SuiteResult:
    mode: str
    machine: dict[str, Any]
    runs: dict[str, Run] = field(default_factory=dict)
    measures: list[Measure] = field(default_factory=list)
    catalog: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    reused: dict[str, str] = field(default_factory=dict)
    ran: dict[str, str] = field(default_factory=dict)  # a reused run's own command (what produced it)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "machine": self.machine,
            "measures": {m.key: asdict(m) for m in self.measures},
            "catalog": self.catalog, "missing": self.missing, "profiles": self.profiles, "reused": self.reused,
            "runs": {k: {"command": self.reused.get(k, r.command_text), "ran": self.ran.get(k, r.command_text),
                         "seconds": r.seconds, "results": r.results} for k, r in self.runs.items()},
        }


def remeasure(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a results file of this program) with its measures computed again from its runs by
    today's measure functions: targets and verdicts follow the code, the figures stay the runs'."""
    measures: list[Measure] = []
    for b in benches(doc.get("mode") == "quick"):
        run = doc["runs"].get(b.name)
        if run is not None:
            measures += b.measures(run["results"], run["command"])
    return doc | {"measures": {m.key: asdict(m) for m in measures}}


def reuse(suite: SuiteResult, name: str, path: Path) -> None:
    """Take a benchmark's figures from a JSON its own tool wrote earlier, or from an earlier
    bench_all results file (``docs/results/benchmarks.json``: its run of that tool), marked
    as such with the file and when the figures were measured."""
    b = next((b for b in benches(suite.mode == "quick") if b.name == name), None)
    if b is None:
        raise ValueError(f"unknown benchmark {name!r}")
    doc = json.loads(path.read_text())
    if "runs" in doc:  # an earlier bench_all's results (benchmarks.json): its run of this tool
        if name not in doc["runs"]:
            raise ValueError(f"{path} holds no run of {name!r}")
        earlier = doc["runs"][name]
        # when that run was made: its own reuse note names it, else the file's commit
        when = re.search(r"written ([^)]+)\)", earlier.get("command", ""))
        written = when.group(1) if when else f"at commit {doc.get('machine', {}).get('commit', '?')}"
        # its command, as recorded by the run (older files did not record it)
        ran = earlier.get("ran") or f"python tools/{b.tool} (its arguments not recorded)"
        doc = {"time": written, "results": earlier["results"], "command": ran}
        source = f"{path}, its {name!r} run"  # (two runs of one tool must not read as one)
    else:
        source = str(path)
    ran = doc.get("command") or f"python tools/{b.tool} (its arguments not recorded)"
    command = f"{ran} (reused: {source}, written {doc.get('time', '?')})"
    run = Run(name, [sys.executable, f"tools/{b.tool}"], doc["results"], 0.0)
    _record(suite, b, run, command)
    suite.reused[name] = command
    suite.ran[name] = ran


def _record(suite: SuiteResult, b: Bench, run: Run, command: str, log: Callable[[str], None] = print) -> None:
    """A tool's run, its measures, and the optional baselines it could not run (``"missing"``)."""
    suite.runs[b.name] = run
    suite.measures += b.measures(run.results, command)
    for what, why in run.results.get("missing", {}).items():
        suite.missing.append(f"{b.name}: the {what} baseline (missing: {why})")
        log(f"-- {b.name}: the {what} baseline is missing: {why}")


def run_suite(*, quick: bool, only: set[str] | None = None, timeout: float = 3600.0,
              reused: dict[str, Path] | None = None, log: Callable[[str], None] = print) -> SuiteResult:
    mode = "quick" if quick else "full"
    suite = SuiteResult(mode, machine())
    for name, path in (reused or {}).items():
        reuse(suite, name, path)
    with tempfile.TemporaryDirectory(prefix="mint-bench-") as tmp:
        work = Path(tmp)
        for b in benches(quick):
            if (only and b.name not in only) or b.name in suite.reused:
                continue
            if not (ROOT / "tools" / b.tool).exists():
                suite.missing.append(f"{b.name}: tools/{b.tool} does not exist in this build")
                log(f"-- {b.name}: skipped (tools/{b.tool} missing)")
                continue
            log(f"-- {b.name}: tools/{b.tool} {' '.join(b.quick if quick else b.full)}")
            try:
                run = run_tool(b.name, b.tool, b.quick if quick else b.full, work, timeout=timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                if not b.optional:
                    raise
                suite.missing.append(f"{b.name}: {e}")
                continue
            _record(suite, b, run, run.command_text, log)
        if only is None or "catalog" in only:
            for n in CATALOG_SIZES[mode]:
                log(f"-- catalog: tools/bench_store.py --n {n}")
                run = run_tool(f"catalog-{n}", "bench_store.py", ["--n", str(n), "--read-ranks", ""], work,
                               timeout=timeout)
                suite.catalog.append(_catalog_point(run))
        for key in ("store-1m", "store"):
            if key in suite.runs:
                point = _catalog_point(suite.runs[key]) | {"command": suite.reused.get(key,
                                                                                  suite.runs[key].command_text)}
                if all(p["n"] != point["n"] for p in suite.catalog):
                    suite.catalog.append(point)
        suite.catalog.sort(key=lambda p: p["n"])
    return suite


def _catalog_point(run: Run) -> dict[str, Any]:
    r = run.results
    reads = r["reads"]
    per_row = {k: v for k, v in reads.items() if k.startswith("trial")}
    ours_us = min(v["ours_s"] for v in per_row.values()) / reads["rows"] * 1e6
    raw_us = min(v["raw_s"] for v in per_row.values()) / reads["rows"] * 1e6
    return {"n": r["config"]["n"], "resolve_p50_us": r["resolve_us"]["p50"], "resolve_p99_us": r["resolve_us"]["p99"],
            "read_us": ours_us, "raw_read_us": raw_us, "row_nbytes": r["row_nbytes"], "command": run.command_text}


def profile_tool(b: Bench, workdir: Path, *, top: int = 12, timeout: float = 1800.0) -> dict[str, Any]:
    """Where the time of a benchmark's slow path goes: a separate run (so the profiler slows no
    timed figure) at the quick sizes, with cProfile on only the sections the tool marks with
    :func:`~tools.bench.profiling.profiled`; a tool that marks none is profiled whole."""
    from .profiling import ENV, summarise

    prefix = workdir / b.name
    args = b.profile if b.profile is not None else b.quick
    command = [sys.executable, f"tools/{b.tool}", *args, "--out", str(workdir / f"{b.name}-profiled.json")]
    subprocess.run(command, cwd=ROOT, timeout=timeout, capture_output=True, text=True, check=True,
                   env=os.environ | {ENV: str(prefix)})
    sections = summarise(prefix, top=top)
    how = "sections"
    if not sections:
        whole = workdir / f"{b.name}.whole"
        subprocess.run([sys.executable, "-m", "cProfile", "-o", f"{whole}.run.prof", *command[1:]], cwd=ROOT,
                       timeout=timeout, capture_output=True, text=True, check=True)
        sections, how = summarise(whole, top=top), "whole run"
    shown = " ".join(shlex.quote(c) for c in ["python", f"tools/{b.tool}", *args])
    return {"command": f"{ENV}=<prefix> {shown}", "scope": how, "sections": sections}


def add_profiles(suite: SuiteResult, *, quick: bool, log: Callable[[str], None] = print) -> None:
    """Profile every benchmark that has a target it did not meet."""
    unmet = {name for name, run in suite.runs.items()
             if any(m.met is False and m.command == run.command_text for m in suite.measures)}
    with tempfile.TemporaryDirectory(prefix="mint-prof-") as tmp:
        for b in benches(quick):
            if b.name in unmet and b.name not in suite.reused and (ROOT / "tools" / b.tool).exists():
                log(f"-- profiling {b.name} (a target was not met)")
                try:
                    suite.profiles[b.name] = profile_tool(b, Path(tmp))
                except (subprocess.SubprocessError, OSError) as e:
                    suite.profiles[b.name] = {"command": "", "scope": "failed", "error": str(e), "sections": {}}
