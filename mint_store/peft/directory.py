"""PEFT LoRA directories (``adapter_config.json`` + ``adapter_model.safetensors``) <-> Adapter.

Import is strict: every tensor must be a LoRA weight the config accounts for, every config
target must have tensors, and any PEFT feature that changes the math beyond
``y += scaling * B @ A @ x`` is refused with :class:`UnsupportedAdapter` instead of being
dropped. PEFT and transformers are not imported here: only torch and safetensors.

Canonical modules
-----------------
Names are the module's path in the base model, PEFT's ``base_model.model.`` prefix
stripped (``model.layers.0.self_attn.q_proj``). Dense LoRA (``target_modules``) keeps
PEFT's own layout: ``A [r, in]``, ``B [out, r]``, and the engine computes
``y = x @ W.T + scaling * (x @ A.T) @ B.T``.

Fused MoE experts (``target_parameters``, e.g. transformers 5.x Qwen3-MoE
``model.layers.N.mlp.experts.gate_up_proj [E, 2*I, H]`` and ``down_proj [E, H, I]``)
become one module named by the parameter's path, with ``A [E, r, in]`` and
``B [E, out, r]``, where ``in``/``out`` are the per-expert input/output features of the
expert's matmul, whatever the storage order of the parameter:

* ``gate_up_proj [E, 2*I, H]``: in = H (hidden), out = 2*I (the parameter's row order,
  i.e. gate rows then up rows for Qwen3-MoE). Expert e computes
  ``x @ (W_e + scaling * B_e @ A_e).T`` with ``W_e = gate_up_proj[e]``.
* ``down_proj [E, H, I]``: in = I (intermediate), out = H.
* a parameter stored transposed (``[E, in, out]``, transformers' ``is_transposed``
  experts such as gpt-oss) keeps the same in/out meaning: its delta is
  ``(scaling * B_e @ A_e).T``.

How PEFT 0.21 stores these (peft/tuners/lora/layer.py, class ParamWrapper): for a 3-d
parameter ``[E, d1, d2]`` it reads ``in, out = d1, d2`` (line 2398) and swaps them unless
the experts are ``is_transposed`` (lines 2437-2440), so in/out are the matmul's features
as above. ``lora_A`` is ``Linear(in, r*E)`` -> weight ``[r*E, in]`` and ``lora_B`` is
``Linear(r*E, out)`` -> weight ``[out, r*E]`` (lines 2455-2456). Per expert it uses
``A.reshape(E, r, in)`` (expert-major rows) but ``B.reshape(out, r, E).permute(2, 0, 1)``
(rank-major columns: expert e, rank k is column ``k*E + e``), lines 2534-2535 and
2552-2560. Scaling is ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA) with the per-expert r.

Several parameters of one module are nested ParamWrappers, innermost = first registered
parameter; PEFT saves the outer one as ``experts.lora_A.weight`` and the inner ones as
``experts.base_layer.lora_A.weight`` (one ``base_layer`` per level). A file does not say
which parameter is which, so we rely on the registration order of transformers' expert
classes (gate_up_proj, gate_proj, up_proj before down_proj; ``peft_config._PARAM_ORDER``)
and check that the shapes chain like an MLP; other names, several per module, are refused.

A 2-d parameter targeted with ``target_parameters`` (``self_attn.q_proj.weight``) is
stored the same way with E = 1: ``M.weight`` with ``A [1, r, in]``, ``B [1, out, r]``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidAdapter, UnsupportedAdapter
from ..format.adapter import UNSPECIFIED_BASE, Adapter, AdapterLimits, LoraModule, make_adapter
from .adapter_config import (
    CONFIG_NAME,
    LoraSettings,
    module_targeted,
    order_parameters,
    parse_config,
    targeted_parameters,
)
from .patterns import MAX_TENSOR_NAME_CHARS, check_module_path, dot_suffixes
from .safetensors_check import MAX_HEADER_BYTES, read_safetensors

TENSORS_PER_MODULE = 4  # lora_A, lora_B (weight and bias) and DoRA's magnitude: the most one module holds

WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_WRAP = ".base_layer"
_PARTS = {".lora_A.weight": "lora_A", ".lora_B.weight": "lora_B"}


# ---------------------------------------------------------------- tensors -> modules


@dataclass(frozen=True, slots=True)
class _Key:
    path: str  # module path, base_layer levels removed
    depth: int  # number of ParamWrapper levels inside the outermost one
    part: str  # "lora_A" | "lora_B"


_REFUSED_KEYS = (
    ("lora_embedding_", "embedding LoRA (lora_embedding_A/B) is not supported; target linear layers only"),
    ("lora_magnitude_vector", "DoRA magnitude vectors are not supported; use plain LoRA (use_dora=false)"),
    ("trainable_tokens_", "trainable token deltas are not supported (trainable_token_indices)"),
    ("modules_to_save", "modules_to_save copies of whole modules are not supported"),
)


def refuse_keys(keys: Iterable[str]) -> None:
    """Name the most specific refused feature among all keys before judging any one key."""
    keys = list(keys)
    for marker, why in _REFUSED_KEYS:
        for key in keys:
            if marker in key:
                raise UnsupportedAdapter(f"tensor {key!r}: {why}")
    for key in keys:
        if key.endswith((".lora_A.bias", ".lora_B.bias")):
            raise UnsupportedAdapter(f"tensor {key!r}: LoRA biases (lora_bias=true) are not supported")


def parse_key(key: str) -> _Key:
    """Map one safetensors key to its LoRA factor, refusing everything that is not one.

    ``[base_model.model.]<path>(.base_layer)*.lora_A|lora_B.weight`` taken apart with string
    operations (linear in the key; a regex with a lazy path backtracked quadratically):
    the shortest non-empty path, so as many ``.base_layer`` levels as the key ends with.
    """
    if len(key) > MAX_TENSOR_NAME_CHARS:
        raise InvalidAdapter(
            f"tensor name of {len(key)} characters is over the limit of {MAX_TENSOR_NAME_CHARS}: "
            f"{key[:100]!r}...; module paths are at most 32 parts of 128 characters"
        )
    part = _PARTS.get(key[-len(".lora_A.weight") :])
    if part is not None:
        rest = key[: -len(".lora_A.weight")]
        if rest.startswith(PEFT_PREFIX) and len(rest) > len(PEFT_PREFIX):
            rest = rest[len(PEFT_PREFIX) :]
        depth = 0
        while rest.endswith(_WRAP) and len(rest) > len(_WRAP):
            rest, depth = rest[: -len(_WRAP)], depth + 1
        if rest:
            return _Key(check_module_path(rest, f"tensor {key[:200]!r}: module"), depth, part)
    if key.endswith(".bias"):
        raise UnsupportedAdapter(
            f"tensor {key!r}: trained base biases (bias='all' or 'lora_only') are not supported; "
            "train with bias='none'"
        )
    if key.endswith(".weight"):
        raise UnsupportedAdapter(
            f"tensor {key!r}: full weights of a base module (PEFT saves these for resized embeddings "
            "and modules_to_save) are not supported; only LoRA factors can be stored"
        )
    raise UnsupportedAdapter(
        f"tensor {key!r} is not a PEFT LoRA weight (expected '<module>.lora_A.weight' or "
        "'<module>.lora_B.weight'); refusing rather than dropping it"
    )


def peft_modules(tensors: Mapping[str, torch.Tensor], s: LoraSettings) -> list[LoraModule]:
    """Canonical modules of a PEFT state dict (unvalidated values: pass them to make_adapter)."""
    refuse_keys(tensors)
    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = defaultdict(dict)
    for key, t in tensors.items():
        k = parse_key(key)
        slot = pairs[(k.path, k.depth)]
        if k.part in slot:
            raise InvalidAdapter(f"tensor {key!r}: a second {k.part} for module {k.path!r}")
        slot[k.part] = t
    out: list[LoraModule] = []
    depths: dict[str, set[int]] = defaultdict(set)
    for (path, depth), slot in pairs.items():
        a, b = _factors(path, slot)
        params = targeted_parameters(s, path)
        if params:
            if depth >= len(params):
                raise InvalidAdapter(_uncovered(path + ".base_layer" * depth))
            depths[path].add(depth)
            out.append(_expert_module(f"{path}.{params[len(params) - 1 - depth]}", a, b, s))
        elif depth == 0 and module_targeted(s, path):
            out.append(_dense_module(path, a, b, s))
        else:
            raise InvalidAdapter(_uncovered(path + ".base_layer" * depth))
    for path, seen in depths.items():
        params = targeted_parameters(s, path)
        missing = [params[len(params) - 1 - d] for d in range(len(params)) if d not in seen]
        if missing:
            raise InvalidAdapter(
                f"target_parameters select {[f'{path}.{p}' for p in missing]} but the file has no LoRA "
                "tensors for them"
            )
        _check_nesting(path, params, out)
    _check_targets_present(s, out)
    return out


def _uncovered(path: str) -> str:
    return (
        f"the file has LoRA tensors for {path!r} but the config's target_modules/target_parameters "
        "do not select it; the config and the weights do not belong together"
    )


def _factors(path: str, slot: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if "lora_A" not in slot or "lora_B" not in slot:
        have, lack = ("lora_A", "lora_B") if "lora_A" in slot else ("lora_B", "lora_A")
        raise InvalidAdapter(f"module {path!r} has {have} but no {lack}; every LoRA module needs both")
    a, b = slot["lora_A"], slot["lora_B"]
    if a.dim() != 2 or b.dim() != 2:
        raise UnsupportedAdapter(
            f"module {path!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not matrices; "
            "convolution LoRA is not supported, only linear layers"
        )
    return a, b


def _dense_module(name: str, a: torch.Tensor, b: torch.Tensor, s: LoraSettings) -> LoraModule:
    r = s.rank_of(name)
    if a.shape[0] != r or b.shape[1] != r:
        raise InvalidAdapter(
            f"module {name!r}: the config gives rank {r} (r / rank_pattern) but lora_A is "
            f"{tuple(a.shape)} and lora_B {tuple(b.shape)}; expected [{r}, in] and [out, {r}]"
        )
    return LoraModule(name, a, b, s.scaling_of(name))


def _expert_module(name: str, a: torch.Tensor, b: torch.Tensor, s: LoraSettings) -> LoraModule:
    r = s.rank_of(name)
    rows, cols = a.shape[0], b.shape[1]
    if rows != cols or rows % r:
        raise InvalidAdapter(
            f"parameter {name!r}: the config gives rank {r} but lora_A is {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}; expected [r*experts, in] and [out, r*experts] with r={r}"
        )
    e = rows // r
    a3 = a.reshape(e, r, a.shape[1])
    # PEFT's B columns are rank-major (column k*E + e), see the module docstring
    b3 = b.reshape(b.shape[0], r, e).permute(2, 0, 1).contiguous()
    return LoraModule(name, a3, b3, s.scaling_of(name))


def _check_nesting(path: str, params: tuple[str, ...], mods: list[LoraModule]) -> None:
    """The nesting order is assumed, not stored: check the shapes chain like an MLP would."""
    if "down_proj" not in params or len(params) < 2:
        return
    by = {m.name: m for m in mods}
    down = by[f"{path}.down_proj"]
    for p in params:
        if p != "down_proj" and by[f"{path}.{p}"].a.shape[-1] != down.b.shape[-2]:
            raise InvalidAdapter(
                f"module {path!r}: {p} has input size {by[f'{path}.{p}'].a.shape[-1]} but down_proj "
                f"outputs {down.b.shape[-2]}; the parameters are not nested in the order "
                f"{list(params)} this store assumes"
            )


def _check_targets_present(s: LoraSettings, mods: list[LoraModule]) -> None:
    # every name each module answers to (itself and its dotted suffixes): one set lookup per target
    dense = {x for m in mods if m.a.dim() == 2 for x in dot_suffixes(m.name)}
    params = {x for m in mods if m.a.dim() == 3 for x in dot_suffixes(m.name)}
    if isinstance(s.target_modules, tuple):
        for t in s.target_modules:
            if t not in dense:
                raise InvalidAdapter(
                    f"target_modules names {t!r} but the file has no LoRA tensors for any such module"
                )
    for t in s.target_parameters:
        if t not in params:
            raise InvalidAdapter(f"target_parameters names {t!r} but the file has no LoRA tensors for it")


# ---------------------------------------------------------------- public: import


def load_peft_files(
    config: bytes | str | Mapping[str, Any],
    weights: str | os.PathLike[str] | bytes | bytearray | memoryview,
    *,
    base: str = UNSPECIFIED_BASE,
    limits: AdapterLimits | None = None,
) -> Adapter:
    """Import a PEFT LoRA adapter from its config (JSON bytes or dict) and safetensors (path or bytes)."""
    cfg, settings = parse_config(config)
    limits = limits or AdapterLimits()
    tensors = read_safetensors(weights, max_file_bytes=limits.max_row_bytes + MAX_HEADER_BYTES + 8,
                               max_tensors=TENSORS_PER_MODULE * limits.max_modules + 16)
    return make_adapter(peft_modules(tensors, settings), base=base, peft_config=cfg, limits=limits)


def check_peft_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path; InvalidAdapter saying whether it is missing or not a directory."""
    d = Path(path)
    if not d.exists():
        raise InvalidAdapter(f"{str(d)!r} does not exist; pass the folder PEFT's save_pretrained wrote")
    if not d.is_dir():
        raise InvalidAdapter(f"{str(d)!r} is not a directory; pass the folder PEFT's save_pretrained wrote")
    return d


