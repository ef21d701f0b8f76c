"""adapter_config.json: which LoraConfig fields we accept, and PEFT's targeting rules.

Everything here mirrors PEFT 0.21 without importing it: ``pattern_key`` is
``peft.utils.other.get_pattern_key``, ``module_targeted`` is
``peft.tuners.tuners_utils.check_target_module_exists``, and the scaling arithmetic is
``LoraLayer.update_layer``'s, so scalings computed here are bit-equal to PEFT's.
Patterns run on RE2 in bounded time (see :mod:`mint_store.peft.patterns`); names are looked
up, so targeting costs one lookup per module and name suffix, not modules x targets.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any

from ..errors import InvalidAdapter, LimitExceeded, UnsupportedAdapter
from ..format import strict_json
from .patterns import (
    MAX_LAYERS_PATTERNS,
    Budget,
    NameSet,
    PatternTable,
    check_module_path,
    compile_pattern,
    dot_suffixes,
)

CONFIG_NAME = "adapter_config.json"
MAX_CONFIG_BYTES = 64 * 2**20
MAX_CONFIG_RANK = 2**24  # r and rank_pattern values; AdapterLimits.max_rank is the usual limit
MAX_LAYER_INDEX = 2**31
_F32_MAX = 3.4028234663852886e38  # lora_alpha is stored as a float32 scaling: it must stay finite

# Registration order of fused expert parameters in transformers' expert classes; PEFT
# nests ParamWrappers in this order (innermost first).
_PARAM_ORDER = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
_EMBEDDING_NAMES = frozenset(
    {"embed_tokens", "wte", "wpe", "word_embeddings", "embed_in", "tok_embeddings", "embed_positions",
     "position_embeddings", "shared", "embeddings"}
)
_INIT_OK = (True, False, "gaussian", "eva", "orthogonal")

# Fields that never change what a loaded adapter computes (bookkeeping, training, init-only).
_INERT_FIELDS = frozenset(
    {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
     "lora_dropout", "fan_in_fan_out", "megatron_core", "qalora_group_size", "runtime_config", "loftq_config",
     "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying"}
)
_MATH_FIELDS = frozenset(
    {"peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules",
     "target_parameters", "exclude_modules", "layers_to_transform", "layers_pattern", "bias", "init_lora_weights"}
)
# Fields whose non-empty value is a feature we refuse, with the reason shown to the user.
_REFUSED_FIELDS = {
    "use_dora": "DoRA (use_dora) adds a magnitude vector that plain LoRA engines do not apply",
    "modules_to_save": "modules_to_save stores full copies of whole modules, not LoRA factors",
    "trainable_token_indices": "trainable_token_indices edits embedding rows, not LoRA factors",
    "megatron_config": "megatron_config (Megatron parallel LoRA layers) is not supported",
    "velora_config": "VeLoRA (velora_config) is a LoRA variant the engine does not implement",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) changes which tokens use the adapter",
    "use_qalora": "QA-LoRA (use_qalora) pools inputs before lora_A",
    "monteclora_config": "MonteCLoRA (monteclora_config) is a LoRA variant the engine does not implement",
    "layer_replication": "layer_replication duplicates base layers, so module paths do not match the base",
    "lora_bias": "lora_bias adds a bias to lora_B that the engine does not apply",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is a LoRA variant the engine does not implement",
    "arrow_config": "Arrow routing (arrow_config) mixes several adapters per token",
    "kasa_config": "KaSA (kasa_config) rewrites the base weights and adds a singular-value vector",
}


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The part of a LoraConfig that decides which modules exist and how they scale."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: str | tuple[str, ...] | None
    target_parameters: tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    match: Matcher = dc_field(compare=False, repr=False)

    def rank_of(self, key: str) -> int:
        got = self.match.rank.first(key)
        return self.r if got is None else self.rank_pattern[got]

    def scaling_of(self, key: str) -> float:
        # same float arithmetic as peft LoraLayer.update_layer, so stored scalings are bit-equal
        r = self.rank_of(key)
        got = self.match.alpha.first(key)
        alpha = self.alpha if got is None else self.alpha_pattern[got]
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


class Matcher:
    """The config's targeting rules compiled once: RE2 for patterns, sets for names, one budget."""

    def __init__(self, cfg: dict[str, Any], targets: str | tuple[str, ...] | None,
                 exclude: str | tuple[str, ...] | None, layers_pattern: tuple[str, ...] | None,
                 params: tuple[str, ...]) -> None:
        self.budget = Budget()
        self.all_linear = isinstance(targets, str) and targets.lower() == "all-linear"
        self.target = _names_or_regex(None if self.all_linear else targets, "target_modules")
        self.exclude = _names_or_regex(exclude, "exclude_modules")
        if layers_pattern is not None and len(layers_pattern) > MAX_LAYERS_PATTERNS:
            raise LimitExceeded(f"layers_pattern has {len(layers_pattern)} entries, over the limit of "
                                f"{MAX_LAYERS_PATTERNS}")
        self.layers = [compile_pattern(p, rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", "layers_pattern")
                       for p in layers_pattern or ()]
        self.rank = PatternTable(_patterns(cfg, "rank_pattern"), "rank_pattern", self.budget)
        self.alpha = PatternTable(_patterns(cfg, "alpha_pattern"), "alpha_pattern", self.budget)
        # target_parameters by the path before their last dot (None: no dot, any module)
        self.params: dict[str | None, set[str]] = defaultdict(set)
        for e in params:
            prefix, dot, leaf = e.rpartition(".")
            self.params[prefix if dot else None].add(leaf)

    def fullmatch(self, rx: Any, key: str) -> bool:
        return self.budget.match(rx, key, full=True) is not None


def _names_or_regex(v: str | tuple[str, ...] | None, what: str) -> Any:
    if v is None:
        return None
    return compile_pattern(v, None, what) if isinstance(v, str) else NameSet(v)


_DEFAULT_LAYER_RE = compile_pattern(r".*?\.[^.]*\.(?P<idx>\d+)\.", None, "the default layer pattern")


def pattern_key(patterns: Mapping[str, Any], key: str) -> str:
    """peft.utils.other.get_pattern_key: the first pattern matching a dotted suffix of ``key``."""
    got = PatternTable(patterns, "patterns", Budget()).first(check_module_path(key))
    return key if got is None else got


# ---------------------------------------------------------------- config


def parse_config(config: bytes | str | Mapping[str, Any]) -> tuple[dict[str, Any], LoraSettings]:
    """Validate ``adapter_config.json`` (bytes or dict); return (JSON-clean copy, settings)."""
    cfg = _config_dict(config)
    _refuse_features(cfg)
    return cfg, _settings(cfg)


def _config_dict(config: bytes | str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        try:
            config = json.dumps(dict(config))
        except (TypeError, ValueError, RecursionError) as e:
            raise InvalidAdapter(f"peft config is not JSON-serialisable: {e}") from None
    if len(config) > MAX_CONFIG_BYTES:
        raise LimitExceeded(f"{CONFIG_NAME} is {len(config)} bytes, over the limit of {MAX_CONFIG_BYTES}")
    try:
        cfg = strict_json.loads(config)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidAdapter(f"{CONFIG_NAME} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise InvalidAdapter(f"{CONFIG_NAME} must be a JSON object (a saved PEFT LoraConfig)")
    return cfg


def _refuse_features(cfg: dict[str, Any]) -> None:
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise UnsupportedAdapter(
            f"peft_type {peft_type!r} is not supported: only LoRA adapters (peft_type 'LORA') can be stored"
        )
    for field, why in _REFUSED_FIELDS.items():
        if cfg.get(field):
            raise UnsupportedAdapter(f"{why} ({field}={cfg[field]!r}); retrain or convert to plain LoRA")
    init = cfg.get("init_lora_weights", True)
    if not any(init is ok or (isinstance(ok, str) and init == ok) for ok in _INIT_OK):
        raise UnsupportedAdapter(
            f"init_lora_weights={init!r} rewrites the base weights or changes the LoRA math when the "
            "adapter is loaded; convert it to plain LoRA first (PEFT: save_pretrained with "
            "path_initial_model_for_weight_conversion) and set init_lora_weights=true"
        )
    if cfg.get("bias", "none") not in ("none", "all", "lora_only"):
        raise InvalidAdapter(f"bias={cfg['bias']!r} is not a PEFT bias mode ('none', 'all', 'lora_only')")
    for field, value in cfg.items():
        if field in _INERT_FIELDS or field in _MATH_FIELDS or field in _REFUSED_FIELDS or not value:
            continue
        raise UnsupportedAdapter(
            f"{CONFIG_NAME} field {field}={value!r} is unknown to this store (newer PEFT?); refusing "
            "rather than ignoring something that may change the math"
        )


def _settings(cfg: dict[str, Any]) -> LoraSettings:
    targets = _name_or_list(cfg, "target_modules")
    params = _name_list(cfg, "target_parameters") or ()
    if not targets and not params:
        raise InvalidAdapter(f"{CONFIG_NAME} has neither target_modules nor target_parameters")
    for name in (targets if isinstance(targets, tuple) else ()) + params:
        if name.rpartition(".")[2] in _EMBEDDING_NAMES:
            raise UnsupportedAdapter(
                f"target {name!r} is an embedding: embedding LoRA is not supported; target linear layers only"
            )
    exclude = _name_or_list(cfg, "exclude_modules")
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (_is_layer(layers) or (isinstance(layers, list) and all(map(_is_layer, layers)))):
        raise InvalidAdapter(
            f"layers_to_transform must be a layer index (0..{MAX_LAYER_INDEX - 1}) or a list of them, "
            f"got {str(layers)[:200]}"
        )
    pattern = _name_or_list(cfg, "layers_pattern")
    # peft treats "" like no layers_pattern at all (its default layer regex)
    layers_pattern = ((pattern,) if pattern else None) if isinstance(pattern, str) else pattern
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise InvalidAdapter(f"use_rslora must be true or false, got {use_rslora!r}")
    rank_pattern = {k: _rank(v, f"rank_pattern[{k[:200]!r}]") for k, v in _patterns(cfg, "rank_pattern").items()}
    alpha_pattern = {k: _alpha(v, f"alpha_pattern[{k[:200]!r}]") for k, v in _patterns(cfg, "alpha_pattern").items()}
    return LoraSettings(
        r=_rank(cfg.get("r", 8), "r"),
        alpha=_alpha(cfg.get("lora_alpha", 8), "lora_alpha"),
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        target_modules=targets,
        target_parameters=params,
        exclude_modules=exclude,
        layers_to_transform=tuple(layers) if isinstance(layers, list) else layers,
        layers_pattern=layers_pattern,
        match=Matcher(cfg, targets, exclude, layers_pattern, params),
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_layer(x: Any) -> bool:
    return _is_int(x) and 0 <= x < MAX_LAYER_INDEX


def _rank(v: Any, what: str) -> int:
    if not _is_int(v) or not 1 <= v <= MAX_CONFIG_RANK:
        raise InvalidAdapter(f"{what} must be a positive integer rank (1..{MAX_CONFIG_RANK}), got {str(v)[:50]}")
    return int(v)


def _alpha(v: Any, what: str) -> float:
    # keep ints as ints: peft divides the JSON value as loaded, and int/int rounds once.
    # The scaling (alpha / r) is stored as float32: an alpha past float32's range (1e39) would
    # make it infinite, so the bound is float32's, not float64's.
    if not isinstance(v, int | float) or isinstance(v, bool) or not (math.isfinite(v) and abs(v) <= _F32_MAX):
        raise InvalidAdapter(
            f"{what} must be a finite number within float32 range (|x| <= {_F32_MAX:.4g}), got {str(v)[:50]}"
        )
    return v


def _name_or_list(cfg: dict[str, Any], field: str) -> str | tuple[str, ...] | None:
    v = cfg.get(field)
    return v if isinstance(v, str) else _name_list(cfg, field, kinds="a string or a list of names")


def _name_list(cfg: dict[str, Any], field: str, *, kinds: str = "a list of names") -> tuple[str, ...] | None:
    v = cfg.get(field)
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(x, str) and x for x in v):
        return tuple(v)
    raise InvalidAdapter(f"{field} must be {kinds}, got {v!r}")


def _patterns(cfg: dict[str, Any], field: str) -> dict[str, Any]:
    v = cfg.get(field) or {}
    if not isinstance(v, dict):
        raise InvalidAdapter(f"{field} must be an object {{pattern: value}}, got {str(v)[:200]}")
    return v


# ---------------------------------------------------------------- targeting (mirrors peft)


def module_targeted(s: LoraSettings, key: str) -> bool:
    """peft.tuners.tuners_utils.check_target_module_exists for a dense module path."""
    m = s.match
    check_module_path(key)
    if s.exclude_modules and (m.exclude.hit(key) if isinstance(m.exclude, NameSet) else m.fullmatch(m.exclude, key)):
        return False
    if s.target_modules is None:
        return False
    if isinstance(s.target_modules, str):
        return m.all_linear or m.fullmatch(m.target, key)
    if not m.target.hit(key):
        return False
    if key in m.target.names:
        return True  # named exactly: peft skips the layer filter
    layers = s.layers_to_transform
    if layers is None or layers == ():
        return True
    idx = _layer_index(m, key)
    if idx is None:
        return False
    return idx == layers if isinstance(layers, int) else idx in layers


def _layer_index(m: Matcher, key: str) -> int | None:
    for rx in m.layers or (_DEFAULT_LAYER_RE,):
        got = m.budget.match(rx, key)
        if got is not None:
            idx = got.group("idx")
            return None if idx is None else int(idx)
    return None


def targeted_parameters(s: LoraSettings, path: str) -> tuple[str, ...]:
    """Names of the parameters of module ``path`` that ``target_parameters`` selects, innermost first.

    ``e`` selects ``path.leaf`` when ``path.leaf == e`` or ends with ``"." + e``: by lookup of
    the part of ``e`` before its last dot among ``path``'s dotted suffixes.
    """
    params = s.match.params
    if not params:
        return ()
    # a bare name (no dot) selects a parameter of that name on any module, as PEFT's lookup
    # over the model's parameters does; a module target_modules selects is an nn.Linear, whose
    # parameters are weight and bias, so a bare name never selects one of its (PEFT's MoE
    # conversion writes target_modules ['q_proj', 'v_proj'], target_parameters ['down_proj',
    # 'gate_up_proj']). With all-linear the config does not say which modules are linear.
    bare = params.get(None, set())
    dense = bool(bare) and s.target_modules is not None and not s.match.all_linear and module_targeted(s, path)
    names = set() if dense else set(bare)
    for suffix in dot_suffixes(path):
        names |= params.get(suffix, set())
    return order_parameters(path, names)


def order_parameters(path: str, names: set[str]) -> tuple[str, ...]:
    if len(names) <= 1:
        return tuple(names)
    unknown = sorted(n for n in names if n not in _PARAM_ORDER)
    if unknown:
        raise UnsupportedAdapter(
            f"module {path!r}: several target_parameters ({sorted(names)}) on one module, including "
            f"{unknown} whose nesting order PEFT derives from the model class; only {list(_PARAM_ORDER)} "
            "are known. Target one parameter per module or convert the adapter to tensors"
        )
    return tuple(n for n in _PARAM_ORDER if n in names)
