"""Swap benchmark: an adapter switch into a live engine against reloading the base, PEFT and vLLM.

(Past ~450 lines on purpose: one program that runs every variant on the same model object
in one process, so the ratios compare like with like; its peers live in swap_baselines.py.)

For each base (a Qwen3-4B-shaped dense model with rank 1 and rank 16 on every linear module;
a Qwen3-30B-A3B-shaped MoE model, layers cut, with rank 1 on attention and every expert),
all in one run and on the same model object:

* **switch, cold**: a never-seen immutable ref (``tenant/aN@1``) into a live ``LoRAEngine``:
  resolve, one read into the host pool, verification, one copy into a device slot; timed to
  the moment a forward could use it (``engine.batch([ref])`` entered). The engine's metrics
  must show a storage read for each (the row was in neither the host cache nor a slot).
* **switch, warm**: two adapters alternating through one slot, both in the host cache: the
  metrics must show a host hit for each.
* **baselines**: a full reload of the base from safetensors into the same model; PEFT
  ``load_adapter`` + ``set_adapter`` of the same adapter; vLLM ``add_lora`` when available.
* **bytes**: the reads, hashes and copies of the same rows done without the engine, to
  separate the fixed cost of a switch from what its bytes cost.
* **probe** (dense base): a small row (rank 1 on one module), many switches: the fixed cost
  per switch with almost no bytes.

The store, PEFT directories and the saved base live in a temporary directory; the rows and
the checkpoint are read once before they are timed, so every tier of the comparison starts
from the page cache (as on a server that just wrote or read them). Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from mint_store.peft.directory import save_peft_dir
from mint_store.store import Store

from . import swap_baselines as bl
from .memwatch import MemoryWatch, anon_bytes
from .profiling import profiled
from .report import percentiles, print_table, write_json
from .swap_models import (
    ATTN_MODULES,
    DENSE_MODULES,
    QWEN3_4B,
    QWEN3_30B_A3B_CUT,
    BaseShape,
    build_base,
    layout_of,
    lora_targets,
    nbytes,
    publish_adapters,
    unique_params,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SwapBenchConfig:
    dense: BaseShape | None = QWEN3_4B
    moe: BaseShape | None = QWEN3_30B_A3B_CUT
    dense_ranks: tuple[int, ...] = (1, 16)
    moe_ranks: tuple[int, ...] = (1,)
    warmup: int = 5  # untimed cold switches first (code paths, caches)
    cold: int = 30  # timed cold switches: this many distinct adapters per rank
    warm: int = 200  # timed warm switches
    probe: int = 500  # cold and warm switches of the small probe row (0: no probe)
    reload_repeat: int = 3
    peft_repeat: int = 5
    forward: bool = True  # one forward after the switches: the engine is live and serves them
    # torch intra-op threads for the whole run. One by default: on a small shared CPU a
    # parallel copy waits at its barrier for a descheduled worker (milliseconds), which would
    # time the neighbours, not the copy; every measurement of the run uses the same setting
    threads: int = 1
    vllm_python: str | None = None
    vllm_timeout: float = 1800.0
    root: str | None = None
    out: str = "docs/results/swap.json"

    def __post_init__(self) -> None:
        if self.cold < 2 or self.warm < 2 or self.warmup < 0 or self.probe < 0:
            raise ValueError("cold and warm need >= 2 switches; warmup and probe >= 0")
        if self.reload_repeat < 1 or self.peft_repeat < 1 or self.threads < 1:
            raise ValueError("reload_repeat, peft_repeat and threads must be >= 1")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# -- switches into the engine ------------------------------------------------------------------


def _switch(engine: Any, ref: str) -> tuple[int, str]:
    """Nanoseconds until a forward could use ``ref``, and the tier that served it."""
    m = engine.metrics
    before = {t: m.count(t) for t in ("device", "host", "storage")}
    batch = engine.batch([ref])
    t0 = time.perf_counter_ns()
    batch.__enter__()  # resolved, read, verified, copied into its slot: a forward could start now
    dt = time.perf_counter_ns() - t0
    batch.__exit__(None, None, None)
    grew = [t for t, n in before.items() if m.count(t) > n]
    return dt, grew[0] if len(grew) == 1 else "+".join(grew) or "none"


def measure_switches(engine: Any, refs: list[str], *, warmup: int, cold: int, warm: int,
                     section: str = "switch") -> dict[str, Any]:
    """Cold switches to ``refs[warmup:warmup+cold]`` (after ``warmup`` untimed), then ``warm``
    switches alternating between the last two (slots=1: each evicts the other from the slot).
    ``section`` names the cold loop in a profile (see :mod:`.profiling`)."""
    if len(refs) < warmup + cold:
        raise ValueError("not enough adapters published")
    for ref in refs[:warmup]:
        _switch(engine, ref)
    cold_ns, warm_ns = [], []
    with profiled(f"{section} cold"):
        for ref in refs[warmup : warmup + cold]:
            dt, tier = _switch(engine, ref)
            if tier != "storage":
                raise RuntimeError(f"a cold switch to {ref} was served by {tier!r}, not storage")
            cold_ns.append(dt)
    pair = refs[warmup + cold - 2 : warmup + cold]
    # a cold switch on the CPU reads straight into the slot, leaving no host-cache copy: put
    # the pair there (as a prefetch does) so the warm switches measure the host tier
    engine.call(engine.prefetch(pair, device=False))
    for i in range(warm):
        dt, tier = _switch(engine, pair[i % 2])
        if tier != "host":
            raise RuntimeError(f"a warm switch to {pair[i % 2]} was served by {tier!r}, not the host cache")
        warm_ns.append(dt)
    return {"cold": percentiles(cold_ns), "warm": percentiles(warm_ns), "cold_n": cold, "warm_n": warm,
            "tiers_checked": True}


def measure_host_loads(engine: Any, refs: list[str]) -> dict[str, Any]:
    """Rows of ``refs`` read into the engine's host cache and verified, no slot copy (what
    vLLM's ``add_lora`` does: an adapter into CPU memory), after the cache is emptied."""
    store = engine.client.direct(read=True)
    if store is None:
        raise RuntimeError("the engine's store is not open as a local store")
    locs = [store.resolve(r) for r in refs]
    engine.streamer.clear()
    out = []
    for loc in locs:
        before = engine.metrics.count("storage")
        t0 = time.perf_counter_ns()
        lease = engine.streamer.fetch_now(loc, alone=True)
        dt = time.perf_counter_ns() - t0
        if lease is None or engine.metrics.count("storage") != before + 1:
            raise RuntimeError(f"{loc.content_id} was not read from storage into the host cache")
        lease.release()
        out.append(dt)
    return percentiles(out)


