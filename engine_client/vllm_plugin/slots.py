"""A MinT adapter's activation zeroes only what its slot's last occupant left there.

vLLM copies an adapter into its slot of each LoRA layer with ``set_lora``, which first zeroes
the whole slot (``reset_lora``) and then copies A into rows ``[:r]`` and B into columns ``[:r]``::

    A_stacked[slice]: [max_loras, 1, max_rank, in]     B_stacked[slice]: [max_loras, 1, out, max_rank]

    reset_lora(i):   A[i] = 0; B[i] = 0               # every slot byte, whatever the rank
    set_lora(i, a, b):
        reset_lora(i)
        A[i, 0, :r, :in] = a                          # a: [r, in]
        B[i, 0, :out, :r] = b                         # b: [out, r]

With ``--max-lora-rank 64`` the memset is of the rank-64 slot for every activation: 3-4 ms for a
Llama of hidden 1024 and 16 layers on a 2-core CPU, a third of vLLM's part of a cold rank-16
load, and rows the copy overwrites right after. For an adapter the plugin loaded (a
``LoRAModel`` :mod:`.direct` marked), activated while :func:`activating` holds, each linear
layer keeps per slot the rank each slice last wrote, and ``set_lora`` zeroes after vLLM's own
copy only what that copy did not overwrite::

    set_lora(i, a, b):                                # (r_old: the rank written before)
        A[i, 0, :r, :] = a ;  A[i, 0, r:r_old, :] = 0
        B[i, 0, :, :r] = b ;  B[i, 0, :, r:r_old] = 0

The slot ends as vLLM's own ``set_lora`` leaves it (tests compare every slot byte). Any other
write keeps the record exact or makes it ``max_rank`` (nothing known): vLLM's own activations
(of adapters not MinT's, which this never changes), ``reset_lora`` from anywhere, a layer class
whose ``set_lora`` is not wrapped here, tensor parallelism or fully sharded LoRA (the rank
dimension is sliced), a slice shape that is not the layer's whole width, and stacked tensors
vLLM reallocated.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, cast

_state = threading.local()  # .mint: a MinT adapter's activation is in progress on this thread
_MARK = "_mint_slot_writes"
Ranks = tuple[list[int], list[int]]  # per slice: rows of A, columns of B written (zero beyond)
# set_lora calls by how the slot was cleared: "mint" (only what the copy left), "vllm" (whole)
counts = {"mint": 0, "vllm": 0}


@contextlib.contextmanager
def activating(mint: bool) -> Iterator[None]:
    """While this holds, ``set_lora`` on this thread zeroes only what the copy leaves (``mint``)."""
    before = getattr(_state, "mint", False)
    _state.mint = mint
    try:
        yield
    finally:
        _state.mint = before


def install() -> int:
    """Wrap ``reset_lora`` and every ``set_lora`` of vLLM's linear LoRA layers (once); the classes wrapped."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    base = BaseLinearLayerWithLoRA
    if not getattr(base.reset_lora, _MARK, False):
        base.reset_lora = _wrap_reset(base.reset_lora)
    done = 0
    for cls in _subclasses(base):
        fn = vars(cls).get("set_lora")
        if fn is not None and not getattr(fn, _MARK, False):
            setattr(cls, "set_lora", _wrap_set(fn))  # noqa: B010  (each class in the walk)
        done += 1
    return done


def _subclasses(cls: type) -> list[type]:
    out: list[type] = [cls]
    todo: list[type] = list(cls.__subclasses__())
    while todo:
        c = todo.pop()
        if c not in out:
            out.append(c)
            todo.extend(c.__subclasses__())
    return out


def _wrapped(layer: Any) -> bool:
    """Every write of this layer's slots goes through a wrapped ``set_lora``."""
    return bool(getattr(type(layer).set_lora, _MARK, False))


def _stacks(layer: Any) -> tuple[int, ...]:
    """Which stacked tensors the layer has now (a record is of these: vLLM may allocate new ones)."""
    return tuple(t.data_ptr() for t in (*layer.lora_a_stacked, *layer.lora_b_stacked))


def _ranks(layer: Any, index: int) -> Ranks | None:
    """The ranks slot ``index``'s A and B slices hold (rows of A, columns of B beyond are zero);
    None where nothing is known (anything up to max_rank)."""
    book = getattr(layer, "_mint_ranks", None)
    if book is None or book[0] != _stacks(layer):  # (never recorded, or vLLM reallocated the stacks)
        return None
    got: Ranks | None = book[1].get(index)
    return got


