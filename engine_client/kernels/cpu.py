"""SHRINK and EXPAND on CPU: a small C library (``csrc/lora_cpu.c``), built on first use.

The groups and the loops are those of :mod:`.groups`; :mod:`.ops` takes these for
every float32 CPU call that needs no gradient: a dense layer's prefill and decode steps, the
fused experts' (expert, sequence) runs, BGMV, SGMV. Short or uneven groups are shapes torch
can only batch by padding or by gathering weights out of the pool; the C loops read each
group's weights in place, once (see the C file for why), and on a prefill's equal groups they
measured faster than torch's batched matmuls too.

The library is compiled on first use by :mod:`mint_store.native` (``$CC``, ``-O3
-march=native``, cached per machine in ``$MINT_KERNEL_CACHE``). Without a compiler, or if the
build fails, one warning says why and the torch ops run instead (same numbers, slower).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import warnings
from pathlib import Path

import torch

from mint_store import native
from mint_store.native import CACHE_ENV, BuildError, compiler

from .groups import GroupedKernels, Groups, feature_strides, h_strides

__all__ = ["CACHE_ENV", "SOURCE", "BuildError", "build", "compiler", "kernels", "library_path"]

SOURCE = Path(__file__).with_name("csrc") / "lora_cpu.c"
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp")


def library_path(root: Path | None = None) -> Path:
    """Where this machine's build of the library lives (it may not exist yet)."""
    return native.library_path(SOURCE, FLAGS, root=root)


def build() -> Path:
    """Compile the library unless this machine's build exists; its path. Raises :class:`BuildError`."""
    return native.build(SOURCE, FLAGS)


# the int64 argument array of ``mint_lora_op``, by index (the C enum Q_*, in its order): a shared
# block, then SHRINK's and EXPAND's (each built from its own tensors, zeros for a pass not run)
_SHARED = ("x", "a", "scaling", "h", "b", "y", "slots", "experts", "rows", "lens", "n_groups", "n_tokens", "rank",
           "sh_g", "sh_t", "n_threads")
_SHRINK_ARGS = ("d_in", "sx_g", "sx_t", "sx_k", "sa_s", "sa_e", "sa_r", "sa_k", "s_scaling", "x_rows",
                "x_row_tokens", "a_slots", "a_experts")
_EXPAND_ARGS = ("d_out", "sb_s", "sb_e", "sb_n", "sb_r", "sy_g", "sy_t", "sy_n", "y_rows", "y_row_tokens", "b_slots",
                "b_experts")
_Q = _SHARED + _SHRINK_ARGS + _EXPAND_ARGS
_NO_SHRINK, _NO_EXPAND = [0] * len(_SHRINK_ARGS), [0] * len(_EXPAND_ARGS)
_SHRINK, _EXPAND, _ADD = 0, 1, 2
_OP_NAMES = ("mint::cpu_shrink", "mint::cpu_expand", "mint::cpu_shrink_expand")


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build()))
    except (BuildError, OSError) as e:
        warnings.warn(f"the CPU LoRA kernels are unavailable, the torch ops run instead: {e}", stacklevel=3)
        return None
    count = getattr(lib, "mint_lora_args", None)
    n_args = count() if count is not None else None
    if n_args != len(_Q):  # a build of another layout: never read it wrong
        warnings.warn(f"the CPU LoRA kernels take {n_args} arguments, this module passes {len(_Q)}: "
                      "the torch ops run instead (delete the kernel cache to rebuild)", stacklevel=3)
        return None
    lib.mint_lora_op.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.mint_lora_op.restype = ctypes.c_int
    return lib


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()  # 0: NULL, an absent tensor


def _optional(groups: Groups) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """slots, experts, rows, lens as contiguous int64 of one length, on the CPU (None where absent:
    the C code checks), else a ValueError."""
    n = groups.slots.shape[0]
    out: list[torch.Tensor | None] = []
    for name, t in (("slots", groups.slots), ("experts", groups.experts), ("rows", groups.rows),
                    ("lens", groups.lens)):
        if t is None:
            out.append(None)
            continue
        if t.dim() != 1 or t.shape[0] != n or t.device.type != "cpu" or t.is_floating_point() or t.is_complex():
            raise ValueError(f"groups.{name} must be [{n}] integers on the CPU, got {tuple(t.shape)} {t.dtype} "
                             f"on {t.device}")
        out.append(t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous())
    slots, experts, rows, lens = out
    assert slots is not None  # (groups.slots is a tensor)
    return slots, experts, rows, lens


def _check(acts: torch.Tensor, n_feat: int, w: torch.Tensor, groups: Groups, *others: torch.Tensor) -> None:
    """The tensors the C loops read and write, as they assume them: float32 on the CPU, the
    activations ``[R, T, f]`` or ``[N, f]`` with ``f = n_feat``, the weights ``[S, ...]`` with an
    expert dimension exactly when ``groups.experts`` is given. ValueError otherwise."""
    for t in (acts, w, *others):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"the CPU kernels take float32 CPU tensors, got {t.dtype} on {t.device}")
    if acts.dim() not in (2, 3) or acts.shape[-1] != n_feat:
        raise ValueError(f"activations {tuple(acts.shape)} do not have the weights' {n_feat} features")
    if w.dim() != (4 if groups.experts is not None else 3):
        raise ValueError(f"weights {tuple(w.shape)} must be [S, E, ., .] with experts, [S, ., .] without")


