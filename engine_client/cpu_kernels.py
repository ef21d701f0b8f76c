"""SHRINK and EXPAND on CPU: a small C library (``csrc/lora_cpu.c``), built on first use.

The groups and the loops are those of :mod:`.lora_groups`; :mod:`.kernels` takes these for
float32 CPU calls that need no gradient where the groups are short or uneven: the fused
experts' (expert, sequence) runs, BGMV, SGMV. Those are shapes torch can only batch by
padding or by gathering weights out of the pool; the C loops read each group's weights in
place, once (see the C file for why). Equal-length groups of a dense layer stay on torch's
batched matmuls, measured as fast there.

The library is compiled with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``;
``-O3 -march=native``) into ``$MINT_KERNEL_CACHE`` (default ``~/.cache/mint_store/kernels``),
keyed by the source, the compiler, its flags and the CPU; concurrent builders each write
their own file and rename it into place. Without a compiler, or if the build fails, one
warning says why and the torch ops run instead (same numbers, slower).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from .lora_groups import GroupedKernels, Groups, feature_strides

__all__ = ["SOURCE", "BuildError", "build", "compiler", "kernels", "library_path"]

SOURCE = Path(__file__).with_name("csrc") / "lora_cpu.c"
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp")
CACHE_ENV = "MINT_KERNEL_CACHE"
_P, _I = ctypes.c_void_p, ctypes.c_int64


class BuildError(RuntimeError):
    """The C library could not be built: no compiler, or the compiler failed (the message says which)."""


def compiler() -> str:
    """The C compiler the library is built with; :class:`BuildError` when there is none."""
    named = os.environ.get("CC")
    cc = shutil.which(named) if named else shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError(f"no C compiler {named!r} found (set CC, or install gcc: apt-get install -y gcc)" if named
                         else "no C compiler found (set CC, or install gcc: apt-get install -y gcc)")
    return cc


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the model name and feature flags of this CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep))) or platform.machine()


def library_path(root: Path | None = None) -> Path:
    """Where this machine's build of the library lives (it may not exist yet)."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, *FLAGS, _cpu_id()]).encode()).hexdigest()
    if root is None and os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV])
    elif root is None:
        try:
            root = Path.home() / ".cache" / "mint_store" / "kernels"
        except RuntimeError:  # no home directory (HOME unset, no passwd entry)
            root = Path(tempfile.gettempdir()) / "mint_store-kernels"
    return root / f"lora_cpu-{key[:16]}.so"


def build() -> Path:
    """Compile the library unless this machine's build exists; its path. Raises :class:`BuildError`.

    A cache directory that cannot be written (a read-only home) falls back to the system's
    temporary directory.
    """
    out = library_path()
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except OSError:
        out = library_path(Path(tempfile.gettempdir()) / "mint_store-kernels")
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler(), *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise BuildError(f"compiling {SOURCE.name} failed:\n{done.stderr.strip()}")
        os.replace(tmp, out)  # atomic: a concurrent builder's identical file may land first
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build()))
    except (BuildError, OSError) as e:
        warnings.warn(f"the CPU LoRA kernels are unavailable, the torch ops run instead: {e}", stacklevel=3)
        return None
    lib.mint_lora_shrink.argtypes = [_P] * 8 + [_I] * 18 + [ctypes.c_int]
    lib.mint_lora_expand.argtypes = [_P] * 7 + [_I] * 17 + [ctypes.c_int]
    lib.mint_lora_shrink.restype = lib.mint_lora_expand.restype = ctypes.c_int
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _optional(groups: Groups) -> list[torch.Tensor | None]:
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
    return out


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


def _extents(rows_of: torch.Tensor, n_slots: int, w: torch.Tensor, groups: Groups) -> tuple[int, int, int, int]:
    """What the C loops check every group against: rows of x / y (and tokens per row when 3-D),
    slots and experts of the weights."""
    return (rows_of.shape[0], rows_of.shape[1] if rows_of.dim() == 3 else -1, n_slots,
            w.shape[1] if groups.experts is not None else 0)


