"""Multi-adapter batching benchmark.

1. One batch whose sequences use 1, 8, 64 and 1,000 distinct adapters, against running the
   same sequences one adapter at a time (one forward per adapter, same engine, adapters
   already in device slots for both).
2. A sweep of switches drawn (Zipf) from a large catalog through a small slot pool: the
   latency of preparing a one-adapter batch (resolve, host/storage fetch, one device copy),
   by the tier that served it.

The base is a small random Llama; the batching times are the best of ``repeat`` runs.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mint_store.format.adapter import make_adapter
from mint_store.format.layout import Layout, encode_rows
from mint_store.store import Store

from .profiling import profiled
from .report import default_device, percentiles, print_table, require_positive, write_json


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchBenchConfig:
    hidden: int = 256
    layers: int = 2
    vocab: int = 1024
    rank: int = 8
    seqs: int = 1000  # sequences in the batch
    seq: int = 4  # tokens per sequence
    distinct: tuple[int, ...] = (1, 8, 64, 1000)  # distinct adapters per batch, one measurement each
    repeat: int = 3
    catalog: int = 10_000
    switches: int = 100_000
    slots: int = 64
    host_rows: int = 1024  # host cache size, in rows
    zipf: float = 1.2
    device: str = field(default_factory=default_device)
    # torch intra-op threads (0: torch's default, as a serving engine runs). A mixed batch's big
    # matmuls use every core and one-sequence forwards cannot, which is part of what batching
    # buys; 1 measures the work saved alone (and is steadier on a busy machine)
    threads: int = 0
    out: str = "docs/results/batch.json"

    def __post_init__(self) -> None:
        require_positive(self, "hidden", "layers", "vocab", "rank", "seqs", "seq", "repeat", "catalog", "switches",
                         "slots")
        if not self.distinct or min(self.distinct) < 1:
            raise ValueError(f"distinct must be one or more counts, each at least 1, got {self.distinct}")
        if self.seqs < max(self.distinct):
            raise ValueError(f"seqs ({self.seqs}) must be >= max(distinct) ({max(self.distinct)}): every adapter "
                             "needs a sequence; raise seqs or drop the larger distinct counts")
        if self.host_rows < 0 or self.threads < 0:
            raise ValueError(f"host_rows and threads must be >= 0, got {self.host_rows} and {self.threads}")
        if self.zipf <= 1:
            raise ValueError(f"zipf must be > 1 (numpy's Zipf exponent), got {self.zipf}")


def build_model(hidden: int, layers: int, vocab: int) -> Any:
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                            num_key_value_heads=max(1, hidden // 64), max_position_embeddings=256,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).eval()


def layout_for(model: Any, rank: int, modules: tuple[str, ...]) -> Layout:
    mods = {}
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in modules and isinstance(m, torch.nn.Linear):
            mods[name] = (torch.zeros(rank, m.in_features), torch.zeros(m.out_features, rank), 1.0)
    return make_adapter(mods).layout


def publish_random(store: Store, tenant: str, n: int, layout: Layout, seed: int) -> list[str]:
    """``n`` random adapters of ``layout`` in bulk; returns immutable refs (``@1``: cached by the engine)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {t.name: torch.randn(n, *t.shape, generator=g) * 0.02 for t in layout.tensors[:-1]}
    tensors["scaling"] = torch.full((n, len(layout.modules)), 2.0)
    names = [(tenant, f"a{i}") for i in range(n)]
    step = 2000
    for i in range(0, n, step):
        chunk = names[i : i + step]
        rows = encode_rows(layout, {k: v[i : i + step] for k, v in tensors.items()}, len(chunk))
        store.publish_rows(chunk, layout, rows)
    return [f"{tenant}/a{i}@1" for i in range(n)]