def _marked(name: str) -> contextlib.AbstractContextManager[object]:
    """A profiler op named ``name`` around a C call while a profiler runs (its entry costs ~10 us,
    a third of a small call, so not otherwise): the bench's "LoRA ops alone" counts these."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _run(op: int, x: torch.Tensor | None, a: torch.Tensor | None, scaling: torch.Tensor | None, h: torch.Tensor,
         b: torch.Tensor | None, y: torch.Tensor | None, groups: Groups) -> None:
    """One ``mint_lora_op`` call: SHRINK (x, a, scaling -> h), EXPAND (h, b -> y) or both, the
    arguments packed into one int64 array in the order of ``_Q``: the shared block, then each
    pass's own. ValueError if a group reaches outside x, y or the weights. (Written for speed: it
    runs once per module and step.)"""
    lib = _library()
    assert lib is not None, "kernels() returned these: the library loaded"
    slots, experts, rows, lens = _optional(groups)  # checked even where nothing runs
    if not (slots.shape[0] and groups.tokens):
        return
    e = groups.experts is not None
    rows_of = x if x is not None else y  # h is laid out like their rows
    assert rows_of is not None, "SHRINK reads x, EXPAND writes y"
    rank = a.shape[-2] if a is not None else b.shape[-1] if b is not None else 0
    q = [_ptr(x), _ptr(a), _ptr(scaling), h.data_ptr(), _ptr(b), _ptr(y), slots.data_ptr(), _ptr(experts),
         _ptr(rows), _ptr(lens), slots.shape[0], groups.tokens, rank, *h_strides(h, rows_of),
         torch.get_num_threads()]
    if x is not None and a is not None and scaling is not None:
        sa, ash = a.stride(), a.shape
        q += [ash[-1], *feature_strides(x), sa[0], sa[1] if e else 0, sa[-2], sa[-1], scaling.stride(0), *_rows(x),
              min(ash[0], scaling.shape[0]), ash[1] if e else 0]
    else:
        q += _NO_SHRINK
    if y is not None and b is not None:
        sb, bsh = b.stride(), b.shape
        q += [bsh[-2], sb[0], sb[1] if e else 0, sb[-2], sb[-1], *feature_strides(y), *_rows(y), bsh[0],
              bsh[1] if e else 0]
    else:
        q += _NO_EXPAND
    args = array.array("q", q)
    with _marked(_OP_NAMES[op]):
        rc = lib.mint_lora_op(op, args.buffer_info()[0])
    if rc == 2:
        acts = [tuple(t.shape) for t in (x, y) if t is not None]
        ws = [tuple(t.shape) for t in (a, b) if t is not None]
        raise ValueError(f"{_OP_NAMES[op]}: groups out of range of x/y {acts} or weights {ws}: slots, experts, "
                         "rows and lengths must index inside them")
    if rc:
        raise MemoryError(f"{_OP_NAMES[op]}: out of memory") if rc == 1 else RuntimeError(f"mint_lora_op returned {rc}")


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(rows, tokens per row) of x or y as the C loops check groups against them (-1: 2-D)."""
    return (t.shape[0], t.shape[1]) if t.dim() == 3 else (t.shape[0], -1)


def _new_h(x: torch.Tensor, rank: int) -> torch.Tensor:
    """SHRINK's output laid out like x's rows: ``[R, T, r]`` or ``[N, 1, r]``, float32."""
    return torch.empty((x.shape[0], x.shape[1] if x.dim() == 3 else 1, rank), dtype=torch.float32)


def shrink(x: torch.Tensor, a: torch.Tensor, scaling: torch.Tensor, groups: Groups) -> torch.Tensor:
    """SHRINK of :mod:`.groups`: ``h`` float32 laid out like x's rows (``[R, T, r]`` or
    ``[N, 1, r]``), ``scaling`` applied. Rows no live group covers are left unwritten.
    """
    _check(x, a.shape[-1], a, groups, scaling)
    if scaling.dim() != 1:
        raise ValueError(f"scaling must be [S], got {tuple(scaling.shape)}")
    h = _new_h(x, a.shape[-2])
    _run(_SHRINK, x, a, scaling, h, None, None, groups)
    return h


def expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """EXPAND of :mod:`.groups`: ``y += b[s] @ h`` in place for every live group; returns ``y``."""
    _check(y, b.shape[-2], b, groups, h)
    rank = b.shape[-1]
    rows_like_y = (y.shape[0], y.shape[1] if y.dim() == 3 else 1)
    if h.dim() != 3 or tuple(h.shape[:2]) != rows_like_y or h.shape[2] < rank or h.stride(-1) != 1:
        raise ValueError(f"h {tuple(h.shape)} (strides {h.stride()}) must be SHRINK's output for these rows: "
                         f"[{rows_like_y[0]}, {rows_like_y[1]}, >= {rank}], unit stride over the rank")
    _run(_EXPAND, None, None, None, h, b, y, groups)
    return y


def add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
        groups: Groups) -> torch.Tensor:
    """SHRINK then EXPAND in one call (the grouped kernels' ``add``): ``y += `` every live group's
    delta of ``x``, in place; returns ``y``. x and y hold the same rows (``y`` laid out as ``x``)."""
    _check(x, a.shape[-1], a, groups, scaling)
    _check(y, b.shape[-2], b, groups)
    if scaling.dim() != 1:
        raise ValueError(f"scaling must be [S], got {tuple(scaling.shape)}")
    if x.dim() != y.dim() or x.shape[:-1] != y.shape[:-1] or a.shape[-2] != b.shape[-1]:
        raise ValueError(f"x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)} and b {tuple(b.shape)} "
                         "do not fit: y must hold x's rows, b's rank be a's")
    _run(_ADD, x, a, scaling, _new_h(x, a.shape[-2]), b, y, groups)
    return y


@functools.cache
def kernels() -> GroupedKernels | None:
    """The CPU backend (float32 only), or None where the library cannot be built (one warning says why)."""
    return None if _library() is None else GroupedKernels("cpu", shrink, expand, (torch.float32,), add)
