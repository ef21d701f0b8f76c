"""Packed MoE adapter load benchmark.

A rank-1 LoRA on the attention and on every expert of a Qwen3-30B-A3B-shaped model
(128 experts; layers cut by flag), loaded into an engine's device slot:

* packed: the store's row (one stacked ``[E, r, in]`` / ``[E, out, r]`` block per layer and
  projection, one row in all) -> one read into the pinned pool -> one copy into the slot;
* per expert: the same adapter as per-expert (Mixtral-style) checkpoints keep it, one
  safetensors tensor per (layer, expert, projection, A or B), read tensor by tensor and
  copied into the same slot views.

Both end with byte-identical slots (checked). The model is built on the meta device: only
its module shapes matter here. Times are the median of ``repeat`` loads.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mint_store.format.adapter import Adapter, make_adapter
from mint_store.store import Store

from .profiling import profiled
from .report import default_device, print_table, require_positive, write_json

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
REF = "bench/moe@1"


@dataclass(frozen=True, slots=True, kw_only=True)
class MoePackBenchConfig:
    layers: int = 48
    experts: int = 128
    hidden: int = 2048
    inter: int = 768  # each expert's intermediate size
    rank: int = 1
    repeat: int = 5
    device: str = field(default_factory=default_device)
    out: str = "docs/results/moe_pack.json"

    def __post_init__(self) -> None:
        require_positive(self, "layers", "experts", "hidden", "inter", "rank", "repeat")


def meta_model(cfg: MoePackBenchConfig) -> Any:
    import transformers as tf

    # a dict: the config's typed signature leaves out head_dim, which it accepts all the same
    kwargs: dict[str, Any] = {
        "vocab_size": 151_936, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": cfg.inter, "num_experts": cfg.experts,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    }
    config = tf.Qwen3MoeConfig(**kwargs)
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


def run(cfg: MoePackBenchConfig) -> dict[str, Any]:
    """Packed (cold and warm) and per-expert loads in a temporary directory (removed after);
    writes ``cfg.out``."""
    from engine_client import LoRAEngine, MintClient

    root = Path(tempfile.mkdtemp(prefix="mint-bench-moe-"))
    try:
        model = meta_model(cfg)
        adapter = random_adapter(model, cfg.rank, torch.bfloat16)
        layout = adapter.layout
        with Store.open(str(root / "store"), index_dir=str(root / "index")) as store:
            cid = store.publish("bench", "moe", adapter).content_id
        n_tensors = per_expert_file(adapter, root / "per_expert.safetensors")
        scalings = {m.name: m.scaling for m in adapter.modules}
        packed, warm, per_expert = [], [], []
        with LoRAEngine(model, MintClient(str(root / "store"), index_dir=str(root / "index")), device=cfg.device,
                        slots=2, host_bytes=layout.row_nbytes + (1 << 20)) as engine:
            for _ in range(cfg.repeat):
                for pool in engine.pools.values():
                    if cid in pool:
                        pool.evict(cid)
                engine.streamer.clear()  # cold: storage -> pinned pool -> slot
                t0 = time.perf_counter()
                with profiled("packed load, cold"):
                    engine.pin(REF)
                    _sync(cfg.device)
                packed.append(time.perf_counter() - t0)
                engine.unpin(REF)
                pool = engine.pools[layout.layout_id]
                pool.evict(cid)
                t0 = time.perf_counter()  # warm: the row is in the host cache
                engine.pin(REF)
                _sync(cfg.device)
                warm.append(time.perf_counter() - t0)
                engine.unpin(REF)
            slot_packed = pool.slot_of(cid)
            if slot_packed is None:
                raise RuntimeError("the packed adapter left its slot")
            other = pool.assign("per-expert")
            for _ in range(cfg.repeat):
                pool.data[other].zero_()
                _sync(cfg.device)
                t0 = time.perf_counter()
                with profiled("per-expert load"):
                    copies = load_per_expert(root / "per_expert.safetensors", pool, other, scalings)
                    _sync(cfg.device)
                per_expert.append(time.perf_counter() - t0)
            if not torch.equal(pool.data[other], pool.data[slot_packed]):
                raise RuntimeError("the per-expert load does not give the packed slot's bytes")
        res: dict[str, Any] = {
            "layers": cfg.layers, "experts": cfg.experts, "rank": cfg.rank, "device": cfg.device,
            "row_bytes": layout.row_nbytes, "per_expert_tensors": n_tensors, "per_expert_copies": copies,
            "packed_cold_s": statistics.median(packed), "packed_warm_s": statistics.median(warm),
            "per_expert_s": statistics.median(per_expert),
        }
        res["speedup_cold"] = res["per_expert_s"] / res["packed_cold_s"]
        res["speedup_warm"] = res["per_expert_s"] / res["packed_warm_s"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(cfg.out, "moe_pack", res)
    return res


def report(res: dict[str, Any], cfg: MoePackBenchConfig) -> None:
    print_table(
        f"rank-{cfg.rank} MoE adapter, {cfg.layers} layers x {cfg.experts} experts, "
        f"{res['row_bytes'] / 2**20:.1f} MiB ({cfg.device}, median of {cfg.repeat})",
        [("packed, cold from the store", f"{res['packed_cold_s'] * 1e3:9.2f} ms   1 read, 1 copy"),
         ("packed, from the host cache", f"{res['packed_warm_s'] * 1e3:9.2f} ms   1 copy"),
         ("per-expert safetensors", f"{res['per_expert_s'] * 1e3:9.2f} ms   {res['per_expert_tensors']} tensors"),
         ("speedup (cold / warm)", f"{res['speedup_cold']:9.1f}x / {res['speedup_warm']:.1f}x   (target >= 20x)")],
    )


def _sync(device: str) -> None:
    # CUDA copies are asynchronous: without a sync the clock would stop before they land
    if device.startswith("cuda"):
        torch.cuda.synchronize()
