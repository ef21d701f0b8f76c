"""Rows straight into vLLM: a MinT adapter loaded from its verified row, with no PEFT files.

The resolver (in the API server) answers a ref with a ``LoRARequest`` whose ``lora_path`` is
a *row path*, ``<cache dir>/rows/<content id>``: absolute (vLLM takes it as it is), never a
file, and a function of the content alone, so vLLM's prefix cache, which keys a LoRA's blocks
on its name and path, cannot serve one content's KV under a tag that moved to another. In
the worker, vLLM's loader is wrapped (:mod:`.compat` says which vLLM):

1. ``WorkerLoRAManager._load_adapter`` of a row path: one resolve of ``sha:<content id>``
   and one read of the row into a host buffer (pinned when there is a GPU; on the CPU a
   page-aligned one that :mod:`.buffers` reuses once vLLM drops the adapter), checked
   against the content id as it is read (over HTTP by the calling thread, the kernel copying
   the body straight into the buffer: :mod:`..client.http_rows`; or, where the service is on
   this machine with a socket (``MINT_LOCAL_SOCKET``, by default the one the service names),
   copied into the buffer, a memfd, by the service itself: :mod:`..client.local_rows`);
   its time and the adapter go to :mod:`.residency`. A row read over the network is also kept
   in a local row cache (``<cache dir>/row-cache``, LRU within ``MINT_VLLM_CACHE_BYTES``, every read checked
   against the content id; written by a thread at the lowest priority): vLLM reloads an
   adapter its CPU cache evicted from the path it was given, and such a reload must not need
   the service (a load that fails inside a step stops vLLM's engine); a store on local disk
   is its own local copy. The cache's writer reads the very buffer vLLM's views point into
   (no copy of its own), so vLLM, which scales B in place, gets B scaled in memory of its own
   (:meth:`.RowPlan.model`'s ``fold``); a row the service on this machine copied, it copies
   into the cache's file too, and vLLM's B stays a view;
2. ``PEFTHelper.from_local_dir`` gets the config of the row (ranks and scalings, as
   :func:`~.resolver.for_vllm` makes vLLM apply them right);
3. ``LoRAModel.from_local_checkpoint`` checks the modules as vLLM does, then hands vLLM's
   own ``from_lora_tensors`` the tensors as views of that buffer (same dtype, on the CPU:
   ``.to`` copies nothing, a pinned tensor is not pinned again);
4. vLLM's activation copies them into its slots: the one copy (the slot zeroed first only
   where the copy leaves rows of the last occupant's: :mod:`.slots`).

Content this worker already holds (under another name or id: e.g. warmed before a tag
move switched the name, :mod:`.preload`) is cloned from vLLM's own ``LoRAModel``, sharing
its tensors: no read at all. That holds for cache-entry directories of the files path
(``<cache dir>/entries/<content id>``) too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mint_store.errors import MintError
from mint_store.format.adapter import Adapter
from mint_store.peft.directory import peft_state_dict, synthesize_config

from ..stream.row_cache import RowCache
from .background import NiceWorker
from .buffers import RowBuffers
from .config import PluginConfig
from .paths import warm_marker
from .residency import Residency
from .row_plan import RowPlan

LOCAL_RETRY_S = 30.0  # after the local socket failed, rows go over HTTP this long before it is tried again
LOCAL_FIND_S = 300.0  # MINT_LOCAL_SOCKET=auto and the service named no socket here: asked again after this
WARM_CHORES_S = 10.0  # longest a warm marker waits for the spare buffer
WARM_KEEP_S = 300.0  # a warm marker older than this was given up on (preload.WARM_WAIT_S): deleted
MAX_PLANS = 4096  # layouts whose plan a worker keeps (a layout per rank and target set, in practice)

log = logging.getLogger("vllm.plugins.mint_lora_resolver.direct")  # where vLLM's own lines go

@dataclass(slots=True)
class _Row:
    config: dict[str, Any]  # adapter_config.json as vLLM reads it
    buf: torch.Tensor  # [S] uint8: the row, verified
    plan: RowPlan | None  # the layout's plan (None: the general way, ``tensors``)
    scalings: tuple[float, ...] = ()
    # the row cache's writer reads buf: vLLM, which scales B in place, must get B in memory of
    # its own (the plan folds the scaling into a copy; :meth:`tensors` copies what would be a view)
    shared: bool = False
    general: dict[str, torch.Tensor] | None = None  # PEFT names -> tensors, where there is no plan

    def __post_init__(self) -> None:
        if self.general is not None:
            self.general = self._owned(self.general)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """PEFT names -> views of the row buffer (or of B folded with its scalings: :func:`.resolver.for_vllm`);
        B never a view of a shared row."""
        if self.general is None:
            assert self.plan is not None
            self.general = self._owned(self.plan.tensors(self.buf))
        return self.general

    def _owned(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: _own_b(k, v, self.buf) for k, v in tensors.items()} if self.shared else tensors


def _own_b(key: str, t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it is a B (``lora_B``) in ``buf``'s memory."""
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    at = t.data_ptr()
    if ".lora_B." in key and lo <= at < hi:  # (a view of the row, whatever storage object holds it)
        return t.clone()
    return t


