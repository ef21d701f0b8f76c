"""Device slots for the adapters of one layout: one ``[slots, S]`` byte tensor.

Every module's stacked factors are strided views into that tensor, made once::

    data      [slots, S]          uint8, S = the layout's row bytes
    a         [slots, r, in]      (fused experts: [slots, E, r, in])
    b         [slots, out, r]     (fused experts: [slots, E, out, r])
    scaling   [slots, n_modules]  float32

so loading an adapter is one ``copy_`` of its row into ``data[slot]`` and the kernels see
it at once, with no per-tensor unpacking. On CUDA the copy runs ``non_blocking`` from
pinned memory on a side stream; the compute stream waits on its event before the next
batch reads the slot (:meth:`DevicePool.wait_ready`), and an upload into a slot waits for
the last batch that read it (:meth:`DevicePool.mark_used`).

Slots are kept least-recently-used first; pinned slots (a running batch holds them, or
the user pinned an adapter) are never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from mint_store.format.layout import DTYPES, Layout, ModuleSpec, TensorSpec

from ..errors import OutOfSlots


@dataclass(frozen=True, slots=True)
class ModuleViews:
    """One module's stacks in a pool (views: they follow every load)."""

    spec: ModuleSpec
    a: torch.Tensor  # [slots, r, in] or [slots, E, r, in]
    b: torch.Tensor  # [slots, out, r] or [slots, E, out, r]
    scaling: torch.Tensor  # [slots] float32, this module's column of the scaling table


