"""Base models' module shapes, as ``Store.register_base`` takes them, from a model or its config.

A registered base maps every module an adapter may target to ``[in, out]`` (a dense
``nn.Linear``), ``[in, out, 1]`` (the same linear's ``M.weight`` through PEFT's
``target_parameters``) or ``[in, out, experts]`` (a fused-experts parameter such as
Qwen3-MoE's ``mlp.experts.gate_up_proj``): the canonical module names and in/out meaning of
:mod:`mint_store.peft.directory`. Publishing under a registered base checks every module of
the adapter against this table (:class:`~mint_store.errors.BaseMismatch` otherwise).

``shapes_from_config(DIR)`` builds the model of ``DIR/config.json`` on the meta device (no
weights are read or allocated: DeepSeek-V3's full config, 1,094 modules, takes half a second
once transformers is imported) and reads its shapes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import InvalidBaseConfig

# the 3-d parameters of transformers' fused-experts classes (Qwen3-MoE, DeepSeek-V3, Mixtral-style)
EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj")


def is_experts(module: nn.Module) -> bool:
    """A fused-experts module: a 3-d ``down_proj`` parameter next to ``gate_up_proj`` or ``up_proj``."""
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj", None)
    if up is None:
        up = getattr(module, "up_proj", None)
    return (
        isinstance(down, nn.Parameter) and down.dim() == 3 and isinstance(up, nn.Parameter) and up.dim() == 3
    )


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Every LoRA target of ``model``: ``{module: [in, out]}``, ``[in, out, 1]``, ``[in, out, experts]``."""
    out: dict[str, list[int]] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            out[path] = [mod.in_features, mod.out_features]
            out[f"{path}.weight"] = [mod.in_features, mod.out_features, 1]
        elif is_experts(mod):
            transposed = bool(getattr(mod, "is_transposed", False))
            for p in EXPERT_PARAMS:
                w = getattr(mod, p, None)
                if isinstance(w, nn.Parameter) and w.dim() == 3:
                    e, d1, d2 = (int(x) for x in w.shape)
                    i, o = (d1, d2) if transposed else (d2, d1)
                    out[f"{path}.{p}"] = [i, o, e]
    return out


def shapes_from_config(config_dir: str | os.PathLike[str]) -> dict[str, list[int]]:
    """Module shapes of the causal LM that ``config_dir/config.json`` describes.

    Parameters
    ----------
    config_dir
        A directory holding a transformers ``config.json`` (a model checkout or a copy of
        its config alone; weights, if present, are not read).

    Raises
    ------
    InvalidBaseConfig
        No such directory or ``config.json``, invalid JSON, or a model type this
        transformers cannot build as a causal LM.
    """
    d = Path(config_dir)
    if not d.is_dir():
        raise InvalidBaseConfig(f"{str(d)!r} does not exist or is not a directory; --config takes the "
                                "directory that holds the base model's config.json")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise InvalidBaseConfig(f"{str(d)!r} has no config.json (the base model's transformers config)")
    try:
        json.loads(cfg_file.read_text())
    except (ValueError, OSError) as e:
        raise InvalidBaseConfig(f"{cfg_file}: not readable JSON ({e})") from None
    return model_shapes(_meta_model(d))


def _meta_model(d: Path) -> Any:
    """The model of ``d``'s config with every tensor on the meta device (shapes only)."""
    try:
        import torch
        import transformers as tf
    except ImportError as e:  # the `hf` extra
        raise InvalidBaseConfig(f"reading a base config needs transformers: pip install 'mint-store[hf]' ({e})") from e
    try:
        config = tf.AutoConfig.from_pretrained(str(d), local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise InvalidBaseConfig(f"{d / 'config.json'}: transformers cannot read it: {e}") from None
    try:
        with torch.device("meta"):
            return tf.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidBaseConfig(
            f"{d / 'config.json'}: transformers {tf.__version__} builds no causal LM from model_type "
            f"{getattr(config, 'model_type', '?')!r}: {e}"
        ) from None
