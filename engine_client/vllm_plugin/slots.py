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

Where the layer's ``set_lora`` is vLLM's plain copy (``BaseLinearLayerWithLoRA``'s or
``MergedColumnParallelLinearWithLoRA``'s, inherited, nothing else in it), the copies are not
made one call at a time: the wrapper only queues them (the destination views cached per
layer, slot and ranks), and when vLLM's activation loop is done, one ``torch._foreach_copy_``
makes every copy of the adapter and one ``torch._foreach_zero_`` clears what they leave. On a
CPU, building 224 strided views (16 layers, 7 modules) and dispatching 224 copies from Python
cost more than the bytes; vLLM's part of a cold r16 load in ``tools/bench_vllm.py`` went from
11.3 to 6.9 ms with this::

    activate(lora):                                   # vLLM's loop, unchanged
        for each layer: set_lora(i, a, b)             # queued: (A[i, 0, :r], a), (B[i, 0, :, :r], b)
    then: foreach_zero(tails); foreach_copy(dsts, srcs)

A slot whose last occupant is not known is cleared from the new rank up to ``max_rank``: the
same bytes as vLLM's own whole zeroing and copy.

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
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

# .mint: a MinT adapter's activation is in progress on this thread; .batch: its queued copies
_state = threading.local()
_MARK = "_mint_slot_writes"
MAX_VIEWS = 256  # destination views a layer keeps (per slot and ranks: a handful in practice)
Ranks = tuple[list[int], list[int]]  # per slice: rows of A, columns of B written (zero beyond)
# set_lora calls by how the slot was cleared: "mint" (only what the copy left), "vllm" (whole);
# "batched": of the "mint" ones, those whose copies were queued for the activation's one foreach
counts = {"mint": 0, "vllm": 0, "batched": 0}
_PLAIN: set[Any] = set()  # vLLM's set_lora functions that only zero and copy (install fills it)
_RESET: list[Any] = []  # the base class's reset_lora, as wrapped here: a batched layer's is this one


@contextlib.contextmanager
def activating(mint: bool) -> Iterator[None]:
    """While this holds, ``set_lora`` on this thread zeroes only what the copy leaves (``mint``),
    and the plain layers' copies are queued, then made together when it ends."""
    before = getattr(_state, "mint", False), getattr(_state, "batch", None)
    _state.mint = mint
    _state.batch = batch = _Batch() if mint else None
    try:
        yield
    finally:
        _state.mint, _state.batch = before
        if batch is not None:
            batch.flush()  # (also after a failure half-way: the slots as vLLM's loop would have left them)


class _Batch:
    """The copies and clears of one activation, made at its end. Each queued slot is of a layer
    queued once, and its clears and copies are of disjoint regions, so their order does not
    matter; a second write of a queued slot (a set or a reset) makes the batch flush first."""

    __slots__ = ("dst", "queued", "src", "zero")

    def __init__(self) -> None:
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.zero: list[torch.Tensor] = []
        self.queued: dict[tuple[int, int], Any] = {}  # (id(layer), slot) -> layer, for its record

    def holds(self, layer: Any, index: int) -> bool:
        return (id(layer), index) in self.queued

    def add(self, layer: Any, index: int, lora_a: Any, lora_b: Any, new: Ranks, held: Ranks,
            key: tuple[int, ...]) -> None:
        if self.holds(layer, index):
            self.flush()  # (vLLM's loop sets a slot once; anything else writes in the order it is asked)
        self.queued[(id(layer), index)] = layer
        dst_a, dst_b = _views(layer, index, new, key)
        for dst, got in ((dst_a, lora_a), (dst_b, lora_b)):
            for d, t in zip(dst, got if isinstance(got, (list, tuple)) else [got], strict=True):
                if t is not None:
                    self.dst.append(d)
                    self.src.append(t)
        for sa, sb, new_a, new_b, old_a, old_b in zip(layer.lora_a_stacked, layer.lora_b_stacked, *new, *held,
                                                      strict=True):
            if old_a > new_a:
                self.zero.append(sa[index, 0, new_a:old_a])  # rows the copy does not write
            if old_b > new_b:
                self.zero.append(sb[index, 0, :, new_b:old_b])

    def flush(self) -> None:
        """Make the queued clears and copies; if that fails, the queued slots' records are
        dropped (nothing known: the next write clears the whole slot, as vLLM's own would)."""
        zero, dst, src, queued = self.zero, self.dst, self.src, self.queued
        self.zero, self.dst, self.src, self.queued = [], [], [], {}
        try:
            if zero:
                torch._foreach_zero_(zero)
            if not dst:
                return
            if all(d.device.type == "cpu" for d in dst) and all(t.device.type == "cpu" for t in src):
                torch._foreach_copy_(dst, src)  # (one call: no Python dispatch per copy)
            else:  # (a GPU's slots: each copy from pinned memory, async, as vLLM makes it)
                for d, t in zip(dst, src, strict=True):
                    d.copy_(t, non_blocking=True)
        except BaseException:
            for (_, index), layer in queued.items():
                _record(layer, index, None)
            raise


def _flush_for(layer: Any, index: int) -> None:
    """Before a write of slot ``index`` that is not queued: make the queued ones of that slot."""
    batch = getattr(_state, "batch", None)
    if batch is not None and batch.holds(layer, index):
        batch.flush()


def _views(layer: Any, index: int, new: Ranks, key: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The slices of slot ``index`` a copy of ranks ``new`` writes: ``A[index, 0, :r]`` and
    ``B[index, 0, :, :r]`` per slice, cached on the layer for its current stacks."""
    book = layer.__dict__.get("_mint_views")
    if book is None or book[0] != key:
        book = (key, dict[Any, Any]())
        layer.__dict__["_mint_views"] = book
    at = (index, tuple(new[0]), tuple(new[1]))
    got: tuple[list[torch.Tensor], list[torch.Tensor]] | None = book[1].get(at)
    if got is None:
        if len(book[1]) >= MAX_VIEWS:
            book[1].clear()
        got = ([sa[index, 0, :ra] for sa, ra in zip(layer.lora_a_stacked, new[0], strict=True)],
               [sb[index, 0, :, :rb] for sb, rb in zip(layer.lora_b_stacked, new[1], strict=True)])
        book[1][at] = got
    return got


def install() -> int:
    """Wrap ``reset_lora`` and every ``set_lora`` of vLLM's linear LoRA layers (once); the classes wrapped."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.column_parallel_linear import MergedColumnParallelLinearWithLoRA

    base = BaseLinearLayerWithLoRA
    for cls in (base, MergedColumnParallelLinearWithLoRA):  # (their own: a copy per slice after a reset)
        fn = vars(cls)["set_lora"]
        fn = getattr(fn, "__wrapped__", fn) if getattr(fn, _MARK, False) else fn
        if getattr(fn, "__module__", "").startswith("vllm.lora.layers."):  # (not another plugin's wrapper)
            _PLAIN.add(fn)
    if not getattr(base.reset_lora, _MARK, False):
        base.reset_lora = _wrap_reset(base.reset_lora)
    _RESET[:] = [vars(base)["reset_lora"]]
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
    return tuple([t.data_ptr() for t in (*layer.lora_a_stacked, *layer.lora_b_stacked)])


# (the layer's own attributes are read from its __dict__: a missing one through getattr costs
# nn.Module's and vLLM's __getattr__ fallbacks, tens of microseconds a call, 64 layers a load)
def _ranks(layer: Any, index: int, key: tuple[int, ...] | None = None) -> Ranks | None:
    """The ranks slot ``index``'s A and B slices hold (rows of A, columns of B beyond are zero);
    None where nothing is known (anything up to max_rank). ``key``: :func:`_stacks` of the layer."""
    book = layer.__dict__.get("_mint_ranks")
    if book is None or book[0] != (key or _stacks(layer)):  # (never recorded, or vLLM reallocated the stacks)
        return None
    got: Ranks | None = book[1].get(index)
    return got


def _full(layer: Any) -> Ranks:
    """Every row of A and column of B of a slot: what a slot nothing is known of may hold."""
    return [s.shape[2] for s in layer.lora_a_stacked], [s.shape[3] for s in layer.lora_b_stacked]


def _record(layer: Any, index: int, ranks: Ranks | None, key: tuple[int, ...] | None = None) -> None:
    key = key or _stacks(layer)
    book = layer.__dict__.get("_mint_ranks")
    if book is None or book[0] != key:
        book = (key, dict[int, Ranks]())
        layer.__dict__["_mint_ranks"] = book
    if ranks is None:
        book[1].pop(index, None)
    else:
        book[1][index] = ranks


Geometry = tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]  # per slice: A's, B's (rows, cols)


def _geometry(layer: Any, key: tuple[int, ...]) -> Geometry | None:
    """Per slice, the ``(rows, cols)`` of A's and of B's stack (``[slots, 1, rows, cols]``); None
    where vLLM's copy may write other than whole rows of A and columns of B (tensor parallelism,
    fully sharded LoRA: the rank dimension is sliced). Kept for the layer's current stacks."""
    got = layer.__dict__.get("_mint_geometry")
    if got is not None and got[0] == key:
        return cast("Geometry | None", got[1])
    stacks_a, stacks_b = layer.lora_a_stacked, layer.lora_b_stacked
    geo: Geometry | None = None
    if (getattr(layer, "tp_size", 1) == 1
            and not getattr(getattr(layer, "lora_config", None), "fully_sharded_loras", False)
            and all(t.dim() == 4 for t in (*stacks_a, *stacks_b)) and len(stacks_a) == len(stacks_b)):
        geo = (tuple((t.shape[2], t.shape[3]) for t in stacks_a), tuple((t.shape[2], t.shape[3]) for t in stacks_b))
    layer.__dict__["_mint_geometry"] = (key, geo)
    return geo


def _shapes(layer: Any, lora_a: Any, lora_b: Any, key: tuple[int, ...] | None = None) -> Ranks | None:
    """The ranks vLLM's copy writes per slice, where it writes whole rows of A (``a``: [r, in])
    and columns of B (``b``: [out, r]), one tensor (or None) per slice; None otherwise."""
    geo = _geometry(layer, key or _stacks(layer))
    if geo is None:
        return None
    a_list = lora_a if isinstance(lora_a, (list, tuple)) else [lora_a]
    b_list = lora_b if isinstance(lora_b, (list, tuple)) else [lora_b]
    if not len(a_list) == len(b_list) == len(geo[0]):
        return None  # (vLLM expands packed groups itself: expand_packed_lora)
    ra, rb = _written(a_list, geo[0], 0), _written(b_list, geo[1], 1)
    return None if ra is None or rb is None else (ra, rb)


def _written(tensors: Sequence[Any], stacks: tuple[tuple[int, int], ...], rank_dim: int) -> list[int] | None:
    """Per slice, the rank a copy of its tensor writes (0: no tensor), where it covers whole rows
    (A: ``[r, in]``, ``rank_dim`` 0) or columns (B: ``[out, r]``, ``rank_dim`` 1) of its stack's
    ``(rows, cols)``; None otherwise."""
    whole = 1 - rank_dim
    out: list[int] = []
    for t, dims in zip(tensors, stacks, strict=True):
        if t is None:
            out.append(0)
            continue
        shape = t.shape
        if len(shape) != 2 or shape[whole] != dims[whole] or shape[rank_dim] > dims[rank_dim]:
            return None
        out.append(int(shape[rank_dim]))
    return out


def _wrap_reset(reset: Any) -> Any:
    def reset_lora(self: Any, index: int) -> None:
        if self.__dict__.get("_mint_defer", False):
            return  # (inside a MinT set_lora: it zeroes what its copy leaves)
        _flush_for(self, index)
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
    plain = set_lora in _PLAIN  # vLLM's copy alone: the activation may make it with the others

    def wrapper(self: Any, index: int, lora_a: Any, lora_b: Any, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_mint_defer", False):
            return set_lora(self, index, lora_a, lora_b, *args, **kwargs)  # (a subclass's, calling up: it clears)
        key = _stacks(self)
        new = _shapes(self, lora_a, lora_b, key)
        mint = new is not None and getattr(_state, "mint", False)
        batch = getattr(_state, "batch", None)
        # (batched only where the class's reset is the base one too: nothing of its own is skipped)
        if mint and batch is not None and plain and not args and not kwargs and type(self).reset_lora in _RESET:
            assert new is not None
            last = _ranks(self, index, key) or _full(self)  # (nothing known: all of it, as vLLM's reset)
            counts["mint"] += 1
            counts["batched"] += 1
            batch.add(self, index, lora_a, lora_b, new, last, key)
            _record(self, index, new, key)
            return None
        _flush_for(self, index)  # (a write of its own: after what was queued for this slot)
        held = _ranks(self, index, key) if mint else None
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