class DevicePool:
    """``DevicePool(layout, slots, device)``: LRU slots for rows of ``layout``."""

    def __init__(self, layout: Layout, slots: int, device: torch.device | str) -> None:
        if slots < 1:
            raise ValueError("a device pool needs at least one slot")
        self.layout = layout
        self.slots = slots
        self.device = torch.device(device)
        # zeros, not empty: an unused slot must hold finite numbers (the kernels gather slot 0
        # for tokens without adapter and mask the result)
        self.data = torch.zeros(slots, layout.row_nbytes, dtype=torch.uint8, device=self.device)  # [slots, S]
        self.scaling = self._view(layout.scaling)  # [slots, n_modules]
        self.modules: dict[str, ModuleViews] = {
            m.name: ModuleViews(m, self._view(m.a), self._view(m.b), self.scaling[:, m.index])
            for m in layout.modules
        }
        self._slot_of: dict[str, int] = {}  # content id -> slot
        self._content: list[str | None] = [None] * slots
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident slots, least recently used first
        self._pins = [0] * slots
        self._pinned = 0  # slots with a pin: available() stays O(1) at thousands of slots
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.loads = 0
        self._stream: Any = None
        self._ready: dict[int, Any] = {}  # slot -> event of its upload
        self._last_use: dict[int, Any] = {}  # slot -> event after the last batch that read it
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
        # on the CPU: the slots as one numpy array (shared memory), so a row can be read into
        # ``host_rows[slot]`` directly; None where a slot is not plain host memory of a whole row
        self.host_rows: Any = self.data.numpy() if self.device.type == "cpu" and self._whole_rows() else None

    def _view(self, t: TensorSpec) -> torch.Tensor:
        # [slots, nbytes] -> [slots, numel] of the dtype -> [slots, *shape]; S and offsets are
        # multiples of 64, so the byte strides divide by every itemsize
        cols = self.data[:, t.offset : t.offset + t.nbytes]
        return cols.view(DTYPES[t.dtype][0]).view(self.slots, *t.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def layout_id(self) -> str:
        """The stored layout whose rows this pool takes (batches and hooks are keyed by it)."""
        return self.layout.layout_id

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row as :meth:`load` takes it."""
        return self.layout.row_nbytes

    # -- residency -------------------------------------------------------------------------

    def __contains__(self, content_id: str) -> bool:
        return content_id in self._slot_of

    @property
    def pinned_slots(self) -> int:
        return self._pinned

    def retire(self) -> None:
        """Before the engine lets go of the slots: later work on the compute stream waits for
        uploads still in flight on the side stream (the caching allocator hands a freed block
        to the compute stream at once, and a pending copy must not land in its next owner)."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def slot_of(self, content_id: str) -> int | None:
        return self._slot_of.get(content_id)

    def content_of(self, slot: int) -> str | None:
        return self._content[slot]

    def resident(self) -> list[str]:
        """Content ids in slots, least recently used first."""
        return [c for s in self._lru if (c := self._content[s]) is not None]

    def touch(self, slot: int) -> None:
        self._lru.move_to_end(slot)

    def pinned(self, slot: int) -> bool:
        return self._pins[slot] > 0

    def pin(self, slot: int) -> None:
        if slot not in self._lru:
            raise RuntimeError(f"slot {slot} holds no adapter; assign() it before pinning")
        if self._pins[slot] == 0:
            self._pinned += 1
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        if self._pins[slot] == 0:
            raise RuntimeError(f"slot {slot} is not pinned")
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._pinned -= 1

    def available(self) -> int:
        """Slots a new adapter could take now (free or evictable)."""
        return len(self._free) + len(self._lru) - self._pinned

    def assign(self, content_id: str) -> int:
        """A slot for ``content_id``: a free one, else the least recently used unpinned one.

        The caller loads the row next (or calls :meth:`evict` if that fails).
        """
        if content_id in self._slot_of:
            raise ValueError(f"{content_id} already has slot {self._slot_of[content_id]}")
        if self._free:
            slot = self._free.pop()
        else:
            slot = next((s for s in self._lru if not self._pins[s]), -1)
            if slot < 0:
                raise OutOfSlots(
                    f"all {self.slots} device slots of layout {self.layout.layout_id} are pinned by running "
                    "batches or by pin(); unpin adapters or give the engine more slots"
                )
            old = self._content[slot]
            if old is not None:
                del self._slot_of[old]
        self._content[slot] = content_id
        self._slot_of[content_id] = slot
        self._lru[slot] = None
        self._lru.move_to_end(slot)
        return slot

    def evict(self, content_id: str) -> None:
        slot = self._slot_of.pop(content_id)
        if self._pins[slot]:
            self._slot_of[content_id] = slot
            raise RuntimeError(f"slot {slot} ({content_id}) is pinned")
        self._content[slot] = None
        del self._lru[slot]
        self._free.append(slot)

    # -- upload -----------------------------------------------------------------------------

    def load(self, slot: int, row: torch.Tensor, *, sliced: bool = False) -> Any:
        """Copy one row (uint8 ``[S]``) into ``slot``: exactly one ``copy_``.

        ``sliced``: ``row`` is already this rank's slice (a tensor-parallel pool read by
        ranges); said, not guessed from its size, which can equal the whole row's.
        Returns the CUDA event that marks the end of the copy (None off CUDA): the source
        row must not be reused before it.
        """
        if row.dtype != torch.uint8 or not self._takes(row, sliced):
            raise ValueError(f"a row of this layout is uint8 [{self.row_nbytes}], got {row.dtype} "
                             f"{tuple(row.shape)}")
        self.loads += 1
        if self._stream is None:
            self._copy_row(slot, row, False, sliced)
            return None
        side = self._stream
        last = self._last_use.pop(slot, None)
        if last is not None:
            side.wait_event(last)  # a queued kernel may still read the adapter we overwrite
        with torch.cuda.stream(side):
            self._copy_row(slot, row, row.is_pinned(), sliced)
            done = torch.cuda.Event()
            done.record(side)
        self._ready[slot] = done
        return done

    def _whole_rows(self) -> bool:
        """A slot holds a whole row (a tensor-parallel pool holds its rank's slice)."""
        return True

    def _takes(self, row: torch.Tensor, sliced: bool) -> bool:
        return not sliced and row.shape == (self.row_nbytes,)

    def _copy_row(self, slot: int, row: torch.Tensor, non_blocking: bool, sliced: bool) -> None:
        self.data[slot].copy_(row, non_blocking=non_blocking)  # [S]

    def wait_ready(self, slots: list[int]) -> None:
        """Make the current (compute) stream wait for the uploads into ``slots``."""
        if self._stream is None:
            return
        cur = torch.cuda.current_stream(self.device)
        for s in slots:
            ev = self._ready.pop(s, None)
            if ev is not None:
                cur.wait_event(ev)

    def mark_used(self, slots: list[int]) -> None:
        """Record that work queued on the current stream reads ``slots``."""
        if self._stream is None or not slots:
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        for s in slots:
            self._last_use[s] = ev
