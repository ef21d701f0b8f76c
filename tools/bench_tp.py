#!/usr/bin/env python3
"""Tensor-parallel engine benchmark (not a test): bytes read, bytes held and switch latency
per rank at TP = 1 and TP = 2 (torchrun, gloo, CPU).

A random-weight Llama base (``--hidden``, ``--layers``) is saved once; ``--adapters``
random rank-``--rank`` LoRA adapters on every linear are published to a local store.
Each TP size runs in fresh processes: the base is loaded sharded at TP = 2 (``DistributedConfig(tp_size=2)``)
into an engine with one slot and no host cache, so every switch (``engine.batch([ref])``:
resolve on rank 0, broadcast, read, verify, copy into a slot, exchange status) loads from
storage. Two copies of the store are read:

* ``blocks``: rows as published now, with block digests: a row's ``first`` load on a rank
  reads only the blocks of its slice (one vectored read, each block checked against the
  digests its commit recorded), ``again`` exactly the slice (checked against its digest);
* ``whole``: the same rows with their block digests removed from the index (as a row
  published by an older build, or moved by a compaction): the ``first`` load reads the whole
  row, verifies it against its content id and slices it on the copy (reading the whole row
  and slicing); ``again`` reads the slice by ranges.

Per rank, store copy and load it reports bytes read from storage per switch and the median
/ p90 switch latency, with the row size, the bytes a slot holds and the byte ranges of a
slice; ``base`` is a batch with no adapter: at TP = 2, the cost of the two object
collectives every batch makes (rank 0's decision, the ranks' status), the floor under a
switch.

    python tools/bench_tp.py                     # small shapes, about a minute
    python tools/bench_tp.py --hidden 1024 --layers 8 --adapters 16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _build(root: Path, a: argparse.Namespace) -> list[str]:
    """Save the base and publish the adapters; returns their refs."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from mint_store.peft.directory import load_peft_dir
    from mint_store.store import Store

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=a.hidden, intermediate_size=a.hidden * 3,
                         num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(root / "base"))
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = get_peft_model(tf.LlamaForCausalLM(cfg), LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=modules))
    refs = []
    with Store.open(str(root / "store"), index_dir=str(root / "index")) as store:
        for i in range(a.adapters):
            with torch.no_grad():
                for name, p in pm.named_parameters():
                    if ".lora_" in name:
                        p.copy_(torch.randn(p.shape) * 0.05)
            pm.save_pretrained(str(root / f"ad{i}"))
            store.publish("bench", f"ad{i}", load_peft_dir(root / f"ad{i}"))
            refs.append(f"bench/ad{i}")
    _strip_block_digests(root)
    return refs


def _strip_block_digests(root: Path) -> None:
    """``store_whole``: a copy of the store whose index records no block digests (rows read whole first)."""
    import shutil

    from mint_store.store import Store

    shutil.copytree(root / "store", root / "store_whole")
    shutil.copytree(root / "index", root / "index_whole")
    # a tool's shortcut into the index: the shard records as an older build wrote them
    with Store.open(str(root / "store_whole"), index_dir=str(root / "index_whole")) as store, \
            store._idx().write() as t:
        for key, rec in list(t.scan("shards")):
            if isinstance(rec, dict) and rec.pop("blocks", None) is not None:
                t.put("shards", key, rec)


def _ranges(pool: Any) -> tuple[int, int]:
    """(bytes, byte ranges) a ranged read of this rank's slices of one row would need."""
    nbytes = ranges = 0
    for c in getattr(pool, "cuts", ()):
        nbytes += c.dst.nbytes
        if c.dim is None or c.dim == len(c.src.shape) - 2:
            ranges += 1  # whole, or rows of B: one contiguous run
        else:  # columns of A: one run per row of A
            ranges += c.src.numel // c.src.shape[-1]
    if not getattr(pool, "cuts", ()):
        nbytes, ranges = sum(t.nbytes for t in pool.layout.tensors), len(pool.layout.tensors)
    return nbytes, ranges