def page_in(engine: Any, refs: list[str]) -> float:
    """Read the rows of ``refs`` once (untimed by the caller) so they sit in the page cache,
    as the base's checkpoint does for its reload; returns GB/s of this pass (disk speed when
    memory pressure had evicted them since they were written)."""
    store = engine.client.direct(read=True)
    if store is None:
        raise RuntimeError("the engine's store is not open as a local store")
    locs = [store.resolve(r) for r in refs]
    scratch = np.empty(max(loc.length for loc in locs), dtype=np.uint8)
    t0 = time.perf_counter()
    for loc in locs:
        store.storage.read_into(loc.shard_key, loc.offset, memoryview(cast(Any, scratch))[: loc.length])
    return sum(loc.length for loc in locs) / (time.perf_counter() - t0) / 1e9


def _byte_work(engine: Any, refs: list[str]) -> dict[str, Any]:
    """:func:`swap_baselines.byte_work` over the rows of ``refs``, located by the engine's store."""
    store = engine.client.direct(read=True)
    if store is None:
        raise RuntimeError("the engine's store is not open as a local store")
    rows = []
    layout_id = ""
    for ref in refs:
        loc = store.resolve(ref)
        path = store.storage.local_path(loc.shard_key)
        if path is None:
            raise RuntimeError("the store's rows are not local files")
        rows.append((path, loc.offset, loc.length))
        layout_id = loc.layout_id
    return {k: percentiles(np.array(v) * 1e9) for k, v in bl.byte_work(rows, layout_id).items()}