def timed(fn: Callable[[], object], repeat: int) -> float:
    """The best of ``repeat`` runs of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_batching(cfg: BatchBenchConfig, root: Path) -> list[dict[str, Any]]:
    from engine_client import LoRAEngine, MintClient

    model = build_model(cfg.hidden, cfg.layers, cfg.vocab)
    layout = layout_for(model, cfg.rank, ("q_proj", "k_proj", "v_proj", "o_proj"))
    most = max(cfg.distinct)
    with Store.open(str(root / "store"), index_dir=str(root / "index")) as store:
        refs = publish_random(store, "batch", most, layout, seed=1)
    ids = torch.randint(0, cfg.vocab, (cfg.seqs, cfg.seq), generator=torch.Generator().manual_seed(0)).to(cfg.device)
    out = []
    with LoRAEngine(model, MintClient(str(root / "store"), index_dir=str(root / "index")), device=cfg.device,
                    slots=most + 8, host_bytes=2 * (most + 8) * layout.row_nbytes + (64 << 20)
                    ) as engine, torch.inference_mode():
        for k in cfg.distinct:
            per_seq = [refs[i % k] for i in range(cfg.seqs)]
            groups = [[i for i in range(cfg.seqs) if i % k == j] for j in range(k)]
            engine.forward(ids, adapters=per_seq)  # loads the k adapters into slots

            def batched(per_seq: list[str] = per_seq) -> None:
                engine.forward(ids, adapters=per_seq)

            def one_at_a_time(groups: list[list[int]] = groups) -> None:
                for j, rows in enumerate(groups):
                    engine.forward(ids[rows], adapters=[refs[j]] * len(rows))

            # the largest count is the one a target judges: only its calls are worth a profile
            profile = k == most
            with profiled(f"batched forward, {k} distinct") if profile else nullcontext():
                tb = timed(batched, cfg.repeat)
            with profiled(f"one adapter at a time, {k} adapters") if profile else nullcontext():
                to = timed(one_at_a_time, cfg.repeat)
            out.append({"distinct": k, "seqs": cfg.seqs, "seq_len": cfg.seq, "batched_s": tb, "one_at_a_time_s": to,
                        "speedup": to / tb})
    return out


def bench_sweep(cfg: BatchBenchConfig, root: Path) -> dict[str, Any]:
    from engine_client import LoRAEngine, MintClient

    model = build_model(cfg.hidden, cfg.layers, cfg.vocab)
    layout = layout_for(model, 1, ("q_proj", "v_proj"))
    with Store.open(str(root / "store2"), index_dir=str(root / "index2")) as store:
        refs = publish_random(store, "cat", cfg.catalog, layout, seed=2)
    rng = np.random.default_rng(0)
    draws = (rng.zipf(cfg.zipf, cfg.switches) - 1) % cfg.catalog
    rows = layout.row_nbytes
    lat: dict[str, list[int]] = {"device": [], "host": [], "storage": []}
    with LoRAEngine(model, MintClient(str(root / "store2"), index_dir=str(root / "index2")), device=cfg.device,
                    slots=cfg.slots, host_bytes=cfg.host_rows * rows + (16 << 20), cache_bytes=cfg.host_rows * rows
                    ) as engine:
        for i in draws:
            before = (engine.metrics.count("device"), engine.metrics.count("host"))
            t0 = time.perf_counter_ns()
            with engine.batch([refs[i]]):
                pass
            dt = time.perf_counter_ns() - t0
            tier = ("device" if engine.metrics.count("device") > before[0]
                    else "host" if engine.metrics.count("host") > before[1] else "storage")
            lat[tier].append(dt)
        snap = engine.metrics.snapshot()
    every = [x for v in lat.values() for x in v]
    # a yardstick for the switch latencies: one row's bytes copied in host memory, nothing else
    memcpy_ns = timed(lambda: torch.empty(rows, dtype=torch.uint8).copy_(torch.empty(rows, dtype=torch.uint8)),
                      200) * 1e9
    tiers = {t: {"count": len(v), **(percentiles(v) if v else {})} for t, v in lat.items()}
    return {"catalog": cfg.catalog, "switches": cfg.switches, "slots": cfg.slots, "host_rows": cfg.host_rows,
            "row_bytes": rows, "zipf": cfg.zipf, "memcpy_us": memcpy_ns / 1e3, "all": percentiles(every), **tiers,
            "hit_rates": {t: snap.hit_rate(t) for t in snap.tiers}}


def config_dict(cfg: BatchBenchConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}


def run(cfg: BatchBenchConfig) -> dict[str, Any]:
    """Both benchmarks in a temporary directory (removed after); writes ``cfg.out``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    root = Path(tempfile.mkdtemp(prefix="mint-bench-batch-"))
    try:
        batching = bench_batching(cfg, root)
        sweep = bench_sweep(cfg, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {"config": config_dict(cfg), "torch_threads": torch.get_num_threads(), "batching": batching,
               "sweep": sweep}
    write_json(cfg.out, "batch", results)
    return results


def report(results: dict[str, Any]) -> None:
    c, batching, sweep = results["config"], results["batching"], results["sweep"]
    print_table(f"one batch of {c['seqs']} sequences x {c['seq']} tokens vs one adapter at a time ({c['device']})",
                [(f"{r['distinct']:>5} distinct", f"batched {r['batched_s'] * 1e3:9.1f} ms   one at a time "
                  f"{r['one_at_a_time_s'] * 1e3:9.1f} ms   speedup {r['speedup']:6.1f}x") for r in batching])
    rows = [(k, f"n={sweep[k]['count']:>7}  p50 {sweep[k].get('p50', 0):8.1f} us  p99 {sweep[k].get('p99', 0):8.1f} us")
            for k in ("device", "host", "storage")]
    rows.append(("all", f"p50 {sweep['all']['p50']:8.1f} us  p99 {sweep['all']['p99']:8.1f} us  (memcpy of one "
                 f"row {sweep['memcpy_us']:.1f} us)"))
    print_table(f"{sweep['switches']} switches from a catalog of {sweep['catalog']} (Zipf {sweep['zipf']}), "
                f"{sweep['slots']} slots", rows)
