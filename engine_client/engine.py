"""``LoRAEngine``: many adapters in one batch of a transformers model, streamed from MinT Store.

    engine = LoRAEngine(model, MintClient("/data/mint"), slots=64)
    await engine.prefetch(["acme/chat:prod", "acme/code@3"])          # optional warm-up
    out = engine.forward(ids, adapters=["acme/chat:prod", None, "acme/code@3"])
    out.logits                                                        # what the model returns
    tokens = engine.generate(ids, adapters=[...], max_new_tokens=32)  # per-sequence adapters

The path of an adapter, once per switch: ref -> location (cached; one batched resolve)
-> row read once into a pinned host buffer (verified, LRU host cache by content id) ->
one copy into a device slot of its layout's pool -> the wrapped layers gather it by slot
index (see :mod:`engine_client.modules` for how the indices reach them). Adapters of
different layouts (rank 1 and rank 16, different targets) run in one batch: one pool and
one kernel call per layout.

An adapter's layout is checked against the model before its first use
(:class:`~engine_client.errors.LayoutMismatch` names the first module that does not fit).
With ``follow=True`` the engine follows the store's change feed: a tag or ``latest`` that
moves is re-resolved and prefetched in the background and takes effect when the next
batch starts; a running batch finishes on the version it started with.

Threads: the client and the streamer run on the engine's own I/O loop (the engine owns
``client`` and closes it in :meth:`close`; to use it meanwhile, go through
:meth:`call`). ``forward``/``generate`` are synchronous and run one batch at a time.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from mint_store.adapter import UNSPECIFIED_BASE
from mint_store.errors import BlobNotFound, MintError, StaleLocation
from mint_store.layout import Layout
from mint_store.records import Location

from ._aio import IOThread
from .client import MintClient
from .device_pool import DevicePool
from .errors import BatchMismatch, EngineClosed, LayoutMismatch, OutOfSlots
from .follow import FeedFollower
from .host_pool import HostPool
from .kernels import progression_of
from .metrics import Metrics
from .modules import BatchContext, ExpertsLoRA, LayoutBatch, LinearLoRA, attach, current_batch, use_batch
from .pool_budget import PoolBudget
from .refs import RefTable
from .streamer import RowLease, Streamer, StreamerConfig, consume_in_thread
from .targets import check_layout, model_targets
from .tp import SlicedPool, TPModel, check_tp_layout, experts_hook, linear_hook, tp_model
from .tp_batch import prepare_batch
from .tp_reads import SliceReader

T = TypeVar("T")
Held = list[tuple[DevicePool, int]]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    slots: int = 16  # device slots per layout
    device_bytes: int | None = None  # all layouts' pools together (None: no limit); idle pools go LRU
    host_bytes: int = 256 * 2**20  # pinned host pool
    cache_bytes: int | None = None  # host cache budget inside it (None: all of it)
    concurrency: int = 16  # storage reads in flight
    base: str | None = None  # refuse adapters published for another base
    follow_wait: float = 10.0  # long-poll of the change feed, seconds

    def __post_init__(self) -> None:
        if self.slots < 1 or self.host_bytes < 1 or self.concurrency < 1:
            raise ValueError("slots, host_bytes and concurrency must be >= 1")
        if self.device_bytes is not None and self.device_bytes < 1:
            raise ValueError("device_bytes must be >= 1 (or None for no limit)")


class LoRAEngine:
    """Wraps ``model`` in place; adapters come from ``client`` (a :class:`MintClient` or its URL).

    Options: ``slots`` per layout on ``device`` (default: the model's), at most ``device_bytes``
    of slots over all layouts (idle layouts' pools are dropped, least recently used first), a
    pinned host pool of ``host_bytes`` holding an LRU row cache of ``cache_bytes``,
    ``concurrency`` storage reads in flight, ``base`` to refuse adapters of another base,
    ``follow`` the change feed.
    """

    def __init__(
        self,
        model: nn.Module,
        client: MintClient | str | os.PathLike[str],
        *,
        slots: int = 16,
        device: torch.device | str | None = None,
        device_bytes: int | None = None,
        host_bytes: int = 256 * 2**20,
        cache_bytes: int | None = None,
        concurrency: int = 16,
        base: str | None = None,
        follow: bool = False,
        follow_wait: float = 10.0,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        self.config = EngineConfig(slots=slots, device_bytes=device_bytes, host_bytes=host_bytes,
                                   cache_bytes=cache_bytes, concurrency=concurrency, base=base,
                                   follow_wait=follow_wait)
        self.model = model
        if device is None:
            param = next(model.parameters(), None)
            self.device = param.device if param is not None else torch.device("cpu")
        else:
            self.device = torch.device(device)
            param = next(model.parameters(), None)
            # the base stays resident where the slots are; a model on the meta device (shapes
            # only, as load benchmarks use) stays there
            if param is not None and param.device.type != "meta" and param.device != self.device:
                model.to(self.device)
        self.client = client if isinstance(client, MintClient) else MintClient(client, **(client_options or {}))
        self.metrics = Metrics()
        self.host_pool = HostPool(host_bytes, pin=self.device.type == "cuda")  # pinned only for DMA
        self.streamer = Streamer(self.client, self.host_pool, metrics=self.metrics,
                                 config=StreamerConfig(concurrency=concurrency, cache_bytes=cache_bytes))
        self._io = IOThread()
        self._targets = model_targets(model)
        # a model transformers loaded with tp_plan: slots hold this rank's slices, rank 0 decides batches
        self._tp: TPModel | None = tp_model(model)
        self._linear_hook = None if self._tp is None else linear_hook(self._tp)
        self._experts_hook = None if self._tp is None else experts_hook(self._tp)
        self._slices = SliceReader()  # slice digests: a rank re-reads only its slice of a row
        self._layouts: dict[str, Layout] = {}
        self._pools: dict[str, DevicePool] = {}
        self._budget = PoolBudget(self.config.device_bytes)
        self._hooks: dict[str, LinearLoRA | ExpertsLoRA] = {}
        self._index: dict[str, torch.Tensor] = {}  # layout id -> int64 device buffer, reused per batch
        self._refs = RefTable()
        self._lock = threading.RLock()  # pools, hooks, layouts
        self._batch_lock = threading.Lock()  # one batch at a time (the index buffers are shared)
        self._user_pins: dict[str, Held] = {}
        self._feed = FeedFollower(self.client, self.streamer, self._refs, self._io, wait=follow_wait)
        self._closed = False
        if follow:
            self.follow()

    # -- running batches ----------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None = None, adapters: Sequence[str | None] | None = None,
                **model_kwargs: Any) -> Any:
        """``model(input_ids, **model_kwargs)`` with sequence ``i`` running ``adapters[i]`` (None: base)."""
        n = _batch_size(input_ids, model_kwargs)
        with self.batch([None] * n if adapters is None else adapters, batch_size=n):
            if input_ids is None:
                return self.model(**model_kwargs)
            return self.model(input_ids=input_ids, **model_kwargs)

    def generate(self, input_ids: torch.Tensor | None = None, adapters: Sequence[str | None] | None = None,
                 **generate_kwargs: Any) -> Any:
        """``model.generate`` with a per-sequence adapter list; every step uses the same slots."""
        n = _batch_size(input_ids, generate_kwargs)
        with self.batch([None] * n if adapters is None else adapters, batch_size=n):
            gen: Any = self.model.generate
            if input_ids is None:
                return gen(**generate_kwargs)
            return gen(input_ids=input_ids, **generate_kwargs)

    @contextmanager
    def batch(self, adapters: Sequence[str | None], *, batch_size: int | None = None) -> Iterator[BatchContext]:
        """Load and pin ``adapters`` and route them to the model's calls made inside the block."""
        self._check_open()
        if current_batch() is not None:  # (the batch lock is not reentrant: fail, don't hang)
            raise RuntimeError("a LoRA batch is already running in this thread; batches do not nest")
        adapters = list(adapters)
        n = len(adapters) if batch_size is None else batch_size
        if len(adapters) != n:
            raise BatchMismatch(f"{len(adapters)} adapters for a batch of {n} sequences; give one per sequence "
                                "(None for the base model)")
        for a in adapters:
            if a is not None and not isinstance(a, str):
                raise TypeError(f"adapters are refs (str) or None, got {type(a).__name__}")
        with self._batch_lock:
            ctx, held, lids = self._prepare(adapters, n)
            try:
                with use_batch(ctx):
                    yield ctx
            finally:
                try:
                    self._release(held)
                finally:
                    self._done(lids)

    def _prepare(self, adapters: list[str | None], n: int) -> tuple[BatchContext, Held, list[str]]:
        """The batch's context, its pinned slots and its layouts in use (the caller releases both)."""
        if self._tp is not None:
            return prepare_batch(self, self._tp, adapters, n)
        self._refs.apply_staged()  # hot swaps land here, between batches
        refs = list(dict.fromkeys(a for a in adapters if a is not None))
        for attempt in (0, 1):
            locs = self._resolve(refs)
            lids = self._acquire(locs)
            held: Held = []
            try:
                missing = self._pin_resident(locs, held)
                if missing:
                    self._upload(missing, held)
                return self._context(adapters, locs, n, held), held, lids
            except (StaleLocation, BlobNotFound):
                self._unwind(held, lids)
                if attempt:
                    raise
                self._refs.forget(refs)  # compacted away since we resolved: once more, fresh
            except BaseException:
                self._unwind(held, lids)
                raise
        raise RuntimeError("unreachable")  # pragma: no cover

    def _resolve(self, refs: list[str]) -> dict[str, Location]:
        out: dict[str, Location] = {}
        missing = []
        for r in refs:
            loc = self._refs.get(r)
            if loc is None:
                missing.append(r)
            else:
                out[r] = loc
        if missing:
            epoch = self._refs.epoch
            store = self.client.direct()  # an open local index: one transaction in this thread
            found = (store.resolve_many(missing) if store is not None
                     else self._io.run(self.client.resolve_many(missing)))
            for r, got in zip(missing, found, strict=True):
                if isinstance(got, MintError):
                    raise got
                out[r] = got
                self._refs.put(r, got, epoch)
        return out

    def _acquire(self, locs: dict[str, Location]) -> list[str]:
        """The layouts of ``locs``, each with its device pool, marked in use so that no other
        layout's pool pushes it out; the caller passes the list to :meth:`_done`.

        Pools still missing are planned together: the idle pools that must go for all of them
        to fit are chosen before any is dropped, so a refusal changes nothing.
        """
        first: dict[str, str] = {}  # layout id -> the first ref that needs it (named in errors)
        for r, loc in locs.items():
            first.setdefault(loc.layout_id, r)
        with self._lock:
            pooled = {lid for lid in first if lid in self._pools}
            if len(pooled) == len(first):  # the common case: every layout has its pool
                for lid in first:
                    self._budget.use(lid)
                return list(first)
        # fetch and check only what has no pool (a batch of known layouts pays for neither),
        # outside the lock: fetching is I/O
        layouts = {lid: self._layout(lid, r) for lid, r in first.items() if lid not in pooled}
        lids: list[str] = []
        with self._lock:
            try:
                for lid in first:
                    if lid in self._pools:  # in use from here: the plan below cannot drop it
                        self._budget.use(lid)
                        lids.append(lid)
                new = [lid for lid in first if lid not in self._pools]
                for lid in new:  # a pool dropped since the look above: its layout was checked when it was made
                    layouts.setdefault(lid, self._layouts[lid])
                need = sum(self.config.slots * layouts[lid].row_nbytes for lid in new)
                for old in self._budget.to_drop(self._pools, new, need) if new else []:
                    self._drop(old)
                for lid in new:
                    with torch.inference_mode(False):  # pools outlive any inference_mode block
                        pool = self._new_pool(layouts[lid])
                    attach(pool, self.model, self._targets, self._hooks, self._linear_hook, self._experts_hook)
                    self._pools[lid] = pool
                    self._budget.use(lid)
                    lids.append(lid)
            except BaseException:
                self._done(lids)
                raise
        return lids

    def _done(self, layout_ids: list[str]) -> None:
        with self._lock:
            for lid in layout_ids:
                self._budget.done(lid)
        layout_ids.clear()

    def _unwind(self, held: Held, layout_ids: list[str]) -> None:
        try:
            self._release(held)
        finally:
            self._done(layout_ids)

    def _layout(self, layout_id: str, ref: str) -> Layout:
        """``layout_id``'s table, fetched once, checked against the model and the engine's base."""
        layout = self._layouts.get(layout_id)
        if layout is None:
            layout = self._io.run(self.client.layout(layout_id))
        who = f"adapter {ref!r} (layout {layout_id})"
        if self.config.base is not None and layout.base not in (self.config.base, UNSPECIFIED_BASE):
            raise LayoutMismatch(f"{who} was published for base {layout.base!r}; this engine runs "
                                 f"{self.config.base!r}")
        check_layout(layout, self._targets, what=who)
        if self._tp is not None:
            check_tp_layout(layout, self._targets, self._tp, what=who)
        with self._lock:
            self._layouts[layout_id] = layout
        return layout

    def _new_pool(self, layout: Layout) -> DevicePool:
        if self._tp is None:
            return DevicePool(layout, self.config.slots, self.device)
        return SlicedPool(layout, self._targets, self._tp, self.config.slots, self.device, self._slices)

    def _drop(self, layout_id: str) -> None:
        """Forget an idle layout's pool (the budget chose it): its adapters load again on next use."""
        self._pools.pop(layout_id).retire()
        self._index.pop(layout_id, None)
        self._budget.forget(layout_id)
        for hook in self._hooks.values():
            hook.drop(layout_id)

    def _pin_resident(self, locs: dict[str, Location], held: Held) -> list[Location]:
        """Pin the adapters already in slots (device hits); return the rows still to upload."""
        by_layout: dict[str, dict[str, Location]] = {}
        for loc in locs.values():
            by_layout.setdefault(loc.layout_id, {})[loc.content_id] = loc
        missing: list[Location] = []
        with self._lock:
            for lid, rows in by_layout.items():
                pool = self._pools[lid]
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

    def _upload(self, locs: list[Location], held: Held | None) -> None:
        """Stream rows through the host pool into slots, one copy each; pin them into ``held``."""
        cold = []
        for loc in locs:  # host hits and direct reads go straight to the device, without the I/O loop
            lease = self.streamer.fetch_now(loc, alone=len(locs) == 1)
            if lease is None:
                cold.append(loc)
            else:
                self._install(lease, held)
        if cold:
            consume_in_thread(self.streamer, self._io.submit, cold, lambda lease: self._install(lease, held))

    def _install(self, lease: RowLease, held: Held | None) -> None:
        fence = None
        try:
            loc = lease.loc
            with self._lock:
                pool = self._pools[loc.layout_id]
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

    def _context(self, adapters: list[str | None], locs: dict[str, Location], n: int, held: Held) -> BatchContext:
        seqs: dict[str, list[int]] = {}
        with self._lock:
            for i, ref in enumerate(adapters):
                if ref is None:
                    continue
                loc = locs[ref]
                slot = self._pools[loc.layout_id].slot_of(loc.content_id)
                seqs.setdefault(loc.layout_id, [-1] * n)[i] = -1 if slot is None else slot
            layouts = {}
            for lid, seq in seqs.items():
                active = [i for i, s in enumerate(seq) if s >= 0]
                host = torch.tensor(seq + active + [seq[i] for i in active], dtype=torch.int64)
                buf = self._index_buffer(lid, host.numel())
                buf[: host.numel()].copy_(host)  # in place: no allocation per batch
                a = len(active)
                layouts[lid] = LayoutBatch(buf[:n], buf[n : n + a], buf[n + a : n + 2 * a], a,
                                           progression_of([seq[i] for i in active]))
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

    def _release(self, held: Held) -> None:
        with self._lock:
            for pool, slot in held:
                pool.mark_used([slot])
                pool.unpin(slot)
        held.clear()

    # -- warming, pinning ---------------------------------------------------------------------

    async def prefetch(self, refs: Sequence[str], *, device: bool = True) -> list[Location]:
        """Resolve ``refs`` and bring their rows into the host cache and (``device``) into free slots."""
        self._check_open()
        refs = list(refs)
        epoch = self._refs.epoch
        locs: list[Location] = await asyncio.wrap_future(self._io.submit(self.streamer.resolve(refs)))
        for r, loc in zip(refs, locs, strict=True):
            self._refs.put(r, loc, epoch)
        if not device:  # the host cache only: no slot, so no device pool either
            await asyncio.wrap_future(self._io.submit(self.streamer.prefetch(locs)))
        else:
            # one thread takes the layouts and gives them back when its uploads are done, even if
            # this coroutine is cancelled meanwhile (a thread cannot be; it runs to the end)
            await asyncio.to_thread(self._prefetch_to_device, refs, locs)
        return locs

    def _prefetch_to_device(self, refs: list[str], locs: list[Location]) -> None:
        lids = self._acquire(dict(zip(refs, locs, strict=True)))
        try:
            to_device, rest = self._pick_for_device(locs)
            warm = self._io.submit(self.streamer.prefetch(rest))
            if to_device:
                self._upload(to_device, None)
            warm.result()
        finally:
            self._done(lids)

    def _pick_for_device(self, locs: list[Location]) -> tuple[list[Location], list[Location]]:
        """(rows to upload now, rows only to warm in the host cache): slots are not overfilled."""
        to_device: list[Location] = []
        rest: list[Location] = []
        seen: set[str] = set()
        room: dict[str, int] = {}
        with self._lock:
            for loc in locs:
                pool = self._pools[loc.layout_id]
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

    def pin(self, ref: str) -> Location:
        """Load ``ref`` into a slot and keep it there until :meth:`unpin` (pins nest)."""
        self._check_open()
        loc = self._resolve([ref])[ref]
        lids = self._acquire({ref: loc})
        held: Held = []
        try:
            missing = self._pin_resident({ref: loc}, held)
            if missing:
                self._upload(missing, held)
        except BaseException:
            self._unwind(held, lids)
            raise
        self._done(lids)  # from here the pin keeps the pool
        self._user_pins.setdefault(ref, []).extend(held)
        return loc

    def unpin(self, ref: str) -> None:
        held = self._user_pins.get(ref)
        if not held:
            raise KeyError(f"{ref!r} is not pinned")
        self._release([held.pop()])
        if not held:
            del self._user_pins[ref]

    def resident(self) -> dict[str, list[str]]:
        """Layout id -> content ids in its device slots, least recently used first."""
        with self._lock:
            return {lid: pool.resident() for lid, pool in self._pools.items()}

    @property
    def pools(self) -> dict[str, DevicePool]:
        return dict(self._pools)

    # -- the change feed (hot swap) -------------------------------------------------------------

    def follow(self) -> None:
        """Follow the store's change feed: moved tags and ``latest`` refs swap between batches."""
        self._check_open()
        self._feed.start()

    def stop_following(self) -> None:
        self._feed.stop()

    def sync_events(self, timeout: float = 30.0) -> int:
        """Wait until every event up to the feed's current head is staged; returns that seq."""
        return self._feed.sync(timeout)

    @property
    def swaps(self) -> int:
        """Staged ref updates applied at batch starts so far."""
        return self._refs.swaps

    # -- lifecycle ------------------------------------------------------------------------------

    def call(self, aw: Awaitable[T]) -> T:
        """Run ``aw`` (e.g. ``engine.client.publish(...)``) on the engine's I/O loop and wait."""
        self._check_open()
        return self._io.run(_await(aw))

    def detach(self) -> None:
        """Unwrap the model: hooks removed, experts' forwards restored."""
        with self._lock:
            for hook in self._hooks.values():
                hook.remove()
            self._hooks.clear()
            self._pools.clear()
            self._index.clear()
            self._budget.forget_all()  # in-flight batches still give back their uses

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_following()
        self.detach()
        self._io.close(self.client.close())

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the engine is closed")

    def __enter__(self) -> LoRAEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _batch_size(input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> int:
    if input_ids is not None:
        return int(input_ids.shape[0])
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        raise BatchMismatch("pass input_ids or inputs_embeds")
    return int(embeds.shape[0])


async def _await(aw: Awaitable[T]) -> T:
    return await aw