def _record(layer: Any, index: int, ranks: Ranks | None) -> None:
    key = _stacks(layer)
    book = getattr(layer, "_mint_ranks", None)
    if book is None or book[0] != key:
        book = (key, dict[int, Ranks]())
        layer._mint_ranks = book
    if ranks is None:
        book[1].pop(index, None)
    else:
        book[1][index] = ranks


def _shapes(layer: Any, lora_a: Any, lora_b: Any) -> Ranks | None:
    """The ranks vLLM's copy writes per slice, where it writes whole rows of A and columns of B
    (one device, unsharded ranks, one tensor per slice); None otherwise."""
    if getattr(layer, "tp_size", 1) != 1 or getattr(getattr(layer, "lora_config", None), "fully_sharded_loras", False):
        return None
    a_list = lora_a if isinstance(lora_a, (list, tuple)) else [lora_a]
    b_list = lora_b if isinstance(lora_b, (list, tuple)) else [lora_b]
    stacks_a, stacks_b = layer.lora_a_stacked, layer.lora_b_stacked
    if not len(a_list) == len(b_list) == len(stacks_a) == len(stacks_b):
        return None  # (vLLM expands packed groups itself: expand_packed_lora)
    ra = [_rank(a, sa, 0) for a, sa in zip(a_list, stacks_a, strict=True)]
    rb = [_rank(b, sb, 1) for b, sb in zip(b_list, stacks_b, strict=True)]
    if None in ra or None in rb:
        return None
    return cast(Ranks, (ra, rb))  # (no None in them)


def _rank(t: Any, stack: Any, rank_dim: int) -> int | None:
    """The rank a copy of ``t`` writes into ``stack`` (0 for no tensor), where it covers whole
    rows (A: ``t`` [r, in], ``rank_dim`` 0) or columns (B: ``t`` [out, r], ``rank_dim`` 1) of
    ``stack`` [slots, 1, rows, cols]; None otherwise."""
    if t is None:
        return 0
    whole = 1 - rank_dim
    if (t.dim() == 2 and stack.dim() == 4 and t.shape[whole] == stack.shape[2 + whole]
            and t.shape[rank_dim] <= stack.shape[2 + rank_dim]):
        return int(t.shape[rank_dim])
    return None


def _wrap_reset(reset: Any) -> Any:
    def reset_lora(self: Any, index: int) -> None:
        if getattr(self, "_mint_defer", False):
            return  # (inside a MinT set_lora: it zeroes what its copy leaves)
        held = _ranks(self, index) if _wrapped(self) and getattr(_state, "mint", False) else None
        if held is None:
            reset(self, index)  # vLLM's own: the whole slot
        else:
            for sa, sb, ra, rb in zip(self.lora_a_stacked, self.lora_b_stacked, *held, strict=True):
                sa[index, 0, :ra] = 0
                sb[index, 0, :, :rb] = 0
        _record(self, index, ([0] * len(self.lora_a_stacked), [0] * len(self.lora_b_stacked)))

    setattr(reset_lora, _MARK, True)
    reset_lora.__wrapped__ = reset  # type: ignore[attr-defined]
    return reset_lora


def _wrap_set(set_lora: Any) -> Any:
    def wrapper(self: Any, index: int, lora_a: Any, lora_b: Any, *args: Any, **kwargs: Any) -> Any:
        new = _shapes(self, lora_a, lora_b)
        held = _ranks(self, index) if new is not None and getattr(_state, "mint", False) else None
        if new is None or held is None:  # vLLM's own way: the whole slot zeroed first
            counts["vllm"] += 1
            out = set_lora(self, index, lora_a, lora_b, *args, **kwargs)
            _record(self, index, new)
            return out
        counts["mint"] += 1
        self._mint_defer = True
        try:
            out = set_lora(self, index, lora_a, lora_b, *args, **kwargs)
        except BaseException:
            self._mint_defer = False
            _record(self, index, None)  # (a copy that failed half-way: vLLM's whole zeroing, as its own would)
            self.reset_lora(index)
            raise
        self._mint_defer = False
        for sa, sb, new_a, new_b, old_a, old_b in zip(self.lora_a_stacked, self.lora_b_stacked, *new, *held,
                                                      strict=True):
            if old_a > new_a:
                sa[index, 0, new_a:old_a] = 0  # rows the copy did not write
            if old_b > new_b:
                sb[index, 0, :, new_b:old_b] = 0
        _record(self, index, new)
        return out

    setattr(wrapper, _MARK, True)
    wrapper.__wrapped__ = set_lora  # type: ignore[attr-defined]
    wrapper.__name__ = "set_lora"
    return wrapper