# -- one base ---------------------------------------------------------------------------------

PROBE_MODULE = "model.layers.0.self_attn.q_proj"


def _case_name(shape: BaseShape, rank: int) -> str:
    return f"{'MoE' if shape.moe else 'dense'} r{rank}"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Published:
    store_dir: Path
    index_dir: Path
    refs: dict[int, list[str]]  # rank -> tenant r{rank}/a{i}@1
    peft_dirs: dict[int, Path]  # rank -> the first timed adapter as a PEFT directory
    row_bytes: dict[int, int]  # rank -> bytes of one row
    probe_refs: list[str]
    probe_row_bytes: int

    @property
    def row_max(self) -> int:
        return max(self.row_bytes.values())


def _publish(model: Any, shape: BaseShape, ranks: tuple[int, ...], cfg: SwapBenchConfig, work: Path) -> _Published:
    layouts = {}
    for r in ranks:
        targets = lora_targets(model, rank=r, dtype=torch.bfloat16,
                               modules=ATTN_MODULES if shape.moe else DENSE_MODULES, experts=shape.moe)
        layouts[r] = layout_of(targets)
        del targets
    probe_layout = None
    if cfg.probe and not shape.moe:
        probe_layout = layout_of(lora_targets(model, rank=1, dtype=torch.bfloat16, modules=("q_proj",),
                                              only=PROBE_MODULE.rsplit(".", 2)[0] + "."))
    store_dir, index_dir = work / "store", work / "index"
    refs: dict[int, list[str]] = {}
    peft_dirs: dict[int, Path] = {}
    with Store.open(str(store_dir), index_dir=str(index_dir)) as store:
        for r, layout in layouts.items():
            refs[r] = publish_adapters(store, layout, tenant=f"r{r}", count=cfg.warmup + cfg.cold, seed=r)
            # PEFT and vLLM load the first timed adapter, from the directory PEFT would save
            peft_dirs[r] = save_peft_dir(store.load(refs[r][cfg.warmup]), work / f"peft-r{r}")
        probe_refs = (publish_adapters(store, probe_layout, tenant="probe", count=cfg.warmup + cfg.probe, seed=99)
                      if probe_layout is not None else [])
    return _Published(store_dir=store_dir, index_dir=index_dir, refs=refs, peft_dirs=peft_dirs,
                      row_bytes={r: lay.row_nbytes for r, lay in layouts.items()}, probe_refs=probe_refs,
                      probe_row_bytes=probe_layout.row_nbytes if probe_layout is not None else 0)


