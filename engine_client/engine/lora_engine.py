"""``LoRAEngine``: many adapters in one batch of a transformers model, streamed from MinT Store.

    engine = LoRAEngine(model, MintClient("/data/mint"), slots=64)
    await engine.prefetch(["acme/chat:prod", "acme/code@3"])          # optional warm-up
    out = engine.forward(ids, adapters=["acme/chat:prod", None, "acme/code@3"])
    out.logits                                                        # what the model returns
    tokens = engine.generate(ids, adapters=[...], max_new_tokens=32)  # per-sequence adapters

The path of an adapter, once per switch: ref -> location (cached; one batched resolve)
-> row read once into a pinned host buffer (verified, LRU host cache by content id) ->
one copy into a device slot of its layout's pool -> the wrapped layers gather it by slot
index (see :mod:`engine_client.engine.lora_layers` for how the indices reach them). Adapters of
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

(A little past ~450 lines because of the numpy-style docstrings of its public entry points;
the pool and slot bookkeeping lives in :mod:`engine_client.device.pool_set`.)
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from mint_store import Location
from mint_store.errors import BlobNotFound, MintError, StaleLocation
from mint_store.format.layout import Layout

from ..client.mint_client import MintClient
from ..device.device_pool import DevicePool
from ..device.pool_set import Held, PoolSet
from ..errors import BatchMismatch, EngineClosed, LayoutMismatch
from ..stream.host_pool import HostPool
from ..stream.io_loop import IOThread, awaited
from ..stream.streamer import Streamer, StreamerConfig, consume_in_thread
from ..tp.batch import prepare_batch
from ..tp.sharding import TPModel, tp_model
from .base_compat import base_refusal
from .follow import FeedFollower
from .lora_layers import BatchContext, current_batch, use_batch
from .metrics import Metrics
from .refs import RefTable
from .targets import model_targets

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    slots: int = 16  # device slots per layout
    device_bytes: int | None = None  # all layouts' pools together (None: no limit); idle pools go LRU
    host_bytes: int = 256 * 2**20  # pinned host pool
    cache_bytes: int | None = None  # host cache budget inside it (None: all of it)
    concurrency: int = 16  # storage reads in flight
    base: str | None = None  # run only adapters published for this base (engine_client.engine.base_compat)
    follow_wait: float = 10.0  # long-poll of the change feed, seconds
    row_cache_dir: str | None = None  # a disk cache of rows (StreamerConfig.row_cache_dir); None: none
    row_cache_bytes: int = 16 * 2**30

    def __post_init__(self) -> None:
        if self.slots < 1 or self.host_bytes < 1 or self.concurrency < 1:
            raise ValueError("slots, host_bytes and concurrency must be >= 1")
        if self.row_cache_bytes < 0:
            raise ValueError("row_cache_bytes must be >= 0")
        if self.device_bytes is not None and self.device_bytes < 1:
            raise ValueError("device_bytes must be >= 1 (or None for no limit)")


class LoRAEngine:
    """Many adapters in one batch of ``model`` (wrapped in place), streamed from MinT Store.

    Parameters
    ----------
    model
        A transformers model (Llama, Qwen2/3, Mistral, Qwen3-MoE, DeepSeek-V3, ...), on its
        device or the meta device; one loaded with ``tp_plan`` runs tensor-parallel.
    client
        A :class:`MintClient`, or the URL to open one with (``client_options``); the engine
        owns it from here and closes it in :meth:`close`.
    slots
        Device slots per layout: distinct adapters of one layout a batch may use.
    device
        Where slots live (default: the model's; the model moves there).
    device_bytes
        All layouts' slots together at most this many bytes; idle pools go least recently
        used first (None: no limit).
    host_bytes, cache_bytes
        The pinned host pool, and the LRU row cache inside it (None: all of it).
    concurrency
        Storage reads in flight.
    base
        Run only adapters published for this MinT base (:mod:`engine_client.engine.base_compat`);
        None: any adapter whose shapes fit.
    follow, follow_wait
        Follow the change feed (moved tags and ``latest`` swap between batches), with this
        long-poll in seconds.
    row_cache_dir, row_cache_bytes
        A local disk cache of rows below the host pool (:mod:`engine_client.stream.row_cache`), at
        most this many bytes, LRU; the engines of one node may share the directory. None:
        every host-pool miss reads storage.
    client_options
        :class:`ClientConfig` fields for a client opened from a URL.

    Raises
    ------
    ValueError
        An option out of range.
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
        row_cache_dir: str | os.PathLike[str] | None = None,
        row_cache_bytes: int = 16 * 2**30,
    ) -> None:
        self.config = EngineConfig(slots=slots, device_bytes=device_bytes, host_bytes=host_bytes,
                                   cache_bytes=cache_bytes, concurrency=concurrency, base=base,
                                   follow_wait=follow_wait, row_cache_bytes=row_cache_bytes,
                                   row_cache_dir=os.fspath(row_cache_dir) if row_cache_dir is not None else None)
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
        owns_client = not isinstance(client, MintClient)
        self.client = client if isinstance(client, MintClient) else MintClient(client, **(client_options or {}))
        self.metrics = Metrics()
        self.host_pool = HostPool(host_bytes, pin=self.device.type == "cuda")  # pinned only for DMA
        self.streamer = Streamer(self.client, self.host_pool, metrics=self.metrics,
                                 config=StreamerConfig(concurrency=concurrency, cache_bytes=cache_bytes,
                                                       row_cache_dir=self.config.row_cache_dir,
                                                       row_cache_bytes=row_cache_bytes))
        self._io = IOThread()
        try:
            self._start(model, slots, device_bytes, follow, follow_wait)
        except BaseException:
            # nothing of a half-built engine may outlive it: the model's hooks, the I/O thread, and
            # the client this constructor opened (a caller's own client stays open)
            if hasattr(self, "_set"):
                self._set.detach()
            self._io.close(self.client.close() if owns_client else None)
            raise

    def _start(self, model: nn.Module, slots: int, device_bytes: int | None, follow: bool,
               follow_wait: float) -> None:
        # a model transformers loaded with tp_plan: slots hold this rank's slices, rank 0 decides batches
        self._tp: TPModel | None = tp_model(model)
        self._set = PoolSet(model, model_targets(model), self.device, slots=slots, device_bytes=device_bytes,
                            fetch_layout=lambda lid: self._io.run(self.client.layout(lid)),
                            check_base=self._check_base, metrics=self.metrics, tp=self._tp)
        # the pool set under the names tensor-parallel batches (tp/batch.py) use
        self._pools, self._lock = self._set.pools, self._set.lock
        self._acquire, self._pin_resident, self._context = self._set.acquire, self._set.pin_resident, self._set.context
        self._unwind, self._release, self._done = self._set.unwind, self._set.release, self._set.done
        self._refs = RefTable()
        self._batch_lock = threading.Lock()  # one batch at a time (the index buffers are shared)
        self._user_pins: dict[str, Held] = {}
        self._feed = FeedFollower(self.client, self.streamer, self._refs, self._io, wait=follow_wait)
        self._closed = False
        if follow:
            self.follow()

    # -- running batches ----------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None = None, adapters: Sequence[str | None] | None = None,
                **model_kwargs: Any) -> Any:
        """``model(input_ids, **model_kwargs)`` with sequence ``i`` running ``adapters[i]`` (None: base).

        Parameters
        ----------
        input_ids
            ``[B, T]`` token ids (or pass ``inputs_embeds`` in ``model_kwargs``).
        adapters
            One ref or None per sequence (None for all: the base model alone).
        **model_kwargs
            Passed to the model as they are.

        Returns
        -------
        Any
            What the model returns.

        Raises
        ------
        BatchMismatch
            Not one adapter per sequence.
        LayoutMismatch
            An adapter that does not fit the model (the first module that does not is named),
            or of another base.
        OutOfSlots
            More distinct adapters of one layout than it has free slots.
        NotFound, IntegrityError
            A ref that names nothing, a row that fails its check (nothing of the batch ran).
        """
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
        problem: Exception | None = None
        if len(adapters) != n:
            problem = BatchMismatch(f"{len(adapters)} adapters for a batch of {n} sequences; give one per sequence "
                                    "(None for the base model)")
        for a in adapters:
            if problem is None and a is not None and not isinstance(a, str):
                problem = TypeError(f"adapters are refs (str) or None, got {type(a).__name__}")
        if problem is not None and self._tp is None:
            raise problem
        # tensor parallel: every rank must reach the batch's collectives, or the others wait there
        # for good; rank 0's problem fails the batch on every rank through them (the other ranks'
        # lists are not used: rank 0's adapters are broadcast, and their count checked against n)
        with self._batch_lock:
            ctx, held, lids = self._prepare(adapters, n, problem)
            try:
                with use_batch(ctx):
                    yield ctx
            finally:
                try:
                    self._release(held)
                finally:
                    self._done(lids)

    def _prepare(self, adapters: list[str | None], n: int,
                 problem: Exception | None = None) -> tuple[BatchContext, Held, list[str]]:
        """The batch's context, its pinned slots and its layouts in use (the caller releases both)."""
        if self._tp is not None:
            return prepare_batch(self, self._tp, adapters, n, problem)
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

    def _upload(self, locs: list[Location], held: Held | None) -> None:
        """Stream rows through the host pool into slots, one copy each; pin them into ``held``."""
        cold = []
        store = self.client.direct(read=True)
        for loc in locs:  # host hits and direct reads go straight to the device, without the I/O loop
            lease = self.streamer.lease_cached(loc)
            if lease is None and store is not None and self._read_into_slot(loc, store, held):
                continue
            if lease is None:
                lease = self.streamer.fetch_now(loc, alone=len(locs) == 1)
            if lease is None:
                cold.append(loc)
            else:
                self._set.install(lease, held)
        if cold:
            consume_in_thread(self.streamer, self._io.submit, cold, lambda lease: self._set.install(lease, held))

    def _read_into_slot(self, loc: Location, store: Any, held: Held | None) -> bool:
        """A CPU slot read straight from a local store, timed as a storage read (PoolSet.read_into_slot)."""
        t0 = time.perf_counter()
        try:
            done = self._set.read_into_slot(loc, store, held, verify=self.streamer.config.verify)
        except BaseException:
            self.metrics.error()
            raise
        if done is not None:  # (a row another thread put in a slot meanwhile is a device hit)
            self.metrics.record("storage" if done == "read" else "device", loc.length, time.perf_counter() - t0)
        return done is not None

    # -- warming, pinning ---------------------------------------------------------------------

    async def prefetch(self, refs: Sequence[str], *, device: bool = True) -> list[Location]:
        """Resolve ``refs`` and bring their rows into the host cache and (``device``) into free slots.

        Parameters
        ----------
        refs
            Refs to warm.
        device
            Also upload into free device slots (never evicting a pinned one).

        Returns
        -------
        list[Location]
            Where each ref's row lies, in order.

        Raises
        ------
        NotFound, LayoutMismatch, IntegrityError
            As :meth:`forward`.
        """
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
            to_device, rest = self._set.pick_for_device(locs)
            warm = self._io.submit(self.streamer.prefetch(rest))
            if to_device:
                self._upload(to_device, None)
            warm.result()
        finally:
            self._done(lids)

    def pin(self, ref: str) -> Location:
        """Load ``ref`` into a slot and keep it there until :meth:`unpin` (pins nest).

        Returns
        -------
        Location
            The pinned version's location.

        Raises
        ------
        OutOfSlots, LayoutMismatch, NotFound
            As :meth:`forward`.
        """
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
        return self._set.resident()

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
        return self._io.run(awaited(aw))

    def detach(self) -> None:
        """Unwrap the model: hooks removed, experts' forwards restored."""
        self._set.detach()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_following()
        self.detach()
        self._io.close(self.client.close())

    def _check_base(self, layout: Layout, who: str) -> None:
        why = base_refusal(layout.base, self.config.base)  # the rule and its reason: base_compat
        if why is not None:
            raise LayoutMismatch(f"{who}: {why}")

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