def worker(spec_path: str) -> None:
    import transformers as tf

    from engine_client import LoRAEngine, MintClient

    spec = json.loads(Path(spec_path).read_text())
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    opts: dict[str, Any] = {}
    if tp > 1:
        try:
            from transformers.distributed import DistributedConfig
        except ImportError:  # feature, not version: older releases took tp_plan="auto" as an argument
            opts = {"tp_plan": "auto"}
        else:
            opts = {"distributed_config": DistributedConfig(tp_size=tp)}
    model = tf.AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32, **opts).eval()
    rank = int(os.environ.get("RANK", "0"))
    refs = spec["refs"]
    out: dict[str, Any] = {"tp": tp, "rank": rank}
    for mode, store, index in (("blocks", spec["store"], spec["index"]),
                               ("whole", spec["store_whole"], spec["index_whole"])):
        # one slot and no host cache: every switch loads from storage. Pass ``first`` is each
        # row's first load on this rank, ``again`` loads them again
        client = MintClient(store, index_dir=index, readonly=rank > 0)
        got: dict[str, Any] = {}
        with LoRAEngine(model, client, slots=1, cache_bytes=1) as engine:
            for tag in ("first", "again", "base"):
                times = []
                before = engine.metrics.snapshot().tiers["storage"].bytes
                for ref in refs if tag != "base" else [None] * len(refs):
                    t0 = time.perf_counter()
                    with engine.batch([ref], batch_size=1):
                        pass
                    times.append(time.perf_counter() - t0)
                read = engine.metrics.snapshot().tiers["storage"].bytes - before
                times.sort()
                got[tag] = {"read_per_switch": read / len(refs), "p50_ms": 1e3 * times[len(times) // 2],
                            "p90_ms": 1e3 * times[int(len(times) * 0.9)]}
            pool = next(iter(engine.pools.values()))
            ranged, n_ranges = _ranges(pool)
            out.update(row_nbytes=pool.row_nbytes, slot_nbytes=pool.layout.row_nbytes, ranged_nbytes=ranged,
                       ranges=n_ranges)
        out[mode] = got
    Path(spec["out"], f"tp{tp}-rank{rank}.json").write_text(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter")
    p.add_argument("--adapters", type=int, default=12, help="adapters switched in, each twice")
    p.add_argument("--out", help="JSON results (default: print only)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        refs = _build(root, a)
        spec = {"base": str(root / "base"), "store": str(root / "store"), "index": str(root / "index"),
                "store_whole": str(root / "store_whole"), "index_whole": str(root / "index_whole"),
                "refs": refs, "out": tmp}
        (root / "spec.json").write_text(json.dumps(spec))
        me = [str(Path(__file__).resolve()), "--worker", str(root / "spec.json")]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, *me], check=True, env=env)
        subprocess.run([torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port,
                        *me], check=True, env=env, stderr=subprocess.DEVNULL)
        rows = [json.loads(f.read_text()) for f in sorted(root.glob("tp*-rank*.json"))]
    print(f"hidden {a.hidden}, {a.layers} layers, rank {a.rank}, {a.adapters} cold switches per rank")
    print(f"{'TP':>3} {'rank':>4} {'row KiB':>8} {'held/slot KiB':>13} {'ranges':>6} | {'store':>6} {'load':>5} "
          f"{'read/switch KiB':>15} {'p50 ms':>7} {'p90 ms':>7}")
    for r in rows:
        for mode in ("blocks", "whole"):
            for tag in ("first", "again", "base"):
                t = r[mode][tag]
                print(f"{r['tp']:>3} {r['rank']:>4} {r['row_nbytes'] / 1024:8.1f} {r['slot_nbytes'] / 1024:13.1f} "
                      f"{r['ranges']:6d} | {mode:>6} {tag:>5} {t['read_per_switch'] / 1024:15.1f} "
                      f"{t['p50_ms']:7.2f} {t['p90_ms']:7.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
