"""Helpers of the training tests: PEFT as the reference, a toy model small enough to learn on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mint_store.format.adapter import Adapter
from mint_store.peft.directory import load_peft_dir
from tests.support.hf_models import build_model, peft_model

TOY_VOCAB = 16


def peft_reference(kind: str, lora: dict[str, Any], ids: torch.Tensor, labels: torch.Tensor, tmp: Path,
                   *, seed: int = 3) -> tuple[Adapter, Adapter]:
    """(the adapter, its gradient) of PEFT training it alone: ``model(ids, labels=labels).loss.backward()``.

    Both come back through ``save_pretrained`` + ``load_peft_dir``, so PEFT's own layout
    (``[r*E, in]`` / ``[out, r*E]`` for experts) is converted by the tested import path: the
    gradient is saved by writing each LoRA parameter's ``.grad`` into it.
    """
    pm = peft_model(build_model(kind), seed=seed, **lora)
    pm.save_pretrained(str(tmp / "weights"))
    pm(input_ids=ids, labels=labels).loss.backward()
    with torch.no_grad():
        for _, p in pm.named_parameters():
            if p.requires_grad:
                p.copy_(p.grad)
    pm.save_pretrained(str(tmp / "grads"))
    return load_peft_dir(tmp / "weights"), load_peft_dir(tmp / "grads")


def relative_diffs(mine: dict[str, tuple[Any, Any]], want: Adapter) -> dict[str, float]:
    """``||g - g_ref|| / ||g_ref||`` per tensor (``<module>.A`` / ``<module>.B``)."""
    out = {}
    assert set(mine) == {m.name for m in want.modules}
    for m in want.modules:
        ga, gb = mine[m.name]
        for tag, got, ref in (("A", ga, m.a), ("B", gb, m.b)):
            assert got is not None and got.shape == ref.shape, (m.name, tag)
            out[f"{m.name}.{tag}"] = ((got - ref).norm() / ref.norm()).item()
    return out


def toy_model(seed: int = 0) -> Any:
    """A tiny random llama with a 16-token vocabulary and no EOS (fixed-length completions)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=TOY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def same_adapter(a: Adapter, b: Adapter) -> bool:
    """Bit-for-bit: names, scalings, shapes, dtypes and every value."""
    return len(a.modules) == len(b.modules) and all(
        x.name == y.name and x.scaling == y.scaling and x.a.dtype == y.a.dtype
        and torch.equal(x.a, y.a) and torch.equal(x.b, y.b)
        for x, y in zip(a.modules, b.modules, strict=True)
    )
