"""The engine's device side: one slot pool per layout, the layer hooks, pins and batch indices.

:class:`PoolSet` is the bookkeeping that :class:`~engine_client.engine.lora_engine.LoRAEngine` does
around its forward path: which layouts have a device pool (under the byte budget of
:mod:`engine_client.device.pool_budget`), which adapters sit in which slots, which slots a batch
or a user pin holds, and the per-layout index tensors the wrapped layers read. Every
method is thread-safe (one reentrant lock); fetching a layout is the one blocking I/O and
runs outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mint_store import Location
from mint_store.format.layout import Layout
from mint_store.storage import LocalStorage

from ..engine.lora_layers import BatchContext, ExpertsLoRA, LayoutBatch, LinearLoRA, attach
from ..engine.metrics import Metrics
from ..engine.targets import Target, check_layout
from ..errors import OutOfSlots
from ..kernels.ops import progression_of
from ..stream.streamer import RowLease
from ..tp.reads import SliceReader
from ..tp.sharding import SlicedPool, TPModel, check_tp_layout, experts_hook, linear_hook
from .device_pool import DevicePool
from .pool_budget import PoolBudget

Held = list[tuple[DevicePool, int]]  # (pool, slot) pairs a batch or a pin holds


class PoolSet:
    """Device pools by layout id, the hooks that route them into ``model``, and their pins.

    Parameters
    ----------
    model
        The model the hooks wrap (in place, on first use of each target module).
    targets
        The model's LoRA targets (:func:`~engine_client.engine.targets.model_targets`).
    device
        Where the slots live.
    slots
        Slots per layout.
    device_bytes
        All pools together at most this many bytes (None: no limit); idle pools go LRU.
    fetch_layout
        ``layout_id -> Layout``: fetches a layout's table (blocking; called without the lock).
    check_base
        ``(layout, who)``: raises if the engine must refuse adapters of ``layout.base``.
    metrics
        Where device hits are counted.
    tp
        The model's tensor-parallel plan, or None.
    """

    def __init__(self, model: nn.Module, targets: dict[str, Target], device: torch.device, *, slots: int,
                 device_bytes: int | None, fetch_layout: Callable[[str], Layout],
                 check_base: Callable[[Layout, str], None], metrics: Metrics, tp: TPModel | None) -> None:
        self.model = model
        self.targets = targets
        self.device = device
        self.slots = slots
        self.metrics = metrics
        self.tp = tp
        self._fetch_layout = fetch_layout
        self._check_base = check_base
        self._linear_hook = None if tp is None else linear_hook(tp)
        self._experts_hook = None if tp is None else experts_hook(tp)
        self._slices = SliceReader()  # slice digests: a rank re-reads only its slice of a row
        self.lock = threading.RLock()  # pools, hooks, layouts
        self.layouts: dict[str, Layout] = {}
        self.pools: dict[str, DevicePool] = {}
        self.budget = PoolBudget(device_bytes)
        self.hooks: dict[str, LinearLoRA | ExpertsLoRA] = {}
        self._index: dict[str, torch.Tensor] = {}  # layout id -> int64 device buffer, reused per batch
        # layout id -> (slots per sequence, the LayoutBatch over _index[lid] that holds them): a
        # batch with the same slots as the last one of its layout (a switch into the same slot,
        # a decode loop) reuses it, with no tensor made and no copy
        self._last: dict[str, tuple[tuple[int, ...], LayoutBatch]] = {}

    # -- pools by layout ------------------------------------------------------------------------

    def acquire(self, locs: dict[str, Location]) -> list[str]:
        """The layouts of ``locs``, each with its device pool, marked in use so that no other
        layout's pool pushes it out; the caller passes the list to :meth:`done`.

        Pools still missing are planned together: the idle pools that must go for all of them
        to fit are chosen before any is dropped, so a refusal changes nothing.
        """
        first: dict[str, str] = {}  # layout id -> the first ref that needs it (named in errors)
        for r, loc in locs.items():
            first.setdefault(loc.layout_id, r)
        with self.lock:
            pooled = {lid for lid in first if lid in self.pools}
            if len(pooled) == len(first):  # the common case: every layout has its pool
                for lid in first:
                    self.budget.use(lid)
                return list(first)
        # fetch and check only what has no pool (a batch of known layouts pays for neither),
        # outside the lock: fetching is I/O
        layouts = {lid: self.layout(lid, r) for lid, r in first.items() if lid not in pooled}
        lids: list[str] = []
        with self.lock:
            try:
                for lid in first:
                    if lid in self.pools:  # in use from here: the plan below cannot drop it
                        self.budget.use(lid)
                        lids.append(lid)
                new = [lid for lid in first if lid not in self.pools]
                for lid in new:  # a pool dropped since the look above: its layout was checked when it was made
                    layouts.setdefault(lid, self.layouts[lid])
                need = sum(self.slots * layouts[lid].row_nbytes for lid in new)
                for old in self.budget.to_drop(self.pools, new, need) if new else []:
                    self._drop(old)
                for lid in new:
                    with torch.inference_mode(False):  # pools outlive any inference_mode block
                        pool = self._new_pool(layouts[lid])
                    attach(pool, self.model, self.targets, self.hooks, self._linear_hook, self._experts_hook)
                    self.pools[lid] = pool
                    self.budget.use(lid)
                    lids.append(lid)
            except BaseException:
                self.done(lids)
                raise
        return lids

    def done(self, layout_ids: list[str]) -> None:
        with self.lock:
            for lid in layout_ids:
                self.budget.done(lid)
        layout_ids.clear()

    def unwind(self, held: Held, layout_ids: list[str]) -> None:
        try:
            self.release(held)
        finally:
            self.done(layout_ids)

    def layout(self, layout_id: str, ref: str) -> Layout:
        """``layout_id``'s table, fetched once, checked against the model and the engine's base."""
        layout = self.layouts.get(layout_id)
        if layout is None:
            layout = self._fetch_layout(layout_id)
        who = f"adapter {ref!r} (layout {layout_id})"
        self._check_base(layout, who)
        check_layout(layout, self.targets, what=who)
        if self.tp is not None:
            check_tp_layout(layout, self.targets, self.tp, what=who)
        with self.lock:
            self.layouts[layout_id] = layout
        return layout

    def _new_pool(self, layout: Layout) -> DevicePool:
        if self.tp is None:
            return DevicePool(layout, self.slots, self.device)
        return SlicedPool(layout, self.targets, self.tp, self.slots, self.device, self._slices)

    def _drop(self, layout_id: str) -> None:
        """Forget an idle layout's pool (the budget chose it): its adapters load again on next use."""
        self.pools.pop(layout_id).retire()
        self._index.pop(layout_id, None)
        self._last.pop(layout_id, None)
        self.budget.forget(layout_id)
        for hook in self.hooks.values():
            hook.drop(layout_id)

    # -- slots ------------------------------------------------------------------------------------

    def pin_resident(self, locs: dict[str, Location], held: Held) -> list[Location]:
        """Pin the adapters already in slots (device hits); return the rows still to upload."""
        by_layout: dict[str, dict[str, Location]] = {}
        for loc in locs.values():
            by_layout.setdefault(loc.layout_id, {})[loc.content_id] = loc
        missing: list[Location] = []
        with self.lock:
            for lid, rows in by_layout.items():
                pool = self.pools[lid]
                if len(rows) > pool.slots:
                    raise OutOfSlots(f"this batch needs {len(rows)} distinct adapters of layout {lid} but its "
                                     f"device pool has {pool.slots} slots; raise slots= or split the batch")
                new = []
                for cid, loc in rows.items():
                    slot = pool.slot_of(cid)
                    if slot is None:
                        new.append(loc)
                        continue
                    pool.pin(slot)
                    pool.touch(slot)
                    held.append((pool, slot))
                    self.metrics.record("device", loc.length, 0.0)
                if len(new) > pool.available():
                    raise OutOfSlots(f"this batch needs {len(new)} more slots of layout {lid} but only "
                                     f"{pool.available()} are not pinned (by pin() or another batch)")
                missing.extend(new)
        return missing

    def install(self, lease: RowLease, held: Held | None) -> None:
        """Copy a streamed row into a slot of its layout's pool (unless one holds it) and pin it into ``held``."""
        fence = None
        try:
            loc = lease.loc
            with self.lock:
                pool = self.pools[loc.layout_id]
                slot = pool.slot_of(loc.content_id)
                if slot is None:  # (a prefetch may have loaded it meanwhile)
                    slot = pool.assign(loc.content_id)
                    try:
                        fence = pool.load(slot, lease.tensor)
                    except BaseException:
                        pool.evict(loc.content_id)
                        raise
                if held is not None:
                    pool.pin(slot)
                    held.append((pool, slot))
        finally:
            lease.release(fence)

    def read_into_slot(self, loc: Location, store: Any, held: Held | None, *, verify: bool = True) -> str | None:
        """Read the row of ``loc`` from a local ``store`` straight into a slot of a CPU pool and
        pin it into ``held``: ``"read"``, or ``"resident"`` when a slot already held it (another
        thread loaded it meanwhile: nothing read). None (nothing done) where the pool is not a
        whole-row CPU pool or the store's packs are not on local disk (where the page cache is
        the host cache).

        On the CPU a slot is host memory already: a read into the host cache and then a copy
        into the slot would be two passes over the row where one does (DESIGN: one read, one
        verify, one copy). The row is verified as it lands (:func:`mint_store.read.read_verified`);
        a row that fails leaves the slot free. The host cache does not get a copy (``prefetch``
        with ``device=False`` still warms it).
        """
        if not isinstance(store.storage, LocalStorage):  # (a remote row is worth its host-cache copy)
            return None
        with self.lock:
            pool = self.pools[loc.layout_id]
            rows = pool.host_rows
            if rows is None or loc.length != pool.row_nbytes:
                return None
            slot = pool.slot_of(loc.content_id)
            how = "resident" if slot is not None else "read"
            if slot is None:
                slot = pool.assign(loc.content_id)
                try:
                    store.read_row(loc, rows[slot], verify=verify)  # [S] of data[slot], in place
                except BaseException:
                    pool.evict(loc.content_id)
                    raise
                pool.loads += 1
            if held is not None:
                pool.pin(slot)
                held.append((pool, slot))
        return how

    def release(self, held: Held) -> None:
        with self.lock:
            for pool, slot in held:
                pool.mark_used([slot])
                pool.unpin(slot)
        held.clear()

    def pick_for_device(self, locs: list[Location]) -> tuple[list[Location], list[Location]]:
        """(rows to upload now, rows only to warm in the host cache): slots are not overfilled."""
        to_device: list[Location] = []
        rest: list[Location] = []
        seen: set[str] = set()
        room: dict[str, int] = {}
        with self.lock:
            for loc in locs:
                pool = self.pools[loc.layout_id]
                if loc.content_id in seen or loc.content_id in pool:
                    continue
                seen.add(loc.content_id)
                left = room.setdefault(loc.layout_id, pool.available())
                if left > 0:
                    room[loc.layout_id] = left - 1
                    to_device.append(loc)
                else:
                    rest.append(loc)
        return to_device, rest

    def resident(self) -> dict[str, list[str]]:
        """Layout id -> content ids in its device slots, least recently used first."""
        with self.lock:
            return {lid: pool.resident() for lid, pool in self.pools.items()}

    # -- one batch's routing ------------------------------------------------------------------

    def context(self, adapters: list[str | None], locs: dict[str, Location], n: int, held: Held) -> BatchContext:
        """The slot index of every sequence, per layout, in the reused device buffers."""
        seqs: dict[str, list[int]] = {}
        with self.lock:
            for i, ref in enumerate(adapters):
                if ref is None:
                    continue
                loc = locs[ref]
                slot = self.pools[loc.layout_id].slot_of(loc.content_id)
                seqs.setdefault(loc.layout_id, [-1] * n)[i] = -1 if slot is None else slot
            layouts = {}
            for lid, seq in seqs.items():
                key = tuple(seq)
                last = self._last.get(lid)
                if last is not None and last[0] == key:
                    layouts[lid] = last[1]
                    continue
                active = [i for i, s in enumerate(seq) if s >= 0]
                host = torch.tensor(seq + active + [seq[i] for i in active], dtype=torch.int64)
                buf = self._index_buffer(lid, host.numel())
                buf[: host.numel()].copy_(host)  # in place: no allocation per batch
                a = len(active)
                layouts[lid] = LayoutBatch(buf[:n], buf[n : n + a], buf[n + a : n + 2 * a], a,
                                           progression_of([seq[i] for i in active]))
                self._last[lid] = (key, layouts[lid])
            for pool, slot in held:
                pool.wait_ready([slot])
        return BatchContext(n, layouts)

    def _index_buffer(self, layout_id: str, size: int) -> torch.Tensor:
        buf = self._index.get(layout_id)
        if buf is None or buf.numel() < size:
            with torch.inference_mode(False):
                buf = torch.empty(max(64, 1 << (size - 1).bit_length()), dtype=torch.int64, device=self.device)
            self._index[layout_id] = buf
        return buf

    def detach(self) -> None:
        """Unwrap the model: hooks removed, experts' forwards restored, pools forgotten."""
        with self.lock:
            for hook in self.hooks.values():
                hook.remove()
            self.hooks.clear()
            for pool in self.pools.values():  # uploads still in flight land before the memory is reused
                pool.retire()
            self.pools.clear()
            self._index.clear()
            self._last.clear()
            self.budget.forget_all()  # in-flight batches still give back their uses
