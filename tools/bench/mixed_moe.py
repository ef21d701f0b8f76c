"""Mixed-adapter batches on an MoE base: LoRA on attention and on the fused experts.

The MoE rows of ``tools/bench_batch.py --part peer`` (see :mod:`.mixed_bench`): a random
Qwen3-MoE base (every layer sparse, ``experts`` experts, top-``top_k``), rank-r LoRA on
q/v/o and on the experts' ``gate_up_proj`` and ``down_proj``, N sequences each with its own
adapter. PEFT has no mixed batch for expert parameters (``lora.ParamWrapper does not support
mixed adapter batches``), so the rows time the base and the engine only; the engine's
logits are checked against PEFT running the first and last sequence's adapter alone. The
floor reads every adapter's bytes once and does the FLOPs of the ``top_k`` experts each
token is routed to; its unfused bound adds the activations of q, v, o once per token and of
each expert module once per routed expert (``top_k`` per token).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import torch

from mint_store.format.adapter import make_adapter
from mint_store.peft.directory import save_peft_dir

from .mixed_bench import DENSE_TARGETS, MixedBenchConfig, _line, inputs, measure, publish, roofline
from .mixed_rounds import ratios

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def build_moe_base(cfg: MixedBenchConfig) -> Any:
    import transformers as tf

    heads = max(1, cfg.hidden // 64)
    config = tf.Qwen3MoeConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate, num_hidden_layers=cfg.layers,
        num_attention_heads=heads, num_key_value_heads=heads,
        moe_intermediate_size=cfg.moe_intermediate, num_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4 * cfg.tokens + 8,
        tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tf.Qwen3MoeForCausalLM(config).eval().to(cfg.device)


def moe_factors(model: Any, cfg: MixedBenchConfig, n: int) -> list[dict[str, tuple[Any, Any, float]]]:
    """``n`` random adapters: [r, in] / [out, r] on q, v, o; [E, r, in] / [E, out, r] on the experts."""
    g = torch.Generator().manual_seed(1)
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for path, mod in model.named_modules():
        if path.rsplit(".", 1)[-1] in DENSE_TARGETS and hasattr(mod, "in_features"):
            shapes.append((path, (cfg.rank, mod.in_features), (mod.out_features, cfg.rank)))
        elif path.endswith("mlp.experts"):
            for p in EXPERT_PARAMS:
                w = getattr(mod, p)  # [E, out, in] (or [E, in, out] when transposed)
                e, o, i = (w.shape[0], w.shape[2], w.shape[1]) if getattr(mod, "is_transposed", False) else w.shape
                shapes.append((f"{path}.{p}", (e, cfg.rank, i), (e, o, cfg.rank)))
    factors: list[dict[str, tuple[Any, Any, float]]] = [{} for _ in range(n)]
    for name, sa, sb in shapes:
        for f in factors:
            f[name] = (torch.randn(sa, generator=g) / sa[-1] ** 0.5, torch.randn(sb, generator=g) * 0.02, 2.0)
    return factors


def moe_floor(cfg: MixedBenchConfig, factors: dict[str, tuple[Any, Any, float]], n: int, new_tokens: int,
              machine: dict[str, float], routed: float = 1.0) -> dict[str, Any]:
    """Each adapter's bytes that the step must read, once; per token, the FLOPs of q, v, o and its
    ``top_k`` experts.

    ``routed`` is the fraction of (sequence, expert) pairs the router sends at least one token to
    (:func:`routed_fraction`): an expert no token of a sequence reaches needs none of that
    sequence's adapter weights for it (a decode step of one token reads ``top_k`` of ``E``).
    """
    dense = sum(a.numel() + b.numel() for a, b, _ in factors.values() if a.dim() == 2)
    experts = sum(a.numel() + b.numel() for a, b, _ in factors.values() if a.dim() == 3)
    per_token = sum((a.numel() + b.numel()) * (cfg.top_k / a.shape[0] if a.dim() == 3 else 1)
                    for a, b, _ in factors.values())
    # a LoRA in passes of its own: per token, x read and y read and rewritten by each module (q, v, o
    # once; each expert module once per routed expert, top_k of them)
    act = n * new_tokens * 4 * sum((a.shape[-1] + 2 * b.shape[-2]) * (cfg.top_k if a.dim() == 3 else 1)
                                   for a, b, _ in factors.values())
    return {"routed_fraction": routed,
            **roofline(int(n * (dense + experts * routed) * 4), 2 * n * new_tokens * per_token, act, machine)}


def routed_fraction(model: Any, run: Any, n: int) -> float:
    """The fraction of (sequence, expert) pairs, over every MoE layer, that ``run()`` (a forward of
    ``n`` sequences through ``model``) routes at least one token to: read off the routers' choice
    (the ``top_k_index`` each fused-experts module is called with)."""
    hit = total = 0

    def count(_mod: Any, args: tuple[Any, ...]) -> None:
        nonlocal hit, total
        idx = args[1]  # [tokens, top_k]: the experts of each token, tokens batch-major
        n_exp = int(_mod.num_experts)
        seq = torch.arange(idx.shape[0]).repeat_interleave(idx.shape[1]) // (idx.shape[0] // n)
        hit += int(torch.unique(seq * n_exp + idx.reshape(-1)).numel())
        total += n * n_exp

    handles = [m.register_forward_pre_hook(count) for p, m in model.named_modules() if p.endswith("mlp.experts")]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    if not total:
        raise ValueError("no fused-experts module ran: not an MoE model")
    return hit / total


def bench_moe_count(cfg: MixedBenchConfig, base: Any, n: int, root: Path,
                    machine: dict[str, float]) -> list[dict[str, Any]]:
    from engine_client import LoRAEngine, MintClient

    factors = moe_factors(base, cfg, n)
    refs, row_bytes = publish(factors, root / f"moe{n}")
    client = MintClient(str(root / f"moe{n}" / "store"), index_dir=str(root / f"moe{n}" / "index"))
    out = []
    with LoRAEngine(copy.deepcopy(base), client, device=cfg.device, slots=n + 1,
                    host_bytes=2 * n * row_bytes + (64 << 20)) as engine, torch.inference_mode():
        engine.forward(inputs(cfg, 1, "prefill")["input_ids"].expand(n, -1), adapters=refs)  # all resident
        variants = {"base": base, "engine": lambda **kw: engine.forward(adapters=refs, **kw)}
        diff = _check_against_peft(base, factors, variants["engine"], inputs(cfg, n, "ragged"), root)
        for shape in cfg.shapes:
            row = {"family": "moe", "n": n, "shape": shape, "tokens": cfg.tokens, "max_logit_diff": diff,
                   "peft_skipped": "PEFT has no mixed adapter batch for expert parameters (ParamWrapper)",
                   **moe_floor(cfg, factors[0], n, 1 if shape == "decode" else cfg.tokens, machine,
                               _routed(base, inputs(cfg, n, shape), n, decode=shape == "decode"))}
            row |= measure(cfg, variants, inputs(cfg, n, shape), decode=shape == "decode")
            row |= ratios(row)
            print("moe " + _line(row), flush=True)
            out.append(row)
    return out


def _routed(base: Any, kw: dict[str, Any], n: int, *, decode: bool) -> float:
    """:func:`routed_fraction` of the step the rows time: the prompt, or one decode step after it."""
    if not decode:
        return routed_fraction(base, lambda: base(**kw), n)
    cache = base(**kw, use_cache=True).past_key_values
    return routed_fraction(base, lambda: base(input_ids=kw["input_ids"][:, -1:], past_key_values=cache), n)


def _check_against_peft(base: Any, factors: list[dict[str, tuple[Any, Any, float]]], engine: Any,
                        kw: dict[str, Any], root: Path) -> float:
    """Max |logit difference| of the engine's first and last sequence against PEFT with that adapter alone."""
    from peft import PeftModel

    got = engine(**kw).logits
    diff = 0.0
    for i in sorted({0, len(factors) - 1}):
        d = save_peft_dir(make_adapter(factors[i]), Path(tempfile.mkdtemp(dir=root)))
        pm = PeftModel.from_pretrained(copy.deepcopy(base), str(d)).eval()
        want = pm(**{k: v[i : i + 1] for k, v in kw.items()}).logits
        diff = max(diff, float((want[0] - got[i]).abs().max()))
    return diff