class DirectLoader:
    """The worker's side: reads rows for vLLM, remembers what it loaded (by content id)."""

    def __init__(self, config: PluginConfig, *, residency: Residency | None = None) -> None:
        self.config = config
        self.residency = residency or Residency(None)
        self._client: Any = None
        self._lock = threading.Lock()
        self._rows_cache: RowCache | None = None
        self._http_rows: Any = None
        self._local_rows: Any = None
        self._local_down_until = 0.0  # the local socket failed: HTTP until then (time.monotonic)
        self._layouts: dict[str, Any] = {}  # layout id -> Layout
        self._plans: dict[str, RowPlan] = {}  # layout id -> its plan (row_plan.py)
        self._store: Any = None  # the open Store of the client (a store URL), reset with it
        self.buffers = RowBuffers(config.buffer_bytes)
        self.buffers.on_spare = self._show_spare
        self._writer = NiceWorker("mint-vllm-row-cache")  # the row cache's writes, off the load's path
        self._rows: dict[str, _Row] = {}  # row path -> read for the load in progress
        # content id -> (location, layout, config) of its last read: what a reload and a clone need
        self._known: dict[str, tuple[Any, Any, dict[str, Any]]] = {}
        # content id -> a LoRAModel vLLM holds: gone when vLLM drops the last reference
        self._models: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self.reads = 0  # rows read (tests and logs)
        self.local_reads = 0  # of them, copied by the service on this machine
        self.clones = 0

    def reconfigure(self, config: PluginConfig, residency: Residency | None) -> None:
        with self._lock:
            client, self._client = (self._client, None) if config != self.config else (None, self._client)
            if config != self.config:
                self._http_rows = self._store = self._local_rows = None
                self._local_down_until = 0.0
            self.config = config
            self.buffers.keep_bytes = config.buffer_bytes
            if residency is not None:
                self.residency = residency
        if client is not None:
            client.close()

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                from ..client.mint_client import SyncMintClient

                c = self.config  # read-only: a vLLM process never takes the writer lock
                self._client = SyncMintClient(c.url, token=c.token, index_dir=c.index_dir, readonly=True)
            return self._client

    def store(self) -> Any:
        """The store of ``MINT_STORE``, as the client opened it (read-only), for this thread's calls."""
        client = self.client()
        if self._store is None:  # (opened once, off the loop's thread)
            self._store = client.call(client.client.store())
        return self._store

    def http_rows(self) -> Any:
        """The service's rows, read by the calling thread (:mod:`..client.http_rows`)."""
        with self._lock:
            if self._http_rows is None:
                from ..client.http_rows import HttpRowReader

                self._http_rows = HttpRowReader(self.config.url, self.config.token)
            return self._http_rows

    def local_rows(self) -> Any:
        """The service's socket on this machine (:mod:`..client.local_rows`: the service copies the
        row into the worker's memory): ``MINT_LOCAL_SOCKET``, or (``auto``) the one the service
        names where it is its own and here. None if there is none, or it failed lately."""
        c = self.config
        if not c.is_remote or (c.local_socket is None and not c.find_socket) \
                or time.monotonic() < self._local_down_until:
            return None
        if self._local_rows is not None:
            return self._local_rows
        from ..client.local_rows import LocalRowReader, find_local_socket

        reader: LocalRowReader | None
        if c.local_socket is not None:
            reader = LocalRowReader(c.local_socket, c.token)
        else:
            try:
                reader = find_local_socket(self.http_rows(), c.token)
            except MintError as e:  # (the service could not be asked now; its reads over HTTP say why)
                log.debug("GET %s/v1/local-socket: %s", c.url, e)
                self._local_down_until = time.monotonic() + LOCAL_RETRY_S
                return None
            if reader is None:  # (none here: asked again after a while, a service may restart with one)
                self._local_down_until = time.monotonic() + LOCAL_FIND_S
                return None
            log.info("rows copied by the MinT service on this machine, through its socket %s", reader.path)
        with self._lock:
            if self.config is not c:  # (reconfigured meanwhile: this reader is of the old settings)
                reader.close()
                return None
            if self._local_rows is None:
                self._local_rows = reader
            elif reader is not self._local_rows:
                reader.close()  # (another thread got there first)
            return self._local_rows

    def _read_local(self, content_id: str) -> tuple[Any, torch.Tensor, Any] | None:
        """The row copied by the service on this machine: ``(location, buffer, the reader)``; None
        to read it over HTTP instead."""
        local = self.local_rows()
        if local is None:
            return None
        from ..errors import ConnectionFailed

        held: list[torch.Tensor] = []

        def alloc(n: int) -> tuple[Any, int]:
            t, fd = self.buffers.take_shared(n)
            held.append(t)
            return t.numpy(), fd

        try:
            loc, _ = local.read_blob(content_id, alloc)
        except ConnectionFailed as e:
            down: BaseException = e
        except MintError:
            raise  # the service's typed answer (a 401 is an OSError too), as over HTTP
        except OSError as e:  # (no memfd here)
            down = e
        else:
            self.local_reads += 1
            return loc, held[-1], local
        self.socket_failed(local, down)
        return None

    def socket_failed(self, local: Any, err: BaseException) -> None:
        """The socket ``local`` broke (a read, or the resolver's ask): HTTP for LOCAL_RETRY_S, then
        it is tried again (one the service named is looked for again: it may have moved it)."""
        log.warning("MinT local socket %s: %s; reading rows over HTTP for %.0f s", local.path, err, LOCAL_RETRY_S)
        self._local_down_until = time.monotonic() + LOCAL_RETRY_S
        if self.config.local_socket is None:
            with self._lock:
                if self._local_rows is local:
                    self._local_rows = None  # (other threads' connections on it end with their own errors)

    def _show_spare(self, fd: int, size: int) -> None:
        """On the pool's spare thread: a shared spare shown to the service on this machine, which
        maps it now, so the row copied into it next is a ``pread`` into a mapping (not a write
        through the memfd, twice as long here). Only a socket already found; errors do not matter."""
        local = self._local_rows
        if local is None or time.monotonic() < self._local_down_until:
            return
        try:
            local.keep(fd)
        except (MintError, OSError) as e:  # (an older service has no keep: the copy goes through the fd)
            log.debug("MinT local socket %s: spare of %d bytes not kept: %s", local.path, size, e)

    def row_cache(self) -> RowCache | None:
        """The local copy of rows read over the network (None for a store on local disk: its
        pack files are already the local copy a reload reads)."""
        url = self.config.url
        if "://" not in url or url.startswith("file://"):
            return None
        with self._lock:
            if self._rows_cache is None:
                self._rows_cache = RowCache(self.config.cache_dir / "row-cache", self.config.cache_bytes)
            return self._rows_cache

    def read(self, path: str, content_id: str) -> _Row:
        """Read and verify the row of ``content_id``; its config and tensors (views of it)."""
        from .resolver import for_vllm

        pin = torch.cuda.is_available()
        cache = self.row_cache()
        known = self._known.get(content_id)
        buf = None
        shared = False  # buf is being written to the row cache
        if known is not None and cache is not None:  # read before, evicted by vLLM since: the local copy
            loc, layout, _ = known
            buf = self.buffers.take(loc.length, pin=pin)  # [S]
            if not cache.load(loc, buf.numpy()):  # (checked against the content id)
                buf = None
        if buf is None:
            client = self.client()
            # a store opened here is called on this thread; a service's rows are read by this thread
            # (the kernel copies the body straight into buf, hashed as it lands): no hop to the
            # client's loop thread, which on vLLM's pinned CPU costs a context switch each way
            store = None if self.config.is_remote else self.store()
            with self.buffers.reading():  # (no spare buffer is faulted in meanwhile)
                got = None if store is not None or pin else self._read_local(content_id)
                local = None  # the service's socket the row came through
                if got is not None:  # copied by the service on this machine, verified as it landed
                    loc, buf, local = got  # [S]
                elif store is None:  # one GET by content id (no resolve first), verified against it as it lands
                    held: list[torch.Tensor] = []
                    loc, _ = self.http_rows().read_blob(content_id,
                                                        lambda n: _hold(held, self.buffers.take(n, pin=pin)))
                    buf = held[-1]  # [S]
                else:
                    loc = store.resolve(f"sha:{content_id}")
                    buf = self.buffers.take(loc.length, pin=pin)  # [S]
                    store.read_row(loc, buf.numpy())  # (verified too)
            if loc.content_id != content_id:
                raise RuntimeError(f"asked for {content_id}, read {loc.content_id}")  # a bug if it happens
            layout = self._layouts.get(loc.layout_id)
            if layout is None:  # (a layout is immutable: its id is the hash of its table)
                layout = self._layouts[loc.layout_id] = (
                    client.layout(loc.layout_id) if store is None else store.layout(loc.layout_id))
            if cache is not None and local is not None:
                # the service on this machine copies the row into the cache's new file too (from
                # its shard, on its own CPU; checked here as it lands, by the writer's thread):
                # nothing reads buf meanwhile, so vLLM scales its B in place, as for its own files
                self._writer.submit(functools.partial(cache.store_filled, loc, functools.partial(
                    _copy_into, local, content_id, loc.length)))
            elif cache is not None:
                # the row itself, written by a thread at the lowest priority: on a CPU the worker
                # shares, the write waits for vLLM's step. vLLM never writes into it meanwhile: it
                # gets B already scaled, in a buffer of its own (_Row.shared). A write lost to a
                # crash costs an entry: the cache checks every row it reads back
                shared = True
                self._writer.submit(functools.partial(cache.store, loc, buf.numpy()))
        with self._lock:
            plan = self._plans.get(loc.layout_id)
            if plan is None:
                if len(self._plans) >= MAX_PLANS:
                    self._plans.pop(next(iter(self._plans)))
                plan = self._plans[loc.layout_id] = RowPlan(layout)
        scalings = plan.scalings(buf)
        config = plan.config(buf, scalings) if plan.dense else None
        if config is not None:
            row = _Row(config, buf, plan, scalings, shared=shared)
        else:  # mixed scalings (folded into copies of B) or fused experts: the general way
            adapter = for_vllm(Adapter.from_row(layout, buf))
            config = adapter.peft_config if adapter.peft_config is not None else synthesize_config(adapter)
            row = _Row(config, buf, None, shared=shared, general=peft_state_dict(adapter))
        with self._lock:
            self.reads += 1
            self._rows[path] = row
            self._known[content_id] = (loc, layout, config)
            while len(self._known) > 65536:
                self._known.pop(next(iter(self._known)))
        return row

    def config_of(self, path: str, content_id: str) -> dict[str, Any]:
        with self._lock:
            row = self._rows.get(path)
            known = self._known.get(content_id)
        if row is not None:
            return row.config
        if known is not None and self.model(content_id) is not None:
            return known[2]
        return self.read(path, content_id).config

    def take(self, path: str, content_id: str) -> _Row:
        with self._lock:
            row = self._rows.pop(path, None)
        return row if row is not None else self.read(path, content_id)

    def model(self, content_id: str) -> Any:
        return self._models.get(content_id)

    def remember(self, content_id: str, model: Any) -> None:
        model._mint_content_id = content_id  # (its activation zeroes only what the copy leaves: slots.py)
        self._models[content_id] = model

    def mark_warm(self, content_id: str, side_name: str) -> None:
        """Once the chores queued so far are done, the row cache's copy of ``content_id`` written
        out to disk included, write the warm marker of ``side_name`` (:func:`.paths.warm_marker`;
        off the caller's thread): the follower switches a moved tag's name to the content after
        it (:mod:`.preload`). With several workers (tensor parallelism) the first one's marker
        lets the switch go on."""
        self._writer.submit(functools.partial(self._mark_warm, content_id, side_name))

    def _mark_warm(self, content_id: str, side_name: str) -> None:
        self.buffers.settle(WARM_CHORES_S)  # (the next spare buffer, faulted in)
        cache = self._rows_cache
        if cache is not None:  # its writeback, now: on this VM a 40 MB row's took 0.3-0.7 s, and
            try:               # slowed the requests after the switch by ~10% while it ran
                fd = os.open(cache.path(content_id), os.O_RDONLY)
            except OSError:
                fd = -1  # (not cached: too large for it, or a full disk)
            if fd >= 0:
                try:
                    os.fdatasync(fd)
                except OSError:
                    pass
                finally:
                    os.close(fd)
        mark = warm_marker(self.config.cache_dir, side_name)
        try:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
            now = time.time()
            for old in mark.parent.iterdir():  # (markers nobody waited for: a follower that gave up)
                with contextlib.suppress(OSError):
                    if now - old.stat().st_mtime > WARM_KEEP_S:
                        old.unlink()
        except OSError as e:  # (the follower switches after its wait instead)
            log.warning("MinT: could not mark %s warm (%s)", content_id, e)

    @contextlib.contextmanager
    def loading(self, path: str) -> Iterator[None]:
        try:
            yield
        finally:
            with self._lock:
                self._rows.pop(path, None)  # a load that failed half-way keeps no buffer


def _hold(held: list[torch.Tensor], buf: torch.Tensor) -> object:
    held.append(buf)
    return buf.numpy()


def _copy_into(local: Any, content_id: str, length: int, fd: int) -> None:
    """The service's copy of the row into the file ``fd`` (``length`` bytes), checked as it lands."""
    mm = mmap.mmap(fd, length)
    try:
        local.read_blob(content_id, lambda n: (mm, fd))
    finally:
        with contextlib.suppress(BufferError):  # (a view still held by a traceback: unmapped when it goes)
            mm.close()
