#!/usr/bin/env python3
"""Multi-adapter batching benchmark (not a test).

1. One batch whose sequences use 1, 8, 64 and 1,000 distinct adapters, against running the
   same sequences one adapter at a time (one forward per adapter, same engine, adapters
   already in device slots for both).
2. A sweep of switches drawn (Zipf) from a large catalog through a small slot pool: the
   latency of preparing a one-adapter batch (resolve, host/storage fetch, one device copy),
   by the tier that served it.

    python tools/bench_batch.py                      # defaults below
    python tools/bench_batch.py --switches 10000 --catalog 2000 --seqs 256   # quicker
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_client import LoRAEngine, MintClient
from mint_store.adapter import make_adapter
from mint_store.bench.report import percentiles, print_table, write_json
from mint_store.layout import Layout, encode_rows
from mint_store.store import Store


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


def timed(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_batching(a: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    model = build_model(a.hidden, a.layers, a.vocab)
    layout = layout_for(model, a.rank, ("q_proj", "k_proj", "v_proj", "o_proj"))
    with Store.open(str(root / "store"), index_dir=str(root / "index")) as store:
        refs = publish_random(store, "batch", max(a.distinct), layout, seed=1)
    ids = torch.randint(0, a.vocab, (a.seqs, a.seq), generator=torch.Generator().manual_seed(0)).to(a.device)
    out = []
    with LoRAEngine(model, MintClient(str(root / "store"), index_dir=str(root / "index")), device=a.device,
                    slots=max(a.distinct) + 8, host_bytes=2 * (max(a.distinct) + 8) * layout.row_nbytes + (64 << 20)
                    ) as engine, torch.inference_mode():
        for k in a.distinct:
            per_seq = [refs[i % k] for i in range(a.seqs)]
            groups = [[i for i in range(a.seqs) if i % k == j] for j in range(k)]
            engine.forward(ids, adapters=per_seq)  # loads the k adapters into slots

            def batched(per_seq: list[str] = per_seq) -> None:
                engine.forward(ids, adapters=per_seq)

            def one_at_a_time(groups: list[list[int]] = groups, k: int = k) -> None:
                for j, rows in enumerate(groups):
                    engine.forward(ids[rows], adapters=[refs[j]] * len(rows))

            tb, to = timed(batched, a.repeat), timed(one_at_a_time, a.repeat)
            out.append({"distinct": k, "seqs": a.seqs, "seq_len": a.seq, "batched_s": tb, "one_at_a_time_s": to,
                        "speedup": to / tb})
    return out


def bench_sweep(a: argparse.Namespace, root: Path) -> dict[str, Any]:
    model = build_model(a.hidden, a.layers, a.vocab)
    layout = layout_for(model, 1, ("q_proj", "v_proj"))
    with Store.open(str(root / "store2"), index_dir=str(root / "index2")) as store:
        refs = publish_random(store, "cat", a.catalog, layout, seed=2)
    rng = np.random.default_rng(0)
    draws = (rng.zipf(a.zipf, a.switches) - 1) % a.catalog
    rows = layout.row_nbytes
    lat: dict[str, list[int]] = {"device": [], "host": [], "storage": []}
    with LoRAEngine(model, MintClient(str(root / "store2"), index_dir=str(root / "index2")), device=a.device,
                    slots=a.slots, host_bytes=a.host_rows * rows + (16 << 20), cache_bytes=a.host_rows * rows
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
    memcpy_ns = timed(lambda: torch.empty(rows, dtype=torch.uint8).copy_(torch.empty(rows, dtype=torch.uint8)),
                      200) * 1e9
    tiers = {t: {"count": len(v), **(percentiles(v) if v else {})} for t, v in lat.items()}
    return {"catalog": a.catalog, "switches": a.switches, "slots": a.slots, "host_rows": a.host_rows,
            "row_bytes": rows, "zipf": a.zipf, "memcpy_us": memcpy_ns / 1e3, "all": percentiles(every), **tiers,
            "hit_rates": {t: snap.hit_rate(t) for t in snap.tiers}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seqs", type=int, default=1000, help="sequences in the batch")
    p.add_argument("--seq", type=int, default=4, help="tokens per sequence")
    p.add_argument("--distinct", default="1,8,64,1000")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--catalog", type=int, default=10_000)
    p.add_argument("--switches", type=int, default=100_000)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--host-rows", type=int, default=1024, help="host cache size, in rows")
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="docs/results/batch.json")
    a = p.parse_args()
    a.distinct = [int(x) for x in a.distinct.split(",")]
    if max(a.distinct) > a.seqs:
        p.error("--seqs must be at least the largest --distinct")
    root = Path(tempfile.mkdtemp(prefix="mint-bench-batch-"))
    try:
        batching = bench_batching(a, root)
        sweep = bench_sweep(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(f"one batch of {a.seqs} sequences x {a.seq} tokens vs one adapter at a time ({a.device})",
                [(f"{r['distinct']:>5} distinct", f"batched {r['batched_s'] * 1e3:9.1f} ms   one at a time "
                  f"{r['one_at_a_time_s'] * 1e3:9.1f} ms   speedup {r['speedup']:6.1f}x") for r in batching])
    rows = [(k, f"n={sweep[k]['count']:>7}  p50 {sweep[k].get('p50', 0):8.1f} us  p99 {sweep[k].get('p99', 0):8.1f} us")
            for k in ("device", "host", "storage")]
    rows.append(("all", f"p50 {sweep['all']['p50']:8.1f} us  p99 {sweep['all']['p99']:8.1f} us  (memcpy of one "
                 f"row {sweep['memcpy_us']:.1f} us)"))
    print_table(f"{a.switches} switches from a catalog of {a.catalog} (Zipf {a.zipf}), {a.slots} slots", rows)
    path = write_json(a.out, "batch", {"config": {k: v for k, v in vars(a).items()}, "batching": batching,
                                       "sweep": sweep})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
