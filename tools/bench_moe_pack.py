#!/usr/bin/env python3
"""Packed MoE adapter load benchmark (not a test).

A rank-1 LoRA on the attention and on every expert of a Qwen3-30B-A3B-shaped model
(128 experts; layers cut by flag), loaded into an engine's device slot:

* packed: the store's row (one stacked ``[E, r, in]`` / ``[E, out, r]`` block per layer and
  projection, one row in all) -> one read into the pinned pool -> one copy into the slot;
* per expert: the same adapter as per-expert (Mixtral-style) checkpoints keep it, one
  safetensors tensor per (layer, expert, projection, A or B), read tensor by tensor and
  copied into the same slot views.

Both end with byte-identical slots (checked). The model is built on the meta device: only
its module shapes matter here.

    python tools/bench_moe_pack.py                # 48 layers
    python tools/bench_moe_pack.py --layers 4     # quicker
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine_client import LoRAEngine, MintClient
from mint_store.adapter import Adapter, make_adapter
from mint_store.bench.report import print_table, write_json
from mint_store.store import Store

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def meta_model(a: argparse.Namespace) -> Any:
    import transformers as tf

    config = tf.Qwen3MoeConfig(
        vocab_size=151_936, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=a.inter, num_experts=a.experts,
        num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return tf.Qwen3MoeForCausalLM(config)


def random_adapter(model: Any, rank: int, dtype: torch.dtype) -> Adapter:
    g = torch.Generator().manual_seed(0)
    mods: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in ATTN:
            mods[name] = (torch.randn(rank, m.in_features, generator=g).to(dtype),
                          torch.randn(m.out_features, rank, generator=g).to(dtype), 2.0)
        elif name.endswith("mlp.experts"):
            e, two_i, h = m.gate_up_proj.shape
            _, _, i = m.down_proj.shape
            mods[f"{name}.gate_up_proj"] = (torch.randn(e, rank, h, generator=g).to(dtype),
                                            torch.randn(e, two_i, rank, generator=g).to(dtype), 2.0)
            mods[f"{name}.down_proj"] = (torch.randn(e, rank, i, generator=g).to(dtype),
                                         torch.randn(e, h, rank, generator=g).to(dtype), 2.0)
    return make_adapter(mods)


def per_expert_file(adapter: Adapter, path: Path) -> int:
    """The adapter as one tensor per (layer, expert, projection, A or B); returns the tensor count."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for m in adapter.modules:
        if m.experts is None:
            out[f"{m.name}.lora_A.weight"] = m.a.contiguous()
            out[f"{m.name}.lora_B.weight"] = m.b.contiguous()
            continue
        experts_path, _, param = m.name.rpartition(".")
        for e in range(m.experts):
            if param == "gate_up_proj":  # separate gate and up LoRAs, as w1/w3 experts keep them
                half = m.b.shape[1] // 2
                parts = {"gate_proj": (m.a[e], m.b[e, :half]), "up_proj": (m.a[e], m.b[e, half:])}
            else:
                parts = {"down_proj": (m.a[e], m.b[e])}
            for proj, (a, b) in parts.items():
                out[f"{experts_path}.{e}.{proj}.lora_A.weight"] = a.clone()  # gate and up own their copies
                out[f"{experts_path}.{e}.{proj}.lora_B.weight"] = b.clone()
    save_file(out, str(path))
    return len(out)