def load_peft_dir(
    path: str | os.PathLike[str], *, base: str = UNSPECIFIED_BASE, limits: AdapterLimits | None = None
) -> Adapter:
    """Import a directory written by PEFT's ``save_pretrained``."""
    d = check_peft_dir(path)
    weights = d / WEIGHTS_NAME
    if not weights.is_file():
        if (d / "adapter_model.bin").exists():
            raise UnsupportedAdapter(
                f"{str(d)!r} holds adapter_model.bin (pickle); save it with safe_serialization=True "
                f"to get {WEIGHTS_NAME}"
            )
        raise InvalidAdapter(f"{str(d)!r} has no {WEIGHTS_NAME}")
    try:
        config = (d / CONFIG_NAME).read_bytes()
    except OSError as e:
        raise InvalidAdapter(f"cannot read {CONFIG_NAME} in {str(d)!r}: {e.strerror}") from None
    return load_peft_files(config, weights, base=base, limits=limits)


# ---------------------------------------------------------------- public: export


def peft_state_dict(adapter: Adapter) -> dict[str, torch.Tensor]:
    """Tensors under the keys PEFT's save_pretrained uses (inverse of :func:`peft_modules`)."""
    out: dict[str, torch.Tensor] = {}
    nested: dict[str, set[str]] = defaultdict(set)
    for m in adapter.modules:
        if m.a.dim() == 3:
            path, _, param = m.name.rpartition(".")
            nested[path].add(param)
    for m in adapter.modules:
        if m.a.dim() == 2:
            out[f"{PEFT_PREFIX}{m.name}.lora_A.weight"] = m.a.contiguous()
            out[f"{PEFT_PREFIX}{m.name}.lora_B.weight"] = m.b.contiguous()
            continue
        path, _, param = m.name.rpartition(".")
        order = order_parameters(path, nested[path])
        key = PEFT_PREFIX + path + ".base_layer" * (len(order) - 1 - order.index(param))
        e, r, n_in = m.a.shape
        out[f"{key}.lora_A.weight"] = m.a.reshape(e * r, n_in).contiguous()
        out[f"{key}.lora_B.weight"] = m.b.permute(1, 2, 0).reshape(m.b.shape[1], r * e).contiguous()
    return out