def _engine_phase(model: Any, shape: BaseShape, ranks: tuple[int, ...], pub: _Published, cfg: SwapBenchConfig,
                  notes: list[str]) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None, dict[str, Any]]:
    """Switches into one live engine over ``model``: per rank, then the probe; the engine is
    closed (the model unwrapped) on return."""
    from engine_client import LoRAEngine, MintClient

    results: dict[int, dict[str, Any]] = {}
    probe: dict[str, Any] | None = None
    client = MintClient(str(pub.store_dir), index_dir=str(pub.index_dir), readonly=True)
    # host pool: room for the warm pair and the cold row coming in
    with LoRAEngine(model, client, slots=1, device="cpu", host_bytes=4 * pub.row_max + (1 << 20)) as engine:
        # commit the pool's pages once, as a serving engine's are after its first pass through
        # the pool (and as pinned memory is at allocation on CUDA): a row cache sized in bytes
        # holds many small rows, so the warm-up alone would not reach every page, and timed
        # reads would pay first-touch faults (measured: 0.8 ms instead of 0.1 ms for 1.2 MB)
        engine.host_pool.tensor.fill_(0)
        for r in ranks:
            timed_refs = pub.refs[r][cfg.warmup :]
            engine.call(engine.client.resolve(pub.refs[r][0]))  # opens the store (the engine's first resolve)
            paged = page_in(engine, timed_refs)
            sw = measure_switches(engine, pub.refs[r], warmup=cfg.warmup, cold=cfg.cold, warm=cfg.warm,
                                  section=f"{shape.name} r{r}")
            results[r] = {"switch": sw, "bytes_us": _byte_work(engine, timed_refs),
                          "host_load": measure_host_loads(engine, timed_refs), "page_in_gb_per_s": paged}
            print(f"  r{r}: switch cold p50 {sw['cold']['p50'] / 1e3:.2f} ms, "
                  f"warm p50 {sw['warm']['p50'] / 1e3:.2f} ms")
        if pub.probe_refs:
            page_in(engine, pub.probe_refs)
            sw = measure_switches(engine, pub.probe_refs, warmup=cfg.warmup, cold=cfg.probe, warm=cfg.probe,
                                  section=f"{shape.name} probe")
            probe = {"switch": sw, "module": PROBE_MODULE,
                     "bytes_us": _byte_work(engine, pub.probe_refs[cfg.warmup :])}
        if cfg.forward:
            r = ranks[-1]
            ids = torch.randint(0, shape.vocab, (1, 4), generator=torch.Generator().manual_seed(0))
            t = time.perf_counter()
            with torch.inference_mode():
                logits = engine.forward(ids, adapters=[pub.refs[r][-1]]).logits
            if not torch.isfinite(logits).all():
                raise RuntimeError("the engine's forward gave non-finite logits")
            notes.append(f"{shape.name}: one forward through the engine (1 x 4 tokens, r{r} adapter) ran in "
                         f"{time.perf_counter() - t:.2f} s, logits finite")
        tiers = {t: dataclasses.asdict(v) for t, v in engine.metrics.snapshot().tiers.items()}
    return results, probe, tiers


def _baseline_phase(model: Any, params: dict[str, torch.Tensor], ranks: tuple[int, ...], pub: _Published,
                    cfg: SwapBenchConfig, base_dir: Path) -> dict[str, Any]:
    """Reloads of the base and PEFT switches, on the same (unwrapped) model."""
    t = time.perf_counter()
    st_path = bl.save_base(params, model.config, base_dir)
    save_s = time.perf_counter() - t
    reload_st = bl.timed(functools.partial(bl.reload_safetensors, params, st_path), cfg.reload_repeat)
    reload_raw = bl.timed(functools.partial(bl.reload_raw, params, st_path), cfg.reload_repeat)
    print(f"  reload: safetensors best {min(reload_st):.2f} s, raw preadv best {min(reload_raw):.2f} s "
          f"(saved in {save_s:.1f} s)")
    peft = bl.PeftSwitcher(model, pub.peft_dirs[ranks[0]])
    peft_s = {r: peft.times(pub.peft_dirs[r], cfg.peft_repeat) for r in ranks}
    peft.unload()
    hot_s = {r: bl.peft_hotswap_times(model, pub.peft_dirs[r], cfg.peft_repeat) for r in ranks}
    print("  PEFT: " + ", ".join(f"r{r} load best {min(v) * 1e3:.1f} ms, hotswap best {min(hot_s[r]) * 1e3:.1f} ms"
                                  for r, v in peft_s.items()))
    return {"reload_st": reload_st, "reload_raw": reload_raw, "peft": peft_s, "peft_hotswap": hot_s, "save_s": save_s}