def load_per_expert(path: Path, pool: Any, slot: int, scalings: dict[str, float]) -> int:
    """Read the per-expert file tensor by tensor into ``slot``'s views; returns the copies made."""
    from safetensors import safe_open

    copies = 0
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 -- safe_open is not a mapping
            t = f.get_tensor(key)
            stem, _, part = key.removesuffix(".weight").rpartition(".")
            head, _, proj = stem.rpartition(".")
            experts_path, _, expert = head.rpartition(".")
            if expert.isdigit():  # <experts>.<e>.<proj>.lora_X
                e = int(expert)
                v = pool.modules[f"{experts_path}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
                if part == "lora_A":
                    v.a[slot, e].copy_(t)
                else:
                    rows = t.shape[0]
                    off = rows if proj == "up_proj" else 0
                    v.b[slot, e, off : off + rows].copy_(t)
            else:
                v = pool.modules[stem]
                (v.a if part == "lora_A" else v.b)[slot].copy_(t)
            copies += 1
    for name, s in scalings.items():
        pool.modules[name].scaling[slot] = s
    return copies + len(scalings)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="docs/results/moe_pack.json")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mint-bench-moe-"))
    try:
        model = meta_model(a)
        adapter = random_adapter(model, a.rank, torch.bfloat16)
        layout = adapter.layout
        with Store.open(str(root / "store"), index_dir=str(root / "index")) as store:
            cid = store.publish("bench", "moe", adapter).content_id
        n_tensors = per_expert_file(adapter, root / "per_expert.safetensors")
        scalings = {m.name: m.scaling for m in adapter.modules}
        packed, warm, per_expert = [], [], []
        with LoRAEngine(model, MintClient(str(root / "store"), index_dir=str(root / "index")), device=a.device,
                        slots=2, host_bytes=layout.row_nbytes + (1 << 20)) as engine:
            for _ in range(a.repeat):
                for pool in engine.pools.values():
                    if cid in pool:
                        pool.evict(cid)
                engine.streamer.clear()  # cold: storage -> pinned pool -> slot
                t0 = time.perf_counter()
                engine.pin("bench/moe@1")
                _sync(a.device)
                packed.append(time.perf_counter() - t0)
                engine.unpin("bench/moe@1")
                pool = engine.pools[layout.layout_id]
                pool.evict(cid)
                t0 = time.perf_counter()  # warm: the row is in the host cache
                engine.pin("bench/moe@1")
                _sync(a.device)
                warm.append(time.perf_counter() - t0)
                engine.unpin("bench/moe@1")
            slot_packed = pool.slot_of(cid)
            if slot_packed is None:
                raise RuntimeError("the packed adapter left its slot")
            other = pool.assign("per-expert")
            for _ in range(a.repeat):
                pool.data[other].zero_()
                _sync(a.device)
                t0 = time.perf_counter()
                copies = load_per_expert(root / "per_expert.safetensors", pool, other, scalings)
                _sync(a.device)
                per_expert.append(time.perf_counter() - t0)
            if not torch.equal(pool.data[other], pool.data[slot_packed]):
                raise RuntimeError("the per-expert load does not give the packed slot's bytes")
        res = {
            "layers": a.layers, "experts": a.experts, "rank": a.rank, "device": a.device,
            "row_bytes": layout.row_nbytes, "per_expert_tensors": n_tensors, "per_expert_copies": copies,
            "packed_cold_s": statistics.median(packed), "packed_warm_s": statistics.median(warm),
            "per_expert_s": statistics.median(per_expert),
        }
        res["speedup_cold"] = res["per_expert_s"] / res["packed_cold_s"]
        res["speedup_warm"] = res["per_expert_s"] / res["packed_warm_s"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(
        f"rank-{a.rank} MoE adapter, {a.layers} layers x {a.experts} experts, {res['row_bytes'] / 2**20:.1f} MiB "
        f"({a.device}, median of {a.repeat})",
        [("packed, cold from the store", f"{res['packed_cold_s'] * 1e3:9.2f} ms   1 read, 1 copy"),
         ("packed, from the host cache", f"{res['packed_warm_s'] * 1e3:9.2f} ms   1 copy"),
         ("per-expert safetensors", f"{res['per_expert_s'] * 1e3:9.2f} ms   {n_tensors} tensors"),
         ("speedup (cold / warm)", f"{res['speedup_cold']:9.1f}x / {res['speedup_warm']:.1f}x   (target >= 20x)")],
    )
    print(f"\nwrote {write_json(a.out, 'moe_pack', res)}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