def synthesize_config(adapter: Adapter) -> dict[str, Any]:
    """A LoraConfig reproducing the adapter's ranks and scalings (to float32 precision)."""
    mods = adapter.modules
    r0 = Counter(m.rank for m in mods).most_common(1)[0][0]
    # alpha = scaling * r is exact in float64 for float32 scalings, so peft's alpha / r gives them back
    alpha0 = Counter(m.scaling * m.rank for m in mods).most_common(1)[0][0]
    dense = [m.name for m in mods if m.experts is None]
    params = [m.name for m in mods if m.experts is not None]
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "r": r0,
        "lora_alpha": alpha0,
        "use_rslora": False,
        # full paths, matched exactly by peft; [] (not null) so peft adds no default targets
        "target_modules": dense,
        "target_parameters": params or None,
        "rank_pattern": {re.escape(m.name): m.rank for m in mods if m.rank != r0},
        "alpha_pattern": {re.escape(m.name): m.scaling * m.rank for m in mods if m.scaling * m.rank != alpha0},
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def peft_files(adapter: Adapter) -> tuple[bytes, bytes]:
    """``(adapter_config.json bytes, adapter_model.safetensors bytes)`` that PEFT loads.

    Reuses ``adapter.peft_config`` when present (exact scalings), else synthesises one. The
    result is re-imported and compared with the adapter before it is returned.
    """
    from safetensors.torch import save

    config, tensors = peft_export(adapter)
    return config, save(tensors, metadata={"format": "pt"})