def run_base(shape: BaseShape, ranks: tuple[int, ...], cfg: SwapBenchConfig, root: Path,
             notes: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every measurement on one base; returns (one result per rank, the probe's or None)."""
    work = root / shape.name
    t0 = time.perf_counter()
    model = build_base(shape)
    params = unique_params(model)
    base_bytes = nbytes(params)
    print(f"\n{shape.name}: {shape.layers} layers, {base_bytes / 1e9:.2f} GB bf16, "
          f"built in {time.perf_counter() - t0:.1f} s")
    pub = _publish(model, shape, ranks, cfg, work)
    results, probe, tiers = _engine_phase(model, shape, ranks, pub, cfg, notes)
    base_dir = work / "base"
    base = _baseline_phase(model, params, ranks, pub, cfg, base_dir)
    del model, params  # one base at a time; vLLM loads its own copy
    gc.collect()

    vllm: dict[str, Any] = {}
    python, why = bl.vllm_python(cfg.vllm_python)
    if python is None:
        notes.append(f"vLLM add_lora skipped: {why}")
    else:
        held = anon_bytes()
        if held is not None:
            notes.append(f"{shape.name}: this process held {held / 2**30:.2f} GiB (anonymous) while vLLM ran")
        got = bl.vllm_add_lora(python, base_dir, {f"r{r}": pub.peft_dirs[r] for r in ranks},
                               repeat=cfg.peft_repeat, max_rank=max(16, *ranks), dtype="bfloat16",
                               moe=shape.moe, timeout=cfg.vllm_timeout)
        if "error" in got:
            notes.append(f"vLLM add_lora on {shape.name} failed: {got['error']}")
        else:
            vllm = got
    shutil.rmtree(work, ignore_errors=True)

    cases = []
    for r in ranks:
        vl = vllm.get("add_lora_s", {}).get(f"r{r}")
        case = _case(shape, r, base_bytes, pub.row_bytes[r], results[r], base["reload_st"], base["reload_raw"],
                     base["peft"][r], vl)
        hot = base["peft_hotswap"][r]
        case["peft_hotswap_s"] = {"best": min(hot), "p50": float(np.median(hot)), "all": hot}
        case["ratio"]["peft_hotswap_vs_cold"] = min(hot) / (case["switch_cold_ms"] / 1e3)
        cases.append(case | {"metrics": tiers, "save_base_s": base["save_s"],
                             "vllm_peak_anon_bytes": vllm.get("peak_anon_bytes"),
                             "vllm_start_s": vllm.get("start_s")})
    if probe is not None:
        probe = _fixed(probe) | {"base": shape.name, "row_bytes": pub.probe_row_bytes}
    return cases, probe


def _fixed(res: dict[str, Any]) -> dict[str, Any]:
    """Fixed cost per switch: above one memcpy of the row (DESIGN's measure), and above all the
    byte work the switch does (cold: read + hash + copy into the slot; warm: the copy), both
    measured on the same rows without the engine."""
    sw, b = res["switch"], res["bytes_us"]
    pread, hsh, memcpy, memcpy_warm = (b[k]["p50"] for k in ("pread", "hash", "memcpy", "memcpy_warm"))
    cold, warm = sw["cold"]["p50"], sw["warm"]["p50"]
    return res | {"fixed_us": {"cold_above_memcpy": cold - memcpy, "warm_above_memcpy": warm - memcpy_warm,
                               "cold_above_byte_work": cold - (pread + hsh + memcpy),
                               "warm_above_byte_work": warm - memcpy_warm}}


def _case(shape: BaseShape, rank: int, base_bytes: int, row_bytes: int, res: dict[str, Any], reload_st: list[float],
          reload_raw: list[float], peft: list[float], vllm: list[float] | None) -> dict[str, Any]:
    res = _fixed(res)
    cold_s, warm_s = res["switch"]["cold"]["p50"] / 1e6, res["switch"]["warm"]["p50"] / 1e6
    fx = res["fixed_us"]
    flat = {  # what tools/bench_all.py (tools.bench.suite) reads
        "name": _case_name(shape, rank).lower().replace(" ", "-"),
        "sizes": f"{shape.name}-shaped, {shape.layers} layers, {base_bytes / 1e9:.2f} GB bf16; rank {rank}, "
                 f"row {row_bytes:,} B",
        "switch_cold_ms": cold_s * 1e3, "switch_warm_ms": warm_s * 1e3, "reload_ms": min(reload_st) * 1e3,
        "ratio_reload": min(reload_st) / cold_s, "peft_ms": min(peft) * 1e3,
        "vllm_ms": None if vllm is None else min(vllm) * 1e3,
        "fixed_cost_us": fx["cold_above_memcpy"], "fixed_cost_above_byte_work_us": fx["cold_above_byte_work"],
        "fixed_cost_warm_us": fx["warm_above_memcpy"],
    }
    return flat | {
        "case": _case_name(shape, rank), "base": dataclasses.asdict(shape), "rank": rank,
        "base_bytes": base_bytes, "adapter_bytes": row_bytes, "bound": base_bytes / row_bytes,
        "reload_safetensors_s": {"best": min(reload_st), "all": reload_st},
        "reload_raw_s": {"best": min(reload_raw), "all": reload_raw},
        "reload_gb_per_s": base_bytes / min(reload_st) / 1e9,
        "peft_s": {"best": min(peft), "p50": float(np.median(peft)), "all": peft},
        "vllm_add_lora_s": None if vllm is None else {"best": min(vllm), "p50": float(np.median(vllm)), "all": vllm},
        "ratio": {
            "reload_vs_cold": min(reload_st) / cold_s, "reload_vs_warm": min(reload_st) / warm_s,
            "raw_reload_vs_cold": min(reload_raw) / cold_s,
            "peft_vs_cold": min(peft) / cold_s, "peft_vs_warm": min(peft) / warm_s,
            "vllm_vs_cold": None if vllm is None else min(vllm) / cold_s,
            "vllm_vs_host_load": None if vllm is None else min(vllm) / (res["host_load"]["p50"] / 1e6),
        },
        **res,
    }


# -- the run ----------------------------------------------------------------------------------


def run(cfg: SwapBenchConfig) -> dict[str, Any]:
    root = Path(cfg.root or tempfile.mkdtemp(prefix="mint-bench-swap-"))
    notes: list[str] = []
    cases: list[dict[str, Any]] = []
    probe = None
    torch.set_grad_enabled(False)
    torch.set_num_threads(cfg.threads)
    try:
        with MemoryWatch() as mem:
            if cfg.dense is not None:
                got, probe = run_base(cfg.dense, cfg.dense_ranks, cfg, root, notes)
                cases += got
            if cfg.moe is not None:
                cases += run_base(cfg.moe, cfg.moe_ranks, cfg, root, notes)[0]
    finally:
        if cfg.root is None:
            shutil.rmtree(root, ignore_errors=True)
    vllm_anon = [c["vllm_peak_anon_bytes"] for c in cases if c.get("vllm_peak_anon_bytes")]
    return {"config": {k: (dataclasses.asdict(v) if isinstance(v, BaseShape) else v)
                       for k, v in ((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg))},
            "cases": cases, "probe": probe,
            # anonymous memory (what competes with other processes) and RSS (page cache mapped in
            # included: safetensors maps the checkpoint it loads)
            "peak_anon_gib": None if mem.peak is None else mem.peak / 2**30, "peak_rss_gib": peak_rss_gib(),
            "peak_anon_vllm_gib": max(vllm_anon) / 2**30 if vllm_anon else None,
            "peak_rss_children_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
            "page_cache": "warm: the timed rows are read once before their switches, the checkpoint's reload "
                          "is the best of several",
            "notes": list(dict.fromkeys(notes))}


def _us(us: float) -> str:
    return f"{us:9.1f} us" if us < 10_000 else f"{us / 1e3:9.2f} ms"


def report(results: dict[str, Any], out: str) -> Path:
    for c in results["cases"]:
        sw, ra, fx, b = c["switch"], c["ratio"], c["fixed_us"], c["bytes_us"]
        vl = c["vllm_add_lora_s"]
        rows = [
            ("base", f"{c['base']['name']}-shaped, {c['base']['layers']} layers, {c['base_bytes'] / 1e9:.2f} GB; "
                     f"adapter row {c['adapter_bytes'] / 2**20:.2f} MiB; bound {c['bound']:.0f}x"),
            ("switch cold (storage) p50", f"{_us(sw['cold']['p50'])}   p90 {_us(sw['cold']['p90'])}"),
            ("switch warm (host) p50", f"{_us(sw['warm']['p50'])}   p90 {_us(sw['warm']['p90'])}"),
            ("reload from safetensors, best", f"{_us(c['reload_safetensors_s']['best'] * 1e6)}   "
                                              f"({c['reload_gb_per_s']:.2f} GB/s)"),
            ("reload raw preadv, best", _us(c["reload_raw_s"]["best"] * 1e6)),
            ("PEFT load+set_adapter, best", f"{_us(c['peft_s']['best'] * 1e6)}   p50 {_us(c['peft_s']['p50'] * 1e6)}"),
            ("vLLM add_lora, best", "skipped" if vl is None else _us(vl["best"] * 1e6)),
            ("ratio reload / cold switch", f"{ra['reload_vs_cold']:9.1f}x   (warm {ra['reload_vs_warm']:.1f}x; "
                                           f"raw reload / cold {ra['raw_reload_vs_cold']:.1f}x)"),
            ("ratio PEFT / cold switch", f"{ra['peft_vs_cold']:9.1f}x   (warm {ra['peft_vs_warm']:.1f}x)"),
            ("PEFT hotswap_adapter, best", "-" if not c.get("peft_hotswap_s") else
             f"{_us(c['peft_hotswap_s']['best'] * 1e6)}   ratio / cold switch {ra['peft_hotswap_vs_cold']:.1f}x"),
            ("load into the host cache p50", f"{_us(c['host_load']['p50'])}   (read + verify, no slot copy)"),
            ("ratio vLLM / cold switch", "-" if ra["vllm_vs_cold"] is None else
             f"{ra['vllm_vs_cold']:9.1f}x   (vLLM / load into the host cache {ra['vllm_vs_host_load']:.1f}x)"),
            ("byte work: pread / hash / memcpy", " / ".join(_us(b[k]["p50"]) for k in ("pread", "hash", "memcpy"))
             + f"   (warm memcpy {_us(b['memcpy_warm']['p50'])})"),
            ("fixed cost above memcpy", f"cold {_us(fx['cold_above_memcpy'])}   warm {_us(fx['warm_above_memcpy'])}"),
            ("fixed cost above byte work", f"cold {_us(fx['cold_above_byte_work'])}   "
                                           f"warm {_us(fx['warm_above_byte_work'])}"),
        ]
        print_table(c["case"], rows)
    p = results["probe"]
    if p is not None:
        sw, fx, b = p["switch"], p["fixed_us"], p["bytes_us"]
        print_table(f"fixed cost probe: {p['row_bytes'] / 1024:.1f} KiB rows (rank 1 on {p['module']})", [
            ("switch cold p50 / p90", f"{_us(sw['cold']['p50'])} / {_us(sw['cold']['p90'])}"),
            ("switch warm p50 / p90", f"{_us(sw['warm']['p50'])} / {_us(sw['warm']['p90'])}"),
            ("byte work: pread / hash / memcpy", " / ".join(_us(b[k]["p50"]) for k in ("pread", "hash", "memcpy"))),
            ("fixed cost above memcpy", f"cold {_us(fx['cold_above_memcpy'])}   warm {_us(fx['warm_above_memcpy'])}"),
            ("fixed cost above byte work", f"cold {_us(fx['cold_above_byte_work'])}   "
                                           f"warm {_us(fx['warm_above_byte_work'])}"),
        ])
    anon, vanon = results["peak_anon_gib"], results["peak_anon_vllm_gib"]
    print_table("run", [("peak anonymous memory (this process)", "?" if anon is None else f"{anon:.2f} GiB"),
                        ("peak RSS, mapped files included", f"{results['peak_rss_gib']:.2f} GiB"),
                        ("peak anonymous memory (vLLM processes)", "-" if vanon is None else f"{vanon:.2f} GiB"),
                        ("peak RSS of a child (vLLM)", f"{results['peak_rss_children_gib']:.2f} GiB"),
                        ("torch threads", str(results["config"]["threads"])),
                        ("page cache", results["page_cache"])] + [("note", n) for n in results["notes"]])
    path = write_json(out, "swap", results)
    print(f"\nwrote {path}")
    return path
