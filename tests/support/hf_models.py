"""Tiny random-weight transformers models and PEFT LoRA adapters for tests.

Nothing is downloaded: every model is built from a small config with seeded random
weights, so the same (kind, seed, dtype) always gives bit-identical weights and a fresh
base for each ``PeftModel.from_pretrained`` (which mutates the model it is given).

Sizes are chosen so no two feature sizes coincide where a transpose bug could hide:
hidden 32, attention q 32 / kv 16, dense MLP 48, MoE expert intermediate 24 (so
``gate_up_proj`` is ``[4, 48, 32]`` and ``down_proj`` ``[4, 32, 24]``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

VOCAB = 128
HIDDEN = 32
MOE_INTER = 24
EXPERTS = 4
MODEL_KINDS = ("llama", "qwen3", "mistral", "qwen3_moe", "deepseek_v3")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MOE_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def model_config(kind: str) -> Any:
    """The transformers config of a tiny model of ``kind`` (one of MODEL_KINDS)."""
    import transformers as tf

    gqa = dict(_COMMON, num_key_value_heads=2, head_dim=8, intermediate_size=48)
    if kind == "llama":
        return tf.LlamaConfig(**gqa)
    if kind == "qwen3":
        return tf.Qwen3Config(**gqa)
    if kind == "mistral":
        return tf.MistralConfig(**gqa, sliding_window=None)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **gqa, moe_intermediate_size=MOE_INTER, num_experts=EXPERTS, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[],
        )
    if kind == "deepseek_v3":
        # layer 0 dense, layer 1 MoE with fused experts + a shared expert; MLA attention
        return tf.DeepseekV3Config(
            **dict(_COMMON, num_key_value_heads=4, intermediate_size=48), moe_intermediate_size=MOE_INTER,
            n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8,
        )
    raise ValueError(f"unknown model kind {kind!r}; use one of {MODEL_KINDS}")


def build_model(kind: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A tiny causal LM with seeded random weights, in eval mode. Milliseconds after import."""
    import transformers as tf

    config = model_config(kind)
    cls = {
        "llama": tf.LlamaForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "deepseek_v3": tf.DeepseekV3ForCausalLM,
    }[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(dtype).eval()


def lora_config(
    *,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: Sequence[str] | str | None = ATTN,
    target_parameters: Sequence[str] | None = None,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    use_rslora: bool = False,
    **extra: Any,
) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules) if isinstance(target_modules, list | tuple) else target_modules,
        target_parameters=list(target_parameters) if target_parameters else None,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        use_rslora=use_rslora,
        **extra,
    )


def peft_model(model: Any, *, seed: int = 1, autocast_adapter_dtype: bool = True, **lora: Any) -> Any:
    """Wrap ``model`` with a LoRA adapter whose A and B are random and non-zero (seeded).

    PEFT initialises B to zero, which would make every adapter a no-op and every
    comparison vacuous; both factors are overwritten with ``randn * 0.1``.
    """
    from peft import get_peft_model

    pm = get_peft_model(model, lora_config(**lora), autocast_adapter_dtype=autocast_adapter_dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return pm.eval()


def make_peft_dir(
    path: str | os.PathLike[str],
    kind: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **lora: Any,
) -> Path:
    """Build a tiny ``kind`` model, add a random LoRA adapter, ``save_pretrained`` it to ``path``.

    A non-float32 ``dtype`` keeps the adapter in that dtype (no autocast to float32), so the
    saved safetensors hold e.g. BF16 tensors.
    """
    pm = peft_model(
        build_model(kind, seed=seed, dtype=dtype), autocast_adapter_dtype=dtype == torch.float32, **lora
    )
    pm.save_pretrained(str(path))
    return Path(path)


def load_peft(
    path: str | os.PathLike[str], kind: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Any:
    """``PeftModel.from_pretrained`` on a fresh base of the given kind/seed/dtype."""
    from peft import PeftModel

    return PeftModel.from_pretrained(build_model(kind, seed=seed, dtype=dtype), str(path)).eval()


def load_sharded(base: str | os.PathLike[str], parallel: dict[str, Any] | None = None) -> Any:
    """``from_pretrained`` of a saved base under torchrun, sharded over its ``WORLD_SIZE`` ranks by transformers'
    ``DistributedConfig(tp_size=WORLD_SIZE, **parallel)`` (``ep_size``: expert parallelism; ``tp_plan``:
    an override, ``{}`` for none); a transformers without ``DistributedConfig`` gets ``tp_plan="auto"``."""
    import transformers as tf

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # feature, not version: older releases took tp_plan as an argument
        if parallel:
            raise
        return tf.AutoModelForCausalLM.from_pretrained(str(base), tp_plan="auto", dtype=torch.float32).eval()
    config = DistributedConfig(tp_size=int(os.environ["WORLD_SIZE"]), **(parallel or {}))
    return tf.AutoModelForCausalLM.from_pretrained(str(base), distributed_config=config, dtype=torch.float32).eval()


def sample_ids(*, batch: int = 2, seq: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits(model: Any, ids: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(sample_ids() if ids is None else ids).logits
