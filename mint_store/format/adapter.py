"""The in-memory adapter: validated LoRA modules, and its row encoding."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import BaseMismatch, InvalidAdapter, LimitExceeded
from ..peft.patterns import MODULE_PATH_RE as _MODULE_RE
from .hashing import content_id
from .layout import (
    DTYPES,
    SCALING,
    Layout,
    build_layout,
    check_finite_rows,
    decode_row,
    dtype_name,
    encode_rows,
    natural_key,
)
from .names import check_name

UNSPECIFIED_BASE = "unspecified"
_F32_MAX = float(np.finfo(np.float32).max)
_MAX_BASE_DIM = 2**31  # in/out features and experts of a base module


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterLimits:
    max_row_bytes: int = 16 * 2**30
    max_modules: int = 200_000
    max_rank: int = 65_536
    max_experts: int = 4_096


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str
    a: torch.Tensor  # [r, in] or [E, r, in]
    b: torch.Tensor  # [out, r] or [E, out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[-2])

    @property
    def experts(self) -> int | None:
        return int(self.a.shape[0]) if self.a.dim() == 3 else None


@dataclass(frozen=True, slots=True)
class Adapter:
    """A validated adapter. Build it with :func:`make_adapter` or :meth:`from_row`."""

    base: str
    modules: tuple[LoraModule, ...]
    peft_config: dict[str, Any] | None = None

    @property
    def layout(self) -> Layout:
        shapes: list[tuple[str, tuple[int, ...], str]] = []
        for m in self.modules:
            shapes.append((m.name + ".lora_A", tuple(m.a.shape), dtype_name(m.a.dtype)))
            shapes.append((m.name + ".lora_B", tuple(m.b.shape), dtype_name(m.b.dtype)))
        shapes.append((SCALING, (len(self.modules),), "float32"))
        return build_layout(self.base, shapes)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for m in self.modules:
            out[m.name + ".lora_A"] = m.a
            out[m.name + ".lora_B"] = m.b
        out[SCALING] = torch.tensor([m.scaling for m in self.modules], dtype=torch.float32)
        return out

    def to_row(self) -> tuple[Layout, np.ndarray]:
        layout = self.layout
        sd = {k: v.unsqueeze(0) for k, v in self.state_dict().items()}
        return layout, encode_rows(layout, sd, 1)[0]

    @classmethod
    def from_row(cls, layout: Layout, buf: Any, *, peft_config: dict[str, Any] | None = None) -> Adapter:
        """Tensors are views of ``buf``."""
        t = decode_row(layout, buf)
        scaling = t[SCALING].tolist()
        mods = tuple(
            LoraModule(m.name, t[m.a.name], t[m.b.name], float(scaling[m.index])) for m in layout.modules
        )
        return cls(layout.base, mods, peft_config)

    def content_id(self) -> str:
        layout, row = self.to_row()
        return content_id(layout.layout_id, row)


def _shape_error(name: str, a: torch.Tensor, b: torch.Tensor, why: str) -> InvalidAdapter:
    return InvalidAdapter(
        f"module {name!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} {why}; expected "
        "A [r, in] and B [out, r] (or [E, r, in] and [E, out, r] for fused experts)"
    )


def check_module(name: str, a: torch.Tensor, b: torch.Tensor, limits: AdapterLimits) -> None:
    if not isinstance(name, str) or not _MODULE_RE.fullmatch(name):
        raise InvalidAdapter(f"invalid module name {name!r}: dotted path of [A-Za-z0-9_] parts")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise InvalidAdapter(f"module {name!r}: lora_A and lora_B must be tensors")
    for t in (a, b):
        if t.dtype not in {v[0] for v in DTYPES.values()}:
            raise InvalidAdapter(f"module {name!r}: unsupported dtype {t.dtype}; use float32, bfloat16 or float16")
    if a.dtype != b.dtype:  # the engine's kernels multiply A's output by B in one dtype
        raise InvalidAdapter(f"module {name!r}: lora_A is {a.dtype} and lora_B {b.dtype}; store both in one dtype "
                             "(convert one with .to(), as PEFT computes in the wider one)")
    if a.dim() != b.dim() or a.dim() not in (2, 3):
        raise _shape_error(name, a, b, "have incompatible ranks of dimensions")
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise _shape_error(name, a, b, "disagree on the number of experts")
    if a.shape[-2] != b.shape[-1]:
        raise _shape_error(name, a, b, "have different LoRA ranks")
    if min(a.shape) < 1 or min(b.shape) < 1:
        raise _shape_error(name, a, b, "have an empty dimension")
    if a.shape[-2] > limits.max_rank:
        raise LimitExceeded(f"module {name!r}: rank {a.shape[-2]} over the limit {limits.max_rank}")
    if a.dim() == 3 and a.shape[0] > limits.max_experts:
        raise LimitExceeded(f"module {name!r}: {a.shape[0]} experts over the limit {limits.max_experts}")


def make_adapter(
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]] | Iterable[LoraModule],
    *,
    base: str = UNSPECIFIED_BASE,
    peft_config: dict[str, Any] | None = None,
    limits: AdapterLimits | None = None,
) -> Adapter:
    """Validate modules (name -> (A, B, scaling)) and return an Adapter in canonical order.

    Checks: names, dtypes, shapes (same r in A and B), finite values, finite scaling, limits.
    """
    limits = limits or AdapterLimits()
    check_name(base, "base")
    items = (
        [LoraModule(k, a, b, s) for k, (a, b, s) in modules.items()]
        if isinstance(modules, Mapping)
        else list(modules)
    )
    if not items:
        raise InvalidAdapter("adapter has no LoRA modules")
    if len(items) > limits.max_modules:
        raise LimitExceeded(f"adapter has {len(items)} modules, over the limit {limits.max_modules}")
    seen: set[str] = set()
    out: list[LoraModule] = []
    for m in items:
        if m.name in seen:
            raise InvalidAdapter(f"module {m.name!r} appears twice")
        seen.add(m.name)
        check_module(m.name, m.a, m.b, limits)
        s = float(m.scaling)
        # rows store the scaling as float32: 1e39 is finite here but infinite there
        if not (math.isfinite(s) and abs(s) <= _F32_MAX):
            raise InvalidAdapter(
                f"module {m.name!r}: scaling {m.scaling!r} is not a finite float32 (|scaling| <= {_F32_MAX:.4g}); "
                "check lora_alpha / alpha_pattern"
            )
        out.append(LoraModule(m.name, m.a.detach().cpu(), m.b.detach().cpu(), s))
    out.sort(key=lambda m: natural_key(m.name))
    adapter = Adapter(base, tuple(out), peft_config)
    layout, row = adapter.to_row()
    if layout.row_nbytes > limits.max_row_bytes:
        raise LimitExceeded(f"adapter row is {layout.row_nbytes} bytes, over the limit {limits.max_row_bytes}")
    if not check_finite_rows(layout, row)[0]:
        # a default for next(): a StopIteration escaping into a coroutine hangs the request
        bad = next(
            (m.name for m in out if not (torch.isfinite(m.a).all() and torch.isfinite(m.b).all())),
            "(scaling vector)",
        )
        raise InvalidAdapter(f"module {bad!r} has NaN or Inf values")
    return adapter


# base registry: module name -> (in_features, out_features, experts or None)
BaseShapes = dict[str, tuple[int, int, int | None]]


def check_base_shapes(shapes: Mapping[str, Any]) -> BaseShapes:
    """Validate a base registration: ``{module: [in, out]}`` or ``{module: [in, out, experts]}``."""
    if not isinstance(shapes, Mapping) or not shapes:
        raise InvalidAdapter("base shapes must be a non-empty object {module: [in, out(, experts)]}")
    out: BaseShapes = {}
    for k, v in shapes.items():
        if not isinstance(k, str) or not _MODULE_RE.fullmatch(k):
            raise InvalidAdapter(f"invalid module name {k!r} in base shapes")
        if (
            not isinstance(v, list | tuple)
            or len(v) not in (2, 3)
            or not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= _MAX_BASE_DIM for x in v)
        ):
            raise InvalidAdapter(
                f"base module {k!r}: expected [in, out] or [in, out, experts], integers in 1..{_MAX_BASE_DIM}"
            )
        out[k] = (v[0], v[1], v[2] if len(v) == 3 else None)
    return out


def check_against_base(layout: Layout, base: BaseShapes) -> None:
    """Raise BaseMismatch naming the first module that does not fit the registered base."""
    for m in layout.modules:
        want = base.get(m.name)
        if want is None:
            raise BaseMismatch(f"module {m.name!r} is not a module of base {layout.base!r}")
        got = (m.in_features, m.out_features, m.experts)
        if got != want:
            raise BaseMismatch(
                f"module {m.name!r}: adapter has (in, out, experts) = {got}, base {layout.base!r} "
                f"has {want}"
            )
