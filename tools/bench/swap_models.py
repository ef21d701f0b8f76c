"""Bases and adapters of the swap benchmark: Qwen3-shaped models with random bf16 weights,
LoRA layouts on them, and rows published in bulk.

A base is built on the ``meta`` device (shapes only, no memory) and its parameters are then
materialised once, directly in the target dtype, from one random block (a float32 pass or
``normal_`` over billions of values would take minutes here; the values do not matter to a
load benchmark, only that they are finite and not all equal).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mint_store.format.adapter import make_adapter
from mint_store.format.layout import Layout, encode_rows
from mint_store.store import Store

DENSE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseShape:
    """The per-layer shapes of a base (a transformers Qwen3 or Qwen3-MoE config)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int = 0  # dense MLP
    experts: int = 0  # > 0: a Qwen3-MoE base (every layer sparse)
    moe_intermediate: int = 0
    top_k: int = 8
    tie_embeddings: bool = False

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def with_layers(self, layers: int) -> BaseShape:
        return dataclasses.replace(self, layers=layers)


# the published models' shapes (Qwen3-4B ties its embeddings; Qwen3-30B-A3B does not)
QWEN3_4B = BaseShape(name="Qwen3-4B", layers=36, hidden=2560, intermediate=9728, heads=32, kv_heads=8,
                     head_dim=128, vocab=151_936, tie_embeddings=True)
QWEN3_30B_A3B = BaseShape(name="Qwen3-30B-A3B", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                          vocab=151_936, experts=128, moe_intermediate=768, top_k=8)
# 6 of its 48 layers: ~8.5 GB in bf16, as much as the dense base (peak memory stays one base)
MOE_LAYERS = 6
QWEN3_30B_A3B_CUT = QWEN3_30B_A3B.with_layers(MOE_LAYERS)
# --quick: the same families, small enough for about a minute in all
QUICK_DENSE = BaseShape(name="dense-quick", layers=4, hidden=512, intermediate=1536, heads=8, kv_heads=2,
                        head_dim=64, vocab=8192, tie_embeddings=True)
QUICK_MOE = BaseShape(name="moe-quick", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=8192,
                      experts=16, moe_intermediate=128, top_k=4)


def hf_config(shape: BaseShape, dtype: torch.dtype) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                  max_position_embeddings=4096, tie_word_embeddings=shape.tie_embeddings)
    config: Any
    if shape.moe:
        config = tf.Qwen3MoeConfig(**common, moe_intermediate_size=shape.moe_intermediate,
                                   num_experts=shape.experts, num_experts_per_tok=shape.top_k,
                                   decoder_sparse_step=1, mlp_only_layers=[])
    else:
        config = tf.Qwen3Config(**common, intermediate_size=shape.intermediate)
    config.dtype = dtype  # what save_pretrained records: a vLLM baseline loads it in this dtype
    return config


def build_base(shape: BaseShape, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """A causal LM of ``shape`` with random weights in ``dtype``, in eval mode, on the CPU."""
    import transformers as tf
    from accelerate import init_empty_weights

    config = hf_config(shape, dtype)
    cls = tf.Qwen3MoeForCausalLM if shape.moe else tf.Qwen3ForCausalLM
    # parameters on meta, buffers (rotary inv_freq) real: they are computed, not loaded
    with init_empty_weights(include_buffers=False):
        model = cls(config)
    config.architectures = [cls.__name__]  # what a saved config.json tells vLLM to build
    gen = torch.Generator().manual_seed(seed)
    block = (torch.randn(1 << 22, generator=gen) * 0.02).to(dtype)  # 4 Mi values, tiled
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta param) -> (it, real one)
    k = 0
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            got = made.get(id(p))
            if got is None:
                t = torch.empty(p.shape, dtype=dtype)
                if p.dim() == 1:
                    t.fill_(1.0)  # norms
                else:
                    k = _tile(t.view(-1), block, k)
                got = made[id(p)] = (p, nn.Parameter(t, requires_grad=False))
            mod._parameters[pname] = got[1]
    if shape.tie_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model.eval()


def _tile(flat: torch.Tensor, block: torch.Tensor, k: int) -> int:
    """Fill ``flat`` with shifted copies of ``block`` (no two tensors start alike)."""
    span = block.numel() - 4096
    i = 0
    while i < flat.numel():
        n = min(flat.numel() - i, span)
        off = (k * 977) % 4096
        flat[i : i + n].copy_(block[off : off + n])
        i += n
        k += 1
    return k


def unique_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> parameter, each storage once (a tied lm_head is the embedding), first name kept."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, nn.Parameter) or t.data_ptr() in seen:
            continue  # buffers are computed (rotary), not part of a checkpoint
        seen.add(t.data_ptr())
        out[name] = t
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def lora_targets(model: nn.Module, *, rank: int, dtype: torch.dtype,
                 modules: tuple[str, ...] = DENSE_MODULES, experts: bool = False,
                 only: str | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Zero LoRA factors (name -> (A, B, scaling)) on the named linear modules and, with
    ``experts``, on every fused-experts parameter; ``only``: modules under that path only."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for path, m in model.named_modules():
        if only is not None and not path.startswith(only):
            continue
        if isinstance(m, nn.Linear) and path.rsplit(".", 1)[-1] in modules:
            out[path] = (torch.zeros(rank, m.in_features, dtype=dtype),
                         torch.zeros(m.out_features, rank, dtype=dtype), 1.0)
        elif experts and path.endswith("mlp.experts"):
            for p in EXPERT_PARAMS:
                e, d_out, d_in = getattr(m, p).shape  # [E, out, in] (not is_transposed)
                out[f"{path}.{p}"] = (torch.zeros(e, rank, d_in, dtype=dtype),
                                      torch.zeros(e, d_out, rank, dtype=dtype), 1.0)
    if not out:
        raise ValueError("no LoRA target in the model")
    return out


def layout_of(targets: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> Layout:
    return make_adapter(targets).layout


def publish_adapters(store: Store, layout: Layout, *, tenant: str, count: int, seed: int,
                     chunk_bytes: int = 256 * 2**20) -> list[str]:
    """``count`` distinct adapters of ``layout`` (random A and B, ``* 0.02``) as ``tenant/a{i}@1``.

    One random row is drawn and every adapter gets its own scalings, so the rows differ
    (distinct content ids, nothing deduplicated) without drawing ``count`` rows of randoms.
    """
    gen = torch.Generator().manual_seed(seed)
    one = {t.name: (torch.randn(1, *t.shape, generator=gen) * 0.02) for t in layout.tensors if t.name != "scaling"}
    one["scaling"] = torch.ones(1, *layout.scaling.shape)
    row = encode_rows(layout, one, 1)[0]
    del one
    sc = layout.scaling
    per = max(1, chunk_bytes // layout.row_nbytes)
    for start in range(0, count, per):
        n = min(per, count - start)
        rows = np.repeat(row[None], n, axis=0)
        scal = rows[:, sc.offset : sc.offset + sc.nbytes].view(np.float32)  # [n, modules]
        scal[:] = (1.0 + (start + np.arange(n, dtype=np.float32)) / 64.0)[:, None]
        store.publish_rows([(tenant, f"a{start + i}") for i in range(n)], layout, rows)
    return [f"{tenant}/a{i}@1" for i in range(count)]