def peft_export(adapter: Adapter) -> tuple[bytes, dict[str, torch.Tensor]]:
    """``(adapter_config.json bytes, checked state dict)``: :func:`peft_files` before the
    safetensors file is serialised (the service streams it instead of building it)."""
    config = adapter.peft_config if adapter.peft_config is not None else synthesize_config(adapter)
    _, settings = parse_config(config)
    tensors = peft_state_dict(adapter)
    _check_export(adapter, peft_modules(tensors, settings))
    # key order of the config is significant: rank_pattern/alpha_pattern match first-wins
    return json.dumps(config, indent=2).encode(), tensors


def save_peft_dir(adapter: Adapter, path: str | os.PathLike[str]) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``path`` (created if needed)."""
    config, weights = peft_files(adapter)
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    for name, data in ((CONFIG_NAME, config), (WEIGHTS_NAME, weights)):
        tmp = d / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, d / name)  # a reader never sees half a file
    return d


def _check_export(adapter: Adapter, back: list[LoraModule]) -> None:
    got = {m.name: m for m in back}
    for m in adapter.modules:
        g = got.pop(m.name, None)
        if g is None or g.a.shape != m.a.shape or g.b.shape != m.b.shape:
            raise InvalidAdapter(
                f"adapter.peft_config does not target module {m.name!r} with its shapes; "
                "drop peft_config to export with a synthesised config"
            )
        # the store keeps scalings as float32, peft recomputes them in float64
        if not math.isclose(g.scaling, m.scaling, rel_tol=2**-23, abs_tol=0.0):
            raise InvalidAdapter(
                f"adapter.peft_config gives module {m.name!r} scaling {g.scaling} but the adapter has "
                f"{m.scaling}; drop peft_config to export with a synthesised config"
            )
    if got:  # pragma: no cover -- peft_modules only returns modules built from the adapter's tensors
        raise InvalidAdapter(f"export produced unexpected modules {sorted(got)}")
