"""A layout's rows as vLLM takes them, worked out once per layout and reused by every load.

A layout is immutable (its id is the hash of its table), so what a cold load derives from the
layout alone is the same for every adapter of that layout: the PEFT key of each tensor and
where it lies in the row, the config of a scalings vector, vLLM's module name of each key (its
``parse_fine_tuned_lora_name``, with the model's weights mapper) and vLLM's check that every
module is one the model takes. Derived on every load, for 16 layers x 7 modules (224 tensors)
that was about a third of the worker's load in ``tools/bench_vllm.py``. With a plan a load is:
the scalings read from the row, one strided view per tensor, and per module one
``LoRALayerWeights.from_config`` (vLLM's own rank and scaling) holding those views: what vLLM's
``LoRAModel.from_lora_tensors`` builds, with the names it parses parsed once.

Dense modules only. A layout with fused experts (MoE) goes the general way: its PEFT tensors
are reshaped copies (:func:`~mint_store.peft.directory.peft_state_dict`), and vLLM drops other
ranks' experts under expert parallelism. So does an adapter whose modules scale differently
(:func:`.resolver.for_vllm` folds its scalings into copies of B) and anything the plan does
not know (a ``modules_to_save`` name, a tensor vLLM would pair differently).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mint_store.format.adapter import Adapter
from mint_store.format.layout import DTYPES, SCALING, Layout, align
from mint_store.peft.directory import PEFT_PREFIX, synthesize_config

MAX_SCALINGS = 64  # scalings vectors a plan keeps a config for (adapters of one recipe share one)
MAX_MODELS = 16  # vLLM module tables a plan keeps (one per served model, in practice)


@dataclass(frozen=True, slots=True)
class _Tensor:
    key: str  # the PEFT name, as in adapter_model.safetensors
    dtype: torch.dtype
    offset: int  # in elements of dtype, from the row's start (offsets are aligned to 64 bytes)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Module:
    name: str  # vLLM's module name (after the weights mapper)
    peft_name: str  # the name rank and alpha patterns refer to
    a: int  # index of its lora_A in the plan's tensors
    b: int


class RowPlan:
    """Everything a load of ``layout``'s rows into vLLM needs that does not depend on the row."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.dense = all(m.experts is None for m in layout.modules)
        specs = []
        for m in layout.modules:
            for t, part in ((m.a, "lora_A"), (m.b, "lora_B")):
                dt = DTYPES[t.dtype][0]
                size = torch.empty(0, dtype=dt).element_size()
                stride = tuple(_contiguous_strides(t.shape))
                specs.append(_Tensor(f"{PEFT_PREFIX}{m.name}.{part}.weight", dt, t.offset // size, t.shape, stride,
                                     t.nbytes))
        self.tensors_ = tuple(specs)
        self.keys = tuple(t.key for t in specs)
        # where each B tensor lies in a buffer of B's scaled by vLLM's scaling (model(fold=...)):
        # tensor index -> byte offset, each on 64 bytes as in the row
        self._fold_at: dict[int, int] = {}
        at = 0
        for i, spec in enumerate(specs):
            if spec.key.endswith(".lora_B.weight"):
                self._fold_at[i] = at
                at += align(spec.nbytes)
        self.fold_nbytes = at
        sc = next(t for t in layout.tensors if t.name == SCALING)
        self._scaling = (sc.offset, sc.nbytes)
        self._lock = threading.Lock()
        self._configs: OrderedDict[tuple[float, ...], dict[str, Any] | None] = OrderedDict()
        self._models: OrderedDict[tuple[Any, ...], tuple[tuple[_Module, ...] | None, Any]] = OrderedDict()

    def scalings(self, row: torch.Tensor) -> tuple[float, ...]:
        """The row's per-module scalings (``row``: ``[S]`` uint8)."""
        off, n = self._scaling
        return tuple(row[off : off + n].view(torch.float32).tolist())

    def config(self, row: torch.Tensor, scalings: tuple[float, ...]) -> dict[str, Any] | None:
        """The PEFT config vLLM reads for rows with these scalings; None where vLLM would apply
        them wrong (mixed scalings: :func:`.resolver.for_vllm` folds them, the general way)."""
        with self._lock:
            if scalings in self._configs:
                self._configs.move_to_end(scalings)
                return self._configs[scalings]
        from .resolver import for_vllm

        adapter = Adapter.from_row(self.layout, row)
        config = synthesize_config(adapter) if for_vllm(adapter) is adapter else None
        with self._lock:
            self._configs[scalings] = config
            while len(self._configs) > MAX_SCALINGS:
                self._configs.popitem(last=False)
        return config

    def views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor of the row as a view of ``row`` (``[S]`` uint8), in the plan's order."""
        flat: dict[torch.dtype, torch.Tensor] = {}
        out = []
        for t in self.tensors_:
            base = flat.get(t.dtype)
            if base is None:
                size = torch.empty(0, dtype=t.dtype).element_size()
                base = flat[t.dtype] = row[: row.numel() // size * size].view(t.dtype)
            out.append(base.as_strided(t.shape, t.stride, base.storage_offset() + t.offset))  # (row may be a slice)
        return out

    def tensors(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """PEFT name -> view of ``row``: what :func:`~mint_store.peft.directory.peft_state_dict` gives."""
        return dict(zip(self.keys, self.views(row), strict=True))

    def model(self, cls: Any, row: torch.Tensor, scalings: tuple[float, ...], *, lora_model_id: int, peft_helper: Any,
              expected: set[str], check: Callable[[Iterable[str]], None], device: Any = "cuda",
              dtype: torch.dtype | None = None, weights_mapper: Any = None,
              skip_prefixes: list[str] | None = None, fold: Callable[[int], torch.Tensor] | None = None) -> Any:
        """vLLM's ``LoRAModel`` of ``row``, as ``cls.from_lora_tensors`` of :meth:`tensors` builds
        it; None where the plan does not know the answer (then ask ``from_lora_tensors``).
        ``check(keys)`` is vLLM's module check: it runs once per model, raising as vLLM does.

        ``fold(nbytes)``: a buffer (``[F]`` uint8) for the B tensors that would be views of
        ``row``, handed to vLLM already multiplied by vLLM's own scaling, which is then 1. vLLM
        merges a scaling into B in place (``LoRALayerWeights.optimize``: ``lora_b *= scaling``);
        folded here into a copy, bit for bit the same product, the row stays as it was read, so
        a writer may read it meanwhile (the row cache, :mod:`.direct`) with no copy of its own.
        """
        modules = self._modules(scalings, peft_helper, expected, check, weights_mapper, skip_prefixes)
        if modules is None:
            return None
        from vllm.lora.lora_weights import LoRALayerWeights
        from vllm.utils.torch_utils import PIN_MEMORY

        pin = str(device) == "cpu" and PIN_MEMORY
        dev = torch.device(device)
        views = self.views(row)
        folded: torch.Tensor | None = None  # [F] uint8, taken at the first B that needs it
        loras = {}
        for m in modules:  # (from_lora_tensors' loop, its names parsed once: _modules)
            lw = LoRALayerWeights.from_config(m.name, peft_helper, m.peft_name)
            a, b = views[m.a], views[m.b]
            if a.device != dev or (dtype is not None and a.dtype != dtype):  # (else .to returns it as it is)
                a = a.to(device=device, dtype=dtype)
            if b.device != dev or (dtype is not None and b.dtype != dtype):
                b = b.to(device=device, dtype=dtype)
            elif fold is not None and lw.scaling != 1:  # still a view of the row: vLLM would scale it there
                if folded is None:
                    folded = fold(self.fold_nbytes)
                at = self._fold_at[m.b]
                t = self.tensors_[m.b]
                out = folded[at : at + t.nbytes].view(t.dtype).view(t.shape)
                b = torch.mul(b, lw.scaling, out=out)  # [out, r]: vLLM's `lora_b *= scaling`, into the copy
                lw.scaling = 1
            if pin:  # (a pinned row's views are pinned: returned as they are)
                a, b = a.pin_memory(), b.pin_memory()
            lw.lora_a, lw.lora_b = a, b
            loras[m.name] = lw
        return cls(lora_model_id, peft_helper.r, loras, modules_to_save={})

    def _modules(self, scalings: tuple[float, ...], peft_helper: Any, expected: set[str],
                 check: Callable[[Iterable[str]], None], weights_mapper: Any,
                 skip_prefixes: list[str] | None) -> tuple[_Module, ...] | None:
        saved = tuple(peft_helper.modules_to_save or ())
        # (not the scalings: vLLM's rank and scaling per module come from the helper, on every load)
        key = (frozenset(expected), tuple(skip_prefixes or ()), _mapper_key(weights_mapper), saved)
        with self._lock:
            got = self._models.get(key)
            if got is not None:
                self._models.move_to_end(key)
                return got[0]
        check(self.keys)  # raises ValueError as vLLM's from_local_checkpoint does: nothing cached
        modules = _pair(self.keys, weights_mapper, skip_prefixes, saved)
        with self._lock:
            self._models[key] = (modules, weights_mapper)
            while len(self._models) > MAX_MODELS:
                self._models.popitem(last=False)
        return modules


def _pair(keys: tuple[str, ...], weights_mapper: Any, skip_prefixes: list[str] | None,
          saved: tuple[str, ...]) -> tuple[_Module, ...] | None:
    """vLLM's module of each key, as ``from_lora_tensors`` names and pairs them (its functions)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    found: dict[str, list[Any]] = {}
    for i, key in enumerate(keys):
        if is_base_embedding_weights(key) or (skip_prefixes and LoRAModel._should_skip_module(key, skip_prefixes)):
            continue
        name, is_a = parse_fine_tuned_lora_name(key, weights_mapper)
        if name in saved:
            return None
        if name not in found:
            found[name] = [parse_fine_tuned_lora_name(key)[0], None, None]
        slot = 1 if is_a else 2
        if found[name][slot] is not None:
            return None  # two tensors vLLM would put in one place: its own loop says what happens
        found[name][slot] = i
    if any(a is None or b is None for _, a, b in found.values()):
        return None
    return tuple(_Module(name, peft, a, b) for name, (peft, a, b) in found.items())


def _mapper_key(mapper: Any) -> Any:
    """A key for vLLM's weights mapper: by value (vLLM makes a new ``WeightsMapper``, a dataclass
    of dicts of strings or compiled patterns, for every load), else by identity (the entry keeps
    the object: its id stays its own)."""
    if mapper is None:
        return None
    try:
        key = _frozen(mapper)
        hash(key)
        return key
    except TypeError:
        return ("id", id(mapper))


def _frozen(x: Any) -> Any:
    """``x`` as nested tuples of its values: equal exactly when the mappers map names alike
    (a compiled pattern compares by its pattern and flags)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__qualname__, tuple((f.name, _frozen(getattr(x, f.name))) for f in dataclasses.fields(x)))
    if isinstance(x, dict):
        return ("dict", tuple((_frozen(k), _frozen(v)) for k, v in x.items()))  # (order matters to a mapper)
    if isinstance(x, (list, tuple)):
        return ("seq", tuple(_frozen(v) for v in x))
    if isinstance(x, (str, int, float, bool, type(None), re.Pattern)):
        return x
    raise TypeError(f"no value key for {type(x).__name__}")


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]