def _raise(rc: int, what: str, groups: Groups, rows_of: torch.Tensor, w: torch.Tensor) -> None:
    if rc == 2:
        raise ValueError(f"{what}: groups out of range of x/y {tuple(rows_of.shape)} or weights {tuple(w.shape)}: "
                         "slots, experts, rows and lengths must index inside them")
    if rc:
        raise MemoryError(f"{what}: out of memory")


def _marked(name: str) -> contextlib.AbstractContextManager[object]:
    """A profiler op named ``name`` around a C call while a profiler runs (its entry costs ~10 us,
    a third of a small call, so not otherwise): the bench's "LoRA ops alone" counts these."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def shrink(x: torch.Tensor, a: torch.Tensor, scaling: torch.Tensor, groups: Groups) -> torch.Tensor:
    """SHRINK of :mod:`.lora_groups`: ``h`` float32 laid out like x's rows (``[R, T, r]`` or
    ``[N, 1, r]``), ``scaling`` applied. Rows no live group covers are left unwritten.
    """
    lib = _library()
    assert lib is not None, "kernels() returned these: the library loaded"
    n_groups, d_in, rank = groups.slots.shape[0], a.shape[-1], a.shape[-2]
    _check(x, d_in, a, groups, scaling)
    if scaling.dim() != 1:
        raise ValueError(f"scaling must be [S], got {tuple(scaling.shape)}")
    h = torch.empty((x.shape[0], x.shape[1] if x.dim() == 3 else 1, rank), dtype=torch.float32)
    ids, sa = _optional(groups), a.stride()
    if n_groups == 0 or groups.tokens == 0:
        return h
    with _marked("mint::cpu_shrink"):
        rc = lib.mint_lora_shrink(
            _ptr(x), _ptr(a), _ptr(scaling), _ptr(h), *map(_ptr, ids), n_groups, groups.tokens, d_in, rank,
            *feature_strides(x), sa[0], sa[1] if groups.experts is not None else 0, sa[-2], sa[-1],
            scaling.stride(0), h.stride(0), h.stride(1), *_extents(x, min(a.shape[0], scaling.shape[0]), a, groups),
            torch.get_num_threads())
    _raise(rc, "mint_lora_shrink", groups, x, a)
    return h


def expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """EXPAND of :mod:`.lora_groups`: ``y += b[s] @ h`` in place for every live group; returns ``y``."""
    lib = _library()
    assert lib is not None, "kernels() returned these: the library loaded"
    n_groups, d_out, rank = groups.slots.shape[0], b.shape[-2], b.shape[-1]
    _check(y, d_out, b, groups, h)
    rows_like_y = (y.shape[0], y.shape[1] if y.dim() == 3 else 1)
    if h.dim() != 3 or tuple(h.shape[:2]) != rows_like_y or h.shape[2] < rank or h.stride(-1) != 1:
        raise ValueError(f"h {tuple(h.shape)} (strides {h.stride()}) must be SHRINK's output for these rows: "
                         f"[{rows_like_y[0]}, {rows_like_y[1]}, >= {rank}], unit stride over the rank")
    ids, sb, sh = _optional(groups), b.stride(), h.stride()
    if n_groups == 0 or groups.tokens == 0:
        return y
    with _marked("mint::cpu_expand"):
        rc = lib.mint_lora_expand(
            _ptr(h), _ptr(b), _ptr(y), *map(_ptr, ids), n_groups, groups.tokens, d_out, rank, sh[0], sh[1],
            sb[0], sb[1] if groups.experts is not None else 0, sb[-2], sb[-1], *feature_strides(y),
            *_extents(y, b.shape[0], b, groups), torch.get_num_threads())
    _raise(rc, "mint_lora_expand", groups, y, b)
    return y


@functools.cache
def kernels() -> GroupedKernels | None:
    """The CPU backend (float32 only), or None where the library cannot be built (one warning says why)."""
    return None if _library() is None else GroupedKernels("cpu", shrink, expand, (torch.float32,))
